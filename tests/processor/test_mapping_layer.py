"""The mapping layer's rules without processes: the declared file's checks, placement, the buffer.

The end-to-end runs (real emitters, rotel, the summaries) are tests/processor/test_foreign_mappings.py.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2 as span_data

from harness.otlp_payloads import kv
from traceml.processor.decode import Decoder
from traceml.processor.mapping import ForeignStep, MappingFileError, MappingSet, PhaseTime, place
from traceml.processor.mapping.builtin import BUILTIN
from traceml.processor.mapping.spec import mapping_from_document
from traceml.processor.store_records import DecodedBatch, bounded_unplaced

ROOT = Path(__file__).resolve().parents[2]
MAPPING_FILE = Path(__file__).parent / "foreign_emitters" / "acme_mapping.toml"


def test_the_worked_example_in_the_docs_is_the_tested_file():
    assert MAPPING_FILE.read_text() in (ROOT / "docs" / "mapping.md").read_text()


@pytest.mark.parametrize("document, message", [
    ({"step": {"span": "s", "number": "n"}, "phases": {"forward": "f"}}, "name must be"),
    ({"name": "x", "phases": {"forward": "f"}}, "[step] needs span"),
    ({"name": "x", "step": {"span": "s", "number": "n"}, "phases": {"fwd": "f"}},
     "[phases] 'fwd' is not a phase (accepted: input_wait, h2d, forward"),
    ({"name": "x", "step": {"span": "s", "number": "n"}}, "names no phase"),
    ({"name": "x", "step": {"span": "s", "number": "n"}, "phases": {"forward": "f"},
      "phase_attributes": {"h2d": {"key": "k", "unit": "min"}}}, "unit 'min' (accepted: s, ms)"),
    ({"name": "x", "step": {"span": "s", "number": "n", "id": 1}, "phases": {"forward": "f"}},
     "[step] has unknown key(s) id"),
    ({"name": "x", "step": {"span": "s", "number": "n"}, "phases": {"forward": []}}, "[phases] forward: expected"),
    ({"name": "x", "steps": {}, "step": {"span": "s", "number": "n"}, "phases": {"forward": "f"}},
     "unknown key(s) steps"),
])
def test_a_declared_mapping_mistake_is_refused_with_where_and_why(document, message):
    with pytest.raises(MappingFileError) as err:
        mapping_from_document(document, "mapping file m.toml")
    assert str(err.value).startswith("mapping file m.toml: ") and message in str(err.value)


@pytest.mark.slow  # two processor start-ups, about 3 s
def test_the_processor_refuses_to_start_on_a_bad_mapping_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[step]\nspan = "s"\nnumber = "n"\n[phases]\nforwards = "f"\n')
    done = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--db", str(tmp_path / "t.db"),
                           "--mapping-file", str(bad), "--otlp-grpc", "off", "--otlp-http", "off"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"mapping file {bad}: [phases] 'forwards' is not a phase" in done.stderr
    unreadable = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--db", str(tmp_path / "t.db"),
                                 "--mapping-file", str(tmp_path / "none.toml")], capture_output=True, text=True,
                                timeout=60)
    assert unreadable.returncode == 2 and "cannot be read" in unreadable.stderr


def _span(name: str, trace: bytes, span_id: bytes, parent: bytes = b"", start_ms: float = 0, end_ms: float = 1,
          **attrs) -> span_data.Span:
    base = 1_700_000_000_000_000_000
    return span_data.Span(trace_id=trace, span_id=span_id, parent_span_id=parent, name=name,
                          start_time_unix_nano=base + int(start_ms * 1e6), end_time_unix_nano=base + int(end_ms * 1e6),
                          attributes=[kv(k.replace("__", "."), v) for k, v in attrs.items()])


def _request(*spans: span_data.Span) -> trace_pb2.ExportTraceServiceRequest:
    res = resource_pb2.Resource(attributes=[kv("nemo.run.id", "r"), kv("dl.rank", 0), kv("dl.world_size", 2)])
    return trace_pb2.ExportTraceServiceRequest(resource_spans=[span_data.ResourceSpans(
        resource=res, scope_spans=[span_data.ScopeSpans(spans=list(spans))])])


def test_phase_spans_sent_before_their_step_in_another_request_are_summed_into_it():
    decoder = Decoder()
    t = os.urandom(16)
    first = decoder.decode_traces(_request(
        _span("megatron.microbatch.forward", t, b"f0000000", b"fb000000", 0, 8),
        _span("megatron.microbatch.forward", t, b"f1000000", b"fb000000", 20, 28),
        _span("megatron.microbatch.backward", t, b"b0000000", b"fb000000", 8, 20)))
    assert first.step_records == [] and not first.ignored
    second = decoder.decode_traces(_request(
        _span("megatron.train.iteration.forward_backward", t, b"fb000000", b"st000000", 0, 30),
        _span("megatron.train.iteration", t, b"st000000", b"tr000000", 0, 40, megatron__iteration=7)))
    (record,) = second.step_records
    assert (record.run_id, record.identity.global_rank, record.step) == ("r", 0, 7)
    values = {raw: (e.cpu_ms, e.gpu_ms, e.count) for raw, e in record.events.items()}
    assert values["_traceml_internal:forward_time"] == (16.0, None, 2)
    assert values["_traceml_internal:backward_time"] == (12.0, None, 1)
    assert values["_traceml_internal:step_time"] == (40.0, None, 1)
    (note,) = second.mapped.values()
    assert (note.mapping, note.unmeasured, dict(note.unplaced)) == ("megatron-lm", ("input_wait", "h2d"), {})


def test_a_phase_span_whose_step_never_comes_is_counted_not_guessed():
    now = [0.0]
    mappings = MappingSet(BUILTIN, max_age_s=120.0, clock=lambda: now[0])
    decoder = Decoder()
    decoder.spans.mappings = mappings
    t = os.urandom(16)
    batch = decoder.decode_traces(_request(_span("megatron.microbatch.forward", t, b"f0000000", b"fb000000"),
                                           _span("GET /items", t, b"g0000000", b"x0000000"),
                                           _span("GET /", os.urandom(16), b"r0000000")))
    assert dict(batch.ignored) == {"not_traceml": 1} and mappings.pending() == 2
    now[0] = 121.0
    later = decoder.decode_traces(_request(_span("GET /", os.urandom(16), b"r1000000")))
    assert dict(later.ignored) == {"unplaced_foreign": 1, "not_traceml": 2} and mappings.pending() == 0
    assert later.step_records == []


def test_a_step_the_rules_refuse_is_rejected_whole_with_its_reason():
    batch = DecodedBatch("traces")
    decoder = Decoder()
    ok = place(batch, ForeignStep("traceml-logs", 3, 1, 2, {"forward": PhaseTime(math.nan)}, run_id="r", rank=0),
               None, decoder.limits, decoder.admission)
    assert not ok and dict(batch.rejected) == {"non_finite_value": 1}
    assert not place(batch, ForeignStep("traceml-logs", None, 1, 2, {"forward": PhaseTime(1.0)}, run_id="r", rank=0),
                     None, decoder.limits, decoder.admission)
    assert not place(batch, ForeignStep("traceml-logs", 3, 1, 2, {"forward": PhaseTime(1.0)}, rank=0),
                     None, decoder.limits, decoder.admission)
    assert dict(batch.rejected) == {"non_finite_value": 1, "missing_step": 1, "missing_run_id": 1}
    assert place(batch, ForeignStep("traceml-logs", 3, 1, 2, {"forward": PhaseTime(1.0, 2)}, run_id="r", rank=0,
                                    world_size=2), None, decoder.limits, decoder.admission, ("h2d",))
    (note,) = batch.mapped.values()
    assert (note.run_id, note.global_rank, note.mapping, note.unmeasured, note.steps) == ("r", 0, "traceml-logs",
                                                                                        ("h2d",), 1)


def test_unplaced_labels_are_bounded_before_they_are_stored():
    counts = {f"span-{i:03d}": 1 for i in range(40)} | {"x" * 300: 5}
    out = bounded_unplaced(counts)
    assert len(out) == 33 and out["(other names)"] == 9 and out["x" * 128] == 5  # 41 names: 32 kept


def test_wire_names_in_the_source_lines_are_escaped_on_the_page_and_the_card():
    from traceml.processor.reporting.source_note import source_lines
    from traceml.processor.web import pages
    from traceml.processor.presenters.terminal_text import printable

    lines = source_lines([{"mapping": "declared:x", "ranks": [0], "steps": 3, "unmeasured_phases": [],
                           "unplaced": {"<script>alert(1)</script>\x1b[2J": 3}}])
    html = pages._sources({"source_notes": lines})
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "\x1b" not in printable("\n".join(lines))


def test_a_rank_that_sends_traceml_spans_keeps_them_as_its_rows_and_its_mapped_steps_are_counted():
    from harness.otlp_payloads import steps_request

    decoder = Decoder()
    own = decoder.decode_traces(steps_request("r", 0, range(2)))
    assert len(own.step_records) == 2
    t = os.urandom(16)
    mapped = decoder.decode_traces(_request(
        _span("megatron.train.iteration", t, b"st000000", b"tr000000", 0, 40, megatron__iteration=1)))
    assert mapped.step_records == [] and dict(mapped.ignored) == {"traceml_spans_win": 1}
