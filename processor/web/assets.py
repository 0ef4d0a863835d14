"""The web view's only static assets, shipped as Python strings (no package-data files, no network).

`ASSETS` is the complete list of what `/ui/assets/<name>` serves: a name not in it
is a 404, so no request path can reach a file of the host. The HTML report inlines
the same stylesheet.

app.js draws nothing itself: every `refresh_s` it fetches the page's JSON endpoint
(`data-api` on the page's root element) and replaces each element whose id is a
key of the answer's `html` map with the server-rendered, escaped fragment (when it
changed since the last answer). Without
JavaScript the page is the same server-rendered HTML (a `<noscript>` refresh keeps
it current). A "Capture rank N" button (the live run page, with a capture book) posts
to `data-capture-api` with the `X-TraceML-Capture` header, which no cross-site form
can send, and shows the answer as text in the header.
"""
from __future__ import annotations

from typing import Mapping

STYLE_CSS = """
:root { --crit: #d62728; --warn: #e69500; --info: #2e7d32; --muted: #666; --line: #ddd; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; background: #fafafa; }
header.top { background: #1f2a36; color: #fff; padding: 8px 16px; display: flex; gap: 16px; align-items: baseline; }
header.top a { color: #cfe3ff; }
header.top .run-id { font-family: ui-monospace, monospace; overflow-wrap: anywhere; }
main { display: grid; grid-template-columns: minmax(0, 3fr) minmax(260px, 1fr); gap: 16px; padding: 16px; }
main.single { display: block; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px; margin-bottom: 16px; }
h1, h2, h3 { margin: 0 0 8px; }
h2 { font-size: 16px; }
.hero { border-left: 8px solid var(--muted); }
.hero.sev-crit { border-left-color: var(--crit); }
.hero.sev-warn { border-left-color: var(--warn); }
.hero.sev-info { border-left-color: var(--info); }
.hero .kind { font-size: 26px; font-weight: 700; letter-spacing: .5px; }
.hero .reason { font-size: 15px; margin: 4px 0 8px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; color: #fff; background: var(--muted); }
.badge.sev-crit { background: var(--crit); }
.badge.sev-warn { background: var(--warn); }
.badge.sev-info { background: var(--info); }
.kpis { display: flex; flex-wrap: wrap; gap: 6px 18px; color: var(--muted); margin: 0; padding: 0; list-style: none; }
.kpis b { color: #222; }
.fresh-live { color: var(--info); } .fresh-bridged { color: var(--warn); } .fresh-expired { color: var(--crit); }
.rail ol { padding-left: 20px; margin: 0; }
.finding { margin-bottom: 12px; }
.finding .summary { margin: 2px 0 4px; }
dl.evidence { display: grid; grid-template-columns: max-content 1fr; gap: 0 8px; margin: 0; font-size: 12px; color: #444; }
dl.evidence dt { font-family: ui-monospace, monospace; color: var(--muted); }
dl.evidence dd { margin: 0; overflow-wrap: anywhere; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 6px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td.material { color: var(--warn); font-weight: 700; }
tr.material td { background: #fff6e0; }
.chart { max-width: 100%; height: auto; display: block; }
.chart-title { font-size: 13px; font-weight: 600; }
.axis-label { font-size: 11px; fill: #555; }
.bar.culprit .axis-label { fill: var(--crit); font-weight: 700; }
.legend { list-style: none; display: flex; flex-wrap: wrap; gap: 4px 14px; padding: 0; margin: 4px 0 0; font-size: 12px; }
.note { color: var(--muted); font-size: 12px; }
.side-by-side { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
article.capture { border-top: 1px solid var(--line); padding-top: 8px; margin-top: 8px; }
table.digest td:first-child { text-align: left; overflow-wrap: anywhere; max-width: 28em; }
button.capture { font: inherit; padding: 2px 10px; margin: 0 4px 4px 0; cursor: pointer; }
.mono { font-family: ui-monospace, monospace; overflow-wrap: anywhere; }
pre.card { font-size: 12px; overflow-x: auto; background: #f4f4f4; padding: 8px; }
#capture-status { color: #ffe08a; font-size: 12px; }
#refresh-status { color: #cfe3ff; font-size: 12px; margin-left: auto; }
"""

APP_JS = """
(function () {
  "use strict";
  var root = document.querySelector("[data-api]");
  if (!root || !window.fetch) { return; }
  var api = root.getAttribute("data-api");
  var every = Math.max(250, 1000 * (parseFloat(root.getAttribute("data-refresh-s")) || 1));
  var status = document.getElementById("refresh-status");
  var updates = 0;
  var shown = {};  // id -> the fragment last put there: an unchanged one is left alone
  function say(text) { if (status) { status.textContent = text; } }
  function apply(data) {
    var html = (data && data.html) || {};
    Object.keys(html).forEach(function (id) {
      var element = document.getElementById(id);
      // Replacing an unchanged part would also replace a button under the pointer, and a click
      // whose press and release land on two different buttons is no click.
      if (element && shown[id] !== html[id]) { element.innerHTML = html[id]; shown[id] = html[id]; }
    });
    updates += 1;
    root.setAttribute("data-updates", String(updates));
    say("updated " + new Date().toLocaleTimeString());
  }
  function poll() {
    fetch(api, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.json();
      })
      .then(apply)
      .catch(function (error) { say("refresh failed: " + error.message); })
      .then(function () { window.setTimeout(poll, every); });
  }
  window.setTimeout(poll, every);
  // A "Capture rank N" button posts to the page's capture route; the answer is shown as text only.
  var captureApi = root.getAttribute("data-capture-api");
  document.addEventListener("click", function (event) {
    var button = event.target && event.target.closest && event.target.closest("button[data-capture-rank]");
    if (!button || !captureApi) { return; }
    var rank = button.getAttribute("data-capture-rank");
    var out = document.getElementById("capture-status");
    function tell(text) { if (out) { out.textContent = text; } else { say(text); } }
    button.disabled = true;
    fetch(captureApi + "&rank=" + encodeURIComponent(rank), {
      method: "POST", credentials: "same-origin", cache: "no-store",
      headers: { "X-TraceML-Capture": "1" }
    })
      .then(function (response) {
        return response.json().then(function (data) {
          if (!response.ok) { throw new Error(data.error || ("HTTP " + response.status)); }
          tell("capture " + data.capture_id + " of rank " + rank + " requested (" + data.status + ")");
        });
      })
      .catch(function (error) { tell("capture refused: " + error.message); })
      .then(function () { button.disabled = false; });
  });
})();
"""

ASSETS: Mapping[str, tuple[str, bytes]] = {
    "style.css": ("text/css; charset=utf-8", STYLE_CSS.encode()),
    "app.js": ("text/javascript; charset=utf-8", APP_JS.encode()),
}
"""name -> (content type, body): everything `/ui/assets/` can answer."""

__all__ = ["APP_JS", "ASSETS", "STYLE_CSS"]
