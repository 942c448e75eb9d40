"""Chapter 3's GPU section: what a recorded ``benchmarks/decode_attention.py`` run measured, beside the prediction.

:func:`gpu_measured` takes a run (:func:`kvlab.roofline.latest_gpu_run`, or None where no GPU has run it) and
returns the values and claims of the sections ``live-gpu-measured`` (from a recorded run) and ``gpu-none`` of
``notebooks/prose/03_triton_attention.md``; :func:`kvlab.roofline.measured_bandwidth_figure` draws the run.
"""

from __future__ import annotations

from .. import budget as B
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


BATCH = 8  # the answer's second whole-step batch: eight 32k sequences fit an 80 GB GPU in BF16 beside 8B weights


def answer(F, run: dict | None = None) -> Facts:
    """The answer: attention is bound by bytes, what the bytes ratio predicts, what a whole step gains at batch 1
    and at :data:`BATCH`, why every ratio is a ceiling, what this CPU measured, and whether a GPU has."""
    from .. import decide
    from ..roofline import decode_step

    pred, ctx = F["pred"], F["dec"]["contexts"]
    whole = {f: decide.step_time(SHAPE_MODEL, BATCH, F["context"], f, "H100-80GB").seconds for f in ("bf16", "fp8_e4m3", "int4")}
    ridge_h100 = decode_step(SHAPE_MODEL, 1, F["context"], "bf16", gpu="H100-80GB").ridge
    quantized = [f for f in ctx[str(F["hi"])] if f not in ("DynamicCache", "fp32", "fp16", "bf16")]
    cpu_slower = all(ctx[n][f]["ratio_to_dynamic"] > ctx[n]["bf16"]["ratio_to_dynamic"] for n in ctx for f in quantized)
    values = {k: F[k] for k in ("ridge", "pred", "fp8_whole", "int4_whole", "context", "cuda_ridge")}
    values |= {"top_intensity": max(s.intensity for s in F["steps"].values()), "measured": bool(run and run.get("rows")),
               "gpu": run["gpu"] if run else None, "ridge_h100": ridge_h100, "batch": BATCH,
               "fp8_batch": whole["bf16"] / whole["fp8_e4m3"], "int4_batch": whole["bf16"] / whole["int4"]}
    claims = {"every format does far fewer FLOPs a byte than the tensor cores' ridge": (
                  values["top_intensity"] * 10 < min(F["ridge"], ridge_h100), values["top_intensity"]),
              "a whole step at batch 1 gains far less than attention alone": (F["int4_whole"] < pred["int4"] / 2,
                                                                             F["int4_whole"]),
              f"an 80 GB GPU holds {BATCH} such sequences in BF16 beside the weights": (
                  B.max_concurrency(SHAPE_MODEL, F["context"], "bf16", "H100-80GB") >= BATCH, BATCH),
              "a bigger batch gains more, still short of the attention ratio": (
                  F["int4_whole"] < values["int4_batch"] < pred["int4"], values["int4_batch"]),
              "on this CPU every quantized format decoded slower than kvlab's own BF16 path, at every length":
                  (cpu_slower, quantized)}
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
    """The exercises' solutions: the step at 128k, the bytes of one kernel tile, the CPU's gap to the bytes model."""
    import inspect

    from ..kernels.reference import split_plan
    from ..roofline import decode_step

    long = decode_step(SHAPE_MODEL, 1, 131072, "int4", gpu="H200")
    block_n = inspect.signature(split_plan).parameters["block_n"].default  # the kernel's tile: BLOCK_N tokens
    values = {"block_n": block_n, "tile_int4_kib": block_n * 128 * 4.5 / 8 / 1024, "tile_bf16_kib": block_n * 128 * 2 / 1024,
              "long_intensity": long.intensity, "ridge": F["ridge"], "r": F["r"], "bp": F["bp"],
              "q4_0": F["dec"]["contexts"][str(F["hi"])]["q4_0"]["ratio_to_dynamic"], "hi": F["hi"]}
    claims = {"INT4 at 128k is still far below the ridge": (long.intensity * 10 < F["ridge"], long.intensity),
              "q4_0, with INT4's bits, took longer still on this CPU": (values["q4_0"] > F["r"]["int4"], values["q4_0"])}
    return Facts(values, claims)


def moved(bf16_layer_mb: float) -> Facts:
    """The check: MB an unfused server moves a layer a step for an FP8 cache (read the codes, write and reread BF16)."""
    values = {"bf16_layer": bf16_layer_mb, "fp8_layer": bf16_layer_mb / 2, "moved": bf16_layer_mb / 2 + 2 * bf16_layer_mb,
              "once": bf16_layer_mb / 2 + bf16_layer_mb}
    return Facts(values, {"expanding moves more than plain BF16 reads": (values["moved"] > bf16_layer_mb, values["moved"])})


SECTIONS = {"answer": lambda F: answer(F), "q-bytes": lambda F: by_hand(), "q-bytes-why": lambda F: by_hand(),
            "q-bytes-scales": lambda F: by_hand(), "q-bytes-kv": lambda F: by_hand(),
            "q-bytes-bf16": lambda F: by_hand(), "exercises": exercises, "gpu-none": lambda F: gpu_measured(None),
            "q-moved": lambda F: moved(67.1), "q-moved-why": lambda F: moved(67.1), "q-moved-once": lambda F: moved(67.1)}
