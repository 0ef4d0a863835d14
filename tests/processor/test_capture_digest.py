"""The capture digest (issue 33, item 5): hand-built rank summaries in, the rows and notes out."""
from __future__ import annotations

import pytest

from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.capture.digest import compute_digest
from traceml.processor.capture.phases import captured_phase_means
from traceml.schema.capture import (
    HOST_NAME,
    KIND_COLLECTIVE,
    KIND_HOST,
    KIND_INPUT,
    KIND_KERNEL,
    KIND_OP,
    OpTime,
    RankCaptureSummary,
)

STEPS = 5
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def summary(rank, step_ms, ops, *, role="culprit", activities=("cpu",), left_out=0, trace_bytes=1000,
            trace_note=None, notes=()):
    """`ops`: name -> (kind, ms per step); stored summed over the captured steps, as a rank sends them."""
    return RankCaptureSummary(
        capture_id="c1", run_id="run", rank=rank, role=role, first_step=10,
        step_ms=tuple([step_ms] * STEPS), activities=activities,
        ops=tuple(OpTime(name=name, kind=kind, count=STEPS,
                         self_ms=0.0 if kind == KIND_KERNEL else ms * STEPS,
                         device_ms=ms * STEPS if kind == KIND_KERNEL else 0.0)
                  for name, (kind, ms) in ops.items()),
        ops_left_out=left_out, trace_bytes=trace_bytes, trace_note=trace_note, notes=notes)


BASE = {"aten::addmm": (KIND_OP, 4.0), "aten::relu": (KIND_OP, 1.0),
        "gloo:all_reduce": (KIND_COLLECTIVE, 2.0), HOST_NAME: (KIND_HOST, 3.0)}


def test_an_extra_op_on_the_culprit_is_the_top_row_with_its_share_of_the_gap():
    culprit = summary(1, 32.0, {**BASE, "aten::sort": (KIND_OP, 21.0), HOST_NAME: (KIND_HOST, 4.0)})
    reference = summary(0, 10.0, BASE, role="reference")
    digest = compute_digest(culprit, reference)
    assert digest.gap_ms == pytest.approx(22.0)
    top = digest.rows[0]
    assert (top.name, top.kind) == ("aten::sort", KIND_OP)
    assert top.culprit_ms == pytest.approx(21.0) and top.reference_ms == 0.0
    assert top.excess_ms == pytest.approx(21.0)
    assert top.share_of_gap == pytest.approx(21.0 / 22.0)
    assert digest.culprit_steps == digest.reference_steps == STEPS
    # the host row and the collective are called out even when their excess is small
    kinds = [row.kind for row in digest.rows]
    assert KIND_HOST in kinds and KIND_COLLECTIVE in kinds
    excesses = [row.excess_ms for row in digest.rows]
    assert excesses == sorted(excesses, reverse=True)


def test_an_input_straggler_points_at_the_input_path():
    ops = {**BASE, LOADER: (KIND_INPUT, 0.5)}
    culprit = summary(1, 40.0, {**ops, LOADER: (KIND_INPUT, 30.0)})
    reference = summary(0, 10.5, ops, role="reference")
    digest = compute_digest(culprit, reference)
    assert digest.rows[0].kind == KIND_INPUT and digest.rows[0].name == LOADER
    assert digest.rows[0].excess_ms == pytest.approx(29.5)
    assert any("DataLoader worker processes are not profiled" in note for note in digest.not_seen)


def test_a_generator_input_without_annotation_shows_as_host_time_and_says_so():
    culprit = summary(1, 40.0, {**BASE, HOST_NAME: (KIND_HOST, 33.0)})
    reference = summary(0, 10.0, BASE, role="reference")
    digest = compute_digest(culprit, reference)
    assert digest.rows[0].kind == KIND_HOST
    assert digest.rows[0].share_of_gap == pytest.approx(30.0 / 30.0)
    assert any("no input path was annotated" in note for note in digest.not_seen)


def test_an_op_the_reference_left_out_is_shown_with_an_unknown_reference_time():
    culprit = summary(1, 20.0, {**BASE, "aten::conv2d": (KIND_OP, 9.0)})
    reference = summary(0, 10.0, BASE, role="reference", left_out=12)
    digest = compute_digest(culprit, reference)
    row = digest.rows[0]
    assert row.name == "aten::conv2d"
    assert row.culprit_ms == pytest.approx(9.0)
    assert row.reference_ms is None and row.excess_ms is None and row.share_of_gap is None
    assert any("rank 0 left out 12 smaller entries" in note for note in digest.not_seen)


def test_an_op_missing_from_a_complete_reference_ran_zero_there():
    culprit = summary(1, 20.0, {**BASE, "aten::conv2d": (KIND_OP, 9.0)})
    digest = compute_digest(culprit, summary(0, 10.0, BASE, role="reference"))
    assert digest.rows[0].reference_ms == 0.0 and digest.rows[0].excess_ms == pytest.approx(9.0)


def test_no_gap_gives_no_share_and_says_why():
    culprit = summary(1, 10.0, {**BASE, "aten::sort": (KIND_OP, 1.0)})
    reference = summary(0, 12.0, BASE, role="reference")
    digest = compute_digest(culprit, reference)
    assert digest.gap_ms == pytest.approx(-2.0)
    assert all(row.share_of_gap is None for row in digest.rows)
    assert digest.rows[0].excess_ms == pytest.approx(1.0)
    assert any("not slower than the reference" in note for note in digest.not_seen)


def test_cpu_only_ranks_say_no_device_kernels_and_a_gpu_rank_does_not():
    cpu = compute_digest(summary(1, 20.0, BASE), summary(0, 10.0, BASE, role="reference"))
    assert any(note == "no device kernels: rank 1 and rank 0 recorded CPU activities only"
               for note in cpu.not_seen)
    gpu_ops = {**BASE, "void gemm_kernel<float>": (KIND_KERNEL, 6.0)}
    gpu = compute_digest(summary(1, 20.0, {**gpu_ops, "void gemm_kernel<float>": (KIND_KERNEL, 14.0)},
                                 activities=("cpu", "cuda")),
                         summary(0, 10.0, gpu_ops, role="reference", activities=("cpu", "cuda")))
    assert not any("no device kernels" in note for note in gpu.not_seen)
    assert gpu.rows[0].kind == KIND_KERNEL and gpu.rows[0].excess_ms == pytest.approx(8.0)


def test_entries_left_out_traces_not_kept_and_rank_notes_are_said():
    many = {f"aten::op{i}": (KIND_OP, float(i)) for i in range(12)}
    culprit = summary(1, 80.0, {**many, HOST_NAME: (KIND_HOST, 2.0)}, left_out=3, trace_bytes=None,
                      trace_note="over the 33554432-byte cap", notes=("profiler warned: x",))
    reference = summary(0, 10.0, {HOST_NAME: (KIND_HOST, 2.0)}, role="reference")
    digest = compute_digest(culprit, reference, top=4)
    assert [row.name for row in digest.rows[:4]] == ["aten::op11", "aten::op10", "aten::op9", "aten::op8"]
    assert len(digest.rows) == 5  # the top four plus the host row
    assert digest.rows_left_out == 13 - 5
    joined = "\n".join(digest.not_seen)
    assert "rank 1 left out 3 smaller entries" in joined
    assert "rank 1's raw trace was not kept: over the 33554432-byte cap" in joined
    assert "rank 1: profiler warned: x" in joined
    assert "phase times of the captured steps: not in the store" in joined


def test_phase_gap_is_kept_largest_first_when_the_store_has_the_steps():
    digest = compute_digest(summary(1, 20.0, BASE), summary(0, 10.0, BASE, role="reference"),
                            phase_means={"forward": (12.0, 4.0), "backward": (5.0, 4.5)})
    assert [(g.phase, g.gap_ms) for g in digest.phase_gap] == [("forward", 8.0), ("backward", 0.5)]
    assert not any("phase times" in note for note in digest.not_seen)


# --- the phases of the captured steps, from an analysis window ---------------------------------


def test_phase_means_come_from_the_captured_steps_when_the_window_holds_them():
    w = window({0: rank_values(bwd=45.0), 1: rank_values(bwd=66.0, traced=116.0)}, steps=30)
    culprit = summary(1, 40.0, BASE)  # first_step 10, five steps: 10..14, all in 1..30
    means = captured_phase_means(w, culprit, summary(0, 10.0, BASE, role="reference"))
    assert means["backward"] == (66.0, 45.0) and means["forward"] == (30.0, 30.0)
    assert "collective_wait" not in means  # not measured: left out, not zero
    digest = compute_digest(culprit, summary(0, 10.0, BASE, role="reference"), phase_means=means)
    assert digest.phase_gap[0].phase == "backward" and digest.phase_gap[0].gap_ms == 21.0


def test_no_phase_means_when_a_captured_step_is_not_in_the_window():
    w = window({0: rank_values(), 1: rank_values()}, steps=12)  # steps 1..12: 13 and 14 not stored yet
    assert captured_phase_means(w, summary(1, 20.0, BASE), summary(0, 10.0, BASE, role="reference")) is None
    assert captured_phase_means(None, summary(1, 20.0, BASE), summary(0, 10.0, BASE, role="reference")) is None
