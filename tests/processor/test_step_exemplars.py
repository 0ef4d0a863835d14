"""Exemplars (issue 35 item 3): the series that stand for a step name the window's worst step.

One harness run (two ranks, TraceML's wire format over OTLP/HTTP, rank 0's step 7 three
times as slow) into a real processor that both serves /metrics and pushes its summary
metrics over OTLP to a test receiver. A real Prometheus with exemplar storage scrapes the
processor (OpenMetrics, as it asks by default) and returns that step's trace and span id
through /api/v1/query_exemplars; the push carries the same ids as OTLP exemplars.
"""
from __future__ import annotations

import shutil
import urllib.request

import pytest

from harness.host_runs import send_straggler_run
from harness.otlp_receiver import OtlpTestReceiver
from harness.processor_process import ProcessorProcess
from harness.prometheus_server import PrometheusServer
from harness.waiting import wait_until
from traceml.schema import vocabulary as v

pytestmark = pytest.mark.slow

SLOW_STEP = 7
RUN = "exemplar-run"


@pytest.fixture(scope="module")
def exemplar_run(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs prometheus (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("step_exemplars")
    with OtlpTestReceiver() as receiver:
        processor = ProcessorProcess(root / "processor", extra_args=[
            "--export-endpoint", receiver.grpc_endpoint, "--export-interval", "0.5"]).start()
        try:
            # No end markers: the run stays live, so its series stay on /metrics.
            sent = send_straggler_run(processor.http, RUN, "host-a", "host-b", slow_step=SLOW_STEP, end=False)
            with PrometheusServer(root / "prometheus", [f"127.0.0.1:{processor.prom}"],
                                  features=["exemplar-storage"]) as prom:
                names = "traceml_run_steps_total|traceml_run_metric_time_seconds_total|traceml_run_badput_time_seconds_total"
                query = f'{{__name__=~"{names}",traceml_run_id="{RUN}"}}'
                assert wait_until(lambda: len(prom.exemplars(query)) >= 5, 60, 0.5), prom.exemplars(query)
                found = prom.exemplars(query)
            assert receiver.wait_for(lambda: any(p.exemplars for _, _, p in receiver.metric_points()), 30)
            request = urllib.request.Request(f"http://127.0.0.1:{processor.prom}/metrics")  # no Accept: text 0.0.4
            with urllib.request.urlopen(request, timeout=10) as response:
                plain = response.read().decode()
            yield {"sent": sent, "exemplars": found, "pushed": receiver.metric_points(), "plain": plain}
        finally:
            processor.stop()


def _by_series(found: list[dict]) -> dict[tuple, list[dict]]:
    return {(s["seriesLabels"]["__name__"],
             s["seriesLabels"].get("traceml_metric") or s["seriesLabels"].get("traceml_badput_cause")): s["exemplars"]
            for s in found}


def test_prometheus_returns_the_worst_steps_trace_id(exemplar_run):
    slow_trace, slow_span = (x.hex() for x in exemplar_run["sent"].span_ids[(0, SLOW_STEP)])
    series = _by_series(exemplar_run["exemplars"])
    steps = series[("traceml_run_steps_total", None)]
    assert {e["labels"]["trace_id"] for e in steps} == {slow_trace}
    assert {e["labels"]["span_id"] for e in steps} == {slow_span}
    # The worst step's step time in seconds: input wait then the traced step, both tripled.
    assert float(steps[-1]["value"]) == pytest.approx(3 * (0.100 + 0.140))
    input_wait = series[("traceml_run_metric_time_seconds_total", v.METRIC_INPUT_WAIT)]
    assert {e["labels"]["trace_id"] for e in input_wait} == {slow_trace}
    assert float(input_wait[-1]["value"]) == pytest.approx(3 * 0.100)
    # The straggler's cost, by ledger cause, leads to the same step.
    stall = series[("traceml_run_badput_time_seconds_total", "straggler_wait")]
    assert {e["labels"]["trace_id"] for e in stall} == {slow_trace}
    # Backward's worst cell is the waiting rank's (120 ms on every step): its own span, not rank 0's.
    backward = series[("traceml_run_metric_time_seconds_total", v.METRIC_BACKWARD)]
    waiting = {exemplar_run["sent"].span_ids[(1, step)][0].hex() for step in range(24)}
    assert {e["labels"]["trace_id"] for e in backward} <= waiting


def test_the_push_carries_the_same_step_as_otlp_exemplars(exemplar_run):
    slow_trace, slow_span = exemplar_run["sent"].span_ids[(0, SLOW_STEP)]
    by_name: dict[str, list] = {}
    for _, metric, point in exemplar_run["pushed"]:
        for exemplar in point.exemplars:
            by_name.setdefault(metric.name, []).append((point, exemplar))
    # Gauges too on OTLP: the window's step-time points and the straggler finding.
    window = [(p, e) for p, e in by_name[v.METRIC_WINDOW_METRIC]
              if any(kv.key == v.ATTR_METRIC and kv.value.string_value == v.METRIC_STEP_TIME for kv in p.attributes)]
    assert window and all(e.trace_id == slow_trace and e.span_id == slow_span for _, e in window)
    findings = by_name[v.METRIC_DIAGNOSIS_ACTIVE]
    assert findings and all(e.trace_id == slow_trace for _, e in findings)
    assert all(e.trace_id == slow_trace for _, e in by_name[v.METRIC_RUN_STEPS])


def test_the_text_format_carries_no_exemplar(exemplar_run):
    plain = exemplar_run["plain"]
    assert f'traceml_run_steps_total{{traceml_run_id="{RUN}"}}' in plain
    assert "trace_id" not in plain  # exemplars only where the scraper asked for OpenMetrics
