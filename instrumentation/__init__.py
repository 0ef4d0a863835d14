"""TraceML training-side API. Importing this package never imports torch."""
