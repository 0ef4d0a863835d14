"""Runs a training script that marks no steps under the original TraceML (traceml-ai), for checks/peers_agreement.py.

    <peer venv>/bin/traceml run checks/original_step_runner.py --args SCRIPT [SCRIPT ARGS...]

This project infers steps from optimizer updates, so a script such as
tests/launcher/scripts/collective_ddp.py imports nothing of TraceML and runs under
our `traceml run` unchanged. The original records a step only inside its
`trace_step(model)`. To compare both tools on the same unmodified script, this
runner does for it what a user of the original would write by hand: it calls the
original's `init(mode="auto")` (its auto-timed forward, backward, optimizer and
DataLoader fetch, as the demo workload's shim does) and runs each iteration of the
script's training loop inside `trace_step`: one DataLoader batch is one step, from
the moment the batch is handed to the loop body until the loop asks for the next
one, the fetch itself left outside the step as in the original's own examples.
The model given to `trace_step` is the script's DistributedDataParallel wrapper.

Runs in the peer environment only (it imports traceml_ai and torch, nothing of
this project).
"""
import runpy
import sys

import traceml_ai
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

traceml_ai.init(mode="auto")  # patches DataLoader.__iter__ (timed fetch), forward, backward, optimizer

_models = []
_ddp_init = DistributedDataParallel.__init__


def _remembering_init(self, *args, **kwargs):
    _ddp_init(self, *args, **kwargs)
    _models.append(self)


DistributedDataParallel.__init__ = _remembering_init

_timed_iter = DataLoader.__iter__  # the original's patched iterator: each fetch timed as input wait


def _stepped_iter(self):
    """Each batch's loop body runs inside the original's trace_step; the generator
    resumes (closing the step) when the loop asks for the next batch, or is closed
    (aborting the step) when the loop leaves early."""
    for batch in _timed_iter(self):
        with traceml_ai.trace_step(_models[-1] if _models else None):
            yield batch


DataLoader.__iter__ = _stepped_iter

if len(sys.argv) < 2:
    raise SystemExit("usage: original_step_runner.py SCRIPT [ARGS...]")
script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
