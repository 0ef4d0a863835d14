"""TraceML training-side API. Importing this package loads nothing but this facade.

    import traceml
    traceml.init()                       # auto mode: patches + samplers (+ exporter)
    for batch in loader:
        with traceml.trace_step(model):  # one TraceML step
            ...
    traceml.shutdown()

See docs/instrumentation.md for modes, lifecycle rules and misuse behaviour.

The package is also the parent of `traceml.processor`, `traceml.schema` and the
other service-side packages, which must not load the training side (nor read its
environment) just because Python runs this file first. So every public name is
resolved on first use (PEP 562 `__getattr__`) from the module that owns it, and
then bound here, so later lookups such as `traceml.trace_step` on every step are
plain attribute reads. Submodules (`traceml.timing`, `traceml.samplers`, ...) load
on first access too.
"""

import importlib

__all__ = [
    "init", "shutdown", "trace_step", "is_initialized", "mode",
    "wrap_dataloader", "wrap_forward", "wrap_optimizer", "timed_region", "timed_forward",
    "timed_backward", "timed_h2d", "timed_input", "timed_optimizer_step", "dataloader_timing_scope",
    "register_sink", "unregister_sink", "dropped_counts", "misuse_counts", "steps_completed",
    "set_recording", "current_capture", "complete_step_capture", "abort_step_capture",
    "StepMemoryTracker", "EventTotals", "PhaseInterval", "ResolvedStepTime",
    "StepMemorySnapshot", "TelemetrySink",
]

_OWNERS = {
    "lifecycle": ("init", "shutdown", "is_initialized", "mode"),
    "traced_step": ("trace_step",),
    "manual": ("wrap_dataloader", "wrap_forward", "wrap_optimizer", "timed_forward",
               "timed_backward", "timed_h2d", "timed_input", "timed_optimizer_step"),
    "timing": ("timed_region", "dataloader_timing_scope"),
    "samplers": ("register_sink", "unregister_sink", "StepTimeSampler", "StepMemorySampler"),
    "step_events": ("dropped_counts", "misuse_counts", "steps_completed", "set_recording",
                    "current_capture", "complete_step_capture", "abort_step_capture"),
    "memory": ("StepMemoryTracker",),
    "records": ("EventTotals", "PhaseInterval", "ResolvedStepTime", "StepMemorySnapshot",
                "TelemetrySink"),
    "forward": ("instrument_forward",),
    "hooks": ("instrument_optimizer", "TimedIterable"),
}
_OWNER_OF = {name: module for module, names in _OWNERS.items() for name in names}

_LIVE = frozenset({"_exporter_sink", "_time_sampler", "_memory_sampler", "_resource_sampler"})
"""Lifecycle state that tests and benchmarks read through the package: looked up on
every access (never bound here), since init() and shutdown() replace it."""


def __getattr__(name: str):
    owner = _OWNER_OF.get(name)
    if owner is not None:
        value = getattr(importlib.import_module(f"{__name__}.{owner}"), name)
        globals()[name] = value  # bound: the next lookup does not come here
        return value
    if name in _LIVE:
        return getattr(importlib.import_module(f"{__name__}.lifecycle"), name)
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")  # binds the submodule here
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
