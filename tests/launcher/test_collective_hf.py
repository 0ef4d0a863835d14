"""`traceml run` on an HF Trainer script with default settings, 2 gloo ranks, one slow dataset.

The fast rank waits in the token-count gather inside `get_batch_samples` (before the
step, in the integration's collection window): that wait is recorded as its collective
wait, so the ranks' step times no longer hide which one was slow.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.launcher.launcher_helpers import SCRIPTS, traceml


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs transformers and accelerate (the huggingface extra)")
@pytest.mark.slow
def test_the_fast_rank_waits_in_hugging_faces_token_count_gather(workdir):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "collective_hf_trainer.py"), "10"], workdir,
                  TRACEML_EXIT_AFTER_FLUSH="1")
    assert run.returncode == 0, run.output[-3000:]
    waits = {g["global_rank"]: g["metrics"]["collective_wait_ms"] for g in run.summary["groups"]}
    # Rank 1 reads 4 items x 20 ms per step; rank 0 waits for it in the gather.
    assert waits[0] >= 40.0 and waits[0] > waits[1] + 30.0, waits
    # The gather runs before the step opens; its segment makes the wait part of the step's time,
    # so no rank waits longer than its step (the sentence once read "565 % of its step").
    for group in run.summary["groups"]:
        metrics = group["metrics"]
        assert metrics["collective_wait_ms"] <= metrics["step_time_ms"], metrics
    diagnosis = run.summary["diagnosis"]
    assert (diagnosis["kind"], diagnosis["culprit_rank"]) == ("INPUT_STRAGGLER", 1), diagnosis
