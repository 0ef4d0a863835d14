"""A 2-rank DDP loop that exports its own traces, metrics and logs with the official OpenTelemetry SDK.

Its SDK is configured the way jobs usually are: from the standard `OTEL_EXPORTER_OTLP_*`
variables, with the job's local agent as the fallback (`--agent`, standing in for the
SDK's built-in `localhost:4318`, which a test cannot own), over the protocol
`OTEL_EXPORTER_OTLP_PROTOCOL` names (http/protobuf unless set). Whatever `traceml run`
put into those variables would therefore redirect the job's own telemetry. No `traceml`
import: the launcher instruments the loop.
"""
import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--agent", required=True, help="base URL of the job's own OTLP agent")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

os.environ.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", args.agent)
os.environ.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler  # noqa: E402
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

if os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
else:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
resource = Resource.create({"service.name": "the-job", "job.rank": rank})
tracer_provider = TracerProvider(resource=resource)
tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
meter_provider = MeterProvider(resource=resource, metric_readers=[
    PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=60_000)])
logger_provider = LoggerProvider(resource=resource)
logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
job_log = logging.getLogger("the-job")
job_log.setLevel(logging.INFO)
job_log.addHandler(LoggingHandler(logger_provider=logger_provider))
tracer = tracer_provider.get_tracer("the-job")
batches = meter_provider.get_meter("the-job").create_counter("job.batches", description="batches trained")

torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with tracer.start_as_current_span("job.train"):
    for step in range(args.steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        batches.add(1)
        job_log.info("job step %d done", step)
dist.barrier()
for provider in (tracer_provider, meter_provider, logger_provider):
    provider.shutdown()  # flushes what is queued to the job's own agent
print(f"rank {rank}: {args.steps} steps, own OTel exported to {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']} "
      f"over {os.environ['OTEL_EXPORTER_OTLP_PROTOCOL']}", flush=True)
dist.destroy_process_group()
