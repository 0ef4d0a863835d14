"""The pure final-summary projector: a finished `StepTimeAnalysis` -> public JSON + text card.

It owns public names, topology, rank identities and card text. It does not load
SQLite, align steps, compute statistics or diagnose: every number comes from the
window's metric statistics, its rank facts, the resource window (`reporting.resources`)
or the diagnosis as given.

Public rules (docs/SCHEMA.md): every key is always present; an unmeasured value is
`null`; a measured zero is `0.0`; time values are milliseconds on the window's
selected clock except the explicit `_cpu_ms` / `_gpu_ms` ones.
"""
from __future__ import annotations

import datetime as _dt
import json
import numbers
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from traceml.processor.presenters.terminal_text import printable
from traceml.processor.capture.model import CaptureRecord
from traceml.processor.endings import RankEnding
from traceml.processor.reporting.badput import UNITS as BADPUT_UNITS
from traceml.processor.reporting.badput import badput_lines, project_badput
from traceml.processor.reporting.captures import UNITS as CAPTURE_UNITS
from traceml.processor.reporting.captures import (
    EVIDENCE_KEY, OPEN_NOTE, capture_lines, link_findings, project_captures, unlinked,
)
from traceml.processor.reporting.public_number import public_number
from traceml.processor.reporting.input_note import BEFORE_FORWARD_SENTENCE, RANKS_NAMED, before_forward_note
from traceml.processor.reporting.inputs import RankMemory, RankTelemetry, RunMetadata, RunTelemetry
from traceml.processor.reporting.source_note import source_lines, sources_section
from traceml.processor.reporting.resources import UNITS as RESOURCE_UNITS
from traceml.processor.reporting.resources import (
    project_resources,
    rank_resources,
    resource_lines,
    resource_window_of,
)
from traceml.processor.resources.model import ResourceWindow
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeAnalysis, StepTimeWindow
from traceml.schema.summary import FINAL_SUMMARY_FILE, SCHEMA_VERSION, SUMMARY_CARD_FILE
from traceml.schema.endings import OUTCOME_FAILED, OUTCOME_FINISHED, OUTCOME_INTERRUPTED, OUTCOME_LOST, OUTCOMES
from traceml.schema.vocabulary import QUEUE_NAMES

# Public key -> window metric name. The order is the card's and the schema's.
PUBLIC_METRICS: tuple[tuple[str, str], ...] = (
    ("step_time_ms", "step_time"),
    ("input_wait_ms", "input_wait"),
    ("traced_step_time_ms", "traced_step_time"),
    ("step_time_cpu_ms", "step_time_cpu"),
    ("step_time_gpu_ms", "step_time_gpu"),
    ("traced_step_time_cpu_ms", "traced_step_time_cpu"),
    ("traced_step_time_gpu_ms", "traced_step_time_gpu"),
    ("dataloader_fetch_cpu_ms", "dataloader_fetch_cpu"),
    ("h2d_ms", "h2d"),
    ("forward_ms", "forward"),
    ("backward_ms", "backward"),
    ("optimizer_ms", "optimizer_step"),
    ("compute_ms", "compute"),
    ("residual_ms", "residual"),
    ("collective_wait_ms", "collective_wait"),
)
PUBLIC_METRIC_KEYS: tuple[str, ...] = tuple(k for k, _ in PUBLIC_METRICS)

UNITS: Mapping[str, str] = {
    "*_ms": "milliseconds",
    "*_bytes": "bytes",
    "score": "ratio of the victim's (straggler) or the median (share rules) Step Time",
    "skew": "ratio: (worst - median) / median",
    "share": "ratio of the median Step Time",
    "generated_at": "ISO 8601, UTC",
    **RESOURCE_UNITS,
    **BADPUT_UNITS,
    **CAPTURE_UNITS,
}

_MS_DIGITS = 3
_RATIO_DIGITS = 4


def _json_safe(value: object) -> object:
    """Evidence values -> JSON-safe values with floats rounded (ratios and ms alike)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return public_number(value, _RATIO_DIGITS)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def project_issue(issue: DiagnosisIssue) -> dict:
    return {
        "kind": issue.kind,
        "severity": issue.severity,
        "status": issue.status,
        "score": public_number(issue.score, _RATIO_DIGITS),
        "summary": issue.summary,
        "culprit_rank": None if issue.culprit_rank is None else int(issue.culprit_rank),
        "victim_rank": None if issue.victim_rank is None else int(issue.victim_rank),
        "component": issue.component,
        "evidence": _json_safe(dict(issue.evidence)),
    }


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _global(window: StepTimeWindow, metadata: RunMetadata) -> dict:
    average, median, middle, worst, skew, coverage = {}, {}, {}, {}, {}, {}
    expected = len(window.expected_ranks)
    for key, name in PUBLIC_METRICS:
        m = window.metrics.get(name)
        average[key] = None if m is None else public_number(m.average, _MS_DIGITS)
        median[key] = {
            "value": None if m is None else public_number(m.representative_value, _MS_DIGITS),
            "rank": None if m is None or m.representative_value is None else m.representative_rank,
        }
        middle[key] = None if m is None else public_number(m.median, _MS_DIGITS)
        worst[key] = {
            "value": None if m is None else public_number(m.worst, _MS_DIGITS),
            "rank": None if m is None or m.worst is None else m.worst_rank,
        }
        skew[key] = None if m is None else public_number(m.skew, _RATIO_DIGITS)
        measured, total = window.coverage.get(name, (0, expected))
        coverage[key] = {"measured_ranks": int(measured), "expected_ranks": int(total)}
    return {
        "window": {
            "clock": window.clock,
            "steps": window.step_count,
            "first_step": window.steps[0] if window.steps else None,
            "last_step": window.steps[-1] if window.steps else None,
            "max_steps": metadata.max_steps,
            "expected_ranks": list(window.expected_ranks),
            "rank_count": expected,
            "coverage": coverage,
        },
        "average": average,
        "median": median,
        "cross_rank_median": middle,
        "worst": worst,
        "skew": skew,
    }


def _memory_of(memory: Mapping[int, RankMemory], rank: int) -> dict:
    m = memory.get(rank)
    return {
        "device": None if m is None else m.device,
        "peak_allocated_bytes": None if m is None else m.peak_allocated_bytes,
        "peak_reserved_bytes": None if m is None else m.peak_reserved_bytes,
    }


def _dropped(counts: Mapping[str, int] | None) -> dict:
    counts = counts or {}
    out = {q: int(counts.get(q, 0)) for q in QUEUE_NAMES}
    return out


def _ending(ending: RankEnding | None) -> dict:
    return {"outcome": None if ending is None else ending.outcome,
            "exit_code": None if ending is None else ending.exit_code}


def _groups(window: StepTimeWindow, memory: Mapping[int, RankMemory],
            telemetry: Mapping[int, RankTelemetry], endings: Mapping[int, RankEnding],
            resources: ResourceWindow) -> list[dict]:
    groups = []
    for rank in window.expected_ranks:
        facts = window.rank_facts.get(rank)
        ident = None if facts is None else facts.identity
        tel = telemetry.get(rank)
        groups.append({
            "global_rank": rank,
            "identity": {
                "local_rank": None if ident is None else ident.local_rank,
                "node_rank": None if ident is None else ident.node_rank,
                "world_size": None if ident is None else ident.world_size,
                "local_world_size": None if ident is None else ident.local_world_size,
                "hostname": None if ident is None else ident.hostname,
            },
            "steps": 0 if facts is None else len(facts.steps),
            "metrics": {
                key: None if facts is None else public_number(facts.average.get(name), _MS_DIGITS)
                for key, name in PUBLIC_METRICS
            },
            "memory": _memory_of(memory, rank),
            "resources": rank_resources(resources, rank),
            "telemetry": {
                "finished": None if tel is None else bool(tel.finished),
                "dropped": _dropped(None if tel is None else tel.dropped),
                "ending": _ending(endings.get(rank)),
            },
        })
    return groups


def _peak(memory: Iterable[RankMemory], attr: str) -> dict:
    best: RankMemory | None = None
    for m in memory:
        v = getattr(m, attr)
        if v is not None and (best is None or v > getattr(best, attr)
                              or (v == getattr(best, attr) and m.global_rank < best.global_rank)):
            best = m
    return {"value": None if best is None else getattr(best, attr),
            "rank": None if best is None else best.global_rank}


def _memory_section(window: StepTimeWindow, memory: Mapping[int, RankMemory]) -> dict:
    expected = set(window.expected_ranks)
    relevant = [m for r, m in sorted(memory.items()) if not expected or r in expected]
    allocated = _peak(relevant, "peak_allocated_bytes")
    return {
        "available": allocated["value"] is not None,
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": _peak(relevant, "peak_reserved_bytes"),
    }


def _telemetry_section(window: StepTimeWindow, telemetry: RunTelemetry,
                       endings: Mapping[int, RankEnding]) -> dict:
    by_rank = {t.global_rank: t for t in telemetry.ranks}
    totals = {q: 0 for q in QUEUE_NAMES}
    for t in by_rank.values():
        for q, n in _dropped(t.dropped).items():
            totals[q] += n
    # A gap in the stored steps is explained by queue drops and by the step records
    # each rank's exporter lost to failed exports (both counted by the rank itself; the
    # end marker carries its final counts, so these are known once a rank finished).
    finished = sorted(r for r, t in by_rank.items() if t.finished)
    return {
        "ranks_expected": len(window.expected_ranks),
        "ranks_finished": finished,
        "ranks_reporting_drops": sorted(r for r, t in by_rank.items() if any(_dropped(t.dropped).values())),
        "dropped": totals,
        "rejected_rows": {str(k): int(v) for k, v in sorted(telemetry.rejected_rows.items())},
        "export_failures": {str(r): int(by_rank[r].export_failures) for r in finished
                            if by_rank[r].export_failures is not None},
        "steps_missing": {str(r): max(0, int(by_rank[r].steps_completed) - int(by_rank[r].steps_stored))
                          for r in finished if by_rank[r].steps_completed is not None},
        # Coverage: a run first seen part-way (processor started after the job, or a replica
        # that received the run after a rebalance) says from which step it is covered.
        "first_step_stored": telemetry.first_step_stored,
        "started_part_way": telemetry.started_part_way,
        # How each rank ended: its end marker joined with the launcher's exit codes.
        "rank_endings": {str(r): {**_ending(e), "end_marker": e.end_marker} for r, e in endings.items()},
        "endings": {outcome: sum(1 for e in endings.values() if e.outcome == outcome) for outcome in OUTCOMES},
        # Elastic restarts: the window holds the latest attempt only; each attempt's stored steps.
        "attempt": telemetry.attempt,
        "attempts": [{"attempt": a.attempt, "steps": {str(r): int(n) for r, n in sorted(a.steps.items())}}
                     for a in telemetry.attempts],
        # How input wait was measured where no DataLoader was seen (issue 30): the time before forward.
        "input_wait_before_forward_ranks": sorted(int(r) for r in telemetry.input_before_forward_ranks),
        # Where the steps came from (issue 34): TraceML's own spans, or a foreign mapping with the
        # phases it can never measure and what it could not place.
        "sources": sources_section(window.expected_ranks, telemetry.sources),
    }


def project_final_summary(
    analysis: StepTimeAnalysis,
    metadata: RunMetadata,
    *,
    memory: Sequence[RankMemory] = (),
    telemetry: RunTelemetry = RunTelemetry(),
    captures: Sequence[CaptureRecord] = (),
) -> dict:
    """The public `final_summary.json` object (its `card` included).

    `captures`: the run's `processor.capture.model.CaptureRecord`s, from the capture book; the
    finding that triggered one gets its id in its evidence."""
    window = analysis.window
    mem = {m.global_rank: m for m in memory}
    tel = {t.global_rank: t for t in telemetry.ranks}
    endings = telemetry.rank_endings(window.expected_ranks)
    issues = [project_issue(i) for i in analysis.diagnosis.issues]
    resources = resource_window_of(analysis)
    from traceml.processor.diagnosis.ledger import run_ledger_from  # the ledger's owner extrapolates

    ledger = run_ledger_from(analysis, telemetry)
    capture_section = project_captures(captures)
    link_findings(issues, capture_section)
    summary = {
        "schema_version": SCHEMA_VERSION,
        "metadata": {
            "run_id": metadata.run_id,
            "generated_at": _iso(metadata.generated_at),
            "traceml_version": metadata.traceml_version,
            "profile": metadata.profile,
            "training_strategy": window.training_strategy,
            "world_size": len(window.expected_ranks),
            "clock": window.clock,
        },
        "diagnosis": issues[0],
        "issues": issues,
        "global": _global(window, metadata),
        "groups": _groups(window, mem, tel, endings, resources),
        "memory": _memory_section(window, mem),
        "resources": project_resources(resources),
        "telemetry": _telemetry_section(window, telemetry, endings),
        "badput": project_badput(ledger),
        "captures": capture_section,
        "units": dict(UNITS),
    }
    summary["card"] = render_card(summary)
    return summary


# --- Text card ------------------------------------------------------------------------------


def _fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "unavailable"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _issue_line(issue: Mapping) -> str:
    score = "" if issue["score"] is None else f" score {issue['score']:.3f}"
    rank = "" if issue["culprit_rank"] is None else f" rank {issue['culprit_rank']}"
    return f"{issue['kind']} [{issue['severity']}, {issue['status']}]{score}{rank}"


def render_card(summary: Mapping) -> str:
    """Plain-text card from the projected summary (so the card can never disagree with the JSON)."""
    meta, glob = summary["metadata"], summary["global"]
    win = glob["window"]
    lines = [
        f"TraceML Step Time summary: run {meta['run_id']}",
        f"{meta['training_strategy']} | {win['rank_count']} rank(s) | clock {win['clock'] or 'none'} | "
        + (f"{win['steps']} aligned steps ({win['first_step']}-{win['last_step']})" if win["steps"]
           else "no aligned steps"),
        "",
        f"Diagnosis: {_issue_line(summary['diagnosis'])}",
        f"  {summary['diagnosis']['summary']}",
    ]
    captures = summary.get("captures", [])  # a summary written before 1.9 has none
    lines += _finding_captures(summary["diagnosis"], captures)
    for issue in summary["issues"][1:]:
        lines.append(f"Also: {_issue_line(issue)}")
        lines.append(f"  {issue['summary']}")
        lines += _finding_captures(issue, captures)
    others = unlinked(captures, summary["issues"])
    if others:
        lines.append("Captures:")
        lines += capture_lines(others)
    if any(c["traces"] for c in captures):
        lines.append(f"  ({OPEN_NOTE})")
    before_forward = summary["telemetry"]["input_wait_before_forward_ranks"]
    if before_forward:
        lines.append(f"Note: {before_forward_note(before_forward)}")
    lines += source_lines(summary["telemetry"]["sources"])
    # The median column is the cross-rank median, the statistic the diagnosis sentences
    # quote; `near` is the representative rank (the real rank nearest it).
    lines += ["", f"{'metric (ms)':<24}{'median':>10}{'near':>6}{'worst':>10}{'rank':>6}{'skew':>8}"]
    for key in PUBLIC_METRIC_KEYS:
        med, worst, skew = glob["median"][key], glob["worst"][key], glob["skew"][key]
        middle = glob["cross_rank_median"][key]
        if med["value"] is None and worst["value"] is None:
            continue
        lines.append(
            f"{key[:-3]:<24}{_fmt_ms(middle):>10}{_rank(med['rank']):>6}"
            f"{_fmt_ms(worst['value']):>10}{_rank(worst['rank']):>6}"
            f"{('—' if skew is None else f'{skew:+.0%}'):>8}"
        )
    mem = summary["memory"]
    if mem["available"]:
        alloc, res = mem["peak_allocated_bytes"], mem["peak_reserved_bytes"]
        lines += ["", f"Peak memory: allocated {_fmt_bytes(alloc['value'])} ({_rank(alloc['rank'])}), "
                      f"reserved {_fmt_bytes(res['value'])} ({_rank(res['rank'])})"]
    else:
        lines += ["", "Peak memory: unavailable (no CUDA device reported)"]
    lines += resource_lines(summary["resources"])
    lines += badput_lines(summary["badput"])
    tel = summary["telemetry"]
    dropped = {q: n for q, n in tel["dropped"].items() if n}
    lines.append(
        f"Telemetry: {_endings_text(tel['rank_endings'])}; "
        + ("dropped " + ", ".join(f"{q} {n}" for q, n in dropped.items()) if dropped else "nothing dropped")
        + ("; rejected rows " + ", ".join(f"{k} {v}" for k, v in tel["rejected_rows"].items())
           if tel["rejected_rows"] else "")
    )
    if len(tel["attempts"]) > 1:
        lines.append(f"Attempts: {len(tel['attempts'])} (elastic restarts); figures cover attempt {tel['attempt']} only; "
                     + "; ".join(f"attempt {a['attempt']}: "
                                 + ", ".join(f"r{r} {n}" for r, n in list(a["steps"].items())[:_RANKS_NAMED])
                                 + (", ..." if len(a["steps"]) > _RANKS_NAMED else "") + " step(s)"
                                 for a in tel["attempts"]))
    if tel["started_part_way"]:
        lines.append(f"Coverage: from step {tel['first_step_stored']} only: the processor first saw this run "
                     "part-way (it started after the job, or received the run after a rebalance); "
                     "earlier steps are in no figure here")
    failed = {r: n for r, n in tel["export_failures"].items() if n}
    missing = {r: n for r, n in tel["steps_missing"].items() if n}
    if failed or missing:
        lines.append(
            "Telemetry losses: "
            + ("export failures " + ", ".join(f"r{r} {n} step(s)" for r, n in failed.items())
               if failed else "no export failures")
            + ("; steps missing " + ", ".join(f"r{r} {n}" for r, n in missing.items()) if missing else "")
        )
    # Run id, strategy, issue texts and queue names came from the wire: the card is printed.
    return printable("\n".join(lines) + "\n", keep_newlines=True)


_RANKS_NAMED = RANKS_NAMED


def _finding_captures(issue: Mapping, captures: list) -> list[str]:
    """The capture lines under a finding whose evidence names one."""
    capture_id = issue["evidence"].get(EVIDENCE_KEY) if isinstance(issue["evidence"], Mapping) else None
    return capture_lines(captures, capture_id) if capture_id is not None else []


def _endings_text(rank_endings: Mapping[str, Mapping]) -> str:
    """`2/2 rank(s) finished cleanly`, or per outcome (and exit code) with the ranks named:
    `1/2 rank(s) finished; 1 failed with exit code 3 (r1)`."""
    total = len(rank_endings)
    if total == 0:
        return "no rank reported"
    groups: dict[tuple[str, int | None], list[str]] = {}
    for rank, ending in rank_endings.items():
        code = ending["exit_code"] if ending["outcome"] == OUTCOME_FAILED else None
        groups.setdefault((ending["outcome"], code), []).append(rank)
    finished = len(groups.get((OUTCOME_FINISHED, None), ()))
    if finished == total:
        return f"{total}/{total} rank(s) finished cleanly"
    parts = [f"{finished}/{total} rank(s) finished"]
    order = {o: i for i, o in enumerate(OUTCOMES)}
    for (outcome, code), ranks in sorted(groups.items(), key=lambda g: (order.get(g[0][0], 99), g[0][1] or 0)):
        if outcome == OUTCOME_FINISHED:
            continue
        named = ", ".join(f"r{r}" for r in ranks[:_RANKS_NAMED]) + (", ..." if len(ranks) > _RANKS_NAMED else "")
        what = {OUTCOME_FAILED: "failed" if code is None else f"failed with exit code {code}",
                OUTCOME_INTERRUPTED: "interrupted",
                OUTCOME_LOST: "lost (no end marker, no exit code)"}.get(outcome, str(outcome))
        parts.append(f"{len(ranks)} {what} ({named})")
    return "; ".join(parts)


def _rank(rank: int | None) -> str:
    return "—" if rank is None else f"r{rank}"


# --- Files ----------------------------------------------------------------------------------


def write_summary_files(directory: str | os.PathLike, summary: Mapping) -> tuple[Path, Path]:
    """Write a built summary's `final_summary.json` and `summary_card.txt` atomically (temp file +
    rename): the one writer of the two files (`summary_section.write_final_summary` builds a run's
    summary from its store and hands it here)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, card_path = out / FINAL_SUMMARY_FILE, out / SUMMARY_CARD_FILE
    _atomic_write(json_path, json.dumps(summary, indent=2, sort_keys=False, allow_nan=False) + "\n")
    _atomic_write(card_path, str(summary["card"]))
    return json_path, card_path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
