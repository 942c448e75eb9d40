"""Schematic diagrams drawn from the library's own definitions, so a picture cannot drift from the code.

:func:`scale_tile` shows which values of one head's K (or V) tile share a scale under each format: a tile of
``tokens`` x ``head_dim`` cells, one colour patch per scale (a checkerboard, so that neighbouring patches
differ), and grey for the tokens the format keeps in full precision (attention sinks at the start of the
context, a residual window at its end). The grouping is read from :class:`kvlab.formats.Quantizer`, the
same description :mod:`kvlab.quant` quantizes with.
"""

from __future__ import annotations

from .formats import Quantizer, get_format

FULL = 2  # the colour index of a full-precision token


def scale_ids(q: Quantizer, tokens: int, channels: int) -> list[list[tuple[int, int]]]:
    """``ids[t][c]``: the (token block, channel block) of the scale that covers value ``c`` of token ``t``."""
    for name, n in (("tokens", tokens), ("channels", channels)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive whole number, got {n!r}")
    g = q.group_size
    block = {"tensor": lambda t, c: (0, 0), "head": lambda t, c: (0, 0), "token": lambda t, c: (t, 0),
             "channel": lambda t, c: (0, c),
             "group": (lambda t, c: (t, c // g)) if q.group_axis == "channel" else (lambda t, c: (t // g, c))}
    return [[block[q.granularity](t, c) for c in range(channels)] for t in range(tokens)]


def tile_colours(fmt: str, tokens: int = 64, head_dim: int = 64, context: int = 4096, which: str = "key") -> list[list[int]]:
    """0/1 by the checkerboard of scales, :data:`FULL` for a full-precision token, for the first ``tokens`` of a
    ``context``-token sequence."""
    f = get_format(fmt)
    if which not in ("key", "value"):
        raise ValueError(f"which must be 'key' or 'value', got {which!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < tokens:
        raise ValueError(f"context must be a whole number of at least tokens ({tokens}), got {context!r}")
    ids = scale_ids(getattr(f, which), tokens, head_dim)
    full = [t < f.sinks or t >= context - f.residual for t in range(tokens)]
    return [[FULL if full[t] else sum(ids[t][c]) % 2 for c in range(head_dim)] for t in range(tokens)]


def scale_tile(formats, tokens: int = 64, head_dim: int = 64, context: int = 4096, which: str = "key", cols: int = 4):
    """A plotly figure: one panel per format, the first ``tokens`` tokens (rows) of one head's ``which``."""
    from plotly.subplots import make_subplots

    formats = list(formats)
    if not formats:
        raise ValueError("formats must name at least one format")
    rows = -(-len(formats) // cols)
    fig = make_subplots(rows=rows, cols=min(cols, len(formats)), subplot_titles=[f"{f}" for f in formats],
                        horizontal_spacing=0.03, vertical_spacing=0.12)
    scale = [[0, "#9ecae1"], [0.5, "#3182bd"], [1, "#bdbdbd"]]
    for i, f in enumerate(formats):
        z = tile_colours(f, tokens, head_dim, context, which)
        fig.add_heatmap(z=z, zmin=0, zmax=FULL, colorscale=scale, showscale=False, xgap=0, ygap=0,
                        hovertemplate="token %{y}, channel %{x}<extra></extra>", row=i // cols + 1, col=i % cols + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False, title_text="token", title_standoff=2)
    fig.update_xaxes(showticklabels=False, title_text="channel (head_dim)", title_standoff=2)
    fig.update_layout(height=270 * rows, margin=dict(l=40, r=20, t=60, b=45),
                      title=f"Which {which} values share a scale: the first {tokens} tokens (rows) x {head_dim} channels "
                            f"of one head; grey = kept in full precision")
    return fig
