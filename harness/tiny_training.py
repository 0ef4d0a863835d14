"""The small training step that tests and benchmarks time, plain or traced.

Traced means TraceML's manual wrappers: `trace_step` around forward, backward and
optimizer regions. Used by subprocess scripts (harness/reliability/train_script.py),
exporter tests and bench_exporter, so a comparison of the two always compares the
same work.
"""
from __future__ import annotations

import torch

import traceml


def plain_step(model, opt, x, y) -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def traced_step(model, opt, x, y) -> None:
    with traceml.trace_step(model):
        with traceml.timed_forward():
            loss = torch.nn.functional.mse_loss(model(x), y)
        with traceml.timed_backward():
            loss.backward()
        with traceml.timed_optimizer_step():
            opt.step()
        opt.zero_grad()
