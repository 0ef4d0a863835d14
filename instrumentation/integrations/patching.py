"""Replacing a framework's function with a wrapper of it, recognisably and reversibly.

Every replacement carries the function it wraps under `ORIGINAL`. That is how an
integration tells its own wrapper from anyone else's (so installing twice wraps
once, and a subclass override is seen as not ours), and a `Patch` remembers what
the owner held before, so that undoing it restores exactly that.
"""
from __future__ import annotations

from typing import Any, Callable

ORIGINAL = "__traceml_original__"
"""Attribute on every TraceML wrapper: the function it wraps."""


def is_wrapper(function: Any) -> bool:
    """True for a function that `patch` installed."""
    return getattr(function, ORIGINAL, None) is not None


class Patch:
    """One attribute of one owner (class, instance or module) replaced by a wrapper."""

    __slots__ = ("owner", "name", "had_own", "before", "replacement")

    def __init__(self, owner: Any, name: str, had_own: bool, before: Any, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.had_own = had_own
        self.before = before
        self.replacement = replacement

    def undo(self) -> None:
        """Put back what the owner held, unless someone patched over us since (theirs stays)."""
        owner, name = self.owner, self.name
        if vars(owner).get(name) is not self.replacement:
            return
        if self.had_own:
            setattr(owner, name, self.before)
        else:
            delattr(owner, name)  # the attribute was inherited: inherit it again


def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> Patch | None:
    """Replace `owner.<name>` by `make(current)`; None when there is nothing callable to wrap."""
    current = getattr(owner, name, None)
    if not callable(current):
        return None
    own = vars(owner)
    had_own = name in own
    before = own.get(name)
    replacement = make(current)
    setattr(replacement, ORIGINAL, current)
    setattr(owner, name, replacement)
    return Patch(owner, name, had_own, before, replacement)


def patch_once(owner: Any, name: str, make: Callable[[Any], Any]) -> Patch | None:
    """`patch`, unless `owner.<name>` already is a TraceML wrapper (then None: nothing new)."""
    if is_wrapper(getattr(owner, name, None)):
        return None
    return patch(owner, name, make)
