"""`traceml demo`'s workload (`traceml.launcher.demo_workload`) on ranks that may have a fake GPU.

    traceml run --standalone --nproc-per-node 2 -m harness.fake_gpu_demo --scenario input-straggler

Each rank whose RANK `HARNESS_FAKE_GPUS` names gets that GPU (`harness.fake_gpu.install`:
seen by the resource sampler only) before the workload starts; the rest is the demo's own
job, ended as its `__main__` ends it. Run as a module (`-m`, the repository root on
PYTHONPATH) so that no harness module shadows a top-level name on the rank.
"""
from __future__ import annotations

import os
import sys

from harness.fake_gpu import install_for_rank


def main(argv: list[str]) -> None:
    install_for_rank(int(os.environ.get("RANK", "0")), os.environ)
    from traceml.launcher import demo_workload

    demo_workload.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
    import traceml

    traceml.shutdown()  # as demo_workload's own __main__: flush now, then leave without torch's teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
