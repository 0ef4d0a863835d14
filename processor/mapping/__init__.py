"""The foreign-step mapping layer: step records of jobs that never installed TraceML -> our rows.

One owner for turning another emitter's step shape into the rows our own `traceml.step`
span becomes (issue 34): `record` (the `ForeignStep` every mapping produces and `place`,
its one way into a decoded batch), `spec` (what a span mapping declares, and the declared
TOML file), `builtin` (Megatron-LM and nemo-lens, read from their code) and `spans` (the
assembler that finds a step span's phases among the spans below it). The span decoder
offers it every span that is not TraceML's; other intake (log records) builds
`ForeignStep`s itself and calls `place`. /work/notes/mapping-api.md and
docs/wire-format.md ("Foreign step records") describe the contract.
"""
from traceml.processor.mapping.builtin import BUILTIN, MEGATRON_LM, NEMO_LENS
from traceml.processor.mapping.record import ForeignStep, OwnRanks, PhaseTime, ingest_record, place
from traceml.processor.mapping.spans import MappingSet
from traceml.processor.mapping.spec import MappingFileError, SpanMapping, load_mapping_file

__all__ = ["BUILTIN", "ForeignStep", "MEGATRON_LM", "MappingFileError", "MappingSet", "NEMO_LENS", "OwnRanks", "PhaseTime",
           "SpanMapping", "ingest_record", "load_mapping_file", "place"]
