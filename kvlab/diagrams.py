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


def cache_contents(formats, context: int = 4096, head_dim: int = 128) -> dict[str, dict[str, float]]:
    """KiB that one head's K and V hold for a ``context``-token sequence, split into what a cache stores: the
    quantized codes, their scales, their zero points, and the tokens kept in full precision (16-bit: attention
    sinks, a residual window, a token group still filling). From :class:`kvlab.layout.Layout`, which sizes every
    store, and :func:`kvlab.budget.full_precision_tokens`, the one rule for the full-precision tokens."""
    from .budget import full_precision_tokens
    from .layout import Layout

    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= 1 << 24:
        raise ValueError(f"context must be a whole number of tokens from 1 to 2**24, got {context!r}")
    out = {}
    for name in formats:
        f = get_format(name)
        full = full_precision_tokens(f, context)
        part = {"codes": 0.0, "scales": 0.0, "zero points": 0.0, "full-precision tokens": full * head_dim * 2 * 2}
        for q in (f.key, f.value):
            lay = Layout(q, head_dim)
            quantized = context - full
            part["codes"] += quantized * lay.code_bytes
            rows = quantized // lay.token_group if lay.grows else 1  # frozen statistics: one row, whatever the length
            n = rows * lay.n_groups if lay.grows else (head_dim if q.granularity == "channel" else 1) * (not q.is_passthrough)
            part["scales"] += n * q.scale_bits / 8 * (not q.is_passthrough)
            part["zero points"] += n * q.zero_bits / 8
        out[f.name] = {k: v / 1024 for k, v in part.items()}
    return out


def cache_contents_figure(formats, context: int = 4096, head_dim: int = 128):
    """A stacked bar a format: the KiB of codes, scales, zero points and full-precision tokens one head holds."""
    import plotly.graph_objects as go

    parts = cache_contents(formats, context, head_dim)
    names = list(parts)
    colours = {"codes": "#3182bd", "scales": "#e6550d", "zero points": "#fdae6b", "full-precision tokens": "#bdbdbd"}
    fig = go.Figure([go.Bar(name=k, y=names, x=[parts[f][k] for f in names], orientation="h", marker_color=c)
                     for k, c in colours.items()])
    fig.update_layout(barmode="stack", height=90 + 34 * len(names), yaxis=dict(autorange="reversed"),
                      xaxis_title=f"KiB for one head's K and V ({context:,} tokens, head_dim {head_dim})",
                      title="What a cache stores: codes, the scales (and zero points) to read them, and tokens kept whole",
                      legend=dict(orientation="h", y=-0.35), margin=dict(l=130, r=20, t=50, b=80))
    return fig


def split_kv(context: int = 4096, q_heads: int = 32, kv_heads: int = 8, block_n: int = 32):
    """The split-KV decode kernel's work for one sequence, as :func:`kvlab.kernels.reference.split_plan` cuts it: one
    row a KV head (serving its group of query heads), one cell a tile of ``block_n`` tokens, one colour band a split
    (one program each); a second kernel merges the splits' partial outputs by their log-sum-exp."""
    import plotly.graph_objects as go

    from .kernels.reference import split_plan

    if isinstance(q_heads, bool) or not isinstance(q_heads, int) or q_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"q_heads must be a positive multiple of kv_heads ({kv_heads}), got {q_heads!r}")
    splits, per_split = split_plan(context, 1, kv_heads, block_n)
    tiles = -(-context // block_n)
    z = [[(t * block_n // per_split) % 2 for t in range(tiles)] for _ in range(kv_heads)]
    g = q_heads // kv_heads
    fig = go.Figure(go.Heatmap(z=z, colorscale=[[0, "#9ecae1"], [1, "#3182bd"]], showscale=False, xgap=1, ygap=3,
                               y=[f"KV head {h} (queries {h * g}-{h * g + g - 1})" for h in range(kv_heads)],
                               hovertemplate="tile %{x}<extra></extra>"))
    for s in range(splits):
        fig.add_annotation(x=(s * per_split + per_split / 2) / block_n - 0.5, y=1.0, yref="paper", yanchor="bottom",
                           showarrow=False, text=f"split {s}", font=dict(size=10))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text=f"tiles of {block_n} tokens ({context:,} tokens in all)", showticklabels=False)
    fig.update_layout(height=120 + 28 * kv_heads, margin=dict(l=170, r=20, t=80, b=50),
                      title=f"Split-KV decode: {kv_heads * splits} programs (KV head x split), each loops over "
                            f"{per_split // block_n} tiles; a merge kernel combines the {splits} splits of each head")
    return fig
