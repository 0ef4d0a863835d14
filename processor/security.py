"""Who may send, over what, and what a run id may become on disk.

Loopback is the default bind everywhere; anything wider should come with a bearer
token and TLS. Run ids arrive from the network, so they are sanitised before they
name a folder: a run id can never walk out of the summary directory.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from traceml.schema.hosts import is_loopback

LOG = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_DIR_NAME = 96
HASH_MARK = "~"
"""Separates a changed id's cleaned prefix from its hash. Never kept by cleaning (it is
outside `[A-Za-z0-9._-]`), so a name holding it is always a hashed one."""
_HASH_HEX = 16  # 64 bits of SHA-256: finding a second id for a given name costs ~2^64 hashes


def sanitize_run_id(run_id: str) -> str:
    """A run id -> a safe, stable folder name (no separators, no leading dots, bounded).

    Injective, so two different ids never share a folder: an id that is already
    safe and short is its own name (ordinary ids stay readable and keep their
    folder); any other id becomes `<cleaned prefix>~<16 hex of SHA-256(id)>`.
    Kept names never hold `~` and hashed names always do, so a kept name can never
    equal a hashed one, whatever the id looks like (before, the id `a_b-<hash>` took
    the folder of `a b`); two hashed names meet only on a 64-bit hash collision.
    """
    cleaned = _UNSAFE.sub("_", run_id).strip("._-") or "run"
    if cleaned == run_id and len(cleaned) <= MAX_DIR_NAME:
        return cleaned
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_HEX]
    return f"{cleaned[:MAX_DIR_NAME - _HASH_HEX - 1]}{HASH_MARK}{digest}"


def summary_folder(summary_dir: Path, run_id: str) -> Path:
    """The folder for one run's summary, guaranteed to sit directly under `summary_dir`."""
    root = Path(summary_dir).resolve()
    folder = (root / sanitize_run_id(run_id)).resolve()
    if folder.parent != root:
        raise ValueError(f"run id {run_id!r} does not map inside {root}")
    return folder


class TokenFileError(ValueError):
    """The bearer-token file cannot be used: the processor must not start (exit 1)."""


def read_token_file(path: str | Path) -> str:
    """The bearer token held by `path`, stripped. Raises TokenFileError.

    An empty file (or one of whitespace only) is refused rather than read as "no
    token": the operator asked for authentication, and starting without it would
    open both receivers to anyone who can reach them.
    """
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read --auth-token-file {path}: {exc}") from None
    if not token:
        raise TokenFileError(f"--auth-token-file {path} is empty: put the bearer token in it "
                             f"(an empty token would turn authentication off)")
    return token


@dataclass(frozen=True)
class BearerAuth:
    """Optional shared-secret check: `Authorization: Bearer <token>` on every request."""

    token: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def allows(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.strip().encode(), self.token.encode())


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate and key (PEM files) shared by both receivers."""

    cert_file: str | None = None
    key_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS needs both a certificate and a key file")
        for name in (self.cert_file, self.key_file):
            if name and not Path(name).is_file():
                raise ValueError(f"TLS file not found: {name}")

    def pem_pair(self) -> tuple[bytes, bytes]:
        return Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def parse_host_port(value: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """`HOST:PORT`, `:PORT`, `[::1]:PORT` -> (host, port). Raises ValueError."""
    text = value.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"bad port in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


def warn_if_exposed(what: str, host: str, auth: BearerAuth, tls: TlsConfig) -> None:
    if not is_loopback(host) and not (auth.enabled and tls.enabled):
        LOG.warning("%s listens on %s without %s: anyone who can reach it can send or read data",
                    what, host, " and ".join(n for n, on in (("a bearer token", auth.enabled),
                                                            ("TLS", tls.enabled)) if not on))
