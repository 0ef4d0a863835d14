"""How a figure is written into the public summary and the views built from it."""
from __future__ import annotations

import math


def public_number(value: object, digits: int) -> float | None:
    """Rounded to `digits`; None stays null, -0.0 becomes 0.0, a non-finite value becomes null
    (JSON has no NaN, and a figure that could not be computed is not a number)."""
    if value is None:
        return None
    f = float(value)  # type: ignore[arg-type]
    return round(f, digits) + 0.0 if math.isfinite(f) else None


__all__ = ["public_number"]
