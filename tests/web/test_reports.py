"""`traceml summary RUN --html [PATH]` and `traceml compare A B --html [PATH]`: one self-contained file each.

Driven through the subcommands' own `main` on the contract scenarios' databases. The
files must carry no reference to anything outside them (no src/href to a URL, no
external stylesheet or script), draw the same facts as final_summary.json, and mark
exactly the changes `compare` calls material.
"""
from __future__ import annotations

import io
import json
import re

from traceml.launcher import compare, summary

_VIEW = re.compile(r'<script type="application/json" id="traceml-view">(.*?)</script>', re.S)
_COMPARE = re.compile(r'<script type="application/json" id="traceml-compare-data">(.*?)</script>', re.S)


def assert_self_contained(text: str) -> None:
    assert "<style>" in text
    assert not re.search(r'<(?:script|img|link|iframe)[^>]+(?:src|href)="(?!data:)', text), \
        re.findall(r'<(?:script|img|link|iframe)[^>]+>', text)
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text


def test_summary_html_writes_the_report_beside_the_summary(scenario_db, tmp_path):
    db = scenario_db("ddp_rank_straggler")
    out = io.StringIO()
    assert summary.main([str(db), "--out", str(tmp_path), "--html"], out=out) == 0
    report = tmp_path / "report.html"
    assert f"HTML report:   {report}" in out.getvalue()
    text = report.read_text()
    assert_self_contained(text)
    final = json.loads((tmp_path / "final_summary.json").read_text())
    view = json.loads(_VIEW.search(text).group(1))
    assert view["profile"] == "summary"
    assert [i["kind"] for i in view["issues"]] == [i["kind"] for i in final["issues"]]
    assert view["window"]["steps"] == final["global"]["window"]["steps"]
    assert text.count('<g class="bar') == 2 and text.count('<path class="line') == 3  # 2 ranks + median


def test_summary_html_to_a_chosen_path_keeps_json_on_stdout(scenario_db, tmp_path):
    out = io.StringIO()
    path = tmp_path / "elsewhere" / "r.html"
    assert summary.main([str(scenario_db("complete_gpu")), "--out", str(tmp_path), "--json", "--html", str(path)],
                        out=out) == 0
    json.loads(out.getvalue())  # stdout is the JSON alone
    assert path.is_file()


def test_compare_html_marks_the_material_changes(scenario_db, tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    assert summary.main([str(scenario_db("jittered_ddp")), "--out", str(a_dir)], out=io.StringIO()) == 0
    assert summary.main([str(scenario_db("ddp_rank_straggler")), "--out", str(b_dir)], out=io.StringIO()) == 0
    out = io.StringIO()
    path = tmp_path / "cmp.html"
    assert compare.main([str(a_dir), str(b_dir), "--json", "--html", str(path)], out=out) == 0
    decided = json.loads(out.getvalue())
    text = path.read_text()
    assert_self_contained(text)
    marked = re.findall(r'<tr class="material" data-name="([^"]+)" data-statistic="([^"]+)"', text)
    expected = [(d["name"], d["statistic"]) for d in (*decided["metrics"], *decided["memory"], *decided["badput"])
                if d["material"]]
    assert marked == expected and marked
    assert "diagnosis" in decided["material_changes"][0]
    shown = re.search(r'data-testid="material-changes">([^<]*)<', text).group(1)
    assert shown == ", ".join(decided["material_changes"])
    view = json.loads(_COMPARE.search(text).group(1))
    assert view["comparison"]["material_changes"] == decided["material_changes"]
    # Side by side: both panels, each with one bar per rank, on one scale.
    sides = re.findall(r'<section class="side side-(a|b)">(.*?)</section>', text, re.S)
    assert [name for name, _ in sides] == ["a", "b"]
    for _, body in sides:
        assert body.count('<g class="bar') == 2
    scales = re.findall(r'text-anchor="middle">([0-9.]+) ms</text></svg>', text)
    assert len(scales) == 2 and scales[0] == scales[1]


def test_compare_html_default_path(scenario_db, tmp_path, monkeypatch):
    a_dir = tmp_path / "a"
    assert summary.main([str(scenario_db("complete_gpu")), "--out", str(a_dir)], out=io.StringIO()) == 0
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    assert compare.main([str(a_dir), str(a_dir), "--html"], out=out) == 0
    assert (tmp_path / "compare.html").is_file() and "HTML report: compare.html" in out.getvalue()
