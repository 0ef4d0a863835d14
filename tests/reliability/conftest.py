"""Reliability tests: real processors on loopback, real SQLite files, real sender processes."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/otlp_test_receiver.py
