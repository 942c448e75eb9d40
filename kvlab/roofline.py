"""Why decode attention is memory-bound, and what a smaller KV format should buy.

Generating one token makes every layer read its whole cache once: each cached
key is dotted with the new query (2 FLOPs per element) and each cached value is
weighted and summed (2 FLOPs per element), for every query head sharing the KV
head. So per byte of cache read, attention does about::

    FLOPs / byte = 2 x (query heads per KV head) / (bytes per element)

— a handful, against the hundreds a modern GPU can do per byte it reads (its
"ridge point", peak FLOP/s divided by peak bytes/s). Decode attention is
therefore bandwidth-bound, its time is about ``bytes read / bandwidth``, and a
format with half the bytes should take about half the time — *if* the kernel
reads that format directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import budget as B
from .formats import get_format

# The efficiency assumptions of the workbook's time and cost models (chapters 5 and 6): real kernels
# reach a fraction of peak. Decode reads bytes at MBU x peak bandwidth, prefill computes at MFU x peak FLOPs.
# Rules of thumb, not measured here: tuned CUDA engines (vLLM, TensorRT-LLM) are commonly described as
# reaching 60-85% of peak bandwidth in decode (open-source-ai.tech glossary, "model bandwidth utilization").
# Ratios between KV formats do not depend on them; absolute tokens/s and dollars scale with them.
MBU = 0.7
MFU = 0.5


def memory_seconds(nbytes: float, bandwidth: float, mbu: float = MBU) -> float:
    """Time to read ``nbytes`` at ``mbu`` x peak ``bandwidth`` (bytes/s). The one memory-time formula."""
    return nbytes / (bandwidth * mbu)


def compute_seconds(flops: float, peak_flops: float | None, mfu: float = MFU) -> float:
    """Time to do ``flops`` at ``mfu`` x peak FLOP/s (0 where the GPU lists no peak). The one compute-time formula."""
    return flops / (peak_flops * mfu) if peak_flops else 0.0


def step_seconds(nbytes: float, flops: float, bandwidth: float, peak_flops: float | None, *,
                 mbu: float = MBU, mfu: float = MFU) -> tuple[float, str]:
    """A roofline step that overlaps its reads and its math: ``(seconds, "memory" or "compute")``, whichever
    bound is slower."""
    t_mem, t_cmp = memory_seconds(nbytes, bandwidth, mbu), compute_seconds(flops, peak_flops, mfu)
    return max(t_mem, t_cmp), "memory" if t_mem >= t_cmp else "compute"


@dataclass(frozen=True)
class DecodeStep:
    model: str
    kv_format: str
    batch: int
    context: int
    cache_bytes_per_layer: float  # read once per generated token
    flops_per_layer: float
    intensity: float  # FLOPs per byte of cache read
    ridge: float | None  # the GPU's FLOPs per byte at which it stops being bandwidth-bound
    seconds_per_layer: float | None  # bytes / bandwidth: the memory-bound time


def decode_step(model, batch: int, context: int, kv_format="bf16", gpu: str | None = "H200") -> DecodeStep:
    """Bytes, FLOPs and bandwidth-bound time of one decode step's attention, per layer."""
    shape = B.load_shape(model)
    layer = shape.layers[0]
    if shape.attention == "mla":
        raise ValueError("decode_step models per-head K/V attention; MLA reads a shared latent instead")
    b = B.budget(model, batch, context, kv_format)
    per_layer = b.cache_bytes / shape.num_layers
    q_heads = shape.q_heads
    flops = batch * context * layer.head_dim * 4 * q_heads  # 2 for q.k, 2 for p.v, per query head
    g = B.get_gpu(gpu) if gpu else None
    ridge = g.peak_bf16_flops / g.bandwidth_bytes_per_s if g else None
    secs = memory_seconds(per_layer, g.bandwidth_bytes_per_s, mbu=1.0) if g else None  # at peak: the roofline
    return DecodeStep(shape.name, get_format(kv_format).name, batch, context, per_layer, flops,
                      flops / per_layer, ridge, secs)


def predicted_speedup(model, context: int, kv_format: str, baseline: str = "bf16", batch: int = 1) -> float:
    """Bandwidth-bound prediction: baseline bytes / format bytes for the same attention."""
    return B.budget(model, batch, context, baseline).cache_bytes / B.budget(model, batch, context, kv_format).cache_bytes


def latest_gpu_run(results_dir=None) -> dict | None:
    """The newest ``benchmarks/decode_attention.py`` result in ``data/results/`` (None when no GPU has run it)."""
    import json
    from pathlib import Path

    from .paths import RESULTS_DIR

    runs = sorted(Path(results_dir or RESULTS_DIR).glob("decode_attention_*.json"))
    return json.loads(runs[-1].read_text()) if runs else None


def measured_bandwidth_figure(doc: dict):
    """Triton's perf_report, for a recorded run: achieved GB/s by context (top) against the GPU's peak (dashed), and
    the speed-up over BF16 SDPA (bottom), one line a format, one column a batch size."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = doc["rows"]
    if not rows:
        raise ValueError("the run has no rows: nothing was measured")
    batches = sorted({r["batch"] for r in rows})
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig = make_subplots(rows=2, cols=len(batches), shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[f"batch {b}" for b in batches])
    for j, b in enumerate(batches, start=1):
        for i, f in enumerate(formats):
            pts = sorted((r["context"], r) for r in rows if r["batch"] == b and r["format"] == f)
            xs = [c for c, _ in pts]
            for row, key in ((1, "bandwidth_gbs"), (2, "speedup_vs_bf16")):
                fig.add_trace(go.Scatter(x=xs, y=[r[key] for _, r in pts], name=f, legendgroup=f, mode="lines+markers",
                                         showlegend=(j == 1 and row == 1),
                                         line=dict(color=f"hsl({360 * i // len(formats)}, 60%, 45%)")), row=row, col=j)
        if doc.get("peak_bandwidth_bytes_per_s"):
            fig.add_hline(y=doc["peak_bandwidth_bytes_per_s"] / 1e9, line_dash="dash", line_color="gray", row=1, col=j,
                          **({"annotation_text": "peak bandwidth"} if j == 1 else {}))
        fig.add_hline(y=1, line_dash="dot", line_color="gray", row=2, col=j)
        contexts = sorted({r["context"] for r in rows})
        fig.update_xaxes(type="log", tickvals=contexts, ticktext=[f"{c // 1024}k" for c in contexts], row=1, col=j)
        fig.update_xaxes(type="log", tickvals=contexts, ticktext=[f"{c // 1024}k" for c in contexts],
                         title_text="context (tokens)", row=2, col=j)
    fig.update_yaxes(title_text="achieved GB/s", row=1, col=1)
    fig.update_yaxes(title_text="speed-up over BF16 SDPA", row=2, col=1)
    fig.update_layout(height=560, title=f"Decode attention on {doc['gpu']} ({doc['date'][:10]})")
    return fig


def measured_speedup_figure(doc: dict, context: int = 32768):
    """Bars of measured speedup over BF16 SDPA per format, one series per batch size, at ``context``."""
    import plotly.graph_objects as go

    rows = [r for r in doc["rows"] if r["context"] == context]
    if not rows:
        raise ValueError(f"the run has no rows at context {context}; it measured {sorted({r['context'] for r in doc['rows']})}")
    fig = go.Figure([go.Bar(name=f"batch {b}", x=[r["format"] for r in rows if r["batch"] == b],
                            y=[r["speedup_vs_bf16"] for r in rows if r["batch"] == b])
                     for b in sorted({r["batch"] for r in rows})])
    fig.update_layout(height=340, title=f"Measured speedup over BF16 SDPA at {context:,} tokens: {doc['gpu']}",
                      xaxis_title="KV format", yaxis_title="speedup over BF16 (x)")
    return fig
