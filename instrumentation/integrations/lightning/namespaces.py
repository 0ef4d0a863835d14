"""The two Lightning import names, and the concrete callback class built for each.

`lightning.pytorch` and `pytorch_lightning` ship the same loops under classes that
are distinct, so a callback must subclass the `Callback` of the trainer's own
namespace. The class is built on first use per namespace; nothing here imports
either namespace at module import.
"""
from __future__ import annotations

import importlib
import sys
import threading

NAMESPACES: tuple[str, ...] = ("lightning.pytorch", "pytorch_lightning")
"""Lightning import names this integration supports (2.x)."""

PUBLIC_MODULE = "traceml.integrations.lightning"
"""Where users import the callback from: its classes name it in their repr."""

_classes: dict[str, type] = {}
_classes_lock = threading.Lock()


def trainer_namespace(trainer) -> str:
    """`lightning.pytorch` or `pytorch_lightning`, from the trainer's class."""
    for klass in type(trainer).__mro__:
        module = klass.__module__ or ""
        for namespace in NAMESPACES:
            if module == namespace or module.startswith(namespace + "."):
                return namespace
    raise TypeError(f"{type(trainer).__qualname__} is not a Lightning Trainer "
                    f"(expected one from {' or '.join(NAMESPACES)})")


def default_namespace() -> str:
    """The namespace already imported; `lightning.pytorch` when both or neither are."""
    if "lightning.pytorch" not in sys.modules and "pytorch_lightning" in sys.modules:
        return "pytorch_lightning"
    return "lightning.pytorch"


def callback_class(namespace: str) -> type:
    """The concrete `TraceMLCallback` subclass of `<namespace>.callbacks.Callback`."""
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; expected one of {NAMESPACES}")
    with _classes_lock:
        klass = _classes.get(namespace)
        if klass is None:
            from .callback import TraceMLCallback  # the callback builds its class through here

            base = importlib.import_module(namespace + ".callbacks").Callback
            klass = type("TraceMLCallback", (TraceMLCallback, base),
                         {"__module__": PUBLIC_MODULE, "namespace": namespace,
                          "__doc__": TraceMLCallback.__doc__})
            _classes[namespace] = klass
    return klass
