"""The web view's resources panel: from the store through the real pipeline, escaped, CSP-strict."""
from __future__ import annotations

import dataclasses
import json
import re
from urllib.parse import quote

from harness.resource_rows import rank_resource_records
from harness.resource_windows import busy_gpu_run
from tests.web.test_web_app import get, write_run
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.web.app import WebApp
from traceml.processor.web.feed import RunFeed
from traceml.processor.web.pages import report_page, resources_section
from traceml.processor.web.view import build_run_view

HOST = "<img src=x onerror=alert(1)>\"'&amp;"


def resource_db(tmp_path, run_id="r1", host=HOST):
    """Four ranks on one host, 30 steps (ends 1.7e9 + step + 0.1); rank 2 waits on input and its GPU
    idles; rank 0 sends the host's CPU (93 % busy)."""
    db = write_run(tmp_path / "res.db", run_id, 4, range(30), slow_rank=2, hostname=host)
    times = [1.7e9 + step + 0.05 for step in range(2, 30)]
    records = []
    for rank in range(4):
        records += rank_resource_records(run_id, rank, times, host=host, cpu=0.2 + 0.1 * rank,
                                         gpu_util=0.2 if rank == 2 else 0.9,
                                         host_cpu=0.93 if rank == 0 else None)
    with StepTimeStore(db) as store:
        store.write(resource_records=records)
    return db


def fragments(app, run_id="r1"):
    return json.loads(get(app, "/ui/api/run", f"id={quote(run_id)}").body)


def test_the_live_page_draws_the_resources_panel_from_the_store(tmp_path):
    app = WebApp(RunFeed(resource_db(tmp_path)))
    data = fragments(app)
    res = data["view"]["resources"]
    assert res["available"] and res["sources"] == ["traceml"]
    gpu = next(r for r in res["figures"] if r["figure"] == "gpu_utilization")
    assert (gpu["median"], gpu["worst"], gpu["worst_member"], gpu["measured"]) == (0.9, 0.2, 2, 4)
    host_cpu = next(r for r in res["figures"] if r["scope"] == "nodes" and r["figure"] == "cpu_utilization")
    assert host_cpu["worst"] == 0.93 and host_cpu["worst_member"] == HOST
    assert [r["rank"] for r in res["ranks"]] == [0, 1, 2, 3]
    html = data["html"]["tm-resources"]
    assert '<tr data-figure="ranks.gpu_utilization"><td>GPU util</td><td>90%</td>' in html
    assert '<tr data-rank="2"><td>rank 2</td>' in html and "<td>20%</td>" in html
    page = get(app, "/ui/run", "id=r1").body.decode()
    assert '<div id="tm-resources"><section><h2>Resources</h2>' in page


def test_a_hostile_host_name_is_text_in_the_panel_the_page_and_the_report(tmp_path):
    app = WebApp(RunFeed(resource_db(tmp_path)))
    data = fragments(app)
    escaped = "&lt;img src=x onerror=alert(1)&gt;&quot;&#x27;&amp;amp;"
    for body in (data["html"]["tm-resources"], get(app, "/ui/run", "id=r1").body.decode(),
                 report_page(data["view"])):
        assert "<img" not in body and escaped in body
    assert data["view"]["resources"]["nodes"][0]["host"] == HOST  # the data keeps the true string


def test_the_panel_is_csp_strict():
    view = build_run_view(_analysis_with(busy_gpu_run("r1")))
    for html in (resources_section(view), report_page(view)):
        assert not re.search(r"\sstyle\s*=", html)
        assert not re.search(r"\son[a-z]+\s*=", html)
    assert "<script" not in resources_section(view)


def test_the_steepest_memory_trend_is_listed_and_drawn_as_its_fitted_line():
    view = build_run_view(_analysis_with(busy_gpu_run("r1")))
    assert [t["rank"] for t in view["resources"]["memory_trends"]] == [1, 0]  # steepest first
    html = resources_section(view)
    assert "r1 rss +12.0 MiB/step from step 10" in html
    assert 'class="chart trend-chart"' in html and '<path class="line" data-rank="1"' in html


def test_without_resource_data_the_panel_says_not_measured(tmp_path):
    app = WebApp(RunFeed(write_run(tmp_path / "plain.db", "r1", 2, range(25))))
    html = fragments(app)["html"]["tm-resources"]
    assert "not measured" in html and "<table" not in html


def _analysis_with(resources):
    from tests.step_time.handbuilt_windows import rank_values, window
    from traceml.processor.diagnosis import diagnose
    from traceml.processor.step_time.model import StepTimeAnalysis

    w = window({r: rank_values() for r in range(3)}, steps=40)
    return dataclasses.replace(StepTimeAnalysis(window=w, diagnosis=diagnose(w)), resources=resources)


def test_a_cpu_only_run_has_no_gpu_columns():
    from harness.resource_windows import GiB, resource_window

    w = resource_window("r1", {r: {"cpu_utilization": 0.5, "rss_bytes": GiB} for r in range(3)})
    html = resources_section(build_run_view(_analysis_with(w)))
    assert "<th>process CPU</th><th>RSS</th></tr>" in html and "<th>GPU" not in html
