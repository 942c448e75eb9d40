"""A claim's truth value, shared by :mod:`kvlab.check` and :mod:`kvlab.facts` (torch-free, imports nothing)."""

from __future__ import annotations

import math


def holds(truth) -> bool:
    """``bool(truth)``, except that a NaN or infinite number never holds: ``bool(nan)`` is true in Python, so a
    claim computed as a ratio of empty counts would otherwise pass as one that holds."""
    if isinstance(truth, float) and not math.isfinite(truth):
        return False
    return bool(truth)
