"""Reliability tests: real processors on loopback, real SQLite files, real sender processes.

Helpers are imported by their full names (`tests.reliability.…`, `harness`);
the sender and training scripts run as `python -m tests.reliability.<script>`.
"""
