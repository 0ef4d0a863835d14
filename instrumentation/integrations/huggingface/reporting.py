"""How the Hugging Face integration speaks up: once per kind, and never by stopping training."""
from __future__ import annotations

from ..warn_once import OnceWarnings

warn_once = OnceWarnings("TraceML: ")


class CustomCollectionWarning(RuntimeWarning):
    """A Trainer subclass overrides `get_batch_samples`: its input is not measured."""


CustomCollectionWarning.__module__ = "traceml.integrations.huggingface"  # its public home


def report(what: str, exc: BaseException) -> None:
    """A TraceML failure never stops training: say it once per kind and carry on."""
    warn_once(f"failure:{what}", f"Hugging Face integration: {what} failed "
              f"({type(exc).__name__}: {exc}); training continues")
