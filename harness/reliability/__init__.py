"""The reliability scenarios: what tests/reliability runs at CI size and checks/ runs for longer.

Senders that replay OTLP traffic (`sender`, `load_sender`), a tiny training run under
endpoint faults (`fault_training`, `train_script`), a processor killed mid-stream
(`crash_scenario`), sustained load (`load_scenario`), the malformed-input corpus
(`fuzz_cases`) and the helpers they share (`reliability_helpers`). The scripts run as
`python -m harness.reliability.<script>` with the repository root on PYTHONPATH
(`harness.child_python`).
"""
