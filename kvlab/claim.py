"""A claim's truth value, shared by :mod:`kvlab.check` and :mod:`kvlab.facts` (torch-free, imports nothing)."""

from __future__ import annotations


def holds(truth) -> bool:
    """Whether a claim holds: its value must be a real boolean (Python's, numpy's, or a one-element boolean tensor).

    Anything else is refused with ``TypeError``: ``bool(nan)`` is true in Python, and so is ``bool([0])`` or
    ``bool("no")``, so a claim computed as a ratio of empty counts, or a list where a test was meant, would
    otherwise pass as one that holds."""
    if isinstance(truth, bool):
        return truth
    kind = type(truth)
    if kind.__module__ == "numpy" and kind.__name__ == "bool":  # numpy.bool (numpy.bool_), without importing numpy
        return bool(truth)
    if kind.__module__.startswith("torch") and getattr(truth, "dtype", None) is not None and \
            str(truth.dtype) == "torch.bool" and truth.numel() == 1:
        return bool(truth)
    raise TypeError(f"a claim must be true or false, got {kind.__name__} {str(truth)[:40]!r}")
