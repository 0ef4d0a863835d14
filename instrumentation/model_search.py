"""Finding the trained model of an unmarked loop, for forward timing (automatic mode).

Automatic mode times forward on the outermost module only (a global module hook
would slow every submodule call), and `trace_step(model)` is how a marked loop
names it. An unmarked loop names nothing, but its optimizer holds the model's
parameters: the outermost module holding the optimizer's first parameter is the
model the loop calls (a `DistributedDataParallel` or `torch.compile` wrapper when
there is one, since they hold the model as a submodule).

The search walks the garbage collector's objects once per optimizer (tens of
milliseconds in a large process), at that optimizer's first update and outside
any inferred step's measured interval. Limits: a container that is never called
itself (an `nn.ModuleDict` holding a generator and a discriminator) is the
outermost holder but records no forward; name the module with `trace_step(model)`
or `traceml.wrap_forward(module)` there.
"""
from __future__ import annotations

import gc


def holds(module, param) -> bool:
    """True when `param` is one of `module`'s parameters (recursively)."""
    try:
        return any(p is param for p in module.parameters())
    except Exception:
        return False


def outermost_module_holding(param):
    """The outermost `nn.Module` among those holding `param`, or None (no torch module holds it)."""
    try:
        from torch import nn
    except ImportError:
        return None
    module_type = nn.Module
    # type(), not isinstance(): isinstance reads `__class__`, which lazy proxies in
    # other libraries answer with an import or a deprecation warning.
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), module_type)]
    children: set[int] = set()
    for module in modules:
        for child in getattr(module, "_modules", {}).values():
            if child is not None:
                children.add(id(child))
    for module in modules:
        if id(module) not in children and holds(module, param):
            return module
    return None


def instrument(model) -> bool:
    """Give `model` forward timing (as `trace_step(model)` does in auto mode); False when it cannot."""
    from . import patches
    from .forward import forward_timer, time_forward_or_warn

    time_forward_or_warn(model, patches.instrument_model)
    return forward_timer(model) is not None
