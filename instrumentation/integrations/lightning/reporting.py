"""How the Lightning integration speaks up: once per kind, never by stopping training."""
from __future__ import annotations

from ..warn_once import OnceWarnings

warn_once = OnceWarnings("TraceML Lightning: ")
