"""The `captures` section of final_summary.json and its card lines (issue 33, item 6)."""
from __future__ import annotations

import json

import jsonschema

from harness.captures import HOSTILE_OP, capture_records
from tests.step_time.test_final_summary import straggler_analysis
from traceml.processor.reporting import RunMetadata, project_final_summary
from traceml.processor.reporting.captures import CAPTURE_KEYS, DIGEST_KEYS, OPEN_NOTE, ROW_KEYS, capture_line
from traceml.schema.summary import final_summary_json_schema_text

SCHEMA = json.loads(final_summary_json_schema_text())


def summary_with(captures, run_id="run-x"):
    return project_final_summary(straggler_analysis(), RunMetadata(run_id, generated_at=0.0), captures=captures)


def finding():
    primary = straggler_analysis().diagnosis.primary
    return primary.kind, primary.culprit_rank


def test_no_capture_is_an_empty_list_and_no_card_line():
    summary = summary_with(())
    assert summary["captures"] == []
    assert "capture_id" not in summary["diagnosis"]["evidence"]
    assert "Capture" not in summary["card"]
    jsonschema.validate(summary, SCHEMA)


def test_a_done_capture_is_public_its_finding_names_it_and_the_card_says_it_under_the_finding():
    kind, culprit = finding()
    done, failed = capture_records("run-x", kind, culprit, 1 - culprit)
    summary = summary_with((failed, done))  # any order in: oldest first out
    jsonschema.validate(json.loads(json.dumps(summary, allow_nan=False)), SCHEMA)
    first, second = summary["captures"]
    assert (first["capture_id"], second["capture_id"]) == ("cap-1", "cap-2")
    assert list(first) == list(CAPTURE_KEYS) and list(first["digest"]) == list(DIGEST_KEYS)
    assert all(list(row) == list(ROW_KEYS) for row in first["digest"]["rows"])
    top = first["digest"]["rows"][0]
    assert (top["name"], top["excess_ms"], top["share_of_gap"]) == ("aten::sort", 21.0, 0.9545)
    assert first["requested_at"] == "2023-11-14T22:15:00Z" and first["traces"] == [
        f"run-x.cap-1.rank{culprit}.pt.trace.json.gz", f"run-x.cap-1.rank{1 - culprit}.pt.trace.json.gz"]
    assert summary["diagnosis"]["evidence"]["capture_id"] == "cap-1"
    assert summary["issues"][0]["evidence"]["capture_id"] == "cap-1"

    card = summary["card"].splitlines()
    under = card.index(f"  {summary['diagnosis']['summary']}") + 1
    assert card[under] == (f"  Capture cap-1: rank {culprit} vs rank {1 - culprit} over 5 step(s): "
                           "aten::sort +21.0 ms/step (95 % of the gap); "
                           "(outside any operator) +1.0 ms/step (5 % of the gap); "
                           "aten::rare 1.0 ms/step (reference time unknown)")
    assert card[under + 1].startswith("    traces: run-x.cap-1.rank")
    # the person's capture that failed names no finding: listed apart, with why
    assert "Captures:" in card
    assert (f"  Capture cap-2: rank {1 - culprit} over 5 step(s): failed: rank {1 - culprit} did not answer "
            "within the 120 s deadline") in card
    assert f"  ({OPEN_NOTE})" in card


def test_a_capture_of_another_finding_is_not_linked_to_this_one():
    kind, culprit = finding()
    done, _ = capture_records("run-x", kind, 1 - culprit, culprit)  # same kind, other rank
    summary = summary_with((done,))
    assert "capture_id" not in summary["diagnosis"]["evidence"]
    assert "Captures:" in summary["card"]


def test_a_hostile_op_name_is_kept_true_in_json_and_printable_in_the_card():
    kind, culprit = finding()
    done, _ = capture_records("run-x", kind, culprit, 1 - culprit, extra_op=HOSTILE_OP + "\x1b[2J")
    summary = summary_with((done,))
    assert summary["captures"][0]["digest"]["rows"][0]["name"] == HOSTILE_OP + "\x1b[2J"
    assert "\x1b" not in summary["card"] and HOSTILE_OP + "\\x1b[2J" in summary["card"]


def test_no_gap_says_so_on_the_card():
    line = capture_line({"capture_id": "c", "culprit_rank": 1, "reference_rank": 0, "steps": 3, "status": "done",
                         "reason": None, "traces": [],
                         "digest": {"gap_ms": -0.4, "rows": [{"name": "aten::mm", "kind": "op", "culprit_ms": 1.0,
                                                              "reference_ms": 1.2, "excess_ms": -0.2,
                                                              "share_of_gap": None}]}})
    assert line == "Capture c: rank 1 vs rank 0 over 3 step(s): no entry took longer on rank 1 (gap -0.4 ms/step)"


def test_a_refused_capture_says_why_and_one_in_progress_its_state():
    base = {"capture_id": "c", "culprit_rank": 1, "reference_rank": 0, "steps": 3, "traces": [], "digest": None}
    assert capture_line({**base, "status": "refused", "reason": "captures are off"}).endswith(
        "refused: captures are off")
    assert capture_line({**base, "status": "capturing", "reason": None}).endswith("over 3 step(s): capturing")


def test_the_final_summary_of_a_stored_run_reads_the_captures_kept_beside_its_store(tmp_path):
    from tests.web.test_web_app import write_run
    from traceml.processor.capture.files import CaptureFiles
    from traceml.processor.summary_section import build_final_summary

    db = write_run(tmp_path / "t.db", "r1", 4, range(30), slow_rank=2)
    files = CaptureFiles(db)
    done, failed = capture_records("r1", "INPUT_STRAGGLER", 2, 0)
    for record in (done, failed):
        files.save_record(record)
    for summary in done.summaries:
        files.save_summary(summary, summary.to_json())
    summary = build_final_summary(db, "r1", generated_at=1.7e9)
    jsonschema.validate(json.loads(json.dumps(summary, allow_nan=False)), SCHEMA)
    assert [c["capture_id"] for c in summary["captures"]] == ["cap-1", "cap-2"]
    digest = summary["captures"][0]["digest"]
    assert digest["rows"][0]["name"] == "aten::sort"
    # the captured steps (12..16) are in the summary window: their phases are compared
    assert {g["phase"] for g in digest["phase_gap"]} >= {"input_wait", "backward"}
    assert not any("phase times" in note for note in digest["not_seen"])
    assert summary["diagnosis"]["evidence"]["capture_id"] == "cap-1"
    assert "  Capture cap-1: rank 2 vs rank 0 over 5 step(s): aten::sort +21.0 ms/step" in summary["card"]
