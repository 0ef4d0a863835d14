"""Interleaved rounds of variants and what is read from them, shared by the step benchmarks.

This VM's speed drifts by tens of percent between minutes, so the step benchmarks never
compare two variants measured apart: every round runs each variant once, in a new
seeded random order, and each figure pairs a variant with the baseline of the same
round. Stdlib only: bench_peers' coordinator imports it without torch.
"""
from __future__ import annotations

import ctypes
import math
import random
import statistics
import time


def run_rounds(n_rounds: int, block: int, clock, variants: dict, warmup: int = 0,
           after_round=None) -> dict[str, list[list[float]]]:
    """variants: name -> callable(steps, clock, out, warmup). A new random order each round.

    Returns, per variant, one list of step times per round; `after_round()`, if
    given, runs at the end of every round. The order is shuffled
    (seeded) rather than rotated so that no variant always follows the same one:
    removing the automatic patches invalidates `torch.Tensor` attribute caches, and
    a fixed successor would pay for it every round.
    """
    names = list(variants)
    order = random.Random(0)
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for _ in range(n_rounds):
        order.shuffle(names)
        for name in names:
            steps: list = []
            variants[name](block, clock, steps, warmup)
            out[name].append(steps)
        if after_round is not None:
            after_round()
    return out


def quartiles(ordered: list) -> tuple:
    """(first, third) quartile of an already sorted list."""
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def paired_added(samples: dict, variant: str, base: str = "off") -> tuple[float, float, float]:
    """Added time per step of `variant` over `base`, paired by round: (median, q1, q3) in us.

    Per round: the difference of the two variants' median step times in that round
    (blocks a few milliseconds apart, so in the same machine state); the figure is
    the median of those differences over all rounds. This machine's speed drifts by
    tens of percent over seconds (a shared VM), which a difference of overall
    medians picks up whenever the two variants' rounds sample the drift unevenly.
    """
    med = statistics.median
    diffs = sorted((med(v) - med(b)) * 1e6 for v, b in zip(samples[variant], samples[base]))
    return (med(diffs), *quartiles(diffs))


def ratio_interval(base: list, variant: list, z: float = 1.96) -> tuple[float, float, float]:
    """Pooled ratio sum(base)/sum(variant) of paired samples, with its delta-method interval."""
    n = len(base)
    ratio = sum(base) / sum(variant)
    mean_v = sum(variant) / n
    se = statistics.stdev(b - ratio * v for b, v in zip(base, variant)) / (mean_v * math.sqrt(n))
    return ratio, ratio - z * se, ratio + z * se


def wall_and_cpu() -> complex:
    """Wall clock (real part) and training-thread CPU (imaginary part) in one subtractable value."""
    return complex(time.perf_counter(), time.thread_time())


def steady_allocator() -> bool:
    """Have glibc keep freed memory (no trimming, fixed mmap threshold); False elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20))
    except (OSError, AttributeError):
        return False
