"""Wire vocabulary, settings and public summary schema shared by both sides (stdlib only)."""
from traceml.schema.summary import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION"]
