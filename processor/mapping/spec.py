"""What a span mapping declares (`SpanMapping`), and the declared-mapping file read into one.

A span mapping names, for one emitter's spans: which span is a step and which attribute
holds its number; which spans are which phase (input wait, H2D, forward, backward,
optimizer, collective wait), or which attributes of the step span hold a phase's
duration; which spans only hold phases (containers, e.g. a forward-backward span around
the microbatches); and where rank, world size and run id come from beyond TraceML's own
keys and the `dl.*`/`nemo.run.id` aliases the resource decoder reads. Names are
`fnmatch` globs (`megatron.p2p.*`), matched case-sensitively.

The built-in mappings (`builtin`) are instances of it; so is a team's declared file,
read here (TOML, `--mapping-file`), every mistake refused at start-up with the file,
the table, the key and what is accepted (`MappingFileError`). The assembler
(`spans`) is the only reader of a `SpanMapping`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import translate
from pathlib import Path
from typing import Mapping

from traceml.schema.vocabulary import CANONICAL_METRICS, METRIC_TRACED_STEP_TIME

PHASES: tuple[str, ...] = tuple(m for m in CANONICAL_METRICS if m != METRIC_TRACED_STEP_TIME)
"""The phases a mapping may place (the traced step is the step span itself)."""

UNITS: Mapping[str, float] = {"s": 1000.0, "ms": 1.0}
"""Milliseconds per unit of a phase attribute."""

DECLARED_PREFIX = "declared:"
"""A declared mapping is shown as `declared:<its name>`, never as a built-in's name."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class MappingFileError(ValueError):
    """A declared mapping file that cannot be used; the message says where and why."""


class Globs:
    """A set of `fnmatch` patterns, compiled once; `match(name)` is memoised per name."""

    __slots__ = ("patterns", "_regex", "_seen")

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = tuple(patterns)
        self._regex = re.compile("|".join(f"(?:{translate(p)})" for p in self.patterns)) if self.patterns else None
        self._seen: dict[str, bool] = {}

    def match(self, name: str) -> bool:
        hit = self._seen.get(name)
        if hit is None:
            hit = bool(self._regex and self._regex.match(name))
            if len(self._seen) < 4096:
                self._seen[name] = hit
        return hit

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __repr__(self) -> str:
        return f"Globs({self.patterns!r})"


@dataclass(frozen=True)
class AttributePhase:
    """A phase's duration carried as an attribute of the step span."""

    key: str
    unit: str = "s"


@dataclass(frozen=True)
class SpanMapping:
    """One emitter's step spans, declared (see the module docstring).

    `unmeasured` is derived: the phases neither a span nor an attribute of this mapping
    can give, said on every surface as "not measured by <name>".
    """

    name: str
    step_spans: tuple[str, ...]
    step_number: tuple[str, ...]
    phase_spans: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    phase_attributes: Mapping[str, AttributePhase] = field(default_factory=dict)
    containers: tuple[str, ...] = ()
    run_id: tuple[str, ...] = ()
    rank: tuple[str, ...] = ()
    world_size: tuple[str, ...] = ()
    step_needs_number: bool = False
    """True: a span named like a step but without a step-number attribute is no step (a
    mapping whose step is recognised by its attribute, as nemo-lens's `dl.iteration`)."""
    not_measured_flag: str | None = None
    """A boolean attribute that, when true, says the span's end is not when its work ended
    (nemo-lens's `nemo.span.truncated`): such a span is counted unplaced, never timed."""
    source: str = ""
    """Where the mapping was derived from (file and version), for docs and errors."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_step", Globs(self.step_spans))
        object.__setattr__(self, "_containers", Globs(self.containers))
        object.__setattr__(self, "_phases", tuple((phase, Globs(globs)) for phase, globs in self.phase_spans.items()))
        object.__setattr__(self, "_phase_of", {})

    @property
    def unmeasured(self) -> tuple[str, ...]:
        return tuple(p for p in PHASES if p not in self.phase_spans and p not in self.phase_attributes)

    def is_step(self, name: str) -> bool:
        return self._step.match(name)  # type: ignore[attr-defined]

    def is_container(self, name: str) -> bool:
        return self._containers.match(name)  # type: ignore[attr-defined]

    def phase_of(self, name: str) -> str | None:
        """The phase a span of this name is (the first phase whose globs match), else None."""
        cache = self._phase_of  # type: ignore[attr-defined]
        try:
            return cache[name]
        except KeyError:
            pass
        phase = next((p for p, globs in self._phases if globs.match(name)), None)  # type: ignore[attr-defined]
        if len(cache) < 4096:
            cache[name] = phase
        return phase


# --- the declared file -----------------------------------------------------------------------

_TOP_KEYS = {"name", "containers", "step", "phases", "phase_attributes", "identity"}
_STEP_KEYS = {"span", "number"}
_IDENTITY_KEYS = {"run_id", "rank", "world_size"}


def _names(value, where: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings -> a tuple; anything else refused."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise MappingFileError(f"{where}: expected a span or attribute name, or a list of them, got {value!r}")
    return tuple(v.strip() for v in value)


def _table(doc: Mapping, key: str, where: str, allowed: set[str] | None) -> Mapping:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise MappingFileError(f"{where}: [{key}] must be a table, got {value!r}")
    if allowed is not None:
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise MappingFileError(f"{where}: [{key}] has unknown key(s) {', '.join(unknown)} "
                                   f"(accepted: {', '.join(sorted(allowed))})")
    return value


def mapping_from_document(doc: Mapping, where: str) -> SpanMapping:
    """A parsed mapping document -> its `SpanMapping`; `MappingFileError` naming the mistake."""
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise MappingFileError(f"{where}: unknown key(s) {', '.join(unknown)} "
                               f"(accepted: {', '.join(sorted(_TOP_KEYS))})")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise MappingFileError(f"{where}: name must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    step = _table(doc, "step", where, _STEP_KEYS)
    for key in ("span", "number"):
        if key not in step:
            raise MappingFileError(f"{where}: [step] needs {key} (the step span's name / the attribute "
                                   "holding the step number)")
    phases = {}
    for phase, globs in _table(doc, "phases", where, None).items():
        if phase not in PHASES:
            raise MappingFileError(f"{where}: [phases] {phase!r} is not a phase (accepted: {', '.join(PHASES)})")
        phases[phase] = _names(globs, f"{where}: [phases] {phase}")
    attributes = {}
    for phase, spec in _table(doc, "phase_attributes", where, None).items():
        if phase not in PHASES:
            raise MappingFileError(f"{where}: [phase_attributes] {phase!r} is not a phase "
                                   f"(accepted: {', '.join(PHASES)})")
        if phase in phases:
            raise MappingFileError(f"{where}: {phase} is named both in [phases] and [phase_attributes]: "
                                   "one source per phase")
        if isinstance(spec, str):
            spec = {"key": spec}
        if not isinstance(spec, dict) or set(spec) - {"key", "unit"} or not isinstance(spec.get("key"), str):
            raise MappingFileError(f"{where}: [phase_attributes] {phase} must be an attribute name or "
                                   f"{{ key = \"...\", unit = \"s\" | \"ms\" }}, got {spec!r}")
        unit = spec.get("unit", "s")
        if unit not in UNITS:
            raise MappingFileError(f"{where}: [phase_attributes] {phase} unit {unit!r} (accepted: s, ms)")
        attributes[phase] = AttributePhase(spec["key"], unit)
    if not phases and not attributes:
        raise MappingFileError(f"{where}: names no phase: give at least one in [phases] or [phase_attributes]")
    identity = _table(doc, "identity", where, _IDENTITY_KEYS)
    containers = _names(doc["containers"], f"{where}: containers") if "containers" in doc else ()
    return SpanMapping(
        name=DECLARED_PREFIX + name,
        step_spans=_names(step["span"], f"{where}: [step] span"),
        step_number=_names(step["number"], f"{where}: [step] number"),
        phase_spans=phases, phase_attributes=attributes, containers=containers,
        run_id=_names(identity["run_id"], f"{where}: [identity] run_id") if "run_id" in identity else (),
        rank=_names(identity["rank"], f"{where}: [identity] rank") if "rank" in identity else (),
        world_size=(_names(identity["world_size"], f"{where}: [identity] world_size")
                    if "world_size" in identity else ()),
        source=where)


def load_mapping_file(path: Path) -> SpanMapping:
    """Read and check a declared mapping file (TOML). Raises `MappingFileError`."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise MappingFileError(f"mapping file {path}: reading TOML needs Python 3.11 or the tomli "
                                   "package") from None
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise MappingFileError(f"mapping file {path}: cannot be read: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise MappingFileError(f"mapping file {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise MappingFileError(f"mapping file {path}: not valid TOML: {exc}") from None
    return mapping_from_document(doc, f"mapping file {path}")
