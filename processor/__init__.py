"""traceml-processor: OTLP receiver, SQLite normalisation, Step Time analysis and diagnosis.

Imports no torch, transformers or lightning: the container ships none of them.
"""
