"""How each rank of a run ended: the one rule that joins end markers and exit codes.

Two witnesses, neither enough alone. A rank's end marker (`traceml.run.end`)
says what its script did (returned, KeyboardInterrupt, an exception or
`sys.exit(N)`), but it is sent before the interpreter exits, so a crash in
teardown, a kill or a lost export escape it. The launcher (`traceml run`) sees
the exit code of each rank it spawned, but only on its own node, and only for
failed ranks when torch's elastic agent stops the others. So:

1. the launcher's exit code, where it has one, is the truth (0 finished; 130, or
   death by SIGINT, interrupted; any other code failed with that code);
2. else the marker's outcome (an older exporter's marker says nothing: finished,
   which is what such a marker always meant);
3. else, when the launcher was itself stopped by a signal (SIGINT, SIGTERM, ...)
   that it forwarded to the ranks of its node, those ranks were interrupted;
4. else the rank is lost: nothing says how it ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from traceml.schema.endings import (
    EXIT_CODE_INTERRUPTED,
    OUTCOME_FAILED,
    OUTCOME_FINISHED,
    OUTCOME_INTERRUPTED,
    OUTCOME_LOST,
)


@dataclass(frozen=True, slots=True)
class LauncherEnding:
    """What the launcher of one node saw of its ranks (`traceml run` passes it to the summary).

    `exit_codes`: global rank -> exit status (negative: killed by that signal, as
    torch reports it). `others_exit_code`: the status of every other rank of
    `node_rank` (0 when the job succeeded: torch reports no per-rank code then).
    `signal`: the signal that stopped the launcher (forwarded to its ranks).
    """

    node_rank: int | None = None
    exit_codes: Mapping[int, int] = field(default_factory=dict)
    others_exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True, slots=True)
class RankEndFacts:
    """One rank's own account: did its end marker arrive, and what did it say."""

    global_rank: int
    end_marker: bool
    outcome: str | None = None
    exit_code: int | None = None
    node_rank: int | None = None


@dataclass(frozen=True, slots=True)
class RankEnding:
    global_rank: int
    outcome: str  # schema.endings.OUTCOMES
    exit_code: int | None
    end_marker: bool


def shell_status(code: int) -> int:
    """torch's exit code (negative = killed by signal N) -> the shell's status (128 + N)."""
    return 128 - code if code < 0 else code


def _from_exit_code(code: int, marker_outcome: str | None) -> tuple[str, int]:
    status = shell_status(code)
    if status == 0:
        return OUTCOME_FINISHED, 0
    if status == EXIT_CODE_INTERRUPTED or marker_outcome == OUTCOME_INTERRUPTED:
        return OUTCOME_INTERRUPTED, status
    return OUTCOME_FAILED, status


def _launcher_code(facts: RankEndFacts, launcher: LauncherEnding | None) -> int | None:
    if launcher is None:
        return None
    if facts.global_rank in launcher.exit_codes:
        return launcher.exit_codes[facts.global_rank]
    if launcher.others_exit_code is not None and _on_node(facts, launcher):
        return launcher.others_exit_code
    return None


def _on_node(facts: RankEndFacts, launcher: LauncherEnding) -> bool:
    """Whether the rank ran under this launcher; unknown node ranks count as ours (one node)."""
    return launcher.node_rank is None or facts.node_rank is None or facts.node_rank == launcher.node_rank


def rank_ending(facts: RankEndFacts, launcher: LauncherEnding | None = None) -> RankEnding:
    code = _launcher_code(facts, launcher)
    if code is not None:
        outcome, status = _from_exit_code(code, facts.outcome if facts.end_marker else None)
        return RankEnding(facts.global_rank, outcome, status, facts.end_marker)
    if facts.end_marker:
        return RankEnding(facts.global_rank, facts.outcome or OUTCOME_FINISHED, facts.exit_code, True)
    if launcher is not None and launcher.signal is not None and _on_node(facts, launcher):
        # Stopped from outside (Ctrl-C, SIGTERM from a scheduler) without a word of its own.
        return RankEnding(facts.global_rank, OUTCOME_INTERRUPTED, None, False)
    return RankEnding(facts.global_rank, OUTCOME_LOST, None, False)


def rank_endings(facts: Iterable[RankEndFacts], expected_ranks: Iterable[int] = (),
                 launcher: LauncherEnding | None = None) -> dict[int, RankEnding]:
    """Every rank's ending, by global rank: those with facts, the expected ones without any
    (lost unless the launcher knows), and the ones only the launcher reported."""
    by_rank = {f.global_rank: f for f in facts}
    ranks = set(by_rank) | set(expected_ranks)
    if launcher is not None:
        ranks |= set(launcher.exit_codes)
    return {r: rank_ending(by_rank.get(r, RankEndFacts(r, False)), launcher) for r in sorted(ranks)}


def launcher_ending_to_json(ending: LauncherEnding) -> dict:
    """`ending` as the run folder keeps it, so `traceml summary` rebuilds what `traceml run` wrote."""
    return {"node_rank": ending.node_rank, "exit_codes": {str(r): c for r, c in ending.exit_codes.items()},
            "others_exit_code": ending.others_exit_code, "signal": ending.signal}


def launcher_ending_from_json(data: Mapping) -> LauncherEnding:
    """The inverse of `launcher_ending_to_json`; ValueError/TypeError/KeyError on a malformed record."""
    def opt_int(value):
        return None if value is None else int(value)

    return LauncherEnding(node_rank=opt_int(data.get("node_rank")),
                          exit_codes={int(r): int(c) for r, c in dict(data.get("exit_codes") or {}).items()},
                          others_exit_code=opt_int(data.get("others_exit_code")), signal=opt_int(data.get("signal")))

