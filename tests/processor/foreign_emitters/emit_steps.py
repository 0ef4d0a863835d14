"""One rank of a job that never installed TraceML, sending its own step spans over OTLP.

Run as a process per rank (each its own resource), with the official OpenTelemetry SDK:
`python emit_steps.py SPEC_JSON`. The spec names the endpoint, the rank, the world size
and the runs to send, each with a shape:

- `megatron` / `megatron-per-step`: Megatron-LM's spans as its code emits them with the span
  groups `all` (microbatch forward/backward, grad sync) or `per_step` (no microbatch spans: the
  forward-backward span holds no phase) plus a garbage collection inside the step;
- `declared` / `declared-unknown`: a team's own names, read through the declared mapping file
  of the test (`acme.*`), the second with an unknown span inside each step;
- `lens` / `lens-unplaceable`: through nemo-lens itself (`setup_telemetry`, its resource,
  provider and exporter, `dl.iteration` / `dl.microbatch_id` from its semconv), only under
  the Python 3.13 venv that has it; one run per process (nemo-lens sets up once).

Every span has explicit timestamps laid out like synchronous data-parallel training:
every rank's step takes as long as the slowest rank's work, and the others wait for it
in the gradient sync (Megatron, declared) or inside backward (nemo-lens: no sync span),
so no figure depends on how loaded the machine is.
"""
from __future__ import annotations

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.trace import set_span_in_context

MS = 1_000_000  # ns
MICRO = 2  # microbatches per step
BASE = {"input_wait": 3, "forward": 8, "backward": 12, "optimizer_step": 5}  # ms per microbatch (fwd/bwd)
SLOW_MS = 20  # added per microbatch (forward) or per step (input_wait) on the slow rank


def _work(rank: int, run: dict) -> dict:
    slow = run.get("slow_rank") == rank
    w = dict(BASE)
    if slow:
        w[run["slow_phase"]] += SLOW_MS
    return w


def _busy(w: dict) -> int:
    """ms of the rank's own work before the gradient sync."""
    return w["input_wait"] + MICRO * (w["forward"] + w["backward"])


def _sync_wait(rank: int, world: int, run: dict) -> int:
    return 2 + max(_busy(_work(r, run)) for r in range(world)) - _busy(_work(rank, run))


class Emitter:
    def __init__(self, tracer, t0: int):
        self.tracer = tracer
        self.t = t0

    def span(self, name: str, parent, start: int, end: int, attrs: dict | None = None):
        ctx = set_span_in_context(parent) if parent is not None else None
        s = self.tracer.start_span(name, context=ctx, start_time=start, attributes=attrs or {})
        s.end(end_time=end)
        return s


def megatron(tracer, rank: int, world: int, run: dict) -> None:
    w, wait = _work(rank, run), _sync_wait(rank, world, run)
    t0 = 1_700_000_000_000 * MS // 1000
    period = 10 + max(_busy(_work(r, run)) for r in range(world)) + 2 + w["optimizer_step"]
    train = tracer.start_span("megatron.train", start_time=t0, attributes={"megatron.train_iters": run["steps"]})
    e = Emitter(tracer, t0)
    for i in range(run["steps"]):
        s0 = t0 + i * period * MS + MS
        step = tracer.start_span("megatron.train.iteration", context=set_span_in_context(train), start_time=s0,
                                 attributes={"megatron.iteration": i})
        t = s0 + w["input_wait"] * MS  # the batch is fetched inside forward_step: part of no span here
        fb = tracer.start_span("megatron.train.iteration.forward_backward", context=set_span_in_context(step),
                               start_time=s0, attributes={"num_microbatches": MICRO})
        for m in range(MICRO):
            if run["shape"] == "megatron":
                e.span("megatron.microbatch.forward", fb, t, t + w["forward"] * MS)
                e.span("megatron.microbatch.backward", fb, t + w["forward"] * MS,
                       t + (w["forward"] + w["backward"]) * MS)
            t += (w["forward"] + w["backward"]) * MS
        e.span("megatron.grad_sync.start", fb, t, t)
        e.span("megatron.grad_sync.finish", fb, t, t + wait * MS)
        t += wait * MS
        fb.end(end_time=t)
        e.span("megatron.train.iteration.optimizer", step, t, t + w["optimizer_step"] * MS,
               {"megatron.update_successful": True})
        t += w["optimizer_step"] * MS
        if run["shape"] == "megatron-per-step":
            e.span("megatron.train.gc_collect", step, t, t + MS)
            t += MS
        step.end(end_time=t)
    train.end(end_time=t0 + (run["steps"] + 1) * period * MS)


def declared(tracer, rank: int, world: int, run: dict) -> None:
    w, wait = _work(rank, run), _sync_wait(rank, world, run)
    t0 = 1_700_000_000_000 * MS // 1000
    period = 10 + max(_busy(_work(r, run)) for r in range(world)) + 2 + w["optimizer_step"]
    e = Emitter(tracer, t0)
    for i in range(run["steps"]):
        s0 = t0 + i * period * MS
        step = tracer.start_span("acme.train_step", start_time=s0,
                                 attributes={"acme.step": i, "acme.h2d_ms": 1.5})
        t = s0
        e.span("acme.fetch", step, t, t + w["input_wait"] * MS)
        t += w["input_wait"] * MS
        for m in range(MICRO):
            e.span("acme.fwd", step, t, t + w["forward"] * MS, {"acme.micro": m})
            t += w["forward"] * MS
            e.span("acme.bwd", step, t, t + w["backward"] * MS, {"acme.micro": m})
            t += w["backward"] * MS
        e.span("acme.allreduce", step, t, t + wait * MS)
        t += wait * MS
        if run["shape"] == "declared-unknown":
            e.span("acme.checkpoint_shard", step, t, t + 2 * MS)
            t += 2 * MS
        e.span("acme.opt", step, t, t + w["optimizer_step"] * MS)
        t += w["optimizer_step"] * MS
        step.end(end_time=t)


def lens(tracer, rank: int, world: int, run: dict) -> None:
    from nemo.lens import safe_set_span_attributes
    from nemo.lens.semconv import DL_ITERATION, DL_MICROBATCH_ID

    w = _work(rank, run)
    # No sync span in this vocabulary: the wait for the slowest rank lands inside backward.
    lag = max(_busy(_work(r, run)) for r in range(world)) - _busy(w)
    t0 = 1_700_000_000_000 * MS // 1000
    period = 10 + max(_busy(_work(r, run)) for r in range(world)) + w["optimizer_step"]
    e = Emitter(tracer, t0)
    for i in range(run["steps"]):
        s0 = t0 + i * period * MS
        step = tracer.start_span("demo.train.step", start_time=s0)
        safe_set_span_attributes(step, {DL_ITERATION: i, "loss": 1.0 / (i + 1)})
        t = s0 + w["input_wait"] * MS
        fb = tracer.start_span("demo.train.forward_backward", context=set_span_in_context(step), start_time=t)
        for m in range(MICRO):
            if run["shape"] == "lens":
                e.span("demo.microbatch.forward", fb, t, t + w["forward"] * MS, {DL_MICROBATCH_ID: m})
                back = w["backward"] + (lag if m == MICRO - 1 else 0)
                e.span("demo.microbatch.backward", fb, t + w["forward"] * MS,
                       t + (w["forward"] + back) * MS, {DL_MICROBATCH_ID: m})
                t += (w["forward"] + back) * MS
            else:
                t += (w["forward"] + w["backward"]) * MS
        fb.end(end_time=t)
        e.span("demo.train.optimizer", step, t, t + w["optimizer_step"] * MS)
        t += w["optimizer_step"] * MS
        if run["shape"] == "lens-unplaceable":
            e.span("demo.train.eval_hook", step, t, t + MS, {"nemo.span.truncated": True})
            t += MS
        step.end(end_time=t)


SHAPES = {"megatron": megatron, "megatron-per-step": megatron, "declared": declared,
          "declared-unknown": declared, "lens": lens, "lens-unplaceable": lens}


def _sdk_provider(resource_attrs: dict, endpoint: str):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(resource_attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world, endpoint = spec["rank"], spec["world"], spec["endpoint"]
    for run in spec["runs"]:
        if "ranks" in run and rank not in run["ranks"]:
            continue  # a mixed run: the other ranks send TraceML's own spans
        shape = run["shape"]
        if shape.startswith("lens"):
            from nemo.lens import NemoLensConfig, setup_telemetry

            os.environ.update({"NEMO_LENS_ENABLED": "1", "NEMO_LENS_EXPORT_STRATEGY": "all_ranks",
                               "NEMO_LENS_SPAN_GROUPS": "all", "NEMO_LENS_RUN_ID": run["run_id"],
                               "NEMO_LENS_METRICS_ENABLED": "0", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
                               "OTEL_EXPORTER_OTLP_INSECURE": "true"})
            handle = setup_telemetry(NemoLensConfig.from_env(), rank=rank, world_size=world)
            lens(handle.tracer, rank, world, run)
            handle.shutdown()
            continue
        if shape.startswith("megatron"):
            # The resource nemo-lens's build_providers gives a Megatron rank.
            attrs = {"service.name": "megatron", "dl.rank": rank, "dl.world_size": world,
                     "nemo.run.id": run["run_id"], "service.instance.id": f"{run['run_id']}-rank{rank}",
                     "dl.data_parallel.size": world}
        else:
            attrs = {"service.name": "acme-trainer", "acme.run": run["run_id"], "acme.rank": rank,
                     "acme.world": world}
        provider = _sdk_provider(attrs, endpoint)
        SHAPES[shape](provider.get_tracer("emit_steps"), rank, world, run)
        provider.shutdown()


if __name__ == "__main__":
    main()
