"""Framework integrations (Hugging Face Trainer, Lightning), one subpackage each.

Importing this package imports nothing else: each integration loads its framework
lazily, so `traceml run` can probe for them without paying the import. What both
need from Python itself lives beside them: `import_hook`, `patching`, `warn_once`.
"""
