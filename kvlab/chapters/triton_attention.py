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
