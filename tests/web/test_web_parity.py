"""Same facts everywhere: the web JSON, the HTML report, the terminal card and final_summary.json.

For every contract scenario (tests/step_time/scenarios.py) the four surfaces must
agree on kind, severity, status, culprit rank and issue order, and on the window's
statistics (clock, aligned steps, first/last step, ranks, median/worst/skew of
Step Time and the phases). The web JSON is read through the real request handler,
the report from its embedded view and its drawn text.
"""
from __future__ import annotations

import html
import json
import re

import pytest
from rich.console import Console

from tests.step_time.scenarios import SCENARIOS
from traceml.processor.presenters import issue_rows, render_live
from traceml.processor.step_time.pipeline import LiveStepTimeSession
from traceml.processor.summary_section import build_final_summary
from traceml.processor.web.app import WebApp
from traceml.processor.web.feed import RunFeed
from traceml.processor.web.report import write_run_report

_VIEW = re.compile(r'<script type="application/json" id="traceml-view">(.*?)</script>', re.S)
STAT_KEYS = ("step_time_ms", "input_wait_ms", "forward_ms", "backward_ms", "compute_ms", "residual_ms",
             "collective_wait_ms")


@pytest.fixture(scope="module")
def surfaces(scenario_db, tmp_path_factory):
    out = {}
    folder = tmp_path_factory.mktemp("reports")
    for name in SCENARIOS:
        db = scenario_db(name)
        web = json.loads(WebApp(RunFeed(db)).handle("GET", "/ui/api/run", f"id={name}", {}).body)
        report_html = write_run_report(db, name, folder / f"{name}.html").read_text()
        report = json.loads(_VIEW.search(report_html).group(1))
        live = LiveStepTimeSession(db, name).refresh()
        final = build_final_summary(db, name, generated_at=0.0)
        out[name] = (web, report, report_html, live, final)
    return out


def _issues(view_or_summary):
    return [(i["kind"], i["severity"], i["status"], i["culprit_rank"]) for i in view_or_summary["issues"]]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.slow
def test_issues_agree_on_every_surface(surfaces, name):
    web, report, report_html, live, final = surfaces[name]
    card = [(r.kind, r.severity, r.status, None if not r.rank else int(r.rank.split()[-1]))
            for r in issue_rows(live)]
    assert _issues(web["view"]) == _issues(report) == _issues(final) == card
    for view in (web["view"], report):
        hero = view["hero"]
        assert (hero["kind"], hero["severity"], hero["culprit_rank"]) == (
            final["diagnosis"]["kind"], final["diagnosis"]["severity"], final["diagnosis"]["culprit_rank"])

    # What is drawn says the same, in the same order: the rail of the live page and of the report.
    for fragment in (web["html"]["tm-rail"], report_html):
        kinds = re.findall(r'<li class="finding sev-(\w+)" data-kind="([A-Z0-9_]+)"', fragment)
        assert kinds == [(s, k) for k, s, _, _ in _issues(final)]
    hero_kind = re.search(r'data-testid="verdict-kind">([^<]*)<', web["html"]["tm-hero"]).group(1)
    assert hero_kind == final["diagnosis"]["kind"]
    if final["diagnosis"]["culprit_rank"] is not None:
        assert f'data-testid="culprit-rank">rank {final["diagnosis"]["culprit_rank"]}<' in web["html"]["tm-hero"]
    # The terminal card lists them in that order too.
    console = Console(width=200, record=True, color_system=None)
    console.print(render_live(live))
    text = console.export_text()
    positions = [text.index(f"{n}. {kind} [{severity}") for n, (kind, severity, _, _) in enumerate(card, 1)]
    assert positions == sorted(positions)


@pytest.mark.parametrize("name", SCENARIOS)
def test_window_statistics_agree(surfaces, name):
    web, report, report_html, live, final = surfaces[name]
    glob = final["global"]
    for view in (web["view"], report):
        win = view["window"]
        for key in ("clock", "steps", "first_step", "last_step", "rank_count"):
            assert win[key] == glob["window"][key], key
        stats = {s["key"]: s for s in view["stats"]}
        for key in STAT_KEYS:
            # The cross-rank median the card and the sentences quote, its near (representative) rank
            # beside it (issue 30 item 4: the report printed the representative rank's value).
            assert stats[key]["median"] == glob["cross_rank_median"][key]
            assert stats[key]["median_rank"] == glob["median"][key]["rank"]
            assert stats[key]["worst"] == glob["worst"][key]["value"]
            assert stats[key]["worst_rank"] == glob["worst"][key]["rank"]
            assert stats[key]["skew"] == glob["skew"][key]
        # Bars: one per rank (these scenarios are small), values = the summary's per-rank averages.
        groups = {g["global_rank"]: g["metrics"] for g in final["groups"]}
        assert [p["rank"] for p in view["phases"]] == sorted(groups)
        for bar in view["phases"]:
            assert bar["values"]["forward"] == groups[bar["rank"]]["forward_ms"]
            assert bar["values"]["residual"] == groups[bar["rank"]]["residual_ms"]
            assert bar["step_time"] == groups[bar["rank"]]["step_time_ms"]
    window = live.analysis.window
    assert web["view"]["steps"]["ids"] == list(window.steps[-100:])
    # The drawn statistics table of the report shows the card's median of every metric it prints.
    card = {line.split()[0]: line.split()[1] for line in final["card"].splitlines()
            if line[:1].islower() and len(line.split()) >= 6 and not line.startswith("metric")}
    for key in STAT_KEYS:
        median = glob["cross_rank_median"][key]
        if median is None:
            continue
        row = re.search(rf'<tr data-metric="{key}"><td>[^<]*</td><td>([^<]*)</td>', report_html)
        assert html.unescape(row.group(1)) == f"{median:.1f}" == card[key[:-3]], key
