"""Markdown tables from rows of values: the one way a chapter's numbers become a table.

    >>> print(markdown(["format", "bits"], [["`int8`", 8.25], ["`fp8_e4m3`", 8]], align="lr"))
    | format | bits |
    |:---|---:|
    | `int8` | 8.25 |
    | `fp8_e4m3` | 8 |
"""

from __future__ import annotations

_ALIGN = {"l": ":---", "r": "---:", "c": ":---:"}


def cell(value) -> str:
    """One cell's text: ``|`` escaped and line breaks folded, so a value cannot break the table."""
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def markdown(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A GitHub-flavoured Markdown table; ``align`` has one of ``l``, ``r``, ``c`` per column (default all ``l``)."""
    if not header:
        raise ValueError("header must name at least one column")
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - set(_ALIGN):
        raise ValueError(f"align must be one of l, r, c per column ({len(header)} columns), got {align!r}")
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells for {len(header)} columns: {row!r}")
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join(_ALIGN[a] for a in align) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
