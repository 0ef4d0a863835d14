"""HTML of the web view and of the one-file report, from a view model (pure formatting).

Every string that came from the wire (run ids, summaries, evidence, hostnames) is
escaped with `esc` in text and attribute context; JSON placed inside a `<script>`
goes through `script_json`, which also escapes `<`, `>`, `&` and U+2028/U+2029, so
no value can close the element or break the script. The live page loads only
`assets/style.css` and `assets/app.js` from its own prefix; the report inlines the
stylesheet and needs no script.
"""
from __future__ import annotations

import json
import numbers
from typing import Mapping, Sequence
from urllib.parse import quote

from traceml.processor.reporting.badput import CAUSE_LABELS, fmt_device_hours, fmt_rank_time, what_if_text
from traceml.processor.reporting.captures import OPEN_NOTE, capture_heading, status_text
from traceml.processor.reporting.input_note import BEFORE_FORWARD_SENTENCE
from traceml.processor.reporting.resources import fmt_figure, trend_text
from traceml.processor.web.assets import STYLE_CSS
from traceml.processor.web.svg import bar_scale_max, esc, line_chart, phase_bars, phase_legend, trend_chart
from traceml.processor.web.view import NODE_RESOURCE_COLUMNS, RANK_RESOURCE_COLUMNS

RUN_FRAGMENTS = ("tm-hero", "tm-badput", "tm-captures", "tm-rail", "tm-phases", "tm-steps", "tm-memory", "tm-resources", "tm-stats",
                 "tm-ranks", "tm-telemetry")
"""Element ids of a run page the JSON endpoint's `html` map refreshes."""

REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


def script_json(value: object) -> str:
    """JSON that is safe inside `<script type="application/json">` (and any script element)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _fmt(value: object) -> str:
    """An evidence or telemetry value as text (not yet escaped)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return f"{float(value):.4g}"
    if isinstance(value, Mapping):
        if set(value) == {"items", "total"}:  # a list or map the view bounded
            return f"{_fmt(value['items'])} … ({value['total']:,} in all)"
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) or "none"
    return str(value)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _rank(rank: int | None) -> str:
    return "—" if rank is None else f"rank {rank}"


def _bytes(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.1f} MiB"


# --- Run fragments -------------------------------------------------------------------------


def hero(view: Mapping) -> str:
    h, win, fresh = view["hero"], view["window"], view["freshness"]
    sev = esc(h["severity"])
    culprit = ("no culprit rank" if h["culprit_rank"] is None
               else f'culprit <b data-testid="culprit-rank">rank {esc(h["culprit_rank"])}</b>')
    age = "" if fresh["age_s"] is None else f", {fresh['age_s']:.1f} s old"
    error = "" if not fresh["error"] else f" ({esc(fresh['error'])})"
    last = "—" if win["last_step"] is None else esc(win["last_step"])
    score = "" if h["score"] is None else f'<li>score <b>{h["score"]:.3f}</b></li>'
    return (
        f'<section class="hero sev-{sev}" data-kind="{esc(h["kind"])}">'
        f'<div><span class="kind" data-testid="verdict-kind">{esc(h["kind"])}</span> '
        f'<span class="badge sev-{sev}" data-testid="verdict-severity">{sev}</span> '
        f'<span class="note">{esc(h["status"])}</span></div>'
        f'<p class="reason" data-testid="verdict-reason">{esc(h["summary"])}</p>'
        + ('<p class="note">no data stored for this run yet: this page fills in when its first steps '
           "arrive</p>" if fresh["state"] == "cold" else "")
        + f'<ul class="kpis"><li>{culprit}</li>{score}'
        f'<li>last step <b data-testid="last-step">{last}</b></li>'
        f'<li>aligned steps <b>{esc(win["steps"])}</b></li>'
        f'<li><b>{esc(win["rank_count"])}</b> rank(s)</li>'
        f'<li>clock <b>{esc(win["clock"] or "none")}</b></li>'
        f'<li>{esc(view["training_strategy"])}</li>'
        f'<li class="fresh-{esc(fresh["state"])}" data-testid="freshness">{esc(fresh["state"])}{esc(age)}{error}</li>'
        f'<li>generated {esc(view["generated_at"] or "—")}</li></ul></section>')


def _evidence(evidence: Mapping) -> str:
    rows = "".join(f"<dt>{esc(k)}</dt><dd>{esc(_fmt(v))}</dd>" for k, v in evidence.items())
    return f'<dl class="evidence">{rows}</dl>' if rows else ""


def rail(view: Mapping) -> str:
    items = []
    for issue in view["issues"]:
        sev = esc(issue["severity"])
        ranks = []
        if issue["culprit_rank"] is not None:
            ranks.append(f"culprit rank {esc(issue['culprit_rank'])}")
        if issue["victim_rank"] is not None:
            ranks.append(f"victim rank {esc(issue['victim_rank'])}")
        if issue["component"]:
            ranks.append(esc(issue["component"]))
        score = "" if issue["score"] is None else f" score {issue['score']:.3f}"
        items.append(
            f'<li class="finding sev-{sev}" data-kind="{esc(issue["kind"])}">'
            f'<b class="finding-kind">{esc(issue["kind"])}</b> <span class="badge sev-{sev}">{sev}</span> '
            f'<span class="note">{esc(issue["status"])}{esc(score)}{" · " if ranks else ""}{" · ".join(ranks)}</span>'
            f'<p class="summary">{esc(issue["summary"])}</p>{_evidence(issue["evidence"])}</li>')
    return f'<section class="rail"><h2>Diagnostics</h2><ol>{"".join(items)}</ol></section>'


def _not_drawn(view: Mapping) -> str:
    ranks = view["ranks"]
    if not ranks["not_drawn"]:
        return ""
    return (f'<p class="note">{ranks["not_drawn"]:,} of {ranks["total"]:,} ranks not drawn: shown are the ranks '
            "the diagnosis names, the worst and representative Step Time ranks, then the slowest; the table "
            "of statistics covers every rank.</p>")


def phases_section(view: Mapping) -> str:
    culprit = view["hero"]["culprit_rank"]
    if not view["phases"]:
        return '<section><h2>Phases per rank</h2><p class="note">no aligned steps yet</p></section>'
    return ("<section><h2>Phases per rank</h2>"
            + phase_bars(view["phases"], view["phase_order"], culprit=culprit)
            + phase_legend(view["phase_order"])
            + '<p class="note">Collective wait (measured, in the statistics table) is no segment of its own: '
              "under DDP it lies inside backward (the gradient all-reduce); a collective between phases is "
              "taken out of residual, so such a bar is shorter than its step by that wait.</p>"
            + _before_forward(view) + _sources(view) + _not_drawn(view) + "</section>")


def _sources(view: Mapping) -> str:
    """The card's source lines (a foreign mapping, what it cannot measure), beside the bars."""
    return "".join(f'<p class="note" data-note="source">{esc(line)}</p>' for line in view.get("source_notes") or ())


def _before_forward(view: Mapping) -> str:
    """The card's note on input wait measured before forward (no DataLoader), beside the bars."""
    ranks = (view.get("telemetry") or {}).get("input_wait_before_forward_ranks")
    if not ranks:
        return ""
    return f'<p class="note" data-note="input-before-forward">{esc(BEFORE_FORWARD_SENTENCE)} ({esc(_fmt(ranks))})</p>'


def steps_section(view: Mapping) -> str:
    steps = view["steps"]
    if not steps["ids"]:
        return '<section><h2>Step time per rank</h2><p class="note">no aligned steps yet</p></section>'
    n, total = len(steps["ids"]), view["window"]["steps"]
    title = f"Step time per rank, last {n} of {total} aligned steps (ms; dashed: median over ranks)"
    return ("<section><h2>Step time per rank</h2>"
            + line_chart(steps["ids"], steps["by_rank"], median=steps["median"],
                         culprit=view["hero"]["culprit_rank"], title=title)
            + _not_drawn(view) + "</section>")


def memory_section(view: Mapping) -> str:
    mem = view["memory"]
    if not mem["available"]:
        return ('<section><h2>Peak memory</h2><p class="note">unavailable (no CUDA device reported)</p>'
                "</section>")
    alloc, res = mem["peak_allocated_bytes"], mem["peak_reserved_bytes"]
    head = (f'<p>peak allocated <b>{_bytes(alloc["value"])}</b> ({esc(_rank(alloc["rank"]))}), '
            f'reserved <b>{_bytes(res["value"])}</b> ({esc(_rank(res["rank"]))})</p>')
    chart = ""
    if mem["steps_by_rank"]:
        chart = line_chart(view["steps"]["ids"], mem["steps_by_rank"], culprit=view["hero"]["culprit_rank"],
                           title="Peak allocated memory per step (MiB)", unit="MiB", divisor=2**20,
                           css="memory-chart")
    return f"<section><h2>Peak memory</h2>{head}{chart}</section>"


def _member(member: object) -> str:
    """A rank (`rank 3`) or a host name, not yet escaped."""
    if member is None:
        return "—"
    return f"rank {member}" if isinstance(member, int) else str(member)


def resources_section(view: Mapping) -> str:
    """Process, GPU and host figures: median and worst member of each, the drawn ranks' own, the
    hosts and the memory trends (the steepest drawn as its fitted line)."""
    res = view["resources"]
    if not res["available"]:
        return ('<section><h2>Resources</h2><p class="note">not measured: no process, host or GPU sample '
                "in the window (the ranks' resource sampler is off or lacks psutil, and no Collector "
                "hostmetrics or DCGM data reached this run)</p></section>")
    rows = []
    for row in res["figures"]:
        if row["measured"] == 0:
            continue
        f = row["figure"]
        rows.append(f'<tr data-figure="{esc(row["scope"])}.{esc(f)}"><td>{esc(row["label"])}</td>'
                    f'<td>{esc(fmt_figure(f, row["median"]))}</td><td>{esc(_member(row["median_member"]))}</td>'
                    f'<td>{esc(fmt_figure(f, row["worst"]))}</td><td>{esc(_member(row["worst_member"]))}</td>'
                    f'<td>{esc(row["measured"])}</td></tr>')
    window = res["window"]
    head = (f'<p class="note">window {esc(window["start_time"] or "—")} to {esc(window["end_time"] or "—")}; '
            f'sources {esc(", ".join(res["sources"]) or "none")}. Worst: the highest, for GPU utilisation the '
            "lowest (the least busy GPU).</p>")
    figures = ('<table class="resources"><thead><tr><th>figure</th><th>median</th><th>near</th><th>worst</th>'
               f'<th>member</th><th>measured</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')
    ranks = ""
    if res["ranks"]:
        # Only the figures some drawn rank measured (a CPU-only run has no GPU columns).
        columns = [(f, label) for f, label in RANK_RESOURCE_COLUMNS if any(r[f] is not None for r in res["ranks"])]
        head_cells = "".join(f"<th>{esc(label)}</th>" for _, label in columns)
        body = "".join(
            f'<tr data-rank="{esc(r["rank"])}"><td>rank {esc(r["rank"])}</td><td class="mono">{esc(r["host"] or "—")}'
            f'</td>{"".join(f"<td>{esc(fmt_figure(f, r[f]))}</td>" for f, _ in columns)}</tr>'
            for r in res["ranks"])
        ranks = (f'<h3>Per rank</h3><table class="resource-ranks"><thead><tr><th>rank</th><th>host</th>{head_cells}'
                 f"</tr></thead><tbody>{body}</tbody></table>" + _not_drawn(view))
    nodes = ""
    if res["nodes"]:
        head_cells = "".join(f"<th>{esc(label)}</th>" for _, label in NODE_RESOURCE_COLUMNS)
        body = "".join(
            f'<tr data-host="{esc(n["host"])}"><td class="mono">{esc(n["host"])}</td>'
            f'<td>{esc(_fmt(n["ranks"]))}</td>'
            f'{"".join(f"<td>{esc(fmt_figure(f, n[f]))}</td>" for f, _ in NODE_RESOURCE_COLUMNS)}'
            f'<td>{esc(", ".join(n["sources"]))}</td></tr>' for n in res["nodes"])
        more = ("" if res["nodes_total"] <= len(res["nodes"])
                else f'<p class="note">{len(res["nodes"])} of {res["nodes_total"]:,} hosts shown.</p>')
        nodes = (f'<h3>Per host</h3><table class="resource-nodes"><thead><tr><th>host</th><th>ranks</th>{head_cells}'
                 f"<th>sources</th></tr></thead><tbody>{body}</tbody></table>{more}")
    trends = ""
    if res["memory_trends"]:
        items = "".join(f'<li data-rank="{esc(t["rank"])}">{esc(trend_text(t))}</li>' for t in res["memory_trends"])
        more = ("" if res["memory_trends_total"] <= len(res["memory_trends"])
                else f'<p class="note">{len(res["memory_trends"])} of {res["memory_trends_total"]:,} shown.</p>')
        steepest = res["steepest_trend"]
        chart = "" if steepest is None else trend_chart(
            [steepest], culprit=view["hero"]["culprit_rank"],
            title=f"Fitted memory trend of rank {steepest['rank']} ({steepest['signal']}, MiB)")
        trends = (f"<h3>Memory trends (fitted; whether one is creep is the diagnosis's call)</h3>"
                  f'<ul class="trends">{items}</ul>{more}{chart}')
    return f"<section><h2>Resources</h2>{head}{figures}{ranks}{nodes}{trends}</section>"


def stats_section(view: Mapping) -> str:
    rows = []
    for s in view["stats"]:
        if s["median"] is None and s["worst"] is None:
            continue
        skew = "—" if s["skew"] is None else f"{s['skew']:+.0%}"
        share = "—" if s["share"] is None else f"{s['share']:.0%}"
        cov = s["coverage"]
        rows.append(f'<tr data-metric="{esc(s["key"])}"><td>{esc(s["label"])}</td><td>{_ms(s["median"])}</td>'
                    f'<td>{esc(_rank(s["median_rank"]))}</td><td>{_ms(s["worst"])}</td>'
                    f'<td>{esc(_rank(s["worst_rank"]))}</td><td>{skew}</td><td>{share}</td>'
                    f'<td>{cov["measured_ranks"]}/{cov["expected_ranks"]}</td></tr>')
    return ('<section><h2>Window statistics (ms)</h2><table class="stats"><thead><tr><th>metric</th>'
            "<th>median</th><th>near</th><th>worst</th><th>rank</th><th>skew</th><th>share</th><th>ranks</th>"
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def ranks_section(view: Mapping) -> str:
    """The drawn bars as numbers: the page without JavaScript or SVG still reads."""
    order = view["phase_order"]
    head = "".join(f"<th>{esc(p['label'])}</th>" for p in order)
    rows = []
    for row in view["phases"]:
        cells = "".join(f"<td>{_ms(row['values'].get(p['metric']))}</td>" for p in order)
        rows.append(f'<tr data-rank="{esc(row["rank"])}"><td>rank {esc(row["rank"])}</td>'
                    f'<td>{_ms(row["step_time"])}</td>{cells}</tr>')
    return ('<section><h2>Per rank (window average, ms)</h2><table class="ranks"><thead><tr><th>rank</th>'
            f'<th>Step Time</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            + _not_drawn(view) + "</section>")


def badput_section(view: Mapping) -> str:
    """The badput ledger: lost rank-time per cause over the window and the run so far, and each
    finding's what-if (figures from the summary's `badput` section, formatted only)."""
    b = view.get("badput")
    if not b or not b["available"]:
        return ('<section class="badput"><h2>Lost time</h2><p class="note">no ledger yet: it needs aligned '
                "steps with their step time measured</p></section>")
    win, run = b["window"], b["run"]
    share = "" if win["total_share"] is None else f" ({win['total_share']:.0%} of the window's rank-time)"
    steps = "" if run["steps"] is None else f" ({run['steps']:,} steps)"
    rows = []
    for cause, entry in run["causes"].items():
        w = win["causes"][cause]
        rank = (f"waiting for rank {esc(entry['culprit_rank'])}" if entry["culprit_rank"] is not None
                else (f"most on rank {esc(entry['worst_rank'])}" if entry["worst_rank"] is not None else ""))
        pct = "—" if entry["share"] is None else f"{entry['share']:.1%}"
        rows.append(f'<tr data-cause="{esc(cause)}"><td>{esc(CAUSE_LABELS.get(cause, cause))}</td>'
                    f"<td>{esc(fmt_rank_time(w['rank_seconds']))}</td><td>{esc(fmt_rank_time(entry['rank_seconds']))}</td>"
                    f"<td>{esc(pct)}</td><td>{rank}</td></tr>")
    what_ifs = "".join(f'<li data-kind="{esc(w["kind"])}">{esc(what_if_text(w))}</li>' for w in b["what_if"])
    return ('<section class="badput"><h2>Lost time (badput ledger)</h2>'
            f'<p data-testid="lost-time"><b>{esc(fmt_rank_time(win["total_rank_seconds"]))}</b> over the window'
            f"{esc(share)}; about <b>{esc(fmt_rank_time(run['total_rank_seconds']))}</b> over the run so far"
            f"{esc(steps)}; {esc(fmt_device_hours(run['total_device_hours'], b['devices_known']))}</p>"
            '<table class="stats"><thead><tr><th>cause</th><th>window</th><th>run so far</th><th>share</th>'
            f'<th>rank</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
            + (f'<h3>What if</h3><ul class="what-if">{what_ifs}</ul>' if what_ifs else "")
            + '<p class="note">Rank-time: one rank idle for one second is one rank-second (docs/DIAGNOSIS.md, '
              '"Badput ledger"); the run so far extrapolates the window over the run\'s steps.</p></section>')


def _signed_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}"


def _digest_table(capture: Mapping) -> str:
    d = capture["digest"]
    culprit, reference = capture["culprit_rank"], capture["reference_rank"]
    rows = "".join(
        f'<tr data-kind="{esc(r["kind"])}"><td class="mono">{esc(r["name"])}</td><td>{esc(r["kind"])}</td>'
        f'<td>{_ms(r["culprit_ms"])}</td><td>{"unknown" if r["reference_ms"] is None else _ms(r["reference_ms"])}</td>'
        f'<td>{_signed_ms(r["excess_ms"])}</td>'
        f'<td>{"—" if r["share_of_gap"] is None else format(r["share_of_gap"], ".0%")}</td></tr>'
        for r in d["rows"])
    more = (f'<p class="note">{d["rows_left_out"]:,} smaller entries not shown</p>' if d["rows_left_out"] else "")
    phases = "".join(f'<li>{esc(g["phase"])}: {_ms(g["culprit_ms"])} vs {_ms(g["reference_ms"])} ms '
                     f'({_signed_ms(g["gap_ms"])})</li>' for g in d["phase_gap"])
    not_seen = "".join(f"<li>{esc(n)}</li>" for n in d["not_seen"])
    return (f'<p>Step: <b>{_ms(d["culprit_step_ms"])}</b> ms on rank {esc(culprit)} against '
            f'<b>{_ms(d["reference_step_ms"])}</b> ms on rank {esc(reference)}, a gap of '
            f'<b>{_signed_ms(d["gap_ms"])}</b> ms per step ({esc(d["culprit_steps"])} and '
            f'{esc(d["reference_steps"])} captured steps)</p>'
            '<table class="stats digest"><thead><tr><th>entry</th><th>kind</th>'
            f'<th>rank {esc(culprit)} ms/step</th><th>rank {esc(reference)} ms/step</th><th>excess</th>'
            f'<th>share of gap</th></tr></thead><tbody>{rows}</tbody></table>{more}'
            + (f'<h4>Phases over the captured steps</h4><ul>{phases}</ul>' if phases else "")
            + (f'<h4>Not seen</h4><ul class="not-seen">{not_seen}</ul>' if not_seen else ""))


def _capture(capture: Mapping) -> str:
    traces = "".join(f'<li class="mono">{esc(t)}</li>' for t in capture["traces"])
    body = (_digest_table(capture) if capture["digest"] is not None
            else f'<p class="capture-status">{esc(status_text(capture))}</p>')
    return (f'<article class="capture" data-capture-id="{esc(capture["capture_id"])}" '
            f'data-status="{esc(capture["status"])}"><h3>Capture {esc(capture["capture_id"])}: '
            f'{esc(capture_heading(capture))} <span class="note">{esc(capture["trigger"])} · '
            f'{esc(capture["status"])} · {esc(capture["requested_at"] or "—")}</span></h3>{body}'
            + (f'<p class="note">{esc(OPEN_NOTE)}</p><ul>{traces}</ul>' if traces else "")
            + "</article>")


def captures_section(view: Mapping) -> str:
    """The run's captures, newest first, each with its digest (the digest's figures, formatted only),
    and on the live page one button per drawn rank asking for a capture of it."""
    c = view.get("captures") or {"items": [], "total": 0, "ranks": []}
    buttons = "".join(f'<button type="button" class="capture" data-capture-rank="{esc(r)}">Capture rank {esc(r)}'
                      "</button> " for r in c["ranks"])
    ask = (f'<p class="capture-ask">{buttons}</p>'
           '<p class="note">A capture records torch.profiler on that rank and a reference rank for a few steps '
           "(docs/capture.md).</p>" if buttons else "")
    if not c["items"]:
        return ('<section class="captures"><h2>Deep captures</h2><p class="note">no capture of this run</p>'
                f"{ask}</section>")
    shown = "".join(_capture(item) for item in c["items"])
    more = (f'<p class="note">{c["total"] - len(c["items"]):,} older capture(s) in final_summary.json</p>'
            if c["total"] > len(c["items"]) else "")
    return f'<section class="captures"><h2>Deep captures</h2>{ask}{shown}{more}</section>'


def telemetry_section(view: Mapping) -> str:
    t = view["telemetry"]
    finished = t["ranks_finished"]
    n_finished = finished["total"] if isinstance(finished, Mapping) else len(finished)
    dropped = {q: n for q, n in t["dropped"].items() if n}
    rows = [
        ("ranks finished", f"{n_finished}/{t['ranks_expected']} ({_fmt(finished)})"),
        ("dropped", _fmt(dropped) if dropped else "nothing dropped"),
        ("ranks reporting drops", _fmt(t["ranks_reporting_drops"])),
        ("rejected rows", _fmt(t["rejected_rows"]) if t["rejected_rows"] else "none"),
        ("export failures", _fmt(t["export_failures"]) if t["export_failures"] else "none"),
        ("steps missing", _fmt(t["steps_missing"]) if t["steps_missing"] else "none"),
        ("first step stored", _fmt(t["first_step_stored"])
         + (" (the processor first saw this run part-way)" if t["started_part_way"] else "")),
    ]
    body = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows)
    return f'<section class="telemetry"><h2>Telemetry</h2><dl class="evidence">{body}</dl></section>'


def run_fragments(view: Mapping) -> dict[str, str]:
    """id -> HTML of every refreshable part of a run page (what the JSON endpoint carries)."""
    return {
        "tm-hero": hero(view), "tm-badput": badput_section(view), "tm-captures": captures_section(view),
        "tm-rail": rail(view),
        "tm-phases": phases_section(view),
        "tm-steps": steps_section(view), "tm-memory": memory_section(view),
        "tm-resources": resources_section(view), "tm-stats": stats_section(view),
        "tm-ranks": ranks_section(view), "tm-telemetry": telemetry_section(view),
    }


def _run_body(fragments: Mapping[str, str]) -> str:
    div = lambda i: f'<div id="{i}">{fragments[i]}</div>'  # noqa: E731
    return (f'<main><div class="primary">{div("tm-hero")}{div("tm-badput")}{div("tm-captures")}{div("tm-phases")}{div("tm-steps")}{div("tm-memory")}'
            f'{div("tm-resources")}{div("tm-stats")}{div("tm-ranks")}</div><aside>{div("tm-rail")}{div("tm-telemetry")}</aside></main>')


def _head(title: str, extra: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="icon" href="data:,">'
            f"<title>{esc(title)}</title>{extra}</head>")


# --- Live pages ----------------------------------------------------------------------------


def run_page(view: Mapping, *, prefix: str, refresh_s: float) -> str:
    """The live page of one run (server-rendered; app.js refreshes the fragments)."""
    run_id = view["run_id"]
    api = f"{prefix}/api/run?id={quote(run_id, safe='')}"
    capture_api = f"{prefix}/api/capture?id={quote(run_id, safe='')}"
    head = _head(f"TraceML · {run_id}",
                 f'<link rel="stylesheet" href="{esc(prefix)}/assets/style.css">'
                 f'<script src="{esc(prefix)}/assets/app.js" defer></script>'
                 f'<noscript><meta http-equiv="refresh" content="{max(2, int(refresh_s * 5))}"></noscript>')
    return (head + f'<body><div id="traceml-run" data-api="{esc(api)}" '
            f'data-capture-api="{esc(capture_api)}" data-refresh-s="{refresh_s:g}">'
            f'<header class="top"><a href="{esc(prefix)}/">TraceML runs</a>'
            f'<span>run <span class="run-id" data-testid="run-id">{esc(run_id)}</span></span>'
            f'<span id="capture-status"></span><span id="refresh-status"></span></header>'
            + _run_body(run_fragments(view)) + "</div></body></html>")


def index_fragment(runs: Sequence[Mapping], prefix: str) -> str:
    if not runs:
        return '<section><h2>Runs</h2><p class="note">no run stored yet</p></section>'
    rows = []
    for run in runs:
        href = f"{prefix}/run?id={quote(run['run_id'], safe='')}"
        rows.append(f'<tr data-run="{esc(run["run_id"])}"><td><a class="mono" href="{esc(href)}">'
                    f'{esc(run["run_id"])}</a></td><td>{esc(run.get("state") or "stored")}</td>'
                    f'<td>{esc(_fmt(run.get("latest_step")))}</td><td>{esc(run.get("last_receive") or "—")}</td></tr>')
    return ('<section><h2>Runs</h2><table class="runs"><thead><tr><th>run</th><th>state</th><th>latest step</th>'
            f'<th>last data (UTC)</th></tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def index_page(runs: Sequence[Mapping], *, prefix: str, refresh_s: float) -> str:
    head = _head("TraceML runs", f'<link rel="stylesheet" href="{esc(prefix)}/assets/style.css">'
                                 f'<script src="{esc(prefix)}/assets/app.js" defer></script>')
    return (head + f'<body><div id="traceml-index" data-api="{esc(prefix)}/api/runs" '
            f'data-refresh-s="{refresh_s:g}"><header class="top"><b>TraceML runs</b>'
            f'<a href="{esc(prefix)}/fleet">fleet</a><span id="refresh-status"></span></header><main class="single"><div id="tm-runs">'
            f"{index_fragment(runs, prefix)}</div></main></div></body></html>")


def fleet_page(entries: Sequence, *, prefix: str, period_s: float) -> str:
    """The fleet page: hosts and their GPUs named as a run's confirmed straggler within the period
    (`fleet.fleet_rows`), most runs flagged first; every wire string escaped."""
    from traceml.processor.fleet import FLEET_COLUMNS, fleet_rows

    head = _head("TraceML fleet", f'<link rel="stylesheet" href="{esc(prefix)}/assets/style.css">')
    days = period_s / 86400.0
    rows = fleet_rows(entries)
    if rows:
        body = ("<table data-testid=\"fleet\"><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in FLEET_COLUMNS)
                + "</tr></thead><tbody>"
                + "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
                + "</tbody></table>")
    else:
        body = f"<p>No host was a confirmed straggler in the last {days:g} days.</p>"
    return (head + f'<body><header class="top"><b>TraceML fleet</b><a href="{esc(prefix)}/">runs</a></header>'
            f'<main class="single"><section><h2>Repeat offenders, last {days:g} days</h2>'
            "<p>Hosts and GPUs by runs whose confirmed straggler ran there, and the rank-time the other "
            "ranks lost waiting for them (the badput ledger's straggler wait).</p>"
            f"{body}</section></main></body></html>")


# --- One-file reports ------------------------------------------------------------------------


def _report_head(title: str) -> str:
    return _head(title, f'<meta http-equiv="Content-Security-Policy" content="{REPORT_CSP}">'
                        f"<style>{STYLE_CSS}</style>")


def report_page(view: Mapping) -> str:
    """The run's one-file HTML report: same fragments, inline CSS and SVG, the view as data."""
    run_id = view["run_id"]
    return (_report_head(f"TraceML report · {run_id}")
            + f'<body><div id="traceml-report"><header class="top"><b>TraceML summary report</b>'
              f'<span>run <span class="run-id" data-testid="run-id">{esc(run_id)}</span></span></header>'
            + _run_body(run_fragments(view))
            + f'<main class="single"><section><h2>Text card</h2><pre class="card">{esc(view["card"])}</pre>'
              f"</section></main></div>"
            + f'<script type="application/json" id="traceml-view">{script_json(view)}</script></body></html>')


def _delta_rows(comparison: Mapping) -> str:
    rows = []
    for d in (*comparison["metrics"], *comparison["memory"], *comparison.get("badput", ())):
        stat = d["statistic"]
        label = d["label"] if stat in ("median", "peak", "share", "rank_s") else f"{d['label']} ({stat})"
        if stat == "share" and d["a"] is None and d["b"] is None:
            continue  # a ledger cause neither run could measure

        def value(x):
            if x is None:
                return "—"
            if stat == "skew":
                return f"{x:+.0%}"
            if stat == "peak":
                return _bytes(x)
            if stat == "share":
                return f"{x:.1%}"
            if stat == "rank_s":
                return f"{x:,.1f} rank-s"
            return f"{x:.2f} ms"

        if d["delta"] is None:
            delta = d["note"] or "—"
        elif stat in ("skew", "share"):
            delta = f"{d['delta'] * 100:+.1f} pts"
        elif stat == "rank_s":
            delta = f"{d['delta']:+,.1f} rank-s"
        elif stat == "peak":
            delta = f"{d['delta'] / 2**20:+,.1f} MiB"
        else:
            delta = f"{d['delta']:+.2f} ms" + ("" if d["relative"] is None else f" ({d['relative']:+.0%})")
        cls = ' class="material"' if d["material"] else ""
        rows.append(f'<tr{cls} data-name="{esc(d["name"])}" data-statistic="{esc(stat)}"><td>{esc(label)}</td>'
                    f"<td>{esc(value(d['a']))}</td><td>{esc(value(d['b']))}</td><td>{esc(delta)}</td>"
                    f'<td class="material">{"material" if d["material"] else ""}</td></tr>')
    return "".join(rows)


def _side(side: Mapping, name: str, phase_order: Sequence[Mapping], scale: float) -> str:
    h = side["hero"]
    culprit = "" if h.get("culprit_rank") is None else f", culprit rank {esc(h['culprit_rank'])}"
    note = ("" if not side["ranks"]["not_drawn"]
            else f'<p class="note">{side["ranks"]["not_drawn"]:,} of {side["ranks"]["total"]:,} ranks not drawn</p>')
    return (f'<section class="side side-{name}"><h2>{name.upper()}: <span class="mono">{esc(side["label"])}</span></h2>'
            f'<p>run <span class="mono">{esc(side["run_id"])}</span>: <b>{esc(h.get("kind"))}</b> '
            f'<span class="badge sev-{esc(h.get("severity"))}">{esc(h.get("severity"))}</span>{culprit}</p>'
            + phase_bars(side["phases"], phase_order, culprit=h.get("culprit_rank"), scale_max=scale,
                         title=f"{name.upper()}: phases per rank (ms, same scale both sides)")
            + note + "</section>")


def compare_page(view: Mapping) -> str:
    """`traceml compare A B --html`: side-by-side phase bars, deltas, material changes marked."""
    c = view["comparison"]
    scale = bar_scale_max(view["a"]["phases"], view["b"]["phases"])
    material = c["material_changes"]
    diag = c["diagnosis"]
    changed = ", ".join(diag["changed"]) if diag["changed"] else "unchanged"
    warnings = "".join(f'<li class="note">{esc(w)}</li>' for w in c["warnings"])
    return (_report_head("TraceML comparison")
            + '<body><div id="traceml-compare"><header class="top"><b>TraceML comparison</b></header>'
              '<main class="single">'
              f'<section class="{"hero sev-warn" if material else "hero sev-info"}"><h2>Material changes</h2>'
              f'<p data-testid="material-changes">{esc(", ".join(material)) if material else "none"}</p>'
              f'<p>Diagnosis: {esc(diag["a"].get("kind"))} → {esc(diag["b"].get("kind"))} ({esc(changed)})</p>'
              f"<ul>{warnings}</ul></section>"
              f'<div class="side-by-side">{_side(view["a"], "a", view["phase_order"], scale)}'
              f'{_side(view["b"], "b", view["phase_order"], scale)}</div>'
            + phase_legend(view["phase_order"])
            + '<section><h2>Deltas (B - A)</h2><table class="deltas"><thead><tr><th>metric</th><th>A</th><th>B</th>'
              f'<th>B - A</th><th>material</th></tr></thead><tbody>{_delta_rows(c)}</tbody></table></section>'
              "</main></div>"
            + f'<script type="application/json" id="traceml-compare-data">{script_json(view)}</script>'
              "</body></html>")


__all__ = ["RUN_FRAGMENTS", "compare_page", "index_fragment", "index_page", "report_page", "run_fragments",
           "run_page", "script_json"]
