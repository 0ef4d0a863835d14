"""Reliability tests: real processors on loopback, real SQLite files, real sender processes.

The scenarios and their scripts are `harness.reliability` (shared with checks/, which
runs them for longer); the scripts run as `python -m harness.reliability.<script>`.
"""
