"""One warning per kind and process: how an integration says it cannot do part of its job.

These are not the training side's misuses (`step_events.warn_once`, counted in
`misuse_counts()`): they report a framework version without a seam, a Trainer the
integration cannot measure, or a TraceML failure the integration absorbed so that
training goes on. None of those is a misuse of TraceML's API, so they stay out of
`misuse_counts()`, and they may carry their own category for users to filter
(`huggingface.CustomCollectionWarning`).
"""
from __future__ import annotations

import warnings


class OnceWarnings:
    """The warn-once of one integration: its message prefix and the kinds already said."""

    __slots__ = ("prefix", "seen")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.seen: set[str] = set()

    def __call__(self, key: str, message: str, category: type[Warning] = RuntimeWarning) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        # stacklevel 3: the code that called the integration helper which warns
        warnings.warn(f"{self.prefix}{message}", category, stacklevel=3)
