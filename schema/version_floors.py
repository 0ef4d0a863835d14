"""The lowest supported version of each third-party component, and the check against them.

One owner for the floor numbers: `pyproject.toml` declares the same lower bounds
(tests/test_version_floors.py holds the two equal), `checks/compat.py` builds its
lowest column from them and records in docs/compatibility.md what ran there. Each
floor is the lowest release that column was seen to pass with, not a guess.

The check reads installed distributions' metadata (`importlib.metadata`), never
imports them, so it costs no torch import and runs before anything starts: the
launcher and the processor refuse to start on a component below its floor with a
one-line message (no traceback); a library entry point (`traceml.init()`, an
integration's install) raises `UnsupportedVersion` with the same message. A
component that is not installed is not this module's business. Standard library only.

An integration that needs more of a component than the rest of TraceML has its own
floor for it in `EXTRA_FLOORS`, keyed by the pyproject extra that installs it (which
declares that bound): the integration checks it when it installs, so an old torch
refuses only the integration whose framework needs the newer one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

FLOORS: dict[str, str] = {
    # training side
    "torch": "2.1.0",
    "transformers": "4.46.1",
    "accelerate": "1.1.0",
    "lightning": "2.0.8",
    "pytorch-lightning": "2.0.8",  # the same releases under their own name (both namespaces are patched)
    "psutil": "5.9.0",
    # both sides: the OTLP messages and their transport
    "protobuf": "4.25.0",
    "grpcio": "1.63.2",
    "opentelemetry-proto": "1.27.0",
    "googleapis-common-protos": "1.56.1",
    "requests": "2.28.0",
    # processor side
    "numpy": "1.24.0",
    "opentelemetry-sdk": "1.27.0",
    "opentelemetry-exporter-otlp-proto-grpc": "1.27.0",
    "opentelemetry-exporter-otlp-proto-http": "1.27.0",
    "prometheus-client": "0.17.0",
    "h11": "0.14.0",
    "rich": "13.0.0",
}
"""Distribution name (as pyproject.toml spells it) -> lowest supported release."""

EXTRA_FLOORS: dict[str, dict[str, str]] = {
    # Accelerate (from 1.1) calls torch.cpu.set_device when a CPU job spans processes;
    # torch 2.2.0 added it (2.1.0 lacks it, so the 2-rank Trainer fails even under plain torchrun).
    "huggingface": {"torch": "2.2.0"},
}
"""pyproject extra -> the floors its integration needs above `FLOORS` (each at least the plain floor)."""

TRAINING = ("torch", "transformers", "accelerate", "lightning", "pytorch-lightning", "psutil",
            "protobuf", "grpcio", "opentelemetry-proto", "googleapis-common-protos", "requests", "rich")
"""What a rank and `traceml run` load (the exporter's transport included)."""

PROCESSOR = ("numpy", "protobuf", "grpcio", "opentelemetry-proto", "googleapis-common-protos",
             "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
             "opentelemetry-exporter-otlp-proto-http", "prometheus-client", "h11", "rich")
"""What `traceml-processor` (and the launcher's embedded one) loads."""


@dataclass(frozen=True)
class TooOld:
    """One installed component below its floor."""

    package: str
    found: str
    floor: str
    extra: str = ""
    """The integration (pyproject extra) whose own floor this is; '' for TraceML's plain floor."""

    def message(self) -> str:
        who = f"TraceML's {self.extra} integration" if self.extra else "TraceML"
        return (f"{who} needs {self.package} >= {self.floor}, but {self.package} {self.found} "
                f"is installed: upgrade it (pip install '{self.package}>={self.floor}')")


class UnsupportedVersion(ImportError):
    """Raised by a library entry point when a component it uses is below its floor."""


def release(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: '2.13.0+cpu' -> (2, 13, 0), '4.47.0rc1' -> (4, 47, 0).

    Pre-releases, dev and local builds of a release count as that release: a nightly or a
    source build of the floor's release is let through rather than refused on a suffix.
    """
    parts = []
    for piece in text.strip().lstrip("vV").split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def _at_least(found: str, floor: str) -> bool:
    have, need = release(found), release(floor)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def installed_version(package: str) -> str | None:
    """The installed distribution's version, None when it is not installed (never raises)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata: nothing to hold against the component
        return None


def floors(extra: str = "") -> dict[str, str]:
    """Every floor as `extra`'s integration sees it (its own floors over the plain ones); '' -> `FLOORS`."""
    return {**FLOORS, **EXTRA_FLOORS[extra]} if extra else dict(FLOORS)


def too_old(packages=None, extra: str = "") -> list[TooOld]:
    """The installed components among `packages` (default: every floor) below their floor (`extra`'s, if given)."""
    wanted = floors(extra)
    found = []
    for package in (wanted if packages is None else packages):
        version = installed_version(package)
        if version is not None and not _at_least(version, wanted[package]):
            own = extra if wanted[package] != FLOORS[package] else ""
            found.append(TooOld(package, version, wanted[package], own))
    return found


def require(packages=None, extra: str = "") -> None:
    """Raise `UnsupportedVersion` naming every installed component of `packages` below its floor."""
    below = too_old(packages, extra)
    if below:
        raise UnsupportedVersion("; ".join(item.message() for item in below))


def refusal(program: str, packages=None) -> str | None:
    """What a command prints (to stderr, then exit 2) before starting; None when all are new enough."""
    below = too_old(packages)
    return "\n".join(f"{program}: {item.message()}" for item in below) if below else None


__all__ = ["EXTRA_FLOORS", "FLOORS", "PROCESSOR", "TRAINING", "TooOld", "UnsupportedVersion", "installed_version",
           "floors", "refusal", "release", "require", "too_old"]
