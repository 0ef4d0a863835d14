"""Framework integrations (Hugging Face Trainer, Lightning).

Importing this package imports nothing else: each integration module loads its
framework lazily, so `traceml run` can probe for them without paying the import.
"""
