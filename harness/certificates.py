"""Throw-away TLS material for tests that start real TLS servers (made with the `openssl` command)."""
from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A one-day self-signed certificate for localhost / 127.0.0.1 (EC P-256: quick to make): (cert, key)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key
