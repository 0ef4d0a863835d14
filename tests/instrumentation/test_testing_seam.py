"""The one test seam, `traceml._testing.reset_for_tests()`: it forgets what outlives shutdown(),
and product code neither defines a reset of its own nor imports the seam (it costs a job nothing)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import traceml
from traceml import step_events
from traceml._testing import reset_for_tests
from traceml.process_state import recording, timing_policy

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("instrumentation", "exporter", "schema", "processor", "launcher")


def test_reset_forgets_steps_drops_warnings_policy_and_forward_timing():
    traceml.init(mode="manual")
    model = torch.nn.Linear(2, 2)
    traceml.wrap_forward(model)
    with traceml.trace_step(model):
        model(torch.zeros(1, 2))
    with pytest.warns(RuntimeWarning, match="the seam's test"):
        step_events.warn_once("seam-test", "a misuse for the seam's test")
    timing_policy.dataloader_timing = False
    traceml.shutdown()
    assert traceml.steps_completed() == 1 and traceml.misuse_counts() == {"seam-test": 1}
    assert traceml.forward.forward_timer(model) is not None

    reset_for_tests()

    assert traceml.steps_completed() == 0
    assert traceml.misuse_counts() == {} and set(traceml.dropped_counts().values()) == {0}
    assert timing_policy.dataloader_timing is True and timing_policy.pool is None
    assert recording.owner is None and recording.active is None and not recording.recording
    assert traceml.forward.forward_timer(model) is None  # wrap_forward outlived shutdown(), not the reset
    with pytest.warns(RuntimeWarning, match="the seam's test"):  # warned once per process: again after it
        step_events.warn_once("seam-test", "a misuse for the seam's test")


def test_reset_clears_the_ending_the_bootstrap_noted():
    from traceml.exporter import process_ending

    process_ending.note_ending(process_ending.ending_of(KeyboardInterrupt()))
    reset_for_tests()
    assert process_ending.noted_ending() is None


@pytest.mark.slow
def test_product_code_has_no_reset_of_its_own_and_never_imports_the_seam():
    wrong = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "_testing.py" and folder == "instrumentation":
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and "reset_for_tests" in node.name:
                    wrong.append(f"{path.relative_to(ROOT)}: defines {node.name}")
                if isinstance(node, ast.ImportFrom) and "_testing" in ((node.module or "") + str(
                        [a.name for a in node.names])):
                    wrong.append(f"{path.relative_to(ROOT)}: imports the test seam")
                if isinstance(node, ast.Import) and any("_testing" in a.name for a in node.names):
                    wrong.append(f"{path.relative_to(ROOT)}: imports the test seam")
    assert wrong == [], wrong


@pytest.mark.slow
def test_a_traced_step_loads_no_test_seam():
    code = ("import sys, torch, traceml\n"
            "traceml.init(mode='manual')\n"
            "m = torch.nn.Linear(2, 2)\n"
            "with traceml.trace_step(m):\n"
            "    m(torch.zeros(1, 2))\n"
            "traceml.shutdown()\n"
            "print('traceml._testing' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TRACEML_DISABLE": "", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
