"""tests/deploy: this folder and tests/processor (shared payload and training helpers) importable."""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent, HERE.parent / "processor"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
