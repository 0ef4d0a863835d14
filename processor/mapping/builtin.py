"""The built-in span mappings, each read from its emitter's own code (docs/wire-format.md cites them).

Megatron-LM (NVIDIA/Megatron-LM at the commits of pull requests #6415 and #6438,
`d7d7a6a` and `dd8c825`, unchanged at `d98e8a6`): with its span groups `step`,
`forward_backward`, `optimizer`, `microbatch` and `communication` enabled
(`--otel-span-groups all`, or `per_step,microbatch,communication`), each rank emits

- `megatron.train.iteration` per iteration (group `step`, attribute `megatron.iteration`;
  megatron/training/training.py, the `_otel_managed_span('step', ...)` around `train_step`);
- inside it `megatron.train.iteration.forward_backward` (attribute `num_microbatches`) and
  `megatron.train.iteration.optimizer` (training.py, `train_step`);
- inside forward-backward one `megatron.microbatch.forward` / `megatron.microbatch.backward`
  per microbatch (megatron/core/pipeline_parallel/schedules.py, `forward_step` /
  `backward_step` wrapped by `trace_fn`), and the pipeline's `megatron.p2p.*` sends and receives
  (p2p_communication.py);
- `megatron.grad_sync.start` / `megatron.grad_sync.finish` around DDP's gradient
  all-reduce or reduce-scatter (megatron/core/distributed/distributed_data_parallel.py).

Its Observability guide (docs/user-guide/observability/span-groups.md) names the same spans
`megatron.train_step`, `megatron.forward_backward` and `megatron.optimizer_step`, which the
code does not emit; both spellings are read. The batch is fetched inside `forward_step`
(`get_batch` in the model's forward-step function) and the `data_loading` group is reserved
with no span, so input wait and H2D cannot be measured: never guessed from forward.
Identity is nemo-lens's resource (below).

nemo-lens 0.1.0 (PyPI, `nemo/lens/semconv.py`, `providers.py`, `helpers.py`) defines the
vocabulary, not span names: the resource carries `dl.rank`, `dl.world_size`,
`nemo.run.id` (`build_providers`); the training iteration is `dl.iteration`, a microbatch
`dl.microbatch_id`; the span groups are `step`, `forward_backward`, `optimizer` (`groups.py`),
whose spans the consumer names (`managed_span('step', 'train.step', ...)` in its quickstart).
So a nemo-lens step is any span carrying `dl.iteration`; its phases are the children named
for the groups: `*.forward_backward` holds phases, `*.optimizer` / `*.optimizer_step` is
the optimizer; `*.forward` / `*.backward` are forward and backward (each microbatch's,
summed). A span with `nemo.span.truncated` true was force-closed at shutdown (the library's
repository after 0.1.0, docs/design/semconv.mdx): never timed.
"""
from __future__ import annotations

from traceml.processor.mapping.spec import SpanMapping
from traceml.schema.vocabulary import (
    METRIC_BACKWARD,
    METRIC_COLLECTIVE_WAIT,
    METRIC_FORWARD,
    METRIC_OPTIMIZER_STEP,
)

MEGATRON_LM = SpanMapping(
    name="megatron-lm",
    step_spans=("megatron.train.iteration", "megatron.train_step"),
    step_number=("megatron.iteration", "dl.iteration"),
    phase_spans={
        METRIC_FORWARD: ("megatron.microbatch.forward",),
        METRIC_BACKWARD: ("megatron.microbatch.backward",),
        METRIC_OPTIMIZER_STEP: ("megatron.train.iteration.optimizer", "megatron.optimizer_step"),
        METRIC_COLLECTIVE_WAIT: ("megatron.grad_sync.start", "megatron.grad_sync.finish", "megatron.p2p.*"),
    },
    containers=("megatron.train.iteration.forward_backward", "megatron.forward_backward"),
    source="NVIDIA/Megatron-LM d98e8a6 (PRs #6415, #6438): megatron/training/training.py, "
           "megatron/core/pipeline_parallel/schedules.py, megatron/core/distributed/distributed_data_parallel.py",
)

NEMO_LENS = SpanMapping(
    name="nemo-lens",
    step_spans=("*",),
    step_number=("dl.iteration",),
    step_needs_number=True,
    phase_spans={
        METRIC_FORWARD: ("*.forward",),
        METRIC_BACKWARD: ("*.backward",),
        METRIC_OPTIMIZER_STEP: ("*.optimizer", "*.optimizer_step"),
    },
    containers=("*.forward_backward",),
    not_measured_flag="nemo.span.truncated",
    source="nemo-lens 0.1.0 (PyPI): nemo/lens/semconv.py, providers.py, groups.py, helpers.py",
)

BUILTIN: tuple[SpanMapping, ...] = (MEGATRON_LM, NEMO_LENS)
"""In the order a step span is offered to them (a declared mapping comes first)."""
