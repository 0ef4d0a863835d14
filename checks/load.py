"""1,024 simulated ranks at a realistic step rate against one processor for several minutes.

    .venv/bin/python -m checks.load                          # 1,024 ranks, 1 step/s, 300 s
    .venv/bin/python -m checks.load --duration 60            # shorter
    .venv/bin/python -m checks.load --ranks 256 --steps-per-s 2 --duration 20   # the CI shape

The processor is the real CLI in its own process; sender processes simulate the
ranks (each rank exports once per second the steps it finished, as the real
exporter batches them; real end times, so lag is meaningful). Rank 137 is an
input straggler. Reported: processor RSS at start and at peak (sampled every
second), lag (`traceml_processor_run_lag_seconds` scraped every second: max and
median), ingest rate (rows stored / wall time; must equal spans sent), sender
retries and late ticks (the senders falling behind their own schedule), the
diagnosis at every scrape while running (how many named rank 137, how many named
any other rank: must be 0) and at the end (must name rank 137 and nobody else).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from harness.reliability.load_scenario import run_load


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps-per-s", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--straggler", type=int, default=137)
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="check-load-"))
    result = run_load(folder, ranks=args.ranks, steps_per_s=args.steps_per_s, duration_s=args.duration,
                      straggler=args.straggler, senders=args.senders)
    lag = result.lag_samples
    print(result.line())
    print(result.rss_trajectory(11))
    print(f"lag median {statistics.median(lag):.2f} s, max {max(lag):.2f} s over {len(lag)} samples"
          if lag else "no lag samples")
    culprits = {c for _, c, _ in result.diagnosis if c}
    ok = (result.rows_stored == result.spans_sent and result.rss_max_mib < 500
          and culprits == {str(args.straggler)} and result.false_culprit_samples == 0)
    print("(shared 2-core machine; senders and processor compete for the same cores)")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
