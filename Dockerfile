# traceml-processor: receives TraceML OTLP, stores it in SQLite, diagnoses live,
# serves summary metrics for Prometheus. No torch: the processor never imports it.
#
#   docker build -t traceml-processor:0.1.0 .
#   docker run -p 4317:4317 -p 4318:4318 -p 9464:9464 -v traceml-data:/data traceml-processor:0.1.0
#
# tests/deploy/test_image.py runs this file's ENTRYPOINT + CMD outside Docker.
FROM python:3.12.8-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE deploy/processor-constraints.txt ./
COPY instrumentation ./instrumentation
COPY exporter ./exporter
COPY processor ./processor
COPY schema ./schema
COPY launcher ./launcher
# The core and the processor extra (the service side; no [train]/[huggingface]/[lightning]
# extra): no torch, transformers or lightning end up in the image. Their versions, and
# those of what they require, are fixed by the constraints file (the versions the tests ran with).
RUN pip install --no-compile -c processor-constraints.txt ".[processor]" \
    && rm -rf /src \
    && groupadd --system --gid 10001 traceml \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home \
       --shell /usr/sbin/nologin traceml \
    && mkdir -p /data/summaries \
    && chown -R traceml:traceml /data

WORKDIR /data
USER 10001:10001
VOLUME ["/data"]

# 4317 OTLP/gRPC, 4318 OTLP/HTTP (+ /healthz, /readyz), 9464 Prometheus /metrics
EXPOSE 4317 4318 9464

# Plain HTTP on the OTLP/HTTP port; with --tls-cert/--tls-key set, override this check.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:4318/healthz', timeout=4).status == 200 else 1)"]

# Inside the container the receivers listen on every interface; put a bearer token
# (--auth-token-file or TRACEML_PROCESSOR_AUTH_TOKEN) and TLS in front of any
# network you do not trust. Override single settings with TRACEML_PROCESSOR_* env
# only where no flag below sets them (flags win over environment).
ENTRYPOINT ["traceml-processor"]
CMD ["--db", "/data/traceml.db", \
     "--otlp-grpc", "0.0.0.0:4317", \
     "--otlp-http", "0.0.0.0:4318", \
     "--prometheus", "0.0.0.0:9464", \
     "--summary-dir", "/data/summaries"]
