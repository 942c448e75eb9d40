"""Chapter 3's GPU section: what a recorded ``benchmarks/decode_attention.py`` run measured, beside the prediction.

:func:`gpu_measured` takes a run (:func:`kvlab.roofline.latest_gpu_run`, or None where no GPU has run it) and
returns the values and claims of the sections ``live-gpu-measured`` (from a recorded run) and ``gpu-none`` of
``notebooks/prose/03_triton_attention.md``; :func:`kvlab.roofline.measured_bandwidth_figure` draws the run.
"""

from __future__ import annotations

from ..facts import Facts
from ..roofline import predicted_speedup
from ..tables import markdown

SHAPE_MODEL = "llama-3.1-8b"  # the benchmark's layer: Llama-3.1-8B's 32 query heads, 8 KV heads, head_dim 128


def gpu_measured(doc: dict | None) -> Facts:
    """Measured speed-up over BF16 SDPA against the bytes-ratio prediction, per format, at batch 1 and the longest
    context the run measured; the best fraction of peak bandwidth any point reached."""
    if not doc or not doc.get("rows"):
        return Facts({"measured": False}, {})
    rows = doc["rows"]
    batch = min(r["batch"] for r in rows)
    context = max(r["context"] for r in rows if r["batch"] == batch)
    at = [r for r in rows if r["batch"] == batch and r["context"] == context]
    table = markdown(["format", "measured speed-up over BF16 SDPA", "predicted (bytes ratio)", "GB/s", "of peak"],
                     [[f"`{r['format']}`", f"{r['speedup_vs_bf16']:.2f}x",
                       f"{predicted_speedup(SHAPE_MODEL, context, r['format']):.2f}x", f"{r['bandwidth_gbs']:,.0f}",
                       "—" if r.get("fraction_of_peak") is None else f"{r['fraction_of_peak']:.0%}"] for r in at],
                     align="lrrrr")
    fractions = [r["fraction_of_peak"] for r in rows if r.get("fraction_of_peak") is not None]
    values = {"measured": True, "gpu": doc["gpu"], "date": doc["date"][:10], "driver": doc.get("driver", "unknown"),
              "torch": doc.get("torch", "?"), "triton": doc.get("triton", "?"), "batch": batch, "context": context,
              "table": table, "best_fraction": max(fractions) if fractions else None,
              "not_measured": len(doc.get("not_measured", [])), "synthetic": bool(doc.get("synthetic"))}
    claims = {"every row of the table was measured at the stated batch and context": (bool(at), len(at))}
    return Facts(values, claims)


def answer(F, run: dict | None = None) -> Facts:
    """The answer: attention is bound by bytes, what the bytes ratio predicts, what a whole step gains, INT4's
    caveat, and what this CPU and (when one is recorded) a GPU measured."""
    pred, r = F["pred"], F["r"]
    values = {k: F[k] for k in ("ridge", "pred", "fp8_whole", "int4_whole", "context", "cuda_fma", "r", "hi")}
    values |= {"top_intensity": max(s.intensity for s in F["steps"].values()), "measured": bool(run and run.get("rows")),
               "gpu": run["gpu"] if run else None}
    claims = {"every format is over ten times below the ridge": (values["top_intensity"] * 10 < F["ridge"],
                                                                 values["top_intensity"]),
              "a whole step gains far less than attention alone": (F["int4_whole"] < pred["int4"] / 2, F["int4_whole"]),
              "on this CPU INT4 decoded slower than INT8": (r["int4"] > r["int8"], r)}
    return Facts(values, claims)


def predicted_figure(F):
    """The bytes-ratio prediction: decode-attention speed-up over BF16 at the chapter's context, per format."""
    import plotly.graph_objects as go

    pred = F["pred"]
    fig = go.Figure(go.Bar(x=list(pred), y=list(pred.values()), text=[f"{v:.2f}x" for v in pred.values()],
                           textposition="outside"))
    fig.update_layout(height=320, title=f"Predicted decode-attention speedup over BF16 at {F['context'] // 1024}k "
                      "(bytes ratio)", xaxis_title="KV format", yaxis_title="x faster (attention only)",
                      margin=dict(t=40, b=40))
    return fig


def by_hand(context: int = 131072) -> Facts:
    """The check: MB of K and V one layer of Llama-3.1-8B reads a token at ``context`` tokens in per-token INT8."""
    from ..roofline import decode_step

    step = decode_step(SHAPE_MODEL, 1, context, "int8", gpu="H200")
    values = {"context": context, "mb": step.cache_bytes_per_layer / 1e6, "no_scales": context * 2 * 8 * 128 / 1e6,
              "k_only": step.cache_bytes_per_layer / 2e6, "bf16": context * 2 * 8 * 128 * 2 / 1e6}
    claims = {"the answer is codes plus one 2-byte scale a token and head, for K and V":
              (abs(values["mb"] - context * 2 * 8 * (128 + 2) / 1e6) < 1e-6, values["mb"])}
    return Facts(values, claims)


def exercises(F) -> Facts:
    """The exercises' solutions: the step at 128k, the INT4 bytes of a tile, the CPU's gap to the bytes model."""
    from ..roofline import decode_step

    long = decode_step(SHAPE_MODEL, 1, 131072, "int4", gpu="H200")
    tile = F["tile"]
    values = {"tile": tile, "tile_int4_kib": tile * 128 * 4.5 / 8 / 1024, "tile_bf16_kib": tile * 128 * 2 / 1024,
              "long_intensity": long.intensity, "ridge": F["ridge"], "r": F["r"], "bp": F["bp"]}
    claims = {"INT4 at 128k is still far below the ridge": (long.intensity * 10 < F["ridge"], long.intensity)}
    return Facts(values, claims)


SECTIONS = {"answer": lambda F: answer(F), "q-bytes": lambda F: by_hand(), "q-bytes-why": lambda F: by_hand(),
            "q-bytes-scales": lambda F: by_hand(), "q-bytes-kv": lambda F: by_hand(),
            "q-bytes-bf16": lambda F: by_hand(), "exercises": exercises, "gpu-none": lambda F: gpu_measured(None)}
