"""The capture book, its files and the trigger policy (issue 33 items 1 and 4), without a server.

The HTTP paths and two replicas are tests/processor/test_capture_routes.py; the real runs under
`traceml run` are tests/launcher/test_capture_runs.py."""
from __future__ import annotations

import gzip
from types import SimpleNamespace

import pytest

from traceml.processor.capture.book import (
    CaptureBook,
    CaptureOff,
    CaptureRefused,
    InProgress,
    NotHeld,
    TooLarge,
    stored_captures,
)
from traceml.processor.capture.files import CaptureFiles, capture_trace_paths, load_records, run_captures_folder
from traceml.processor.capture.policy import CapturePolicy, bears_watching, capture_target, culprit_of, reference_for
from traceml.processor.capture.book import digest_of
from traceml.schema import diagnosis as d
from traceml.schema.capture import (
    HOST_NAME,
    KIND_HOST,
    KIND_OP,
    ROLE_CULPRIT,
    ROLE_REFERENCE,
    STATUS_CAPTURING,
    STATUS_DONE,
    STATUS_FAILED,
    STATUS_REQUESTED,
    OpTime,
    RankCaptureSummary,
)

RUN = "run-a"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def summary(capture_id: str, rank: int, role: str, step_ms: float, sort_ms: float, run_id: str = RUN) -> bytes:
    ops = (OpTime("aten::sort", KIND_OP, 5, sort_ms * 5), OpTime("aten::addmm", KIND_OP, 5, 10.0),
           OpTime(HOST_NAME, KIND_HOST, 5, 2.0))
    return RankCaptureSummary(capture_id=capture_id, run_id=run_id, rank=rank, role=role, first_step=30,
                              step_ms=(step_ms,) * 5, activities=("cpu",), ops=ops).to_json()


def make_book(tmp_path, **kwargs) -> tuple[CaptureBook, Clock]:
    clock = Clock()
    ranks = kwargs.pop("ranks", {RUN: {0, 1, 2, 3}})
    book = CaptureBook(CaptureFiles(tmp_path / "traceml.db"), holds_run=ranks.get, digest=digest_of,
                       monotonic=clock, **kwargs)
    return book, clock


def test_a_persons_request_is_handed_once_to_each_rank_and_done_with_a_digest_once_both_answered(tmp_path):
    book, _ = make_book(tmp_path)
    record = book.request_capture(RUN, 1, 0, steps=5)
    assert record.status == STATUS_REQUESTED and record.trigger == "manual"
    assert book.pending_for(RUN, 2) is None  # not part of it
    request = book.pending_for(RUN, 1)
    assert (request.capture_id, request.rank, request.role, request.steps) == (record.capture_id, 1, ROLE_CULPRIT, 5)
    assert book.pending_for(RUN, 1) is None  # taken
    assert book.get(record.capture_id).status == STATUS_CAPTURING
    assert book.pending_for(RUN, 0).role == ROLE_REFERENCE
    book.receive_summary(record.capture_id, 1, summary(record.capture_id, 1, ROLE_CULPRIT, 40.0, 20.0))
    assert book.get(record.capture_id).status == STATUS_CAPTURING
    book.receive_summary(record.capture_id, 0, summary(record.capture_id, 0, ROLE_REFERENCE, 20.0, 0.0))
    done = book.get(record.capture_id)
    assert done.status == STATUS_DONE and done.finished_at is not None
    assert done.digest.rows[0].name == "aten::sort" and done.digest.rows[0].excess_ms == pytest.approx(20.0)
    # Read back from the files by another process: the same record and digest.
    again = stored_captures(tmp_path / "traceml.db", RUN)
    assert [r.capture_id for r in again] == [record.capture_id]
    assert again[0].status == STATUS_DONE and again[0].digest == done.digest


def test_one_capture_of_a_run_at_a_time_and_a_persons_request_ignores_the_cooldown(tmp_path):
    book, clock = make_book(tmp_path, ranks={RUN: {0, 1}, "other": {0, 1}}, cooldown_s=300.0)
    first = book.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER)
    assert first is not None and first.trigger == d.COMPUTE_STRAGGLER
    with pytest.raises(InProgress):
        book.request_capture(RUN, 1, 0)
    assert book.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is None
    assert book.request_capture("other", 0, 1) is not None  # another run is not held back
    book.receive_failure(first.capture_id, 1, "profiler busy")
    assert book.get(first.capture_id).status == STATUS_FAILED
    assert book.get(first.capture_id).reason == "rank 1: profiler busy"
    clock.now += 299.0
    assert book.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is None  # the cooldown
    assert book.request_capture(RUN, 1, 0) is not None  # a person is not held back by it


def test_the_cooldown_passes_for_the_diagnosis(tmp_path):
    book, clock = make_book(tmp_path, ranks={RUN: {0, 1}}, cooldown_s=300.0, deadline_s=10.0)
    assert book.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is not None
    clock.now += 301.0  # the first one failed at its deadline meanwhile
    assert book.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is not None


def test_deadlines_fail_a_capture_nobody_took_and_one_a_rank_took_but_never_answered(tmp_path):
    book, clock = make_book(tmp_path, deadline_s=120.0)
    untaken = book.request_capture(RUN, 1, 0)
    clock.now += 121.0
    record = book.get(untaken.capture_id)
    assert record.status == STATUS_FAILED and "no rank took the request" in record.reason
    taken = book.request_capture(RUN, 1, 0)
    clock.now += 100.0
    assert book.pending_for(RUN, 1) is not None
    assert book.pending_for(RUN, 0) is not None
    book.receive_summary(taken.capture_id, 0, summary(taken.capture_id, 0, ROLE_REFERENCE, 20.0, 0.0))
    clock.now += 119.0
    assert book.get(taken.capture_id).status == STATUS_CAPTURING  # within the deadline of its delivery
    clock.now += 2.0
    record = book.get(taken.capture_id)
    assert record.status == STATUS_FAILED and record.reason.startswith("rank 1 did not answer")


def test_refusals_name_the_problem(tmp_path):
    book, _ = make_book(tmp_path)
    with pytest.raises(NotHeld, match="not held by this processor"):
        book.request_capture("elsewhere", 1, 0)
    with pytest.raises(NotHeld, match="rank 9"):
        book.request_capture(RUN, 9, 0)
    with pytest.raises(CaptureRefused, match="must differ"):
        book.request_capture(RUN, 1, 1)
    with pytest.raises(CaptureRefused, match="steps must be 1..50"):
        book.request_capture(RUN, 1, 0, steps=51)
    record = book.request_capture(RUN, 1, 0)
    with pytest.raises(CaptureRefused, match="'rank' is 0, the path names 1"):
        book.receive_summary(record.capture_id, 1, summary(record.capture_id, 0, ROLE_REFERENCE, 1.0, 0.0))
    with pytest.raises(CaptureRefused, match="'step_ms' must hold"):
        book.receive_summary(record.capture_id, 1, b'{"capture_id": "%s", "run_id": "run-a", "rank": 1, '
                                                   b'"role": "culprit", "step_ms": []}' % record.capture_id.encode())
    with pytest.raises(CaptureRefused, match="not part of capture"):
        book.receive_summary(record.capture_id, 3, summary(record.capture_id, 3, ROLE_REFERENCE, 1.0, 0.0))
    with pytest.raises(NotHeld):
        book.receive_summary("c1-nothere", 1, summary("c1-nothere", 1, ROLE_CULPRIT, 1.0, 0.0))
    # Nothing of the refused uploads was stored.
    folder = run_captures_folder(tmp_path / "traceml.db", RUN) / record.capture_id
    assert sorted(p.name for p in folder.iterdir()) == ["capture.json"]


def test_off_hands_out_nothing_and_manual_takes_only_a_persons_request(tmp_path):
    off, _ = make_book(tmp_path / "off", mode="off")
    with pytest.raises(CaptureOff):
        off.request_capture(RUN, 1, 0)
    assert off.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is None and off.pending_for(RUN, 1) is None
    manual, _ = make_book(tmp_path / "manual", mode="manual")
    assert manual.auto_capture(RUN, 1, 0, d.COMPUTE_STRAGGLER) is None
    assert manual.request_capture(RUN, 1, 0) is not None


def test_traces_are_capped_kept_under_their_file_name_and_removed_with_the_run(tmp_path):
    book, _ = make_book(tmp_path, max_trace_bytes=200)
    record = book.request_capture(RUN, 1, 0)
    with pytest.raises(TooLarge, match="over the cap of 200 bytes"):
        book.receive_trace(record.capture_id, 1, gzip.compress(bytes(range(256)) * 8, compresslevel=0))
    with pytest.raises(CaptureRefused, match="gzip"):
        book.receive_trace(record.capture_id, 1, b"{}")
    book.receive_trace(record.capture_id, 1, gzip.compress(b'{"traceEvents": []}'))
    with pytest.raises(InProgress):
        book.receive_trace(record.capture_id, 1, gzip.compress(b'{"traceEvents": []}'))
    paths = capture_trace_paths(tmp_path / "traceml.db", RUN)
    assert [p.name for p in paths] == [f"{RUN}.{record.capture_id}.rank1.pt.trace.json.gz"]
    assert load_records(tmp_path / "traceml.db", RUN)[0].traces == (paths[0].name,)
    book.forget_run(RUN)
    assert not run_captures_folder(tmp_path / "traceml.db", RUN).exists()
    assert book.of_run(RUN) == [] and capture_trace_paths(tmp_path / "traceml.db", RUN) == []


def test_a_request_for_a_run_that_ended_is_refused(tmp_path):
    book, _ = make_book(tmp_path, run_ended=lambda run_id: True)
    with pytest.raises(InProgress, match="has ended"):
        book.request_capture(RUN, 1, 0)


def test_without_an_analysis_a_persons_request_gets_the_lowest_other_rank_as_reference(tmp_path):
    book, _ = make_book(tmp_path, ranks={RUN: {0, 1, 2}})
    assert book.request_capture(RUN, 0).reference_rank == 1


# --- the policy ------------------------------------------------------------------------------


def _facts(rank, step_ms, node, host="h"):
    identity = SimpleNamespace(node_rank=node, hostname=host)
    return SimpleNamespace(identity=identity, average=SimpleNamespace(step_time=step_ms))


def _window(facts, representative, steps=40):
    return SimpleNamespace(rank_facts=facts, metrics={"step_time": SimpleNamespace(representative_rank=representative)},
                           step_count=steps)


def _issue(kind, culprit=None, status=d.STATUS_CONFIRMED, evidence=None):
    return SimpleNamespace(kind=kind, culprit_rank=culprit, status=status, evidence=evidence or {})


def test_the_reference_is_the_fastest_other_rank_of_the_culprits_node_else_the_representative_never_the_culprit():
    facts = {0: _facts(0, 50.0, 0), 1: _facts(1, 40.0, 0), 2: _facts(2, 30.0, 1), 3: _facts(3, 35.0, 1)}
    window = _window(facts, representative=2)
    assert reference_for(window, 0) == 1  # same node: rank 1 (not rank 2, faster but on node 1)
    assert reference_for(window, 2) == 3
    alone = {0: _facts(0, 50.0, 0), 1: _facts(1, 40.0, 1), 2: _facts(2, 30.0, 2)}
    assert reference_for(_window(alone, representative=1), 0) == 1
    assert reference_for(_window(alone, representative=0), 0) == 1  # the representative is the culprit
    assert reference_for(_window({0: _facts(0, 1.0, 0)}, 0), 0) is None


def test_which_confirmed_findings_name_a_culprit():
    assert culprit_of(_issue(d.COMPUTE_STRAGGLER, 1)) == 1
    assert culprit_of(_issue(d.STEP_TIME_DRIFT, 2)) == 2
    assert culprit_of(_issue(d.STEP_TIME_DRIFT, None)) is None  # job-wide
    standing_out = {"least_wait_rank": 3, "rank_shares": {"0": 0.5, "1": 0.6, "2": 0.55, "3": 0.1}}
    assert culprit_of(_issue(d.COLLECTIVE_BOUND, evidence=standing_out)) == 3
    even = {"least_wait_rank": 3, "rank_shares": {"0": 0.5, "1": 0.6, "2": 0.55, "3": 0.45}}
    assert culprit_of(_issue(d.COLLECTIVE_BOUND, evidence=even)) is None
    assert culprit_of(_issue(d.INPUT_BOUND)) is None
    facts = {0: _facts(0, 50.0, 0), 1: _facts(1, 50.0, 0)}
    provisional = SimpleNamespace(window=_window(facts, 0), diagnosis=SimpleNamespace(issues=(
        _issue(d.COMPUTE_STRAGGLER, 1, status=d.STATUS_PROVISIONAL), _issue(d.BALANCED))))
    assert capture_target(provisional) is None
    confirmed = SimpleNamespace(window=_window(facts, 0), diagnosis=SimpleNamespace(issues=(
        _issue(d.INPUT_BOUND), _issue(d.INPUT_STRAGGLER, 0))))
    assert capture_target(confirmed) == (d.INPUT_STRAGGLER, 0, 1)


def test_the_policy_asks_the_book_after_a_refresh_and_a_balanced_run_asks_nothing(tmp_path):
    book, _ = make_book(tmp_path, ranks={RUN: {0, 1}})
    policy = CapturePolicy(book)
    facts = {0: _facts(0, 50.0, 0), 1: _facts(1, 50.0, 0)}
    balanced = SimpleNamespace(analysis=SimpleNamespace(window=_window(facts, 0), diagnosis=SimpleNamespace(
        issues=(_issue(d.BALANCED, status=d.STATUS_BALANCED),))))
    assert policy.after_refresh(RUN, balanced) is False  # nothing near: the watch may slow down
    assert book.of_run(RUN) == []
    straggler = SimpleNamespace(analysis=SimpleNamespace(window=_window(facts, 0), diagnosis=SimpleNamespace(
        issues=(_issue(d.COMPUTE_STRAGGLER, 1),))))
    assert policy.after_refresh(RUN, straggler) is True
    [record] = book.of_run(RUN)
    assert (record.trigger, record.culprit_rank, record.reference_rank) == (d.COMPUTE_STRAGGLER, 1, 0)
    assert policy.choose_reference(RUN, 0) == 1


def test_the_watch_may_slow_down_only_over_a_confirmable_window_with_no_culprit_in_sight():
    facts = {0: _facts(0, 50.0, 0), 1: _facts(1, 50.0, 0)}

    def analysis(steps, *issues):
        return SimpleNamespace(window=_window(facts, 0, steps), diagnosis=SimpleNamespace(issues=issues))

    assert not bears_watching(analysis(20, _issue(d.BALANCED, status=d.STATUS_BALANCED)))
    assert not bears_watching(analysis(20, _issue(d.INPUT_BOUND)))  # a finding, but nobody to capture
    assert bears_watching(analysis(19, _issue(d.BALANCED, status=d.STATUS_BALANCED)))  # too short to confirm
    assert bears_watching(analysis(20, _issue(d.COMPUTE_STRAGGLER, 1, status=d.STATUS_PROVISIONAL)))
    assert bears_watching(analysis(400, _issue(d.INPUT_BOUND), _issue(d.STEP_TIME_DRIFT, 2)))


def test_after_a_restart_the_adopted_runs_captures_come_back_open_ones_failed_and_other_runs_files_go(tmp_path):
    before, _ = make_book(tmp_path, ranks={RUN: {0, 1}, "gone": {0, 1}})
    done = before.request_capture(RUN, 1, 0)
    before.receive_summary(done.capture_id, 1, summary(done.capture_id, 1, ROLE_CULPRIT, 40.0, 20.0))
    before.receive_summary(done.capture_id, 0, summary(done.capture_id, 0, ROLE_REFERENCE, 20.0, 0.0))
    before.request_capture("gone", 1, 0)
    after, _ = make_book(tmp_path, ranks={RUN: {0, 1}})
    after.adopt([RUN])
    [restored] = after.of_run(RUN)
    assert restored.status == STATUS_DONE and restored.digest.rows[0].name == "aten::sort"
    assert not run_captures_folder(tmp_path / "traceml.db", "gone").exists()
    opened = after.request_capture(RUN, 1, 0)  # nothing in progress: a new one is taken
    again, _ = make_book(tmp_path, ranks={RUN: {0, 1}})
    again.adopt([RUN])
    record = again.get(opened.capture_id)
    assert record.status == STATUS_FAILED and "restarted" in record.reason
    assert load_records(tmp_path / "traceml.db", RUN)[-1].status == STATUS_FAILED
