"""Jobs that never installed TraceML, diagnosed through the mapping layer (issue 34).

One module-scoped stack: an in-process processor with the declared mapping file of
`foreign_emitters/acme_mapping.toml`, behind `rotel-agent` as a relay, and real emitter
processes, one per rank (each its own resource), sending over OTLP/gRPC with the official
OpenTelemetry SDK: Megatron-LM's spans as its code emits them, a team's own `acme.*` spans,
and nemo-lens itself (its `setup_telemetry`, under the cached Python 3.13 venv of
scripts/setup_nemo_lens.sh). Per mapping: a run with rank 1 slowed in one phase, a
balanced run, and a shape the mapping cannot fully place. Every span carries explicit
timestamps (synchronous data-parallel timing, the others waiting for the slow rank), so
no verdict depends on the machine's load.
"""
from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from harness.otlp_payloads import steps_request
from harness.processor_service import make_service
from harness.rotel_relay import RotelRelay
from harness.waiting import wait_until
from traceml.processor.mapping import load_mapping_file
from traceml.processor.summary_section import build_final_summary
from traceml.processor.web.pages import report_page
from traceml.processor.web.report import build_report_view

pytestmark = pytest.mark.slow  # one module run of 10 emitter processes and rotel (about 17 s)

ROOT = Path(__file__).resolve().parents[2]
EMITTERS = Path(__file__).parent / "foreign_emitters"
MAPPING_FILE = EMITTERS / "acme_mapping.toml"
LENS_VENV = Path(os.environ.get("TRACEML_NEMO_LENS_VENV", Path.home() / ".cache" / "traceml-nemo-lens" / "venv"))
STEPS = 24  # crit needs 20 aligned steps

RUNS = {
    "megatron-lm": [
        {"run_id": "mg-straggler", "shape": "megatron", "steps": STEPS, "slow_rank": 1, "slow_phase": "forward"},
        {"run_id": "mg-balanced", "shape": "megatron", "steps": STEPS},
        {"run_id": "mg-per-step", "shape": "megatron-per-step", "steps": STEPS},
        {"run_id": "mixed", "shape": "megatron", "steps": STEPS, "ranks": [1]},
    ],
    "declared:acme-trainer": [
        {"run_id": "acme-straggler", "shape": "declared", "steps": STEPS, "slow_rank": 1, "slow_phase": "input_wait"},
        {"run_id": "acme-balanced", "shape": "declared", "steps": STEPS},
        {"run_id": "acme-unknown", "shape": "declared-unknown", "steps": STEPS},
    ],
    "nemo-lens": [
        {"run_id": "lens-straggler", "shape": "lens", "steps": STEPS, "slow_rank": 1, "slow_phase": "forward"},
        {"run_id": "lens-balanced", "shape": "lens", "steps": STEPS},
        {"run_id": "lens-unplaceable", "shape": "lens-unplaceable", "steps": STEPS},
    ],
}


def _lens_python() -> Path:
    """The cached 3.13 venv with nemo-lens, built by the setup script when missing."""
    python = LENS_VENV / "bin" / "python"
    probe = [str(python), "-c", "import nemo.lens"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        built = subprocess.run(["bash", str(ROOT / "scripts" / "setup_nemo_lens.sh")], capture_output=True,
                               text=True, timeout=600, env={**os.environ, "TRACEML_NEMO_LENS_VENV": str(LENS_VENV)})
        assert built.returncode == 0, f"could not build the nemo-lens venv: {built.stderr[-2000:]}"
    return python


def _emit(python: Path, rank: int, endpoint: str, runs: list[dict]) -> subprocess.Popen:
    spec = {"rank": rank, "world": 2, "endpoint": endpoint, "runs": runs}
    return subprocess.Popen([str(python), str(EMITTERS / "emit_steps.py"), json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def summaries(tmp_path_factory) -> dict[str, dict]:
    """Every run above, sent through rotel to one processor, then its final summary by run id."""
    tmp = tmp_path_factory.mktemp("foreign")
    lens_python = _lens_python()
    service = make_service(tmp, mapping=load_mapping_file(MAPPING_FILE))
    try:
        with RotelRelay(tmp / "rotel", f"http://127.0.0.1:{service.grpc_port}", "grpc") as relay:
            procs = []
            for rank in range(2):
                procs.append(_emit(Path(sys.executable), rank, relay.grpc_endpoint,
                                   RUNS["megatron-lm"] + RUNS["declared:acme-trainer"]))
                for run in RUNS["nemo-lens"]:  # nemo-lens sets itself up once per process
                    procs.append(_emit(lens_python, rank, relay.grpc_endpoint, [run]))
            # The mixed run's rank 0 is TraceML's own: its step spans, straight to the processor.
            with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    steps_request("mixed", 0, range(STEPS)), timeout=10)
            for proc in procs:
                out, _ = proc.communicate(timeout=120)
                assert proc.returncode == 0, out
        # rotel flushed what it held on SIGTERM; the processor commits before it answers.
        expected = 2 * STEPS * sum(len(r) for r in RUNS.values())  # the mixed run: r0 ours, r1 Megatron
        assert wait_until(lambda: service.stats.snapshot().get(("accepted", "traces"), 0) >= expected, 20, 0.1), \
            service.stats.snapshot()
        run_ids = [r["run_id"] for runs in RUNS.values() for r in runs]
        out = {run: build_final_summary(tmp / "traceml.db", run) for run in run_ids}
        # The web view's run page (the one-file report draws the same page) of two runs.
        out["pages"] = {run: report_page(build_report_view(tmp / "traceml.db", run))
                        for run in ("mg-per-step", "mixed")}
        return out
    finally:
        service.stop()


def _kinds(summary: dict) -> list[tuple[str, int | None]]:
    return [(i["kind"], i.get("culprit_rank")) for i in summary["issues"]]


def _source(summary: dict, mapping: str) -> dict:
    (entry,) = [s for s in summary["telemetry"]["sources"] if s["mapping"] == mapping]
    return entry


@pytest.mark.parametrize("mapping, run, kind", [
    ("megatron-lm", "mg-straggler", "COMPUTE_STRAGGLER"),
    ("declared:acme-trainer", "acme-straggler", "INPUT_STRAGGLER"),
    ("nemo-lens", "lens-straggler", "COMPUTE_STRAGGLER"),
])
def test_the_slowed_rank_is_named_the_straggler(summaries, mapping, run, kind):
    summary = summaries[run]
    straggler = [i for i in summary["issues"] if "STRAGGLER" in i["kind"]]
    assert [(i["kind"], i["culprit_rank"]) for i in straggler] == [(kind, 1)], _kinds(summary)
    assert _source(summary, mapping)["ranks"] == [0, 1]
    assert _source(summary, mapping)["steps"] == 2 * STEPS
    assert f"Source: {mapping} (r0, r1), {2 * STEPS} step(s) mapped" in summary["card"]


@pytest.mark.parametrize("run", ["mg-balanced", "acme-balanced", "lens-balanced"])
def test_a_balanced_run_names_no_rank(summaries, run):
    summary = summaries[run]
    assert not [i for i in summary["issues"] if i.get("culprit_rank") is not None], _kinds(summary)
    assert summary["global"]["window"]["steps"] == STEPS


def test_megatron_says_what_it_cannot_measure_and_counts_what_it_cannot_place(summaries):
    straggler, per_step = summaries["mg-straggler"], summaries["mg-per-step"]
    # No input-wait or H2D span exists in Megatron-LM: no input verdict, and the summary says why.
    assert _source(straggler, "megatron-lm")["unmeasured_phases"] == ["input_wait", "h2d"]
    assert "not measured by this mapping: input_wait, h2d" in straggler["card"]
    assert straggler["global"]["median"]["input_wait_ms"]["value"] is None
    assert not [i for i in straggler["issues"] if i["kind"] in ("INPUT_BOUND", "INPUT_STRAGGLER")]
    # Microbatches summed: 2 x 8 ms forward and 2 x 12 ms backward per step on the fast rank.
    fast = next(g for g in straggler["groups"] if g["global_rank"] == 0)["metrics"]
    assert (fast["forward_ms"], fast["backward_ms"]) == (16.0, 24.0)
    # `per_step` span groups: the forward-backward span holds no microbatch span, so forward and
    # backward are not guessed from it: counted, and the missing signals reported.
    unplaced = _source(per_step, "megatron-lm")["unplaced"]
    assert unplaced == {"megatron.train.iteration.forward_backward": 2 * STEPS,
                        "megatron.train.gc_collect": 2 * STEPS}
    assert per_step["global"]["median"]["forward_ms"]["value"] is None
    incomplete = [i for i in per_step["issues"] if i["kind"] == "INCOMPLETE_DATA"]
    assert incomplete and {"forward", "backward"} <= set(incomplete[0]["evidence"]["missing_signals"])


def test_the_declared_mapping_places_its_phases_and_counts_an_unknown_span(summaries):
    straggler, unknown = summaries["acme-straggler"], summaries["acme-unknown"]
    assert _source(straggler, "declared:acme-trainer")["unmeasured_phases"] == []
    fast = next(g for g in straggler["groups"] if g["global_rank"] == 0)["metrics"]
    assert (fast["input_wait_ms"], fast["h2d_ms"], fast["optimizer_ms"]) == (3.0, 1.5, 5.0)
    assert _source(unknown, "declared:acme-trainer")["unplaced"] == {"acme.checkpoint_shard": 2 * STEPS}
    assert "not placed in any phase (left in residual): acme.checkpoint_shard x48" in unknown["card"]


def test_nemo_lens_counts_a_truncated_span_and_a_forward_backward_without_microbatches(summaries):
    source = _source(summaries["lens-unplaceable"], "nemo-lens")
    assert source["unplaced"] == {"demo.train.eval_hook (not measured: truncated)": 2 * STEPS,
                                  "demo.train.forward_backward": 2 * STEPS}
    assert source["unmeasured_phases"] == ["input_wait", "h2d", "collective_wait"]


def test_a_mixed_run_is_diagnosed_and_says_where_each_rank_came_from(summaries):
    summary = summaries["mixed"]
    assert [(s["mapping"], s["ranks"]) for s in summary["telemetry"]["sources"]] == [
        ("megatron-lm", [1]), ("traceml", [0])]
    assert "Mixed sources: megatron-lm r1; traceml r0." in summary["card"]
    assert summary["global"]["window"]["steps"] == STEPS
    # Rank 1 measured no input wait: one basis for every rank, the traced step.
    assert summary["global"]["median"]["traced_step_time_ms"]["value"] is not None


def test_the_web_view_says_which_mapping_and_what_it_could_not_place(summaries):
    page, mixed = (html.unescape(summaries["pages"][run]) for run in ("mg-per-step", "mixed"))
    assert ('<p class="note" data-note="source">Source: megatron-lm (r0, r1), 48 step(s) mapped; not measured by '
            "this mapping: input_wait, h2d (no finding can be about them; the fixes INCOMPLETE_DATA names are for "
            "a job running TraceML); not placed in any phase (left in residual): megatron.train.gc_collect x48, "
            "megatron.train.iteration.forward_backward x48; its telemetry has no end-of-run marker, so its ranks' "
            "endings read as lost</p>") in page
    assert "Mixed sources: megatron-lm r1; traceml r0." in mixed
