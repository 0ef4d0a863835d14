"""The web view and the HTML report in a real headless Chromium, fed by a real 2-rank run.

One `traceml run --ui --html-report` of the demo workload with an injected input
straggler on rank 1 (gloo, CPU), under a run id carrying `<script>` and quotes.
While it trains, Playwright drives Debian's /usr/bin/chromium (no browser download)
against the embedded processor's `--ui` address: no console error and no failed
request, the hero names rank 1, the rail lists what the terminal presenter lists,
one bar and one line per rank with real geometry, the step counter advances, the
run id is text. After the run, the one-file report opens from disk with the same
checks against the card. Screenshots go to the test's folder and must not be blank.
"""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher.launcher_helpers import TRACEML, clean_env
from traceml.launcher.demo import WORKLOAD

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed "
                                                    "(scripts/install-system-deps.sh installs it)"),
]
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra) is not installed")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_ID = "web\"<script>window.__pwned=1</script>'run"
STRAGGLER = 1
STEPS = 300  # ~15 s of training here: long enough for the live checks, short enough for the minute
MIN_COLOURS = 40

COUNT_COLOURS = """async (b64) => {
  const img = new Image(); img.src = "data:image/png;base64," + b64; await img.decode();
  const canvas = document.createElement("canvas"); canvas.width = img.width; canvas.height = img.height;
  const g = canvas.getContext("2d"); g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, canvas.width, canvas.height).data; const seen = new Set();
  for (let i = 0; i < d.length; i += 4) { seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]); }
  return seen.size;
}"""


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        # A second try: once in a clean-clone CI run (11:11, suite near its end) this VM's chromium
        # started (pid given) and never answered Playwright within 30 s; the page is the claim,
        # not the launch, and a launch that fails twice still fails the test.
        for attempt in (1, 2):
            try:
                chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, timeout=45_000)
                break
            except playwright_api.Error:
                if attempt == 2:
                    raise
        try:
            yield chromium
        finally:
            chromium.close()


class Watched:
    """A page whose console errors, page errors, failed requests and error answers are collected."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1280, "height": 1000})
        self.problems: list[str] = []
        # On the context: every page opened in it (the index too) is watched.
        self.context.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        self.context.on("weberror", lambda e: self.problems.append(f"page error: {e.error}"))
        self.context.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url} {r.failure}"))
        self.context.on("response",
                        lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))
        self.page = self.context.new_page()

    def close(self):
        self.context.close()


def colours(browser, png: bytes) -> int:
    blank = browser.new_page()
    try:
        return blank.evaluate(COUNT_COLOURS, base64.b64encode(png).decode())
    finally:
        blank.close()


def rail_kinds(page) -> list[str]:
    return page.locator("#tm-rail li.finding").evaluate_all("els => els.map(e => e.dataset.kind)")


def assert_drawn(page, ranks: int) -> None:
    bars = page.locator("#tm-phases g.bar")
    assert bars.count() == ranks
    for i in range(ranks):
        box = bars.nth(i).bounding_box()
        assert box and box["width"] > 50 and box["height"] > 5, box
    lines = page.locator("#tm-steps path.line[data-rank]")
    assert lines.count() == ranks
    boxes = lines.evaluate_all("els => els.map(e => { const b = e.getBBox(); return [b.width, b.height]; })")
    assert all(w > 100 for w, _ in boxes), boxes
    assert page.locator("#tm-phases rect.seg").count() >= 3 * ranks


def assert_run_id_is_text(page) -> None:
    assert page.locator('[data-testid="run-id"]').first.text_content() == RUN_ID
    assert page.evaluate("window.__pwned") is None


def card_kinds(card: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^(?:Diagnosis|Also): ([A-Z0-9_]+) \[", card, re.M)]


def test_live_page_and_report_of_a_real_run(browser, tmp_path):
    from traceml.processor.presenters import issue_rows
    from traceml.processor.step_time.pipeline import LiveStepTimeSession

    proc = subprocess.Popen(
        [str(TRACEML), "run", "--standalone", "--nproc-per-node", "2", "--ui", "--html-report",
         "--run-id", RUN_ID, "--no-summary-print", str(WORKLOAD), "--scenario", "input-straggler",
         "--steps", str(STEPS), "--straggler-rank", str(STRAGGLER)],
        # Captures only when asked (no automatic one holds the run's slot when the button is pressed).
        cwd=tmp_path, env=clean_env(TRACEML_PROCESSOR_CAPTURE="manual"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    output: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            found = re.search(r"\[traceml\] live web view: (\S+)", line)
            url = found.group(1) if found else None
        assert url, "".join(output)
        db = next((tmp_path / "traceml_runs").glob("*/traceml.sqlite"))

        live = Watched(browser)
        page = live.page
        page.goto(url)
        # Locator assertions poll from outside the page (the page's CSP refuses string evaluation).
        expect = playwright_api.expect
        expect(page.locator('[data-testid="verdict-kind"]')).to_have_text("INPUT_STRAGGLER", timeout=60_000)
        expect(page.locator('[data-testid="culprit-rank"]')).to_have_text(f"rank {STRAGGLER}")
        first = int(page.locator('[data-testid="last-step"]').text_content())
        expect(page.locator('[data-testid="last-step"]')).not_to_have_text(str(first), timeout=20_000)
        assert int(page.locator('[data-testid="last-step"]').text_content()) > first  # the page follows the run
        assert_drawn(page, 2)
        assert_run_id_is_text(page)
        # The "Capture rank N" button: app.js posts to the page's capture route (the run id, quotes and
        # <script> included, travels percent-encoded) and shows the book's answer as text.
        page.locator(f'button[data-capture-rank="{STRAGGLER}"]').click()
        expect(page.locator("#capture-status")).to_have_text(
            re.compile(rf"^capture c[0-9]+-[0-9a-f]+ of rank {STRAGGLER} requested \(requested\)$"), timeout=30_000)
        assert page.evaluate("window.__pwned") is None
        index = live.context.new_page()
        index.goto(url.split("run?")[0])
        assert index.locator("#tm-runs a.mono").first.text_content() == RUN_ID
        assert index.evaluate("window.__pwned") is None
        index.close()
        # The rail lists what the terminal presenter lists for the stored data (both follow the run,
        # so they are compared until they meet, within a bound).
        for _ in range(20):
            terminal = [r.kind for r in issue_rows(LiveStepTimeSession(db, RUN_ID).refresh())]
            if rail_kinds(page) == terminal:
                break
            time.sleep(0.5)
        assert rail_kinds(page) == terminal
        shot = page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
        assert colours(browser, shot) > MIN_COLOURS

        problems = list(live.problems)  # read before closing: a poll cut short by the close is no failure
        live.close()  # before the run ends: its processor then stops answering
        assert problems == [], problems

        rest, _ = proc.communicate(timeout=180)
        output.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, "".join(output)[-4000:]

    run_dir = next((tmp_path / "traceml_runs").iterdir())
    summary = json.loads((run_dir / "final_summary.json").read_text())
    card = (run_dir / "summary_card.txt").read_text()
    report = run_dir / "report.html"
    assert f"HTML report:   {report}" in "".join(output)

    offline = Watched(browser)
    page = offline.page
    page.goto(report.as_uri())
    assert page.locator('[data-testid="verdict-kind"]').text_content() == summary["diagnosis"]["kind"]
    assert summary["diagnosis"]["culprit_rank"] == STRAGGLER
    assert page.locator('[data-testid="culprit-rank"]').text_content() == f"rank {STRAGGLER}"
    assert rail_kinds(page) == card_kinds(card) == [i["kind"] for i in summary["issues"]]
    assert int(page.locator('[data-testid="last-step"]').text_content()) == summary["global"]["window"]["last_step"]
    assert_drawn(page, 2)
    assert_run_id_is_text(page)
    embedded = json.loads(page.locator("#traceml-view").text_content())
    assert embedded["run_id"] == RUN_ID and embedded["hero"]["kind"] == summary["diagnosis"]["kind"]
    shot = page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert colours(browser, shot) > MIN_COLOURS
    offline.close()
    assert offline.problems == [], offline.problems
    assert os.path.getsize(tmp_path / "live.png") > 10_000
