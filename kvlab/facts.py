"""What the chapters state, computed once by the library and checked against named thresholds.

Each chapter whose prose states numbers has a function here returning a :class:`Facts`: the values
its sentences print (filled into ``notebooks/prose/<chapter>.md`` by :mod:`kvlab.prose`) and the
claims those sentences make, each a condition on the data. The chapter plots from the same object,
so a figure and the sentence under it cannot disagree; ``tests/test_facts.py`` computes every
chapter's facts in ``make quick`` and fails, naming the sentence, when the data stop supporting one.
(d2l keeps its checks in the library, not in the page; this is that.)

    >>> F = prefix_cache()
    >>> F["split"]["int4"]["saving_unshared"], F.failed()      # a value, and the claims that no longer hold
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .claim import holds  # a NaN claim never holds
from .decide import pct as _pct
from .decide import per_model, risk_models, short_model_name, short_needle
from .results import PPL_TOLERANCE

LADDER_PPL_WINDOWS = 4  # held-out windows the ladder sweep's perplexity read (scripts/sweep_evals.py)


class Facts(dict):
    """Values by name (a dict, so templates read them) plus ``claims``: sentence -> (holds, evidence)."""

    def __init__(self, values: dict, claims: dict[str, tuple[bool, object] | bool]):
        super().__init__(values)
        # a claim is (holds, evidence), or a bare truth value where the sentence is its own evidence
        self.claims = {}
        for c, v in claims.items():
            truth, evidence = v if isinstance(v, tuple) else (v, None)
            try:
                self.claims[c] = (holds(truth), evidence)
            except TypeError as e:
                raise TypeError(f"claim {c!r}: {e}") from None

    def failed(self) -> dict[str, object]:
        """``{claim: evidence}`` for every claim the data no longer support."""
        return {c: ev for c, (ok, ev) in self.claims.items() if not ok}

    def check(self) -> None:
        """Raise ``AssertionError`` naming each claim that no longer holds, with its evidence."""
        bad = self.failed()
        if bad:
            raise AssertionError("these sentences no longer hold: " + "; ".join(f"{c} ({ev!r})" for c, ev in bad.items()))


def _claim(ok, evidence=None) -> tuple[bool, object]:
    return bool(ok), evidence


# --------------------------------------------------------------------------- chapter 1

CH1 = dict(model="llama-3.1-70b", gpu="H200", weights="fp8", chats=100, context=32768, utilization=0.9)
CH1_LOG = "llama3-8b-a100-40gb"  # the published vLLM log chapter 1 reads line by line (the one with every term)


def _logs_md(logs: list[dict]) -> str:
    rows = ["| model | GPU | KV dtype | TP | cache memory printed | tokens printed | kvlab's tokens | vLLM / kvlab | source |",
            "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for x in logs:
        model = x["model"] + ("" if x.get("model_stated", True) else " (inferred)")
        rows.append(f"| {model} | {x['gpu']} | {x['kv_cache_dtype']} | {x['tp']} | {x['numbers']['available_gib']:.2f} GiB | "
                    f"{x['logged_tokens']:,} | {x['kvlab_tokens']:,} | {x['ratio']:.4f}{'' if x['within_rounding'] else ' ✗'} | "
                    f"[{x['source']}]({x['url']}) |")
    return "\n".join(rows)


def cache_budget() -> Facts:
    """Chapter 1: the 70B headline in GiB with the engine's reserve, weights vs cache quantization side by
    side, and kvlab's engine model read against published vLLM start-up logs."""
    from . import budget as B
    from .formats import engine_options, engines_offering

    G, c = B.GIB, CH1
    fit = B.fit(c["model"], c["gpu"], c["weights"], memory_utilization=c["utilization"])
    chats = B.budget(c["model"], c["chats"], c["context"], "fp8_e4m3").cache_bytes_per_gpu
    grid = {(w, k): B.max_concurrency(c["model"], c["context"], k, c["gpu"], w)
            for w in ("bf16", "fp8", "int4") for k in ("bf16", "fp8_e4m3", "int4")}
    logs = B.published_vllm_logs()
    shown = next(x for x in logs if x["id"] == CH1_LOG)
    n = shown["numbers"]
    misses = [x for x in logs if not x["within_rounding"]]
    w4_kv8, w8_kv4 = grid[("int4", "fp8_e4m3")], grid[("fp8", "int4")]
    (fp8_log,) = [x for x in logs if x["fmt"] == "fp8_e4m3"]
    fp8_shape = B.load_shape(fp8_log["model"])
    miss_shape = B.load_shape(misses[0]["model"]) if misses else None
    int4_exact, int4_near = int4_engines()
    nvfp4_engines = engines_offering(["nvfp4"])["nvfp4"]
    values = {
        **c, "gpu_gib": B.get_gpu(c["gpu"]).memory_bytes / G, "gpu_gb": B.get_gpu(c["gpu"]).nominal_gb,
        "int4_cache_engines": engines_md(int4_exact), "int4_near_engines": engines_md(int4_near),
        "int4_weight_bits": B.WEIGHT_BITS["int4"],
        "fp4_cache_engines": engines_md(nvfp4_engines), "weights_gib": fit.weights_bytes_per_gpu / G,
        "usable_gib": fit.usable_bytes_per_gpu / G, "reserve_gib": fit.reserve_bytes_per_gpu / G,
        "free_gib": fit.free_for_cache_per_gpu / G, "chats_gib": chats / G, "chats_x": chats / fit.free_for_cache_per_gpu,
        "grid": grid, "w4_kv8": w4_kv8, "w8_kv4": w8_kv4, "w8_kv8": grid[("fp8", "fp8_e4m3")],
        "w4_kv4": grid[("int4", "int4")], "bf16_weights_fit": grid[("bf16", "bf16")] > 0,
        "lever": "the cache" if w8_kv4 > w4_kv8 else ("the weights" if w4_kv8 > w8_kv4 else "neither"),
        "weights_int4_saving_gib": (B.weights_bytes(c["model"], "fp8") - B.weights_bytes(c["model"], "int4")) / G,
        "logs": logs, "n_logs": len(logs), "n_models": len({x["model"] for x in logs}),
        "n_within": len(logs) - len(misses), "miss": misses[0] if misses else None,
        "miss_pct": (1 - misses[0]["ratio"]) * 100 if misses else 0.0,
        "miss_heads": max(1, miss_shape.layers[0].kv_heads // misses[0]["tp"]) if misses else None,
        "fp8_log": fp8_log, "fp8_kib": fp8_log["numbers"]["available_gib"] * G / fp8_log["logged_tokens"] / 1024,
        "fp8_shape": f"{fp8_shape.num_layers} layers, {fp8_shape.layers[0].kv_heads} KV heads of "
                     f"{fp8_shape.layers[0].head_dim}",
        "log": shown, "log_n": n, "log_reserve_gib": shown["reserve_gib"],
        "log_available_gib": B.engine_available_bytes(n["total_gib"], n["utilization"], n["weights_gib"],
                                                      shown["reserve_gib"]) / G,
        "log_concurrency": shown["logged_tokens"] / n["max_model_len"],
        "tp2_reserve_gib": B.TP_RESERVE_GIB[2],
        "w8_kv8_big_reserve": B.max_concurrency(c["model"], c["context"], "fp8_e4m3", c["gpu"], c["weights"],
                                                reserve_gib=shown["reserve_gib"]),
        "rounding_tokens": B.LOG_ROUNDING_GIB * G / shown["bytes_per_token"],
        "default_reserve_gib": B.DEFAULT_RESERVE_GIB,
        "logs_md": _logs_md(logs),
        # by hand under tensor parallelism: one GPU's share of one 32k sequence's BF16 cache
        "tp_gib": {tp: B.budget(c["model"], 1, c["context"], "bf16", tp=tp).cache_bytes_per_gpu / G for tp in (1, 2, 8, 16)},
        "mla_gib": {tp: B.budget("deepseek-v3", 1, c["context"], "bf16", tp=tp).cache_bytes_per_gpu / G for tp in (1, 8)},
        "kv_heads": B.load_shape(c["model"]).layers[0].kv_heads,
        "grid_md": "| weights \\ KV cache | BF16 | FP8 | INT4 |\n|---|---:|---:|---:|\n" + "\n".join(
            f"| {w.upper()} | " + " | ".join(str(grid[(w, k)]) for k in ("bf16", "fp8_e4m3", "int4")) + " |"
            for w in ("bf16", "fp8", "int4")),
    }
    claims = {
        "the FP8 weights and the reserve fit, and 100 chats at 32k need several times the room left":
            _claim(fit.weights_fit and values["chats_x"] > 5, values["chats_x"]),
        "BF16 weights of a 70B model do not fit one H200": not values["bf16_weights_fit"],
        "halving the weights helps too: INT4 weights beat FP8 weights at every cache format":
            _claim(all(grid[("int4", k)] > grid[("fp8", k)] for k in ("bf16", "fp8_e4m3", "int4")), grid),
        "the lever named is the one the grid shows": _claim(values["lever"] != "neither", (w4_kv8, w8_kv4)),
        "every published log but the one named lies within the printed rounding": _claim(len(misses) <= 1, len(misses)),
        "the named miss is the tensor-parallel one with an LMCache connector, about 1% low":
            _claim(not misses or (misses[0]["tp"] > 1 and "LMCache" in misses[0]["model_note"]
                                  and 0.5 < values["miss_pct"] < 2), values["miss_pct"]),
        "the FP8 log's bytes per token are its stand-in preset's FP8 size (within 0.1%)":
            _claim(abs(values["fp8_kib"] * 1024 / fp8_log["bytes_per_token"] - 1) < 0.001,
                   (values["fp8_kib"], fp8_log["bytes_per_token"])),
        "the shown log's breakdown gives its printed cache memory":
            _claim(abs(values["log_available_gib"] - n["available_gib"]) <= 0.01, values["log_available_gib"]),
        "tensor parallelism splits the KV heads: half a GPU's share at 2, an eighth at 8, no less past the head count":
            _claim(values["kv_heads"] == 8 and abs(values["tp_gib"][2] - values["tp_gib"][1] / 2) < 1e-9
                   and abs(values["tp_gib"][8] - values["tp_gib"][1] / 8) < 1e-9 and values["tp_gib"][16] == values["tp_gib"][8],
                   values["tp_gib"]),
        "an MLA latent is whole on every GPU": _claim(values["mla_gib"][8] == values["mla_gib"][1], values["mla_gib"]),
        "an exact INT4 preset in LMDeploy, llama.cpp and transformers; vLLM's INT4 only near one; none in SGLang or TensorRT-LLM":
            _claim((int4_exact, int4_near) == (["LMDeploy", "llama.cpp", "transformers"], ["vLLM"]), (int4_exact, int4_near)),
        "NVFP4 caches in SGLang, TensorRT-LLM and vLLM, the last two on Blackwell":
            _claim(set(nvfp4_engines) == {"SGLang", "TensorRT-LLM", "vLLM"}
                   and all("Blackwell" in engine_options("nvfp4")[e] for e in ("TensorRT-LLM", "vLLM")),
                   engine_options("nvfp4")),
        "the logs cover at least four models and two cache dtypes":
            _claim(values["n_models"] >= 4 and len({x["fmt"] for x in logs}) >= 2, values["n_models"]),
    }
    return Facts(values, claims)


# --------------------------------------------------------------------------- chapter 3

CH3_MODEL, CH3_GPU, CH3_CONTEXT = "llama-3.1-8b", "H200", 32768
CH3_FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "q4_0"]
H200_FP32_FLOPS = 67e12  # FP32 on the CUDA cores, NVIDIA H200 datasheet


def triton_attention(decode_cpu: dict | None = None) -> Facts:
    """Chapter 3: decode attention's roofline (bytes and intensity per format), what the whole step gains, and
    what the torch tile path measured on a CPU (``data/results/decode_cpu.json``)."""
    import json

    from . import budget as B
    from . import decide, roofline
    from .paths import RESULTS_DIR

    steps = {f: roofline.decode_step(CH3_MODEL, 1, CH3_CONTEXT, f, gpu=CH3_GPU) for f in CH3_FORMATS}
    pred = {f: roofline.predicted_speedup(CH3_MODEL, CH3_CONTEXT, f) for f in CH3_FORMATS}
    whole = {f: decide.step_time(CH3_MODEL, 1, CH3_CONTEXT, f, CH3_GPU).seconds for f in ["bf16", "fp8_e4m3", "int4"]}
    whole_w8 = {f: decide.step_time(CH3_MODEL, 1, CH3_CONTEXT, f, CH3_GPU, "fp8").seconds for f in ["bf16", "fp8_e4m3", "int4"]}
    shape = B.load_shape(CH3_MODEL)
    gqa = shape.q_heads // shape.layers[0].kv_heads
    cuda_ridge = H200_FP32_FLOPS / B.get_gpu(CH3_GPU).bandwidth_bytes_per_s
    dec = decode_cpu if decode_cpu is not None else json.loads((RESULTS_DIR / "decode_cpu.json").read_text())
    ctx = dec["contexts"]
    lo, hi = min(ctx, key=int), max(ctx, key=int)
    mem = {f: (ctx[hi][f]["attend_peak_bytes"], ctx[hi][f]["layer_fp32_kv_bytes"]) for f in ["int8", "int4"]}
    tile = str(dec["tile_tokens"])
    r = {f: ctx[hi][f]["ratio_to_dynamic"] for f in ["int8", "fp8_e4m3", "int4"]}
    # what the bytes model predicts for this CPU run: time ~ (fp32 weights + cache) read per token
    w = B.weights_bytes(dec["model"], "fp32")
    bp = {f: (w + ctx[hi][f]["cache_bytes"]) / (w + ctx[hi]["DynamicCache"]["cache_bytes"]) for f in r}
    aot = json.loads((RESULTS_DIR / "aot_compile.json").read_text())
    by_arch = {a: [row for row in aot["rows"] if str(row["arch"]) == a] for a in aot["archs"]}
    failed = {(row["variant"], row["arch"]) for row in aot["rows"] if not row["ok"]}
    values = {"steps": steps, "pred": pred, "ridge": steps["bf16"].ridge, "cuda_ridge": cuda_ridge, "cuda_fma": cuda_ridge / 2,
              "aot": aot, "by_arch": by_arch,
              "fp8_whole": whole["bf16"] / whole["fp8_e4m3"], "int4_whole": whole["bf16"] / whole["int4"],
              "fp8_whole_w8": whole_w8["bf16"] / whole_w8["fp8_e4m3"], "int4_whole_w8": whole_w8["bf16"] / whole_w8["int4"],
              "context": CH3_CONTEXT, "dec": dec, "lo": int(lo), "hi": int(hi), "tile": dec["tile_tokens"],
              "int4_peak_mib": mem["int4"][0] / 2**20, "int4_fp32_mib": mem["int4"][1] / 2**20, "r": r,
              "int8_lo": ctx[lo]["int8"]["ratio_to_dynamic"], "bp": bp, "weights_mb": w / 1e6,
              "dyn_cache_mb": ctx[hi]["DynamicCache"]["cache_bytes"] / 1e6,
              "int4_fewer_bytes": 1 - bp["int4"] / bp["int8"]}  # a whole step's bytes, weights included
    claims = {
        "INT4 reads about half INT8's cache bytes but under 15% fewer bytes a step":
            _claim(0.45 < ctx[hi]["int4"]["cache_bytes"] / ctx[hi]["int8"]["cache_bytes"] < 0.6
                   and 0 < values["int4_fewer_bytes"] < 0.15, (values["int4_fewer_bytes"], ctx[hi]["int4"]["cache_bytes"])),
        "every format sits more than ten times below the tensor-core ridge point":
            _claim(all(st.intensity < st.ridge / 10 for st in steps.values())),
        "the H200's ridge point is about 200 FLOP/byte": _claim(150 < values["ridge"] < 250, values["ridge"]),
        "the H200's CUDA-core ridge is about 14 operations per byte": _claim(abs(cuda_ridge - 14) < 0.5, cuda_ridge),
        "BF16: 2 FLOPs per element per query head over 2 bytes per element":
            _claim(abs(steps["bf16"].intensity - 2 * gqa / 2) < 0.01, steps["bf16"].intensity),
        "FP8 predicts 2x (its scale adds a few bytes), INT4 about 3.5x":
            _claim(1.9 < pred["fp8_e4m3"] <= 2.0 and 3.4 < pred["int4"] < 3.6, pred),
        "for the whole step at batch 1 the gain is far smaller":
            _claim(values["fp8_whole"] < 1.3 and values["int4_whole"] < 1.3, whole),
        "with FP8 weights the cache's share of a step grows, and so does its gain (still under 1.5x)":
            _claim(values["fp8_whole"] < values["fp8_whole_w8"] < 1.5 and values["int4_whole"] < values["int4_whole_w8"] < 1.5,
                   whole_w8),
        "a tile is 4,096 tokens": _claim(dec["tile_tokens"] == 4096, dec["tile_tokens"]),
        "a decode step needs far less than one layer's full-precision K and V":
            _claim(all(pk < full / 2 for pk, full in mem.values()), mem),
        "the extra memory stops growing past one tile":
            _claim(all(tile not in ctx or mem[f][0] <= 1.3 * ctx[tile][f]["attend_peak_bytes"] for f in mem), mem),
        "INT8 and FP8 within 1.3x of DynamicCache, INT4 within 1.5x":
            _claim(r["int8"] < 1.3 and r["fp8_e4m3"] < 1.3 and r["int4"] < 1.5, r),
        "INT4 decodes slower than INT8 although it reads half the bytes": _claim(r["int4"] > r["int8"], r),
        "every quantized format took longer on this CPU than the bytes model predicts":
            _claim(all(r[f] > bp[f] for f in r), (r, bp)),
        "the bytes model predicts INT4 faster than DynamicCache here": _claim(bp["int4"] < 0.8, bp),
        "FP8 decodes slower than INT8 at about the same bytes": _claim(r["fp8_e4m3"] > r["int8"], r),
        "only native FP8 E4M3 before sm_89 fails to compile":
            _claim(all("fp8_e4m3" in v and arch < 89 for v, arch in failed), failed),
        "the sm_80 FP8 path (codes read as bytes) compiles":
            _claim(all(row["ok"] for row in by_arch["80"] if "as bytes" in row["variant"])),
    }
    return Facts(values, claims)


# --------------------------------------------------------------------------- chapter 4

CH4_NAMES = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M"}
CH4_KEYS = {"smollm2-135m": "S", "gemma3-270m": "G"}  # how the prose names each model's facts
CH4_FIGURE = ["fp32", "fp8_e4m3", "int8", "q4_0", "int4", "int4_token", "int4_tensor", "kivi-4", "kivi-2"]


def names_md(fmts: list[str], empty: str = "none", notes: dict[str, str] | None = None) -> str:
    """``a``, ``b`` and ``c`` as Markdown code, or ``empty``; ``notes`` adds text after a name: ``a`` (note)."""
    fmts = [f"`{f}`" + (f" ({notes[f]})" if notes and f in notes else "") for f in fmts]
    if not fmts:
        return empty
    return fmts[0] if len(fmts) == 1 else ", ".join(fmts[:-1]) + " and " + fmts[-1]


def engines_md(engines) -> str:
    """Engine names as prose: "vLLM, SGLang and TensorRT-LLM" (names, not code)."""
    return names_md(list(engines)).replace("`", "")


def _bits_notes(fmts: list[str], head_dim: int = 128) -> dict[str, str]:
    """``{format: "N bits"}``: what a "4-bit" format really costs an element, scales included (a residual window's
    full-precision tokens not counted), at ``head_dim``."""
    from .formats import get_format

    return {f: f"{get_format(f).bits_per_element(head_dim):.3g} bits" for f in fmts}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _lists(sweep, stage: str, formats: list[str] | None = None) -> dict:
    """Which formats the paired test finds worse where, in one stage of one model's sweep (``formats``: the
    sweep's own by default; :attr:`~kvlab.results.LongSweep.all_formats` adds those measured later)."""
    from .results import rungs

    if not sweep.lengths(stage):
        return {"measured": False, "lengths": [], "never": [], "short": [], "later": [], "trap": [], "by": {},
                "never_md": "none", "short_md": "none", "later_md": "none", "trap_md": "none", "flips": [], "status": {}}
    by = {r["kv_format"]: r for r in rungs(sweep, stage, formats=formats)}
    lengths = sweep.lengths(stage)
    fell = {f: r["worse_at"] for f, r in by.items() if r["worse_at"]}
    later = [f for f, r in by.items() if r["short_verdict"] != "worse" and r["worse_at"]]
    return {
        "measured": True, "lengths": lengths, "by": by, "rows": list(by.values()),
        "longest": lengths[-1], "longest_k": _k(lengths[-1]), "shortest_k": _k(lengths[0]),
        "lengths_text": ", ".join(_k(n) for n in lengths),
        "never": [f for f in by if f not in fell], "never_md": names_md([f for f in by if f not in fell]),
        "short": [f for f, r in by.items() if r["short_verdict"] == "worse"],
        "short_md": names_md([f for f, r in by.items() if r["short_verdict"] == "worse"]),
        "later": later, "later_md": ", ".join(f"`{f}` ({', '.join(_k(n) for n in by[f]['worse_at'])})"
                                              for f in later) or "none",
        "trap": [f for f, r in by.items() if r["trap"]], "trap_md": names_md([f for f, r in by.items() if r["trap"]]),
        "flips": [f for f, at in fell.items() if any(n not in at for n in lengths if n > at[0])],
        "ref": {n: sweep.counts("filler" if stage == "cached" else stage, "fp32", n) for n in lengths},
        "ref_text": ", ".join("{}/{} at {}".format(*sweep.counts("filler" if stage == "cached" else stage, "fp32", n),
                                                  _k(n)) for n in lengths),
        "cell": {(r["kv_format"], r["length"]): r for r in sweep.table(stage)},  # rate, lost, gained, p, verdict
        "c": {f"{r['kv_format']} {r['length']}": r for r in sweep.table(stage)},  # the same, for templates: {G[c][int4 1024]}
        "status": {f: "never worse" if not r["worse_at"] else "worse at " + ", ".join(_k(n) for n in r["worse_at"])
                   for f, r in by.items()},
    }


def _model_facts(sweep, formats: list[str] | None = None) -> dict:
    """What one model's long sweep says, rung by rung (the sentences of 4.1-4.3 read these). ``formats``: the
    sweep's own by default (chapter 4's); chapter 6 adds the engine formats measured later on the same prompts."""
    from .formats import get_format
    from .results import holm_worse, rungs

    asked = formats
    if formats is not None:  # only those measured at every length of both haystacks (one added later may not be)
        both = [{r["kv_format"] for r in rungs(sweep, st, formats=formats)} for st in SINGLE_NEEDLE if sweep.lengths(st)]
        formats = [n for n in formats if n == "fp32" or all(n in b for b in both)]
    f = _lists(sweep, "filler", formats)
    prose = _lists(sweep, "prose", formats)
    # a format added later, not yet in at every length: already worse at a finished length, that is its verdict
    # ({format: (haystack, [lengths])}, the first haystack where it was)
    partial = {}
    for st in SINGLE_NEEDLE if asked else ():
        for c in sweep.table(st):
            n = c["kv_format"]
            if n in asked and n not in formats and c["verdict"] == "worse" and partial.setdefault(n, (st, []))[0] == st:
                partial[n][1].append(c["length"])
    prose_worse = {n for n, r in prose["by"].items() if r["worse_at"]}
    if not f["measured"]:
        raise ValueError(f"the {sweep.model} sweep has no filler prompts")
    ref = f["ref"]
    prompts = {t for _, t in ref.values()}
    seconds = sum(r.get("seconds", 0) for r in sweep.records)
    ppl = {n: r["ppl_increase"] for n, r in f["by"].items() if r["ppl_increase"] is not None}
    for n in asked or ():
        if n not in ppl and n != "fp32":
            try:  # a format added later whose held-out windows are in, not yet its needles
                ppl[n] = sweep.paired_perplexity(n)["increase"]
            except KeyError:
                pass
    # the single needle in both haystacks, every length pooled into one paired test per format
    pooled = {n: sweep.paired_pooled(SINGLE_NEEDLE, n) for n in f["by"]}
    # never worse on the needle: at no length in either haystack, nor pooled (the takeaways' "held")
    held = [n for n in f["never"] if n not in prose_worse and pooled[n].verdict != "worse"]
    # never worse at one length in either haystack, yet worse once every length is pooled: a small loss
    pooled_only = [n for n in f["never"] if n not in prose_worse and pooled[n].verdict == "worse"]
    intervals = {n: sweep.perplexity_interval(n) for n in ppl}  # 90% bootstrap over the passages read
    # each verdict rests on several tests (a length in each haystack, and pooled): those still "worse" after Holm
    tests = {n: sweep.needle_tests(n, SINGLE_NEEDLE) for n in f["by"]}
    # each format that ran with the prompt reading its own cache, beside the same prompts in full prefill
    cached_vs_full = {f"{f} {n}": {"cached": sweep.counts("cached", f, n), "full": sweep.counts("filler", f, n),
                                   "paired": sweep.paired("cached", f, n, f, "filler")}
                      for n in sweep.lengths("cached") for f in sweep.formats
                      if f != "fp32" and sweep.counts("cached", f, n)[1]}
    for n in pooled_only:  # never worse at one length in either haystack, yet worse pooled: say both
        f["status"][n] = f"never worse at one length, worse pooled (−{pooled[n].lost} +{pooled[n].gained})"
    return f | {
        "name": CH4_NAMES.get(sweep.model, sweep.model), "model": sweep.model,
        "prompts": min(prompts), "prompts_all": prompts,
        "ref_text": ", ".join(f"{c}/{t} at {_k(n)}" for n, (c, t) in ref.items()),
        "flips_md": names_md(f["flips"]), "ppl": ppl,
        "ppl_windows": len([r for r in sweep.records if r["stage"] == "perplexity"]),
        "ppl_flags": [n for n, r in f["by"].items() if r["ppl_increase"] is not None and not r["ppl_ok"]],
        "ppl_flags_md": names_md([n for n, r in f["by"].items() if r["ppl_increase"] is not None and not r["ppl_ok"]]),
        "hours": seconds / 3600, "machine": sweep.header.get("machine", "?"), "date": sweep.header.get("date", "?"),
        "torch": sweep.header.get("torch", "?"), "transformers": sweep.header.get("transformers", "?"),
        "prose": prose, "cached": _lists(sweep, "cached"), "multikey": _lists(sweep, "multikey"),
        "orders": _lists(sweep, "orders"),
        **{f"{st}_pooled": {f: sweep.paired_pooled(st, f) for f in sweep.formats if f != "fp32"}
           if sweep.lengths(st) else {} for st in ("multikey", "orders")},
        "pooled": pooled, "held": held, "pooled_only": pooled_only, "partial": partial,
        "needle_tests": tests, "n_needle_tests": {len(t) for t in tests.values()},
        # called worse by the paired rule, yet by no test once Holm corrects for how many tests a format faces
        "holm_rescued": [n for n in f["by"] if n not in held and not holm_worse(tests[n])],
        "min_p": {n: min(t.p for t in ts.values()) for n, ts in tests.items()},
        "cached_vs_full": cached_vs_full,
        # the same two modes pooled over every length the cached stage ran (each prompt still against itself)
        "cached_modes_pooled_paired": {f: sweep.paired_pooled("cached", f, f, reference_stage="filler")
                                       for f in dict.fromkeys(k.split()[0] for k in cached_vs_full)},
        "ppl_paired": {n: sweep.paired_perplexity(n) for n in ppl},
        # where the passages read decide which side of the bar a format falls: 90% bootstrap interval over passages
        "ppl_on_bar": {n: iv for n, iv in intervals.items() if iv[0] <= PPL_TOLERANCE < iv[1]},
        "perplexity_lo": {n: iv[0] for n, iv in intervals.items()},
        "vs_base": against_base(sweep), "vs_base_prose": against_base(sweep, "prose"),
        "ppl_later_md": ", ".join(f"`{n}` {ppl[n]:+.0%}" for n in f["later"] if n in ppl) or "none",
        "n_later": len(f["later"]),
        "bits": {n: sweep.format_entry(n).get("bits_per_element") for n in sweep.all_formats},
        "never_low_md": ", ".join(f"`{n}` ({sweep.format_entry(n)['bits_per_element']:.3g} bits"
                                  + (f" plus {r} recent tokens in full precision" if (r := get_format(n).residual) else "")
                                  + ")" for n in held if _low_bit(n)) or "none",
        "never_8bit_md": names_md([n for n in held if not _low_bit(n)]),
    }


def needle_label(mf: dict, fmt: str) -> str:
    """One model's paired needle verdict for ``fmt``, short (``mf`` is :func:`_model_facts`): "held", or the first
    test it failed: "worse in filler at 1k, 4k", "worse in prose at 8k", "worse pooled (−6 +0)"; for a format
    whose lengths are not all in yet, "worse in filler at 8k so far" (:func:`_model_facts`' ``partial``)."""
    if fmt not in mf["by"] and fmt in mf.get("partial", {}):
        stage, at = mf["partial"][fmt]
        return f"worse in {stage} at {', '.join(_k(n) for n in at)} so far"
    if fmt in mf["held"]:
        return "held"
    if at := mf["by"][fmt]["worse_at"]:
        return "worse in filler at " + ", ".join(_k(n) for n in at)
    if at := mf["prose"]["by"].get(fmt, {}).get("worse_at"):
        return "worse in prose at " + ", ".join(_k(n) for n in at)
    p = mf["pooled"][fmt]
    return f"worse pooled (−{p.lost} +{p.gained})"


def _modes_holm_md(modes: dict, kept: dict, family: str) -> str:
    """What Holm's correction over ``family`` (text) leaves of the differences between a format's two prefill modes:
    ``modes`` maps "fmt length" to its :class:`~kvlab.results.Paired` (cached against full prefill, same prompts),
    ``kept`` to whether Holm keeps it. Names the kept differences, or says none survives and gives the uncorrected
    ones after it."""
    apart = [f for f, pr in modes.items() if pr.verdict != "not distinguishable"]
    if not apart:
        return "the two modes are not distinguishable"

    def one(f, was=""):
        pr = modes[f]
        return (f"`{f.split()[0]}` at {_k(int(f.split()[1]))} {was}{pr.verdict} with the prompt reading the cache "
                f"(−{pr.lost} +{pr.gained}, p = {pr.p:.2f})")

    if survivors := [f for f in apart if kept[f]]:
        return f"Holm's correction over {family} keeps " + ", ".join(one(f) for f in survivors)
    return (f"no difference survives Holm's correction over {family}; uncorrected, "
            + ", ".join(one(f, "was ") for f in apart))


def _needle_with_holm_md(fmt: str, mfs) -> str:
    """``fmt``'s paired needle verdict on each model (:func:`needle_label`), saying of each verdict of worse
    whether Holm's correction for the tests the format faced keeps it: "held on Gemma; on SmolLM2 worse pooled
    (−12 +0), which Holm's correction keeps"."""
    held = [short_model_name(mf["name"]) for mf in mfs if fmt in mf["held"]]
    parts = [f"held on {' and '.join(held)}"] if held else []
    for mf in mfs:
        if fmt in mf["held"] or (fmt not in mf["by"] and fmt not in mf.get("partial", {})):
            continue
        kept = "withdraws" if fmt in mf["holm_rescued"] else "keeps"
        parts.append(f"on {short_model_name(mf['name'])} {needle_label(mf, fmt)}, which Holm's correction {kept}")
    return "; ".join(parts) or "not measured"


def paired_risk(sweeps: dict | None = None, model_facts: list | None = None) -> dict:
    """Chapter 4's paired verdicts per model, the quality input of :func:`kvlab.decide.options`:
    ``{model name: {"held": [formats], "needle": {format: short verdict}, "ppl": {format: perplexity change}}}``.
    ``sweeps`` maps model ids to :class:`~kvlab.results.LongSweep` (default: both shipped sweeps);
    ``model_facts`` are :func:`_model_facts` already computed from them."""
    from .results import LONG_SWEEPS, LongSweep

    if model_facts is None:
        sweeps = sweeps or {m: LongSweep.load(p) for m, p in LONG_SWEEPS.items()}
        model_facts = [_model_facts(sw) for sw in sweeps.values()]
    return {mf["name"]: {"held": list(mf["held"]), "needle": {f: needle_label(mf, f) for f in [*mf["by"], *mf["partial"]]},
                         "ppl": dict(mf["ppl"])} for mf in model_facts}


def shipped_perplexity(formats: list[str], reference: str = "fp32", sweeps: dict | None = None
                       ) -> dict[str, dict[str, dict]]:
    """Each format's held-out perplexity against ``reference`` in chapter 4's paired sweeps, per model:
    ``{format: {"SmolLM2": paired_perplexity row, "Gemma": ...}}`` (chapter 2 sets its live error numbers beside
    them); a model where the format has not run on every window is left out."""
    from .results import LONG_SWEEPS, LongSweep

    sweeps = sweeps or {m: LongSweep.load(p) for m, p in LONG_SWEEPS.items()}
    out = {}
    for f in formats:
        out[f] = {}
        for m, sw in sweeps.items():
            try:
                out[f][short_model_name(CH4_NAMES.get(m, m))] = sw.paired_perplexity(f, reference)
            except KeyError:
                continue
    return out


def format_costs(sweeps: dict | None = None) -> Facts:
    """Chapter 2's shipped numbers (its other numbers it measures live): what FP8 E5M2 and NVFP4 cost on held-out
    text in chapter 4's paired sweeps, beside E4M3, ``int4``, ``q4_0`` and llama.cpp's rotated ``q4_0``."""
    from .results import LONG_SWEEPS, PPL_TOLERANCE, LongSweep

    sweeps = sweeps or {m: LongSweep.load(p) for m, p in LONG_SWEEPS.items()}
    ppl = shipped_perplexity(["fp8_e4m3", "fp8_e5m2", "nvfp4", "int4", "q4_0", "q4_0+rotate"], sweeps=sweeps)
    e5 = shipped_perplexity(["fp8_e5m2"], reference="fp8_e4m3", sweeps=sweeps)["fp8_e5m2"]  # passage by passage
    nv = {b: shipped_perplexity(["nvfp4"], reference=b, sweeps=sweeps)["nvfp4"] for b in ("int4", "q4_0")}
    models = ("SmolLM2", "Gemma")
    return Facts({"ppl": ppl, "e5": e5, "nv": nv}, {
        "on held-out text E5M2 is worse than E4M3 on both models (paired)":
            _claim(len(e5) == 2 and all(r["verdict"] == "worse" for r in e5.values()), e5),
        "NVFP4 beats int4 on both models and q4_0 on Gemma; on SmolLM2 the test cannot tell it from q4_0":
            _claim([nv["int4"].get(m, {}).get("verdict") for m in models] == ["better"] * 2
                   and [nv["q4_0"].get(m, {}).get("verdict") for m in models] == ["not distinguishable", "better"], nv),
        "NVFP4 still costs over 5% perplexity on both models":
            _claim(all(m in ppl["nvfp4"] and ppl["nvfp4"][m]["increase"] > PPL_TOLERANCE for m in models), ppl["nvfp4"]),
    })


SINGLE_NEEDLE = ("filler", "prose")  # the stages whose prompts hold one passkey: pooled together for 4.1's verdict
CH4_HEAD_DIM = {"smollm2-135m": 64, "gemma3-270m": 256}
CH4_COMMON_LONGEST = 8192  # both models are swept to here (SmolLM2's window)
CH4_MITIGATIONS = {"int4_token+sinks4": "int4_token", "int4_token+residual128": "int4_token",
                   "int4_token+rotate": "int4_token", "int4_tensor+rotate": "int4_tensor", "kivi-2+rotate": "kivi-2",
                   "int4_g16": "int4", "int4_token@global": "int4_token", "int4_token@sliding": "int4_token"}


def _same_groups_but_zero(head_dim: int) -> bool:
    """Whether, for heads ``head_dim`` wide, ``int4`` and ``int4_token`` put the same key values under one scale
    and differ only in ``int4``'s zero point (asymmetric) against ``int4_token``'s symmetric codes."""
    from .formats import get_format

    f, g = get_format("int4"), get_format("int4_token")
    return values_per_scale("int4", head_dim) == values_per_scale("int4_token", head_dim) == str(head_dim) and all(
        a.element == b.element and a.scale_bits == b.scale_bits and a.full_range == b.full_range
        and not a.symmetric and b.symmetric and a.group_size == head_dim and b.granularity == "token"
        for a, b in ((f.key, g.key), (f.value, g.value)))


def values_per_scale(fmt: str, head_dim: int) -> str:
    """How many of a key's values share one scale: the granularity that decides INT4's fate (as text)."""
    from .formats import get_format

    f = get_format(fmt)
    q = (f.layers[0][1] if f.layers else f).key  # a per-layer-type mix: the format of the layers it quantizes
    if q.is_passthrough:
        return "—"
    if q.granularity == "tensor":
        return "all"
    if q.granularity == "token":
        return str(head_dim)
    if q.granularity == "group" and q.group_axis == "channel":
        return str(q.group_size)
    return f"{q.group_size} tokens"  # KIVI's keys: one scale per channel across a group of tokens


def against_base(sweep, stage: str = "filler") -> dict[str, dict]:
    """Each mitigation against the format it modifies, on the same prompts (the one paired test, pooled over
    every length of ``stage``): ``fixed`` = prompts the base got wrong and the mitigation right, ``broke`` = the
    reverse, with the exact McNemar p and verdict ("better" = the mitigation helped)."""
    from .results import mcnemar, verdict

    out = {}
    for f, base in CH4_MITIGATIONS.items():
        pairs = []
        for n in sweep.lengths(stage):
            try:
                pairs.append(sweep.paired(stage, f, n, reference=base))
            except KeyError:  # not run at this length (or not at all)
                continue
        if pairs:
            fixed, broke = sum(p.gained for p in pairs), sum(p.lost for p in pairs)
            out[f] = {"base": base, "fixed": fixed, "broke": broke, "prompts": sum(p.prompts for p in pairs),
                      "p": mcnemar(broke, fixed), "verdict": verdict(broke, fixed)}
    return out


def _p_text(p: float) -> str:
    return f"{p:.2f}" if p >= 0.01 else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _mitigations_md(m: dict) -> str:
    """One line per mitigation on one model: the direct paired test against its base format, then where each
    is worse than full precision."""
    def at(f):
        r = m["by"].get(f)
        return "—" if r is None else ", ".join(_k(n) for n in r["worse_at"]) or "never"

    word = {"better": "**helped**", "worse": "**hurt**", "not distinguishable": "no difference shown"}
    rows = [f"| `{f}` | `{d['base']}` | {d['fixed']} / {d['broke']} | {_p_text(d['p'])} | {word[d['verdict']]} | "
            f"{at(f)} | {at(d['base'])} |" for f, d in m["vs_base"].items()]
    return ("| mitigation | its base | fixed / broke | p | against its base | worse than fp32 at | base worse at |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def _keys_md(keys: list[str]) -> str:
    """["q4_0 8192", "q4_0 32768", "int8 32768"] as "`q4_0` (8k, 32k), `int8` (32k)"."""
    at = {}
    for key in keys:
        f, n = key.split()
        at.setdefault(f, []).append(_k(int(n)))
    return ", ".join(f"`{f}` ({', '.join(ns)})" for f, ns in at.items())


def _modes_md(modes: dict) -> str:
    """One format's two prefill modes on the same prompts ({"q4_0 8192": Paired, ...}), in words."""
    if not modes:
        return ""
    worse = [f.split()[0] for f, pr in modes.items() if pr.verdict == "worse"]
    better = [f.split()[0] for f, pr in modes.items() if pr.verdict == "better"]
    shown = ", ".join(f"`{f.split()[0]}` −{pr.lost} +{pr.gained} (p = {pr.p:.2f})" for f, pr in modes.items()
                      if pr.lost or pr.gained)
    apart = ([f"worse with the prompt reading the cache for {names_md(worse)}"] if worse else []) + (
        [f"better with the prompt reading the cache for {names_md(better)}"] if better else [])
    return (("the paired test finds the quantized prefill " + " and ".join(apart) if apart
             else "the paired test cannot tell the two modes apart for any format")
            + (f" (prompts the quantized prefill lost and gained: {shown})" if shown else ""))


def _moved(m: dict, fmt: str, n) -> int | None:
    """Needles ``fmt`` found at ``n`` tokens with the prompt reading its cache, less those it found with a
    full-precision prefill on the same prompts (None where the cached stage did not run it there)."""
    v = m["cached_vs_full"].get(f"{fmt} {n}")
    return None if v is None else v["cached"][0] - v["full"][0]


def _cached_at_md(m: dict, n: int) -> str:
    """One length of a model's prompt-reads-the-cache stage: each format against full precision (whose answers
    come from the filler stage, the same prompts), and against its own answers with the prompt in full precision."""
    c, t = m["cached"]["ref"][n]
    keys = [k for k in m["cached_vs_full"] if k.endswith(f" {n}")]

    def d(k):
        return _moved(m, *k.split())

    return (f"at {_k(n)} (full precision found {c} of {t}), with the prompt reading the cache: " + "; ".join(
        f"`{k.split()[0]}` found {m['cached_vs_full'][k]['cached'][0]} ({m['cached_vs_full'][k]['full'][0]} with a "
        f"full-precision prefill; against full precision's answers −{m['cached']['c'][k]['lost']} "
        f"+{m['cached']['c'][k]['gained']}, {m['cached']['c'][k]['verdict']})" for k in keys)
        + f". Against the same format with a full-precision prefill, on the same prompts, {m['cached_modes_at'][n]}"
        + (". Needles found with the prompt reading the cache, compared with a full-precision prefill: " + "; ".join(
            f"{what} {names_md(fs)}" for what, fs in (("fewer for", [k.split()[0] for k in keys if d(k) < 0]),
                                                     ("more for", [k.split()[0] for k in keys if d(k) > 0]),
                                                     ("as many for", [k.split()[0] for k in keys if d(k) == 0])) if fs))
        + ".")


def _direction_md(m: dict, n: int, base: int = 8192) -> str:
    """Whether the formats that found fewer needles at ``base`` with the prompt reading the cache did so again at
    ``n`` (a direction read from counts; the paired verdicts above are the test)."""
    def moved(f, at):
        return _moved(m, f, at)

    fewer = [k.split()[0] for k in m["cached_vs_full"] if k.endswith(f" {base}") and moved(k.split()[0], base) < 0]
    if not fewer:
        return ""
    held = [f for f in fewer if (moved(f, n) or 0) < 0]
    gone = [f for f in fewer if moved(f, n) is not None and moved(f, n) >= 0]
    return (f" At {_k(base)}, {names_md(fewer)} found fewer needles with the prompt reading the cache. At {_k(n)} "
            + "; ".join(x for x in (f"{names_md(held)} again found fewer" if held else "",
                                    f"{names_md(gone)} found as many or more" if gone else "") if x)
            + " (counts; the paired verdicts above are the test).")


def _stage_md(models: list[dict], stage: str) -> str:
    """Per model, what the paired test found in one stage of the sweep, or that the stage was not run."""
    lines = []
    for m in models:
        st = m[stage]
        if not st["measured"]:
            from .results import LONG_SWEEPS

            extra = "" if m["model"] == "gemma3-270m" else (
                f" --lengths {' '.join(map(str, m['lengths']))} --out data/results/{LONG_SWEEPS[m['model']].name}")
            lines.append(f"* **{m['name']}**: not measured in this stage yet (`python scripts/sweep_long.py --model "
                         f"{m['model']} --stages {stage}{extra}` adds it to the shipped sweep).")
            continue
        ref = ", ".join(f"{c}/{t} at {_k(n)}" for n, (c, t) in st["ref"].items())
        if len(st["lengths"]) == 1:  # one length: "already" and "only at longer lengths" would mean nothing
            lines.append(f"* **{m['name']}** (measured at {st['shortest_k']} only; full precision {ref}): never worse: "
                         f"{st['never_md']}; worse: {st['short_md']}.")
            continue
        lines.append(f"* **{m['name']}** ({st['lengths_text']}; full precision {ref}): never worse: {st['never_md']}; "
                     f"worse already at {st['shortest_k']}: {st['short_md']}; worse only at longer lengths: "
                     f"{st['later_md']}.")
    return "\n".join(lines)


def _formats_md(fmts: list[str]) -> str:
    """The formats of chapter 4 in one table: what shares a scale, at each model's head size, and the bits."""
    from .formats import get_format

    rows = []
    for f in dict.fromkeys(fmts):
        fmt = get_format(f)
        per = " / ".join(values_per_scale(f, hd) for hd in (64, 256))
        bits = "—" if fmt.layers else " / ".join(f"{fmt.bits_per_element(hd):.3g}" for hd in (64, 256))
        base = get_format(f.split("+")[0].split("@")[0])  # what the +options change
        extra = [what for on, what in ((fmt.sinks != base.sinks, f"plus the first {fmt.sinks} tokens in full precision"),
                                       (fmt.residual != base.residual,
                                        f"plus the newest {fmt.residual} tokens in full precision"),
                                       (fmt.rotate != base.rotate, "after a Hadamard rotation of head_dim")) if on]
        what = fmt.source + ("; " + ", ".join(extra) if extra and "@" not in f else "")
        rows.append(f"| `{f}` | {per} | {bits} | {what} |")
    return ("| format | values sharing a scale (head_dim 64 / 256) | bits an element (64 / 256) | what it is |\n"
            "|---|---|---|---|\n" + "\n".join(rows))


def _flags_md(models: list[dict], fmts: list[str]) -> str:
    """Chapter 4's formats as an engineer switches them on: each model's verdict, then each engine's documented
    option that stores exactly that format (``kvlab formats --engines``; "none" = a format only kvlab runs)."""
    from .formats import engine_options, engine_table

    table = engine_table()
    notes, presets = table["notes"], table["presets"]  # a mitigation (``+rotate``) is no engine's preset: no flag
    head = "| format | " + " | ".join(f"{m['name']}" for m in models) + " | how an engine selects it |"
    out = [head, "|---" * (2 + len(models)) + "|"]
    for f in fmts:
        if f == "fp32":
            continue
        flags = [f"{e}: `{flag.split(' (')[0]}`" for e, flag in engine_options(f).items() if flag] if f in presets else []

        def verdicts(m, f=f):
            filler, prose = m["status"].get(f, "—"), m["prose"]["status"].get(f)
            same = prose in (None, filler) or ("worse pooled" in filler and prose == "never worse")  # pooled: both
            out = filler if same else f"{filler}; in prose {prose}"
            out = out.replace("worse pooled", "**worse pooled**")
            r = m["by"].get(f)
            if r is None or r["ppl_increase"] is None:
                return out
            ppl = f"perplexity {_pct(r['ppl_increase'])}"
            ppl = ppl if r["ppl_ok"] else "**" + ppl + "**"
            if f in m["ppl_on_bar"]:  # the passages read decide the side of the bar
                lo, hi = m["ppl_on_bar"][f]
                ppl += f" (on the bar: {lo:+.1%} to {hi:+.1%} over resampled passages)"
            return f"{out}; {ppl}"

        name = f"`{f}`" + (" (scale fitted to each prompt)" if f.startswith("fp8") else "")
        nearest = notes.get(f, "") if not flags else ""  # what an engine offers closest to a kvlab-only format
        if nearest.startswith("As ") and nearest[3:].rstrip(".") in notes:  # "As kivi-4."
            nearest = notes[nearest[3:].rstrip(".")]
        out.append(f"| {name} | " + " | ".join(verdicts(m) for m in models)
                   + f" | {'; '.join(flags) or 'none exactly' + ('. ' + nearest if nearest else ' (kvlab only)')} |")
    return "\n".join(out)


def _residual_note(by_model: dict) -> str:
    """A caveat for formats with a residual window among ``{model: [formats]}``: the perplexity rung under-credits
    them (each passage's last tokens stay in full precision, not each token's latest ones)."""
    from .formats import get_format

    fs = sorted({f for fs in by_model.values() for f in fs if get_format(f).residual})
    return (f" (though for {names_md(fs)} the perplexity rung is harsh: it under-credits residual windows, appendix A)"
            if fs else "")


def _low_bit(fmt: str) -> bool:
    """A 4-bit (or 2-bit) KV format, mitigations and per-layer mixes included: what "INT4 KV" turns on."""
    return any(t in fmt for t in ("int4", "q4_", "kivi", "fp4"))


def _plain_low_bit(fmt: str) -> bool:
    """A 4-bit (or 2-bit) format as such: no mitigation (``+rotate``) and no per-layer mix (``@global``)."""
    return _low_bit(fmt) and "+" not in fmt and "@" not in fmt


def _short_passed(m: dict, fmt: str) -> bool:
    """The short needle passed ``fmt`` on model facts ``m``: not worse at the shortest length in either haystack."""
    return (m["by"][fmt]["short_verdict"] != "worse"
            and m["lengths"][0] not in m["prose"]["by"].get(fmt, {}).get("worse_at", []))


def _refuse_to_skip(models: list[dict]) -> dict:
    """What each rung, run alone, would have let ship: the low-bit formats it passed that another rung showed
    losing needles (worse than full precision at some length in either haystack, or pooled). The answer to chapter 4's check-yourself
    question is the rung with the fewest such false passes."""
    failed = {(m["name"], f) for m in models for f in m["by"] if _low_bit(f) and f not in m["held"]}
    passes = {"ppl": set(), "short": set(), "long": set()}
    for m in models:
        for f, r in m["by"].items():
            if not _low_bit(f):
                continue
            if r["ppl_increase"] is not None and r["ppl_ok"]:
                passes["ppl"].add((m["name"], f))
            prose_at = m["prose"]["by"].get(f, {}).get("worse_at", [])  # each rung is run in both haystacks
            if _short_passed(m, f):
                passes["short"].add((m["name"], f))
            if m["longest"] not in r["worse_at"] and m["longest"] not in prose_at:
                passes["long"].add((m["name"], f))
    false = {k: sorted(v & failed) for k, v in passes.items()}
    md = {k: "; ".join(f"`{f}` on {name}" for name, f in v) or "none" for k, v in false.items()}
    best = min(false, key=lambda k: len(false[k]))
    needles_only = set(false["short"]) & set(false["long"])  # what a short and a longest needle, together, let through
    return {"false": false, "false_md": md, "n_false": {k: len(v) for k, v in false.items()}, "answer": best,
            "n_failed": len(failed), "n_needles_only": len(needles_only)}


def _worse_at_cell(filler: list[int], prose: list[int], pooled_worse: bool) -> str:
    """Where a format was worse, for one model: "4k, 16k; prose 4k", "prose 4k", "pooled" or "never"."""
    parts = ([", ".join(_k(n) for n in filler)] if filler else []) + (
        ["prose " + ", ".join(_k(n) for n in prose)] if prose else [])
    return "; ".join(parts) or ("pooled" if pooled_worse else "never")


def _rungs_md(models: list[dict], fmts: list[str]) -> str:
    """One row per format: per model, the perplexity increase, the short needle's verdict, where it is worse."""
    head = "| format | " + " | ".join(f"{m['name']}: perplexity | short needle ({m['shortest_k']}) | worse at"
                                     for m in models) + " |"
    caption = ("*Filler haystack unless marked. Perplexity in bold where it misses the bar; the short needle's paired verdict; the "
               "lengths where the paired test finds the format worse, each length alone, in the filler haystack and then in "
               "prose (\"prose 4k\", 4.3); \"pooled\": worse only with every length of both haystacks in one test, 4.1.*")
    out = [caption, "", head, "|---" * (1 + 3 * len(models)) + "|"]
    for f in fmts:
        if f == "fp32":
            continue
        cells = []
        for m in models:
            r = m["by"].get(f)
            if r is None:
                cells += ["—"] * 3
                continue
            ppl = "—" if r["ppl_increase"] is None else _pct(r["ppl_increase"])
            cells += [f"**{ppl}**" if r["ppl_increase"] is not None and not r["ppl_ok"] else ppl,
                      "**worse**" if r["short_verdict"] == "worse" else "not worse",
                      _worse_at_cell(r["worse_at"], m["prose"]["by"].get(f, {}).get("worse_at") or [],
                                     m["pooled"][f].verdict == "worse")]
        out.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _smollm2_ladder() -> tuple[dict, dict]:
    """Chapter 4's SmolLM2 ladder sweep (eval_sweep.json) and the engine comparisons: values and claims."""
    import json

    from .endpoint import load as load_side_by_side
    from .endpoint import results as side_results
    from .paths import RESULTS_DIR
    from .results import counts, ladder, llamacpp_time_ratio, llamacpp_vs_kvlab, load_sweep

    sweep = load_sweep()
    E = sweep["formats"]
    lad = {r["kv_format"]: r for r in ladder(sweep, short=512, long_min=max(sweep["lengths"]))}
    n_cell = len(sweep["depths"]) * sweep["trials"]
    v: dict = {"ladder_sweep": sweep, "ladder": lad, "n_cell": n_cell, "n_formats": len(E), "n_depths": len(sweep["depths"]),
               "ladder_minutes": sweep["seconds"] / 60}
    c: dict = {
        "25 formats, each with a prose sweep at 512 and 2048 tokens":
            _claim(len(E) == 25 and sweep["prose_lengths"] == [512, 2048] and all(E[n]["prose_result"].rows for n in E)),
        "at least 25 prompts per format and length, up to 8192 tokens, 5 depths":
            _claim(n_cell >= 25 and max(sweep["lengths"]) >= 8192 and len(sweep["depths"]) >= 5),
        "the teacher rung is 2 golden prompts, 16 new tokens each":
            _claim(len(E["fp32"]["teacher"]["first_divergence"]) == 2 and E["fp32"]["teacher"]["max_new_tokens"] == 16),
    }
    # 4.3: the prose haystack in the ladder sweep (counts per cell: intervals, not paired verdicts)
    P0, P = min(sweep["prose_lengths"]), max(sweep["prose_lengths"])
    pr = {n: (E[n]["prose_result"].accuracy(P0), E[n]["prose_result"].accuracy(P)) for n in E if E[n]["prose_result"].rows}
    fine = ["fp8_e4m3", "int8", "int4", "int4_token", "q4_0"]
    v |= {"pr": pr, "P0": P0, "P": P, "pr_fine_lo": min(pr[n][1] for n in fine), "pr_fine_hi": max(pr[n][1] for n in fine)}
    c |= {
        "in SmolLM2's prose haystack full precision itself drops over 20 points with length":
            _claim(pr["fp32"][1] < pr["fp32"][0] - 0.2, pr["fp32"]),
        "FP8, INT8 and the finer INT4 formats stay within three prompts of full precision there":
            _claim(all(abs(pr[n][1] - pr["fp32"][1]) <= 3 / n_cell for n in fine), {n: pr[n] for n in fine}),
        "INT4 per tensor and KIVI-2 fall well below it": _claim(pr["int4_tensor"][1] < pr["fp32"][1] - 0.3
                                                               and pr["kivi-2"][1] < pr["fp32"][1] - 0.2),
    }
    # 4.4: the prompt reading the quantized cache, at 2048 tokens
    n_pf, order = 2048, ["fp8_e4m3", "int8", "q4_0", "int4", "int4_token", "kivi-2", "int4_tensor"]
    pf = {n: (counts(E[n]["passkey"], length=n_pf), counts(sweep["prefill_cached"][n], length=n_pf))
          for n in order if n in sweep["prefill_cached"]}
    acc = {n: (a[0] / a[1], b[0] / b[1]) for n, (a, b) in pf.items()}
    held = ["fp8_e4m3", "int8", "q4_0", "int4", "int4_token"]
    v |= {"pf": pf, "pf_length": n_pf, "acc": acc, "pf_held_md": ", ".join(f"`{n}` {acc[n][1]:.0%}" for n in held),
          "pf_n_full": pf["int4_tensor"][0][1], "pf_n_cached": pf["int4_tensor"][1][1]}
    c |= {
        "25 prompts with the prompt in full precision, 10 with it quantized":
            _claim(all(a[1] == 25 and b[1] == 10 for a, b in pf.values())),
        "a quantized prompt costs INT4 per tensor and KIVI-2 over 30 points":
            _claim(all(acc[n][1] < acc[n][0] - 0.3 for n in ["int4_tensor", "kivi-2"]), acc),
        "FP8, INT8, q4_0 and the finer INT4 formats hold within 10 points":
            _claim(all(acc[n][1] >= acc[n][0] - 0.1 for n in held), acc),
    }
    # 4.5: mitigations on SmolLM2: needles at 512 tokens from the ladder sweep, perplexity from the paired sweep
    from .results import LONG_SWEEPS, LongSweep

    r = lad
    try:
        paired = LongSweep.load(LONG_SWEEPS["smollm2-135m"])
        ppl = {f: paired.paired_perplexity(f)["increase"] for f in paired.formats if f != "fp32"}
    except (FileNotFoundError, KeyError):
        paired, ppl = None, {f: x["ppl_increase"] for f, x in lad.items()}
    v["smol_ppl"] = ppl
    c |= {
        "rotation lifts INT4 per tensor's short needle by 20+ points":
            _claim(r["int4_tensor+rotate"]["needle_short"] > r["int4_tensor"]["needle_short"] + 0.2),
        "and halves its perplexity cost": _claim(ppl["int4_tensor+rotate"] < ppl["int4_tensor"] / 2),
        "rotation cuts INT4 per token's perplexity cost threefold":
            _claim(ppl["int4_token+rotate"] < ppl["int4_token"] / 3),
        "KIVI-4 < groups of 16 < int4 in perplexity cost": _claim(ppl["kivi-4"] < ppl["int4_g16"] < ppl["int4"]),
        "a zero point per token at least halves the cost": _claim(ppl["int4"] < ppl["int4_token"] / 2),
        "sinks help, less than rotation": _claim(ppl["int4_token+rotate"] < ppl["int4_token+sinks4"] < ppl["int4_token"]),
    }
    v |= {"L_smol": max(sweep["lengths"])}
    try:
        if paired is None:
            raise FileNotFoundError
        # the ladder read the first LADDER_PPL_WINDOWS held-out windows: compare on those same windows
        diffs = {f: abs(paired.paired_perplexity(f, windows=LADDER_PPL_WINDOWS)["increase"] - lad[f]["ppl_increase"])
                 for f in lad if f != "fp32" and f in paired.formats}
        v["ppl_gap"] = max(diffs.values())
        v["ladder_ppl_windows"] = LADDER_PPL_WINDOWS
        # ... and what reading other passages does: q4_0 on the first windows against all of them, one run
        v["ppl_q4_first"] = paired.paired_perplexity("q4_0", windows=LADDER_PPL_WINDOWS)["increase"]
        # the formats whose side of the bar depends on which of the two runs you read
        v["ppl_straddle"] = sorted(f for f in diffs if (paired.paired_perplexity(f)["increase"] <= PPL_TOLERANCE)
                                   != (lad[f]["ppl_increase"] <= PPL_TOLERANCE))
        v["ppl_straddle_md"] = names_md(v["ppl_straddle"])
        # ... and on the same first passages, where only the code differs
        v["ppl_straddle_same_md"] = names_md(sorted(
            f for f in diffs if (paired.paired_perplexity(f, windows=LADDER_PPL_WINDOWS)["increase"] <= PPL_TOLERANCE)
            != (lad[f]["ppl_increase"] <= PPL_TOLERANCE)))
    except (FileNotFoundError, KeyError):
        v["ppl_gap"], v["ladder_ppl_windows"], v["ppl_straddle"], v["ppl_straddle_md"] = None, LADDER_PPL_WINDOWS, [], "none"
        v["ppl_straddle_same_md"] = "none"
        v["ppl_q4_first"] = None
    # 4.7: what each rung misses
    kl_gain = lad["int4_token"]["kl"] / lad["int4_token+residual128"]["kl"]
    res_long, tok_long = lad["int4_token+residual128"]["needle_long"], lad["int4_token"]["needle_long"]
    chain = sweep["chain2_fp32"]
    chain_acc = sum(x["correct"] for x in chain) / sum(x["trials"] for x in chain)
    v |= {"kl_gain": kl_gain, "res_long": res_long, "tok_long": tok_long, "chain_acc": chain_acc,
          "chain_prompts": sum(x["trials"] for x in chain), "bf16_first": min(E["bf16"]["teacher"]["first_divergence"])}
    c |= {
        "a residual window cuts INT4 per token's KL over 5x and leaves its long needle within 3 prompts":
            _claim(kl_gain > 5 and abs(res_long - tok_long) <= 0.12, (kl_gain, res_long, tok_long)),
        "SmolLM2 cannot follow a 2-hop chain even in full precision": _claim(chain_acc < 0.3, chain_acc),
    }
    # appendix: transformers' QuantizedCache (quanto, HQQ), llama.cpp, two llama.cpp servers
    eng = json.loads((RESULTS_DIR / "engines_quanto.json").read_text())
    i4, i2 = eng["formats"]["hf-int4"], eng["formats"]["hf-int2"]
    rate2 = {side: sum(x for x, _ in i2[side].values()) / sum(t for _, t in i2[side].values()) for side in ("engine", "kvlab")}
    hq = json.loads((RESULTS_DIR / "engines_hqq.json").read_text())
    h4, h2 = hq["formats"]["hqq-int4"], hq["formats"]["hqq-int2"]

    def passkeys(row, side):
        return sum(x for x, _ in row[side].values()), sum(t for _, t in row[side].values())

    llama = json.loads((RESULTS_DIR / "engines_llamacpp.json").read_text())
    side = llamacpp_vs_kvlab(llama, sweep)

    def rate(x):
        return x[0] / x[1]

    gap = {(ct, n): rate(x["llama.cpp"]) - rate(x["kvlab"]) for ct, rr in side.items() for n, x in rr["lengths"].items()}
    max_gap, point = max(abs(g) for g in gap.values()), llama["trials"] * len(llama["depths"])  # prompts a point
    drop = {who: {(ct, n): rate(side["f16"]["lengths"][n][who]) - rate(side[ct]["lengths"][n][who])
                  for ct in side for n in side[ct]["lengths"]} for who in ("llama.cpp", "kvlab")}
    srv = load_side_by_side(RESULTS_DIR / "engines_llamacpp_server.json")
    res = side_results(srv)
    t_url, s_url = srv["teacher"], srv["student"]
    sacc = {u: rr.accuracy() for u, rr in res.items()}
    n_srv = sum(x["trials"] for x in res[t_url].rows)
    v |= {"eng": eng, "i4": i4, "i2": i2, "rate2": rate2, "hq": hq, "h4": h4, "h2": h2,
          "h2_engine": passkeys(h2, "engine"), "h2_kvlab": passkeys(h2, "kvlab"),
          "llama": llama, "side": side, "max_drop_llama": 100 * max(abs(d) for d in drop["llama.cpp"].values()),
          "max_drop_kvlab": 100 * max(abs(d) for d in drop["kvlab"].values()), "max_gap": max_gap,
          "max_gap_f16": max(abs(g) for (ct, _), g in gap.items() if ct == "f16"),
          "llama_point_prompts": point, "max_gap_prompts": round(max_gap * point),
          "q4_slow": llamacpp_time_ratio(llama["cache_types"], "q4_0"),
          "srv": srv, "srv_results": res, "srv_acc_t": sacc[t_url], "srv_acc_s": sacc[s_url], "srv_prompts": n_srv,
          "srv_disagree": len(srv["disagreements"]), "srv_ag": srv["agreement"],
          "srv_sec_t": srv["seconds_per_request"][t_url], "srv_sec_s": srv["seconds_per_request"][s_url],
          "srv_sec_ratio": srv["seconds_per_request"][s_url] / srv["seconds_per_request"][t_url]}
    c |= {
        "llama.cpp's q4_0 cache was over 2x slower than f16 on this CPU in both runs":
            _claim(min(v["q4_slow"], v["srv_sec_ratio"]) > 2, (v["q4_slow"], v["srv_sec_ratio"])),
        "at 4 bits kvlab reproduces the engine token for token":
            _claim(i4["identical"] == i4["prompts"] and i4["mean_kl"] < 0.01, i4["mean_kl"]),
        "at 4 bits both retrieve the same passkeys": _claim(i4["engine"] == i4["kvlab"]),
        "at 2 bits the two visibly disagree": _claim(i2["identical"] < i2["prompts"] / 2 and i2["mean_kl"] > 0.1, i2["mean_kl"]),
        "but both fail the passkey": _claim(max(rate2.values()) <= 0.2, rate2),
        "at 4 bits HQQ and kvlab's per-token emulation give the same greedy tokens":
            _claim(h4["identical"] == h4["prompts"], h4["identical"]),
        "and both retrieve every passkey":
            _claim(passkeys(h4, "engine") == passkeys(h4, "kvlab") == (h4["prompts"], h4["prompts"])),
        "at 2 bits they part ways (KL over 0.5)": _claim(h2["mean_kl"] > 0.5, h2["mean_kl"]),
        "at 2 bits neither side retrieves more than half the passkeys":
            _claim(max(passkeys(h2, "engine")[0], passkeys(h2, "kvlab")[0]) <= h2["prompts"] / 2),
        "llama.cpp and kvlab agree within 10 points in every cell": _claim(all(abs(g) <= 0.1 for g in gap.values()), gap),
        "in llama.cpp, q8_0 and q4_0 retrieve within 10 points of f16 at every length":
            _claim(max(abs(d) for d in drop["llama.cpp"].values()) <= 0.1, drop),
        "every (format, length) cell is compared": _claim(len(drop["kvlab"]) == sum(len(rr["lengths"]) for rr in side.values())),
        "every request was answered": _claim(all(not e for e in srv["errors"].values())),
        "the servers counted the intended prompt lengths (within 2 tokens)":
            _claim(max(srv["length_check"].values()) <= 2, srv["length_check"]),
        "q4_0 retrieves within 2 prompts of f16": _claim(abs(sacc[s_url] - sacc[t_url]) <= 2 / n_srv, sacc),
        "the next-token distributions still differ measurably": _claim(srv["agreement"]["mean_topk_kl"] > 0),
    }
    return v, c


def where_int4_breaks(sweeps: dict | None = None) -> Facts:
    """Chapter 4: which formats each model's paired long-context sweep finds worse than full precision, where."""
    from .formats import get_format
    from .results import PPL_TOLERANCE, fewest_prompts_to_detect, load_long_sweeps

    sweeps = sweeps if sweeps is not None else load_long_sweeps()
    values: dict = {"sweeps": sweeps, "ppl_tolerance": PPL_TOLERANCE, "figure_formats": CH4_FIGURE}
    for model, sw in sweeps.items():
        values[CH4_KEYS.get(model, model)] = _model_facts(sw)
    values["provenance_md"] = "\n".join(
        f"* **{m['name']}**: lengths {m['lengths_text']} (filler), {m['prompts']} identical prompts a point "
        f"(5 depths), {len(m['by']) + 1} formats; {m['hours']:.1f} hours of sweep so far on {m['machine']} "
        f"({m['date']}, torch {m['torch']}, transformers {m['transformers']})"
        for m in (values[CH4_KEYS.get(k, k)] for k in sweeps))
    keys = [CH4_KEYS.get(k, k) for k in sweeps]
    values["table_formats"] = list(dict.fromkeys(f for k in sweeps for f in sweeps[k].formats))
    values["rungs_md"] = _rungs_md([values[k] for k in keys], values["table_formats"])
    ladder_values, ladder_claims = _smollm2_ladder()
    values |= ladder_values
    # the engines' formats added to both sweeps later (--add-formats): chapter 6 reads them, this chapter names them
    values["added_md"] = names_md(list(dict.fromkeys(f for sw in sweeps.values() for f in sw.added_formats)))
    # a zero point per token and head (LMDeploy's INT4, added to the sweeps later) on each model's passages
    values["zero_point_ppl"] = {CH4_KEYS.get(k, k): sw.paired_perplexity("lmdeploy-int4")["increase"]
                                for k, sw in sweeps.items() if "lmdeploy-int4" in sw.all_formats}
    values["q"] = _refuse_to_skip([values[k] for k in keys])
    from .budget import load_shape

    layers = load_shape("gemma-3-270m").layers  # how many of Gemma's layers see the whole context, how far the rest
    values["gemma_layers"] = {"all": len(layers), "global": sum(x.window is None for x in layers),
                              "sliding": sum(x.window is not None for x in layers),
                              "window": max(x.window or 0 for x in layers)}
    # never worse on the needle: in the filler haystack, in prose where the format ran there, and pooled
    held_low = [(values[k]["name"], f) for k in keys for f in values[k]["held"] if _low_bit(f)]
    alarms = [(n, f) for n, f in held_low if not values[CH4_KEYS[next(m for m in sweeps if CH4_NAMES.get(m) == n)]]["by"][f]["ppl_ok"]]
    values |= {"n_held_low": len(held_low), "n_alarms": len(alarms),
               "alarms_md": "; ".join(f"`{f}` on {n}" for n, f in alarms) or "none",
               "n_tests": sum(1 for k in keys for st in (values[k], values[k]["prose"], values[k]["cached"],
                                                          values[k]["multikey"], values[k]["orders"])
                             for f, _ in st.get("cell", {}) if f != "fp32"), "min_detect": fewest_prompts_to_detect(),
               "undetectable": fewest_prompts_to_detect() - 1}
    values["chance_cells"] = int(0.05 * values["n_tests"])  # the most chance "worse" cells p < 0.05 allows on average
    values["formats_md"] = _formats_md(values["figure_formats"][:3] + ["q8_0"] + values["figure_formats"][3:]
                                       + list(CH4_MITIGATIONS))
    on_bar = [f"`{f}` on {values[k]['name']}" for k in keys for f in values[k]["ppl_on_bar"]]
    # none on the bar: name the format whose interval's low end comes nearest to it from above
    above = [(lo - PPL_TOLERANCE, f, values[k]["name"], lo) for k in keys
             for f, lo in values[k]["perplexity_lo"].items() if lo > PPL_TOLERANCE]
    nearest = min(above, default=None)
    values["on_bar_md"] = "; ".join(on_bar) or (
        f"no format here: the nearest, `{nearest[1]}` on {nearest[2]}, has {nearest[3]:+.1%} at the interval's low end"
        if nearest else "no format here")
    values["flags_md"] = _flags_md([values[k] for k in keys], list(dict.fromkeys(
        values["figure_formats"][:3] + ["q8_0"] + values["figure_formats"][3:] + ["int4_g16", "int4_token+rotate"])))
    for model in sweeps:
        m = values[CH4_KEYS.get(model, model)]
        m["mitigations_md"] = _mitigations_md(m)
        for v in ("better", "worse", "not distinguishable"):
            key = {"better": "helped", "worse": "hurt", "not distinguishable": "none"}[v]
            m[f"vs_base_{key}"] = [f for f, d in m["vs_base"].items() if d["verdict"] == v]
            m[f"vs_base_{key}_md"] = names_md(m[f"vs_base_{key}"])
        both = [f for f in m["vs_base"] if f in m["vs_base_prose"]]
        diff = [f for f in both if m["vs_base"][f]["verdict"] != m["vs_base_prose"][f]["verdict"]]
        m["vs_base_prose_n"], m["vs_base_prose_same"] = len(both), len(both) - len(diff)
        m["vs_base_prose_diff_md"] = "" if not diff else "; not for " + ", ".join(
            f"`{f}` ({m['vs_base_prose'][f]['verdict']} in prose)" for f in diff)
        m["helped_still_worse"] = [f for f in m["vs_base_helped"] if m["by"][f]["worse_at"]]
        m["helped_still_worse_md"] = names_md(m["helped_still_worse"])
        m["head_dim"] = CH4_HEAD_DIM.get(model)
        m["per_scale"] = {f: values_per_scale(f, m["head_dim"]) for f in CH4_FIGURE if m["head_dim"]}
    for key in keys:  # what each model's longest length shows, and whether any loss grows steadily with length
        m = values[key]
        L, cell = m["longest"], m["cell"]
        m["worse_at_longest"] = [f for f in m["by"] if cell.get((f, L), {}).get("verdict") == "worse"]
        m["worse_at_longest_md"] = names_md(m["worse_at_longest"])
        m["ref_longest"] = m["ref"][L]
        m["lost_gained"] = {f: [(cell[f, n]["lost"], cell[f, n]["gained"]) for n in m["lengths"] if (f, n) in cell]
                            for f in m["by"]}
        # the share of full precision's correct answers a format lost, by length (lost is bounded by what
        # full precision got right, which falls at the window's end)
        m["lost_share"] = {f: [cell[f, n]["lost"] / max(1, m["ref"][n][0]) for n in m["lengths"] if (f, n) in cell]
                           for f in m["by"]}
        upto = [n for n in m["lengths"] if n <= CH4_COMMON_LONGEST]
        lost = {f: [x[0] for x in lg] for f, lg in m["lost_gained"].items()}

        def rises(xs):
            return len(xs) > 2 and all(a < b for a, b in zip(xs, xs[1:]))

        def grows(f, n_steps, lost=lost, m=m, cell=cell):
            # more prompts lost at every step, counted and as a share of what full precision found (a share
            # that rises only because full precision fell is not growth), ending worse by the paired test
            k = min(n_steps, len(lost[f]))
            return rises(lost[f][:k]) and rises(m["lost_share"][f][:k]) \
                and cell.get((f, m["lengths"][k - 1]), {}).get("verdict") == "worse"

        m["grows_common"] = [f for f in m["by"] if f in lost and grows(f, len(upto))]
        # how far each keeps growing, and what the longest length shows
        m["grows_to"] = {f: max(k for k in range(len(upto), len(m["lengths"]) + 1) if grows(f, k))
                         for f in m["grows_common"]}
        m["grows_common_md"] = ", ".join(
            f"`{f}` ({', '.join(str(x) for x in lost[f][:m['grows_to'][f]])} lost, to {_k(m['lengths'][m['grows_to'][f] - 1])})"
            for f in m["grows_common"]) or "none"
        m["grows_names_md"] = names_md(m["grows_common"], empty="no format")
        m["lost_md"] = {f: ", ".join(str(x) for x in xs) for f, xs in lost.items()}
        m["prose_status"] = {f: m["prose"]["status"].get(f, "not run in prose") for f in m["by"]}
        m["prose_spared"] = [f for f, r in m["prose"]["by"].items() if not r["worse_at"] and m["by"][f]["worse_at"]]
        m["prose_spared_md"] = names_md(m["prose_spared"])
        m["single_cell"] = [f for f, r in m["by"].items() if len(r["worse_at"]) == 1]
        m["single_cell_md"] = ", ".join(
            f"`{f}` ({_k(m['by'][f]['worse_at'][0])}; pooled −{m['pooled'][f].lost} +{m['pooled'][f].gained}, "
            f"p = {m['pooled'][f].p:.2g})" for f in m["single_cell"]) or "none"
        m["longest_grow_k"] = _k(m["lengths"][max(m["grows_to"].values(), default=len(upto)) - 1])
        m["shrinks_at_longest"] = [f for f in m["grows_common"] if m["grows_to"][f] < len(m["lengths"])
                                   and lost[f][-1] < max(lost[f])]
        m["common_longest_k"] = _k(upto[-1])
        m["flipped_at_longest"] = [f for f in m["by"] if (f, L) in cell and cell[f, L]["gained"] >= 2]
        m["flipped_at_longest_md"] = names_md(m["flipped_at_longest"])
        m["int4_at"] = ", ".join(_k(n) for n in m["by"]["int4"]["worse_at"]) or "no length" if "int4" in m["by"] else "—"
        m["int4_cells"] = len(m["by"]["int4"]["worse_at"]) if "int4" in m["by"] else 0
        m["int4_pooled"] = m["pooled"].get("int4")
        m["int4_one_in"] = round(m["int4_pooled"].prompts / m["int4_pooled"].lost) if m["int4_pooled"] and m["int4_pooled"].lost else None
        m["n_lengths"] = len(m["lengths"])
    values["prose_md"] = _stage_md([values[k] for k in keys], "prose")
    values["cached_md"] = _stage_md([values[k] for k in keys], "cached")
    values["multikey_md"] = _stage_md([values[k] for k in keys], "multikey")
    values["orders_md"] = _stage_md([values[k] for k in keys], "orders")
    from .tasks import ORDER_RECORDS

    swept = {r.get("records") for m in values["sweeps"].values() for r in m.records if r["stage"] == "orders"}
    if len(swept) > 1:
        raise ValueError(f"the order-records rung ran with different record counts: {sorted(swept)}")
    values["order_records"] = swept.pop() if swept else ORDER_RECORDS
    # formats never worse on a single needle (either haystack) that the order-records rung found worse
    values["orders_new_md"] = "not measured yet" if not any(values[k]["orders"]["measured"] for k in keys) else "; ".join(
        f"`{f}` on {values[k]['name']}" for k in keys for f, r in values[k]["orders"]["by"].items()
        if r["worse_at"] and f in values[k]["held"]) or "none"
    # the rung's lengths pooled into one paired test per format: full precision's low rate leaves one length's
    # test few prompts a format could lose
    for st in ("multikey", "orders"):
        for k in keys:
            m = values[k]
            m[f"{st}_pooled_worse"] = [f for f, pr in m[f"{st}_pooled"].items() if pr.verdict == "worse"]
        values[f"{st}_pooled_md"] = "; ".join(
            f"{names_md(values[k][f'{st}_pooled_worse'])} on {values[k]['name']}" for k in keys
            if values[k][st]["measured"])
        values[f"{st}_pooled_new"] = [f"`{f}` on {values[k]['name']}" for k in keys
                                      for f in values[k][f"{st}_pooled_worse"] if f in values[k]["held"]]
        values[f"{st}_pooled_new_md"] = "; ".join(values[f"{st}_pooled_new"]) or "none"
    od = [values[k] for k in keys if values[k]["orders"]["measured"]]
    any_worse = any(f for m in od for f, r in m["orders"]["by"].items() if r["worse_at"])
    values["orders_summary_md"] = "" if not od else (
        "\n* **A product-like rung:** a tool call that must copy one of several order records' IDs from retrieved "
        "documents (4.3). "
        "Full precision found " + "; ".join(f"{m['orders']['ref_text']} on {m['name']}" for m in od)
        + ("; no format was worse than full precision there." if not any_worse else
           ". Worse than full precision on this rung: "
           + "; ".join(f"{m['orders']['short_md'] if not m['orders']['later'] else m['orders']['short_md'] + ', ' + m['orders']['later_md']} on {m['name']}" for m in od)
           + (", each already worse on a single needle" if values["orders_new_md"] == "none"
              else f"; worse here and on no single needle: {values['orders_new_md']}")
           + f". Pooled over its lengths: {values['orders_pooled_md']}; of these, never worse on a single needle: "
             f"{values['orders_pooled_new_md']}.")
        + " Where full precision answers few prompts, a format can lose only those, so a clean verdict there says "
          "little (4.3 pools the rung's lengths).")
    for k in keys:  # each format's two prefill modes on the same prompts, by the chapter's one paired rule
        m = values[k]
        modes = {f: v["paired"] for f, v in m["cached_vs_full"].items()}
        worse = [f for f, pr in modes.items() if pr.verdict == "worse"]
        m["cached_modes_worse"] = worse
        # the family: every format's two modes at every length; a verdict there that Holm would withdraw is said so
        from .results import holm

        kept = dict(zip(modes, holm([pr.p for pr in modes.values()]))) if modes else {}
        m["cached_modes_holm"] = kept
        apart = [f for f, pr in modes.items() if pr.verdict != "not distinguishable"]
        n_f = len({f.split()[0] for f in modes})
        family = f"the {len(modes)} comparisons of the two modes on {m['name']} ({n_f} formats × {len(modes) // max(n_f, 1)} lengths)"
        m["cached_modes_holm_md"] = "" if not apart else (
            ". Counted among " + family + ", Holm's correction (see the glossary) "
            + " and ".join(f"{'keeps' if kept[f] else 'withdraws'} `{f.split()[0]}` at {_k(int(f.split()[1]))}"
                           for f in apart))
        # each format's two modes pooled over every length measured (distinct prompts at each length)
        pooled = m["cached_modes_pooled_paired"]
        pk = dict(zip(pooled, holm([pr.p for pr in pooled.values()]))) if pooled else {}
        m["cached_modes_pooled"] = {f: (pr.lost, pr.gained, pr.p, pr.verdict, pk[f]) for f, pr in pooled.items()}
        differ = [f for f, v in m["cached_modes_pooled"].items() if v[3] != "not distinguishable"]
        m["cached_modes_pooled_md"] = "" if len(m["cached"]["lengths"]) < 2 else (
            " Pooled over " + " and ".join(_k(n) for n in m["cached"]["lengths"])
            + " (the same test on every prompt of " + ("both" if len(m["cached"]["lengths"]) == 2 else "all")
            + " lengths), the two modes "
            "compared: " + ", ".join(f"`{f}` −{lo} +{ga} (p = {p_:.3f}{', ' + v + ' with the prompt reading the cache' if v != 'not distinguishable' else ''})"
                                     for f, (lo, ga, p_, v, _) in m["cached_modes_pooled"].items())
            + ("" if not differ else "; Holm's correction over these " + str(len(pooled)) + " "
               + " and ".join(f"{'keeps' if m['cached_modes_pooled'][f][4] else 'withdraws'} `{f}`'s" for f in differ))
            + ".")
        # the same, one length at a time ({G[cached_modes_at][8192]} in a template)
        m["cached_modes_at"] = {n: _modes_md({f: pr for f, pr in modes.items() if f.endswith(f" {n}")})
                                + (m["cached_modes_holm_md"] if any(f.endswith(f" {n}") for f in apart) else "")
                                for n in m["cached"]["lengths"]}
        m["cached_modes_worse_at"] = {n: [f for f in worse if f.endswith(f" {n}")] for n in m["cached"]["lengths"]}
        m["cached_at_md"] = {n: _cached_at_md(m, n) for n in m["cached"]["lengths"]}
        # worse than full precision with the prompt reading the cache, not worse there with it in full precision
        m["cached_new"] = [key for key in m["cached_vs_full"] if m["cached"]["c"][key]["verdict"] == "worse"
                           and m["c"].get(key, {}).get("verdict") != "worse"]
        better_ref = [key for key in m["cached_vs_full"] if m["cached"]["c"][key]["verdict"] == "better"]
        worse_ref = [key for key in m["cached_vs_full"] if m["cached"]["c"][key]["verdict"] == "worse"]
        m["cached_brief_md"] = "" if not modes else (
            f"On {m['name']} ({m['cached']['lengths_text']}), "
            + ("; ".join(f"`{key.split()[0]}` was worse than full precision at {_k(int(key.split()[1]))} with the prompt "
                         f"reading the cache (−{m['cached']['c'][key]['lost']} +{m['cached']['c'][key]['gained']}) and "
                         "not with the prompt in full precision (the verdicts differ; whether the modes do is the direct comparison "
                         "that follows)" for key in m["cached_new"])
               if m["cached_new"] else
               ("the formats worse than full precision in this mode, " + _keys_md(worse_ref)
                + ", were already worse with the prompt in full precision" if worse_ref
                else "no format was worse than full precision in this mode"))
            + ("; " + "; ".join(f"`{key.split()[0]}` answered more prompts than full precision at {_k(int(key.split()[1]))} "
                                f"with the prompt reading the cache (−{m['cached']['c'][key]['lost']} "
                                f"+{m['cached']['c'][key]['gained']})" for key in better_ref) if better_ref else "")
            + "; against the same format with a full-precision prefill, " + _modes_holm_md(modes, kept, family)
            + ("" if not [f for f, v in m["cached_modes_pooled"].items() if v[3] != "not distinguishable" and v[4]] else
               "; pooled over both lengths, " + ", ".join(
                   f"`{f}` was {v[3]} with the prompt reading the cache (−{v[0]} +{v[1]}, p = {v[2]:.3f}, kept by Holm's correction over the " f"{len(m['cached_modes_pooled'])} pooled comparisons)"
                   for f, v in m["cached_modes_pooled"].items() if v[3] != "not distinguishable" and v[4])))
    # formats the single-needle stages never found worse that the two-key rung did
    values["multikey_new"] = [(values[k]["name"], f) for k in keys for f in values[k]["multikey"]["by"]
                              if values[k]["multikey"]["by"][f]["worse_at"] and f in values[k]["held"]]
    values["multikey_new_md"] = "; ".join(f"`{f}` on {n}" for n, f in values["multikey_new"]) or "none"
    values["multikey_measured"] = [values[k]["name"] for k in keys if values[k]["multikey"]["measured"]]
    mk = [values[k] for k in keys if values[k]["multikey"]["measured"]]
    values["multikey_summary_md"] = "" if not mk else (
        ("* **A two-key rung found nothing new.** " if not values["multikey_new"] and values["multikey_pooled_new_md"] == "none"
         else "* **A two-key rung found more.** ")
        + "With two named pass keys in the haystack (4.3), where full precision itself found only "
        + "; ".join(f"{m['multikey']['ref_text']} on {m['name']}" for m in mk)
        + ", the formats worse than full precision were "
        + "; ".join(f"{m['multikey']['short_md'] if not m['multikey']['later'] else m['multikey']['short_md'] + ', ' + m['multikey']['later_md']} on {m['name']}" for m in mk)
        + (": every one already worse on a single needle" if not values["multikey_new"]
           else f"; worse there only: {values['multikey_new_md']}")
        + f". Pooled over its lengths: {values['multikey_pooled_md']}; of these, never worse on a single needle: "
          f"{values['multikey_pooled_new_md']}. With full precision that low, this rung can show fewer losses than the "
          "single needle, so read it as a check, not a stricter test.")

    G = values.get("G")
    S = values.get("S")
    values["S_int4_token_lost"] = None if S is None else sum(lost for lost, _ in S["lost_gained"]["int4_token"])
    s_sweep = next((sw for m, sw in sweeps.items() if CH4_KEYS.get(m, m) == "S"), None)
    values["S_int4_token_prose_lost"] = (s_sweep.paired_pooled("prose", "int4_token").lost
                                         if s_sweep is not None and s_sweep.lengths("prose") else None)
    # SmolLM2's paired prompt-reads-the-cache stage, once swept: each format against full precision, and against
    # its own full-prefill answers on the same prompts
    values["s_cached_sentence_md"] = "" if S is None or not S["cached"]["measured"] else "".join(
        f"\n\nOn {S['name']}, {md}" for md in S["cached_at_md"].values())
    # Gemma's cached stage past 8k (4.4's 8k paragraph is written out; longer lengths join as they finish)
    values["g_cached_long_md"] = "" if G is None else "".join(
        f"\n\nOn {G['name']}, {md}" + _direction_md(G, n) for n, md in G["cached_at_md"].items() if n != 8192) \
        + ("" if G is None else G["cached_modes_pooled_md"])
    ran = [values[k] for k in keys if values[k].get("cached_brief_md")]
    worse_any = list(dict.fromkeys(key.split()[0] for m in ran for key, c in m["cached"]["c"].items()
                                   if c["verdict"] == "worse"))
    fine = [f for f in dict.fromkeys(key.split()[0] for m in ran for key in m["cached"]["c"]) if f not in worse_any]
    values["cached_brief_md"] = ("In short: " + (names_md(worse_any) + (" was" if len(worse_any) == 1 else " were")
                                                   + " worse than full precision in this mode" if worse_any
                                                   else "no format was worse than full precision in this mode")
                                 + (f"; {names_md(fine)} {'was' if len(fine) == 1 else 'were'} not, at any length"
                                    f" measured on {'either model' if len(ran) == 2 else 'any model'}"
                                    if fine and worse_any else "")
                                 + ". " + ". ".join(m["cached_brief_md"] for m in ran)) if ran else "Not run yet"
    # where SmolLM2 ran with the prompt reading its cache: the paired stage's lengths, and the ladder's unpaired run
    values["s_cached_md"] = ((f"{S['cached']['lengths_text']} (paired) and " if S is not None and S["cached"]["measured"]
                              else "") + f"{values['pf_length']:,} tokens (unpaired)")
    values["g16_bits"] = get_format("int4_g16").bits_per_element(128)
    g_claims = {} if G is None else {
        "on Gemma q4_0 and int4_g16 are never worse": _claim({"q4_0", "int4_g16"} <= set(G["never"]), G["never"]),
        "pooled, int4 lost over 15% of Gemma's prompts and was clearly worse (p < 0.001)":
            _claim(G["int4_pooled"].lost > 0.15 * G["int4_pooled"].prompts and G["int4_pooled"].p < 1e-3,
                   G["int4_pooled"]),
        "groups of 16 held on both models, groups of 32 (q4_0) on Gemma only, the 64-value int4 on neither":
            _claim("int4_g16" in S["held"] and "int4_g16" in G["held"] and "q4_0" in G["held"] and "q4_0" not in S["held"]
                   and "int4" not in S["held"] and "int4" not in G["held"], (S["held"], G["held"])),
        "on Gemma int4 passes the short needle and is worse at a longer length": _claim("int4" in G["later"], G["later"]),
        "on Gemma int4_token is worse at every length": _claim(G["by"]["int4_token"]["worse_at"] == G["lengths"],
                                                               G["by"]["int4_token"]["worse_at"]),
        "on Gemma full precision finds fewer needles at the longest length than at any shorter one":
            _claim(all(G["ref_longest"][0] / G["ref_longest"][1] < c / t for n, (c, t) in G["ref"].items()
                       if n != G["longest"]), G["ref"]),
        "at Gemma's longest length some formats find needles full precision missed": _claim(bool(G["flipped_at_longest"])),
        "on Gemma the residual window's, the rotated per-tensor format's and the global-only mix's losses grow to 8k":
            _claim({"int4_token+residual128", "int4_tensor+rotate", "int4_token@global"} <= set(G["grows_common"]),
                   G["grows_common"]),
        "on Gemma at 8k, with the prompt quantized too q4_0 and per-token INT4 found fewer needles, FP8 and INT8 not fewer":
            _claim(G["cached"]["measured"] and all(
                (G["cached_vs_full"][f"{f} 8192"]["cached"][0] < G["cached_vs_full"][f"{f} 8192"]["full"][0])
                == (f in ("q4_0", "int4_token")) for f in ("fp8_e4m3", "int8", "q4_0", "int4_token")),
                G["cached_vs_full"]),
        "on Gemma at 8k no format's quantized prefill is distinguishable from its full prefill on the same prompts":
            _claim(G["cached"]["measured"] and not G["cached_modes_worse_at"].get(8192, ["not measured"]),
                   G["cached_vs_full"]),
        "on Gemma at 8k with the prompt quantized, q4_0 is still not worse than full precision; per-token INT4 is":
            _claim(G["cached"]["measured"] and G["cached"]["c"]["q4_0 8192"]["verdict"] != "worse"
                   and G["cached"]["c"]["int4_token 8192"]["verdict"] == "worse", G["cached"]["status"]),
        "on Gemma at 32k with the prompt reading the cache, per-token INT4 is worse than full precision and FP8, INT8 "
        "and q4_0 are not; FP8's gain over its own full prefill does not survive Holm":
            _claim(32768 in G["cached"]["lengths"]
                   and [f for f in ("fp8_e4m3", "int8", "q4_0", "int4_token")
                        if G["cached"]["c"][f"{f} 32768"]["verdict"] == "worse"] == ["int4_token"]
                   and not G["cached_modes_holm"].get("fp8_e4m3 32768", True), G["cached"]["status"]),
        "pooled over 8k and 32k, only per-token INT4's two prefill modes differ on Gemma, kept by Holm (worse with "
        "the prompt reading the cache)":
            _claim([f for f, v in G["cached_modes_pooled"].items() if v[3] != "not distinguishable" and v[4]]
                   == ["int4_token"] and G["cached_modes_pooled"]["int4_token"][3] == "worse", G["cached_modes_pooled"]),
        "on Gemma every growing loss keeps growing past 8k and is smaller at 32k, where full precision falls":
            _claim(G["grows_common"] and all(G["grows_to"][f] > len([n for n in G["lengths"] if n <= CH4_COMMON_LONGEST])
                                            for f in G["grows_common"])
                   and set(G["shrinks_at_longest"]) == set(G["grows_common"]), (G["grows_to"], G["lost_md"])),
        "on Gemma rotation lifts per-tensor INT4 at the shortest length":
            _claim(G["cell"]["int4_tensor+rotate", G["lengths"][0]]["correct"]
                   > G["cell"]["int4_tensor", G["lengths"][0]]["correct"] + 10),
    }
    trap_claims = {} if G is None else {
        "on Gemma perplexity flags every format that passed the short needle and lost a longer one":
            _claim(set(G["later"]) <= set(G["ppl_flags"]), (G["later"], G["ppl_flags"])),
        "on Gemma perplexity also flags q4_0 and int4_g16, which never lost a needle":
            _claim({"q4_0", "int4_g16"} <= set(G["ppl_flags"]) & set(G["never"])),
        "on Gemma the paired test on windows calls FP8 worse although it costs under 1% perplexity":
            _claim(G["ppl_paired"]["fp8_e4m3"]["verdict"] == "worse" and G["ppl"]["fp8_e4m3"] < 0.01,
                   G["ppl_paired"]["fp8_e4m3"]),
        "no format is trapped on Gemma": _claim(not G["trap"], G["trap"]),
        "on Gemma rotation leaves per-token INT4 worse at fewer lengths":
            _claim(set(G["by"]["int4_token+rotate"]["worse_at"]) < set(G["by"]["int4_token"]["worse_at"])),
        "on Gemma INT4 on the windowed layers alone is worse at no more lengths than on the global layers alone":
            _claim(set(G["by"]["int4_token@sliding"]["worse_at"]) <= set(G["by"]["int4_token@global"]["worse_at"])),
        "on Gemma the residual window holds at the shortest length": _claim(G["by"]["int4_token+residual128"]["short_verdict"] != "worse"),
        "on Gemma sinks do not help": _claim(G["by"]["int4_token+sinks4"]["worse_at"] == G["by"]["int4_token"]["worse_at"]
                                             and G["vs_base"]["int4_token+sinks4"]["verdict"] != "better"),
        "on Gemma rotation hurts KIVI-2 and helps per-token and per-tensor INT4, directly against their bases": _claim(
            G["vs_base"]["kivi-2+rotate"]["verdict"] == "worse"
            and {"int4_token+rotate", "int4_tensor+rotate"} <= set(G["vs_base_helped"]), G["vs_base"]),
        "on SmolLM2 rotation helps KIVI-2 directly against it": _claim(
            S is None or S["vs_base"]["kivi-2+rotate"]["verdict"] == "better", S and S["vs_base"]["kivi-2+rotate"]),
        "on SmolLM2 per-token INT4 lost fewer filler prompts than the test can detect a fix for": _claim(
            S is None or values["S_int4_token_lost"] < fewest_prompts_to_detect(), values.get("S_int4_token_lost")),
        "in SmolLM2's prose, where per-token INT4 lost more, rotation and the residual window helped it": _claim(
            S is None or (values["S_int4_token_prose_lost"] > 2 * values["S_int4_token_lost"]
                          and all(S["vs_base_prose"][f]["verdict"] == "better"
                                  for f in ("int4_token+rotate", "int4_token+residual128"))),
            S and (values["S_int4_token_prose_lost"], S["vs_base_prose"])),
        "on Gemma the 4-bit formats line up with the values a scale covers": _claim(
            {"q4_0", "int4_g16"} <= set(G["never"]) and G["by"]["int4"]["short_verdict"] != "worse"
            and 0 < len(G["by"]["int4"]["worse_at"]) < len(G["lengths"])
            and G["by"]["int4_token"]["worse_at"] == G["lengths"], G["by"]["int4"]["worse_at"]),
        "on Gemma rotation hurts KIVI-2": _claim(
            G["by"]["kivi-2+rotate"]["short_verdict"] == "worse" and G["by"]["kivi-2"]["short_verdict"] != "worse"
            and set(G["by"]["kivi-2"]["worse_at"]) < set(G["by"]["kivi-2+rotate"]["worse_at"]),
            (G["by"]["kivi-2"]["worse_at"], G["by"]["kivi-2+rotate"]["worse_at"])),
        "on Gemma KIVI-2 is worse at one length, in filler sentences only":
            _claim(len(G["by"]["kivi-2"]["worse_at"]) == 1 and not G["prose"]["by"]["kivi-2"]["worse_at"],
                   (G["by"]["kivi-2"]["worse_at"], G["prose"]["by"]["kivi-2"]["worse_at"])),
        "on SmolLM2 int4 and int4_token share a scale among as many values and differ only in the zero point, "
        "which costs int4_token over twice int4's perplexity": _claim(
            S is None or (_same_groups_but_zero(S["head_dim"]) and S["ppl"]["int4_token"] > 2 * S["ppl"]["int4"] > 0),
            S and (S["head_dim"], S["ppl"]["int4"], S["ppl"]["int4_token"])),
        "on Gemma per-token INT4 costs over 100% perplexity with a zero point per token and head (lmdeploy-int4) and "
        "without one (int4_token), and int4's groups of 64 with a zero point under a quarter of either":
            _claim(min(values.get("zero_point_ppl", {}).get("G", 0), G["ppl"]["int4_token"]) > 1.0
                   and 4 * G["ppl"]["int4"] < min(values["zero_point_ppl"].get("G", 0), G["ppl"]["int4_token"])
                   and not get_format("lmdeploy-int4").key.symmetric and get_format("lmdeploy-int4").key.granularity == "token",
                   (values.get("zero_point_ppl"), G["ppl"]["int4_token"], G["ppl"]["int4"])),
        "at 32k on Gemma FP8 and q4_0 found more needles with the prompt reading the cache than with it in full precision":
            _claim(all(G["cached_vs_full"][f"{f} 32768"]["cached"][0] > G["cached_vs_full"][f"{f} 32768"]["full"][0]
                       for f in ("fp8_e4m3", "q4_0")), {f: G["cached_vs_full"].get(f"{f} 32768") for f in ("fp8_e4m3", "q4_0")}),
        "on SmolLM2's paired run at 8k per-token INT4 found fewer needles with the prompt reading the cache":
            _claim(S is None or (S["cached_vs_full"]["int4_token 8192"]["cached"][0]
                                 < S["cached_vs_full"]["int4_token 8192"]["full"][0]),
                   S and S["cached_vs_full"].get("int4_token 8192")),
        "on Gemma every mitigation costs more than the perplexity tolerance":
            _claim(all(not G["by"][f]["ppl_ok"] for f in CH4_MITIGATIONS if f in G["by"])),
    }
    S = values.get("S")
    both = [m for m in (G, S) if m is not None]
    # the loosest bar that still lets no format through: the smallest perplexity among the formats that passed the
    # short needle and lost a longer one, in either haystack
    # (a format on a model: the short needle is run in both haystacks, so it must have passed in both)
    def lost_in(m, f):
        return " and ".join(h for h, st in (("filler", m), ("prose", m["prose"])) if f in st["later"])
    later_ppl = sorted({(m["ppl"][f], f, short_model_name(m["name"]), lost_in(m, f))
                        for m in both for f in set(m["later"]) | set(m["prose"]["later"])
                        if f in m["ppl"] and _short_passed(m, f)})
    values["trap_at"], values["trap_first"] = later_ppl[0][:2] if later_ppl else (None, None)
    values["trap_first_md"] = "none"
    for m in both:  # where that format lost a longer needle: the evidence the "would have been trapped" rests on
        for stage, st in (("filler", m), ("prose", m["prose"])):
            if values["trap_first"] in st["later"] and m["ppl"].get(values["trap_first"]) == values["trap_at"]:
                at = st["by"][values["trap_first"]]["worse_at"]
                cells = ", ".join(f"{_k(n)}: −{st['cell'][values['trap_first'], n]['lost']} "
                                  f"+{st['cell'][values['trap_first'], n]['gained']}" for n in at)
                pool = m["pooled"][values["trap_first"]]
                one = f"; one length only, but pooled −{pool.lost} +{pool.gained}, p = {pool.p:.2g}" if len(at) == 1 else ""
                values["trap_first_md"] = (f"`{values['trap_first']}` on {m['name']} (worse in the {stage} haystack at "
                                           f"{cells}{one})")
    # how the trap would appear as the bar loosens: each further format and the bar above which it slips through
    values["trap_more_md"] = ", ".join(f"`{f}` on {m} (lost in {h}) above {x:.1%}"
                                       for x, f, m, h in later_ppl[1:4]) or "no other format"
    values["n_trap_more"] = max(len(later_ppl) - 1, 0)  # every (format, model) a looser bar would let in
    never_one = [f for f in both[0]["never"] if all(f in m["never"] for m in both)]  # filler, every length alone
    # no loss detected: never worse at any one length in either haystack, nor with them all pooled, on both models
    values["never_both"] = [f for f in never_one if all(f in m["held"] for m in both)]
    values["never_both_md"] = names_md(values["never_both"])
    # never worse at any one length in either haystack, yet worse once every length is pooled: a small loss
    values["pooled_only"] = {m["name"]: m["pooled_only"] for m in both}
    values["pooled_only_md"] = "; ".join(
        f"on {m['name']}, " + names_md(fs, notes={f: f"−{m['pooled'][f].lost} +{m['pooled'][f].gained} over "
                                                     f"{m['pooled'][f].prompts} prompts, p = {m['pooled'][f].p:.3f}"
                                                  for f in fs})
        for m in both if (fs := values["pooled_only"][m["name"]]))
    # a harmless format facing every test of its verdict fails one by chance more often than 5%: Holm's correction
    rescued = {m["name"]: m["holm_rescued"] for m in both}
    values["holm_rescued"] = rescued
    same = all(set(rescued[m["name"]]) == set(m["pooled_only"]) for m in both)  # exactly the pooled-only losses
    which = ("the pooled-only verdicts above would not stand; every other format called worse would still be worse on "
             "at least one test (some single-length marks alone would not survive)." if same else
             "; ".join(f"on {m['name']}, " + names_md(fs, notes={f: f"lowest p = {m['min_p'][f]:.3f}" for f in fs})
                       for m in both if (fs := rescued[m["name"]])) + " would no longer be called worse; every other "
             "verdict stands.")
    values["holm_md"] = ("Corrected for that number (Holm's method: 5% for a format's whole family of tests), "
                         + (f"{which} Each of those formats misses the perplexity bar by more than twice its "
                            f"{PPL_TOLERANCE:.0%} anyway (4.2), so no advice below changes{_residual_note(rescued)}."
                            if any(rescued.values()) else "every verdict of worse stands."))
    values["n_needle_tests"] = {short_model_name(m["name"]): min(m["n_needle_tests"]) for m in both}
    # do the rescued verdicts matter for a recommendation? Not if each of those formats misses the perplexity bar
    values["holm_rescued_ppl"] = {(m["name"], f): m["ppl"].get(f) for m in both for f in rescued[m["name"]]}
    holm_claims = {
        "every format on a model faces the same number of needle tests":
            _claim(all(len(m["n_needle_tests"]) == 1 for m in both), {m["name"]: m["n_needle_tests"] for m in both}),
        "a format held exactly when none of its needle tests calls it worse":
            _claim(all((f in m["held"]) == all(t.verdict != "worse" for t in m["needle_tests"][f].values())
                       for m in both for f in m["by"])),
        "each format Holm's correction would rescue misses the perplexity bar on that model by more than twice":
            _claim(all(v is not None and v > 2 * PPL_TOLERANCE for v in values["holm_rescued_ppl"].values()),
                   values["holm_rescued_ppl"]),
    }
    from .formats import engine_options

    # what an engineer can switch on today among the formats never worse on both models
    values["never_both_engine_md"] = names_md([f for f in values["never_both"] if any(engine_options(f).values())])
    values["never_both_kvlab_md"] = names_md([f for f in values["never_both"] if not any(engine_options(f).values())])
    # what "no loss detected" still allows: each of those formats' discordant prompts, every single-needle prompt
    def short(m):
        return short_model_name(m["name"])

    n_pooled = {short(m): {m["pooled"][f].prompts for f in values["never_both"]} for m in both}
    uniform = all(len(v) == 1 for v in n_pooled.values())  # every format pooled the same prompts on a model
    values["never_both_pooled_md"] = "; ".join(
        f"`{f}` " + ", ".join(f"−{m['pooled'][f].lost} +{m['pooled'][f].gained}"
                              + ("" if uniform else f" of {m['pooled'][f].prompts}") + f" on {short(m)}" for m in both)
        for f in values["never_both"]) + ("" if not uniform or not values["never_both"] else " (of " + ", ".join(
            f"{next(iter(v))} prompts on {m}" for m, v in n_pooled.items()) + ")")
    # ... and turned into a bound: the share of prompts such a format could lose, one-sided 95% (exact)
    from .results import exact_upper

    bounds = sorted(((exact_upper(m["pooled"][f].lost, m["pooled"][f].prompts), f, short(m))
                     for f in values["never_both"] for m in both), reverse=True)
    values["never_both_bound"] = bounds[0][0] if bounds else None
    # the pooled bound averages over lengths: the worst single length of those formats, and its own bound
    cells = [(c["lost"], -c["gained"], f, _k(n), short(m), c) for m in both for st in (m, m["prose"])
             for (f, n), c in st.get("cell", {}).items() if f in values["never_both"]]
    if cells:
        lost, _, f, n, name, c = max(cells, key=lambda x: x[:2])
        values["never_both_worst_md"] = (f"`{f}` at {n} on {name} lost {lost} and gained {c['gained']} of "
                                         f"{c['prompts']} prompts, where one length's bound is "
                                         f"{exact_upper(lost, c['prompts']):.0%}")
    else:
        values["never_both_worst_md"] = "none"
    values["never_both_bound_md"] = (f"at most {bounds[0][0]:.1%} of prompts for the loosest, `{bounds[0][1]}` on "
                                     f"{bounds[0][2]}, and at most {bounds[-1][0]:.1%} for the tightest, "
                                     f"`{bounds[-1][1]}` on {bounds[-1][2]}") if bounds else "none"
    both_claims = {
        "FP8, INT8 and q8_0 were never worse on either model":
            _claim(all({"fp8_e4m3", "int8", "q8_0"} <= set(m["never"]) for m in both)),
        "one scale per tensor was worse on both models": _claim(all(m["by"]["int4_tensor"]["worse_at"] for m in both)),
        "no format is trapped on either model": _claim(all(not m["trap"] for m in both), {m["name"]: m["trap"] for m in both}),
        "on SmolLM2 prose catches per-token INT4 (with and without sinks), never worse in filler; perplexity flagged both":
            _claim(S is None or all(f in S["prose"]["later"] and f in S["never"] and f in S["ppl_flags"]
                                    for f in ("int4_token", "int4_token+sinks4")), S and S["prose"]["later"]),
        "no format is trapped in the prose haystack either":
            _claim(all(not m["prose"]["trap"] for m in both), {m["name"]: m["prose"]["trap"] for m in both}),
        "a bar looser than the first short-needle passer's perplexity increase would let the trap appear":
            _claim(values["trap_at"] is not None and values["trap_at"] > PPL_TOLERANCE, later_ppl[:2]),
        "on both models perplexity flagged every format that passed the short needle and lost a longer one":
            _claim(all(set(m["later"]) <= set(m["ppl_flags"]) for m in both), {m["name"]: m["later"] for m in both}),
        "every format that only the pooled test finds worse missed the perplexity bar":
            _claim(all(not m["by"][f]["ppl_ok"] for m in both for f in values["pooled_only"][m["name"]]),
                   values["pooled_only"]),
        "pooling found a loss that no single length showed":
            _claim(any(values["pooled_only"].values()), values["pooled_only"]),
        "FP8, INT8, q8_0 and KIVI-4 are among the formats never worse on both models":
            _claim({"fp8_e4m3", "int8", "q8_0", "kivi-4"} <= set(values["never_both"]), values["never_both"]),
        "KIVI-4 was never worse on either model; KIVI-2 was worse on both, at every length on SmolLM2":
            _claim(G is None or S is None or (G["by"]["kivi-2"]["worse_at"] and S["by"]["kivi-2"]["worse_at"] == S["lengths"]
                                              and "kivi-4" in G["never"] and "kivi-4" in S["never"])),
        "rotation hurt KIVI-2 on Gemma and helped it on SmolLM2":
            _claim(G is None or S is None or (len(S["by"]["kivi-2+rotate"]["worse_at"]) < len(S["by"]["kivi-2"]["worse_at"]))),
        "one scale per token was worse from the shortest length on Gemma and never in the filler haystack on SmolLM2":
            _claim(G is None or S is None or ("int4_token" in G["short"] and not S["by"]["int4_token"]["worse_at"])),
        "on SmolLM2 per-tensor INT4's paired losses do not grow at every step (appendix B cites them)":
            _claim(S is None or "int4_tensor" not in S["grows_common"], S and S["lost_md"].get("int4_tensor")),
        "both models were swept to at least 8k": _claim(all(m["longest"] >= CH4_COMMON_LONGEST for m in both),
                                                        {m["name"]: m["longest"] for m in both}),
    }
    steady_claim = {"the loss grows with length for only a few formats on each model":
                    _claim(all(len(values[k]["grows_common"]) <= len(values[k]["by"]) // 3 for k in keys),
                           {k: values[k]["grows_common"] for k in keys})}
    values |= llamacpp_gemma(sweeps.get("gemma3-270m"))
    claims = g_claims | trap_claims | both_claims | steady_claim | holm_claims | {
        "every model's sweep ran at least 25 identical prompts a point":
            _claim(all(values[CH4_KEYS.get(k, k)]["prompts"] >= 25 for k in sweeps),
                   {k: values[CH4_KEYS.get(k, k)]["prompts_all"] for k in sweeps}),
    } | ladder_claims
    return Facts(values, claims)


def _mark(p) -> str:
    """A paired comparison as the chapter's tables show it: −lost +gained, ✗ where the format is worse."""
    return f"−{p.lost} +{p.gained}" + (" ✗" if p.verdict == "worse" else "")


def llamacpp_gemma(sweep, path=None) -> dict:
    """llama.cpp on Gemma 3's GGUF beside kvlab on the long sweep's identical prompts (chapter 4, appendix):
    a table with each side's paired verdict against its own full-precision cache, and whether they agree.
    Says how to run it while ``data/results/engines_llamacpp_gemma3.json`` is not shipped."""
    import json

    from .paths import RESULTS_DIR
    from .results import (
        fewest_prompts_to_detect,
        llamacpp_machines_md,
        llamacpp_paired,
        llamacpp_pending,
    )

    path = path or RESULTS_DIR / "engines_llamacpp_gemma3.json"
    if sweep is None or not path.is_file():
        return {"llama_gemma_ran": False, "llama_gemma_md": "llama.cpp on Gemma's GGUF, paired with kvlab on the long "
                "sweep's prompts, has not run yet: `python scripts/compare_engines.py --llama-cpp --model gemma3-270m` "
                "(after `make peers`) writes it.", "llama_gemma_summary_md": ""}
    doc = json.loads(path.read_text())
    pairs = llamacpp_paired(doc, sweep)
    rows = ["| cache | context | llama.cpp found | vs its f16 (−lost +gained) | kvlab format (prefill) | kvlab found | "
            "vs its fp32 (−lost +gained) | both right or both wrong |", "|---|---|---|---|---|---|---|---|"]
    agree = []
    for ct, by_n in pairs.items():
        for n, x in by_n.items():
            e, k, b = x["engine"], x["kvlab"], x["between"]
            rows.append(f"| {ct} | {_k(n)} | {e.correct}/{e.prompts} | {_mark(e) if ct != 'f16' else '—'} | "
                        f"`{x['preset'] if ct != 'f16' else 'fp32'}` ({'prompt reads the cache' if x['kvlab_stage'] == 'cached' else 'prompt in full precision'}) | "
                        f"{k.correct}/{k.prompts} | {_mark(k) if ct != 'f16' else '—'} | "
                        f"{b.prompts - b.lost - b.gained}/{b.prompts} |")
            if ct != "f16":
                agree.append((ct, n, e.verdict == k.verdict, e, k))
    same = all(g for _, _, g, _, _ in agree)
    pending = llamacpp_pending(doc)
    window = sorted({r["length"] for v in doc["cache_types"].values() for r in v["rows"] if r.get("swa_full") is False})
    swa_md = "" if not window else (
        f" At {', '.join(_k(n) for n in window)} the sliding-window layers kept a cache of their window only "
        "(`swa_full=False`, each prompt prefilled from its first token: quadratic time only in the 3 global layers); "
        "elsewhere llama-cpp-python's default full-size cache, with the shared prefix of consecutive prompts reused.")
    running = "; ".join(f"{ct} at {_k(n)}: {k} of {len(doc['depths']) * doc['trials']} prompts run so far"
                        for ct, by_n in pending.items() for n, k in by_n.items())
    pending_md = (f"\n\n*Not finished, so not in the table:* {running} (`python scripts/compare_engines.py --llama-cpp "
                  f"--model gemma3-270m --lengths {' '.join(str(n) for n in doc['lengths'])}"
                  f"{' --swa-cache window' if window else ''}` resumes it)." if pending else "")
    rotate_cached = any(sweep.counts("cached", "q4_0+rotate", n)[1] for by_n in pairs.values() for n in by_n)
    between = [(ct, n, x["between"]) for ct, by_n in pairs.items() for n, x in by_n.items() if ct != "f16"]
    ct_max, n_max, b_max = max(between, key=lambda t: t[2].lost + t[2].gained) if between else (None, None, None)
    direct_md = "" if not b_max else (
        f" Set directly against each other on the same prompts, llama.cpp and kvlab with the same cache type differed "
        f"in correctness on at most {b_max.lost + b_max.gained} of {b_max.prompts} ({ct_max} at "
        f"{_k(n_max)}: kvlab alone right on {b_max.lost}, llama.cpp alone on {b_max.gained}); the exact test "
        + ("found no difference in any row" if all(b.verdict == "not distinguishable" for _, _, b in between)
           else "found a difference in " + ", ".join(f"{ct} at {_k(n)}" for ct, n, b in between
                                                       if b.verdict != "not distinguishable"))
        + f" (smallest p {min(b.p for _, _, b in between):.2f}). With {b_max.prompts} prompts that test calls a "
        f"difference only from {fewest_prompts_to_detect()} discordant prompts all one way, so the agreement rules "
        "out large differences, not small ones.")
    summary = (f"llama.cpp as built by llama-cpp-python {doc.get('versions', {}).get('llama-cpp-python', '?')}, on "
               "the same Q4_K_M GGUF file kvlab loads (kvlab dequantizes its weights once; llama.cpp computes with them "
               f"directly), ran on {llamacpp_machines_md(doc)}. "
               + ("Against its own full-precision cache, each quantized cache got the same paired verdict in llama.cpp "
                  "as in kvlab: " if same else "The paired verdicts differ between the two: ")
               + "; ".join(f"{ct} at {_k(n)}: llama.cpp {e.verdict} (−{e.lost} +{e.gained}), kvlab {k.verdict} "
                           f"(−{k.lost} +{k.gained})" for ct, n, _, e, k in agree) + "." + direct_md
               + " llama.cpp Hadamard-rotated Q, K and V before its quantized caches (its default since PR #21038) and "
               "kvlab's q8_0 and q4_0 did not, so each row sets rotated blocks beside unrotated ones"
               + ("" if rotate_cached else " (kvlab's rotated `q4_0+rotate` ran with the prompt in full precision "
                  "only: chapter 6.4)") + "." + swa_md)
    intro = ("The long-context model's GGUF ran in llama.cpp too, on the long sweep's own filler prompts (same seed, "
             "depths and prompts a depth), so each llama.cpp answer pairs with kvlab's on the identical prompt. "
             "llama.cpp's prompt reads its quantized cache, so its q4_0 sits beside kvlab's q4_0 with the prompt "
             "reading the cache where the sweep ran that mode (4.4), and beside the full-precision prompt otherwise (the q8_0 "
             "rows); with the rotation below, no kvlab row matches llama.cpp in both rotation and prefill mode. "
             "Each side is judged against its own full-precision cache (llama.cpp's f16, kvlab's fp32) by the paired "
             "test; the last column counts the prompts on which llama.cpp and kvlab, with the same cache type, were "
             "both right or both wrong (the same correctness, not necessarily the same digits).\n\n")
    return {"llama_gemma_ran": True, "llama_gemma": doc, "llama_gemma_pairs": pairs, "llama_gemma_md": intro + "\n".join(rows) + pending_md,
            "llama_gemma_agree": same, "llama_gemma_summary_md": summary}


# --------------------------------------------------------------------------- chapter 5

CH5_MODEL, CH5_GPU, CH5_SWEEP_GPU = "llama-3.1-8b", "L4", "H100-80GB"
CH5_FORMATS = ["bf16", "fp8_e4m3", "int4"]
CH5_POOLS_GIB = [0.5, 1, 2, 4, 8, 16, 32, 64]
CH5_QUALITY_FORMATS = ["bf16", "fp8_e4m3", "q8_0", "kivi-4", "int4", "q4_0", "int4_token", "int4_tensor"]
CH5_PPL_LIMIT = PPL_TOLERANCE  # the workbook's one perplexity bar (kvlab.results)
INT4_CACHES = ["int4", "lmdeploy-int4", "q4_0", "hf-int4"]  # the INT4 presets an engine might offer
INT4_NEAR = ["int4_token+rotate"]  # kvlab INT4 formats an engine stores nearly (vLLM 0.26's int4_per_token_head)


def int4_engines() -> tuple[list[str], list[str]]:
    """The engines with an integer INT4 cache: those storing one of kvlab's INT4 presets exactly, and those whose
    INT4 cache is only near one of kvlab's formats (``kvlab formats --engines``)."""
    from .formats import engine_nearest, engines_offering

    exact = sorted({e for es in engines_offering(INT4_CACHES).values() for e in es})
    near = sorted({e for f in INT4_NEAR for e in engine_nearest(f)} - set(exact))
    return exact, near


CH5_TRACE = dict(n=400, docs=200, doc_len=1000, rate=4.0, seed=0)  # the rest: kvlab.workloads.rag's defaults


def ch5_requests():
    """Chapter 5's trace: RAG requests (a system prompt, 3 of 200 documents with Zipf popularity, a question)."""
    from .workloads import rag

    return rag(**CH5_TRACE)


def prefix_cache(requests=None, sweeps: dict | None = None) -> Facts:
    """Chapter 5: blocks per format, hit rate vs pool size, cost with and without sharing, quality-adjusted cost.

    The quality is chapter 4's paired sweeps (``sweeps``: model id -> :class:`~kvlab.results.LongSweep`, default
    both shipped ones): each model's paired needle verdict and perplexity change, as in chapter 6."""
    from . import budget as B
    from . import simulator as S
    from .decide import REFERENCE_FORMATS
    from .results import LONG_SWEEPS, LongSweep
    from .workloads import cost_split

    reqs = requests if requests is not None else ch5_requests()
    gib = 2**30
    blocks = {f: S.pool_blocks(CH5_MODEL, CH5_GPU, f)[0] for f in CH5_FORMATS}
    curves = S.hit_rate_vs_pool(reqs, CH5_MODEL, CH5_SWEEP_GPU, CH5_FORMATS, CH5_POOLS_GIB)
    int4_at_1 = curves["int4"][CH5_POOLS_GIB.index(1)]
    # the working set in GiB: blocks read by more than one request, and every distinct block the trace writes
    ws = {f: {k: v / gib for k, v in S.working_set(reqs, CH5_MODEL, f).items()} for f in CH5_FORMATS}
    ceiling = max(y[-1] for y in curves.values())
    # each curve at the first pool that holds the reused blocks, and at the largest pool below every distinct block
    at_reused = {f: next(y for g, y in zip(CH5_POOLS_GIB, curves[f]) if g >= ws[f]["reused"]) for f in CH5_FORMATS}
    below_distinct = {f: [y for g, y in zip(CH5_POOLS_GIB, curves[f]) if g <= ws[f]["distinct"]][-1] for f in CH5_FORMATS}
    bf16_scaled = S.simulate(reqs, CH5_MODEL, CH5_SWEEP_GPU, "bf16", pool_bytes=int(gib * 16 / 4.5)).hit_rate
    split = {r["kv_format"]: r for r in cost_split(reqs, CH5_MODEL, CH5_GPU, CH5_FORMATS[1:])}
    l4 = B.get_gpu(CH5_GPU)
    b, f8, i4 = split["bf16"], split["fp8_e4m3"], split["int4"]
    gain = {n: r["saving_shared"] - r["saving_unshared"] for n, r in split.items()}
    own_drop = {n: 1 - r["usd_shared"] / r["usd_unshared"] for n, r in split.items()}  # what sharing saves each format
    usd = {n: (b["usd_unshared"] - r["usd_unshared"], b["usd_shared"] - r["usd_shared"]) for n, r in split.items()}
    int4_exact, int4_near = int4_engines()

    sweeps = sweeps or {m: LongSweep.load(path) for m, path in LONG_SWEEPS.items()}
    mfs = [_model_facts(sw) for sw in sweeps.values()]
    risk = paired_risk(model_facts=mfs)
    short = {m: short_model_name(m) for m in risk}  # "SmolLM2", "Gemma"
    fmts = CH5_QUALITY_FORMATS
    needle = {f: {short[m]: "reference" if f in REFERENCE_FORMATS else r["needle"][f] for m, r in risk.items()}
              for f in fmts}
    ppl = {f: {short[m]: r["ppl"][f] for m, r in risk.items()} for f in fmts if f not in REFERENCE_FORMATS}
    table = S.cost_table(reqs, CH5_MODEL, CH5_GPU, fmts, needle=needle, perplexity=ppl, max_ppl_increase=CH5_PPL_LIMIT)
    by_fmt = {r["kv_format"]: r for r in table}
    int4_rows = [f for f in fmts if f.startswith("int4") or f == "q4_0"]
    both = [f for f in fmts if by_fmt[f]["needle_ok"] and by_fmt[f]["ppl_ok"] is not False]
    from .formats import engine_options

    offered = {f: any(engine_options(f).values()) for f in fmts}  # does a serving engine store it?
    both_offered = [f for f in both if offered[f]]
    prompts = {t for mf in mfs for t in mf["prompts_all"]}
    smol, gemma = mfs

    import inspect

    from .workloads import rag

    trace = {k: p.default for k, p in inspect.signature(rag).parameters.items()} | CH5_TRACE
    gpu = B.get_gpu(CH5_GPU)
    values = {
        "requests": reqs, "needle": needle, "formats": fmts, "s": smol, "g": gemma,
        "ppl_limit": CH5_PPL_LIMIT, "trace": trace, "model": CH5_MODEL,
        "gpu": CH5_GPU, "gpu_gib": gpu.memory_bytes / B.GIB, "gpu_gb": gpu.nominal_gb,
        "free_gib": B.fit(CH5_MODEL, CH5_GPU, "bf16").free_for_cache_per_gpu / gib,
        "mfu": S.CostModel.mfu, "mbu": S.CostModel.mbu, "int4_pool_gib": 16 / 4.5,
        "blocks": blocks, "curves": curves, "pools": CH5_POOLS_GIB, "split": split, "table": table,
        "price": l4.usd_per_hour, "price_source": l4.price_source,
        "bf16_scaled_hit": bf16_scaled, "int4_hit_1gib": int4_at_1,
        "ws": ws, "ceiling": ceiling, "ws_gap_points": 100 * min(ceiling - y for y in at_reused.values()),
        "fp8_blocks_x": blocks["fp8_e4m3"] / blocks["bf16"], "int4_blocks_x": blocks["int4"] / blocks["bf16"],
        "b": b, "f8": f8, "i4": i4, "gain_f8": 100 * gain["fp8_e4m3"], "gain_i4": 100 * gain["int4"],
        "own_drop": {"b": own_drop["bf16"], "f8": own_drop["fp8_e4m3"], "i4": own_drop["int4"]},
        "usd_f8": usd["fp8_e4m3"], "usd_i4": usd["int4"], "int4_engines": ", ".join(int4_exact), "int4_near": ", ".join(int4_near),
        "ppl": ppl, "int4_labels": {f: needle[f] for f in int4_rows},
        # to admit an INT4 row on perplexity alone, the limit must pass its larger increase of the two models
        "min_int4_ppl": min(max(ppl[f].values()) for f in int4_rows),
        "min_int4_ppl_at": min(int4_rows, key=lambda f: max(ppl[f].values())),
        "prompts_per_cell": next(iter(prompts)) if len(prompts) == 1 else None,
        # the seed's "quality-adjusted cost": the price of a million tokens at the quality you accept, i.e. the
        # cheapest row that passes both columns and that an engine offers (the cheapest row of all may not)
        "both_md": names_md(both), "both_q_md": names_md([f for f in both if f not in REFERENCE_FORMATS]),
        "offered": offered, "by_fmt": by_fmt,
        "both_ppl_max": max(max(ppl[f].values()) for f in both if f in ppl),
        "cheapest_pass": min(both, key=lambda f: by_fmt[f]["usd_per_m_tokens"]) if both else None,
        "qa": min(both_offered, key=lambda f: by_fmt[f]["usd_per_m_tokens"]) if both_offered else None,
        "qa_usd": min(by_fmt[f]["usd_per_m_tokens"] for f in both_offered) if both_offered else None,
        "bf16_usd": by_fmt["bf16"]["usd_per_m_tokens"],
        # every row at the lowest price (rounded to the cent, as printed): a tie is named whole
        "cheapest": min(fmts, key=lambda f: by_fmt[f]["usd_per_m_tokens"]),
        "cheapest_md": names_md([f for f in fmts if round(by_fmt[f]["usd_per_m_tokens"], 2)
                                 == round(min(by_fmt[g]["usd_per_m_tokens"] for g in fmts), 2)]),
        "cheapest_usd": min(by_fmt[f]["usd_per_m_tokens"] for f in fmts),
    }
    values["qa_saving"] = 1 - values["qa_usd"] / values["bf16_usd"] if both_offered else None
    # beyond this table's rows: the 4-bit formats chapter 4 found held on both models, and whether an engine stores one
    low_held = [f for f in smol["held"] if _low_bit(f) and f in gemma["held"]]
    values["low_held_md"] = names_md(low_held, notes=_bits_notes(low_held))
    values["int4_rows_md"] = names_md(int4_rows)
    # chapter 4's rule is each test at p < 0.05; corrected for the number of tests (Holm), these rows would hold
    holm_both = [f for f in int4_rows if all(f in mf["held"] or f in mf["holm_rescued"] for mf in mfs)]
    over = [f for f in holm_both if max(ppl[f].values()) > CH5_PPL_LIMIT]
    values["int4_holm_md"] = ("[Holm's correction](glossary.md#paired-test) for the number of tests (chapter 6.4) would "
                              "not change that" if not holm_both
                              else f"Corrected for the number of tests ([Holm's method](glossary.md#paired-test), chapter 6.4), {names_md(holm_both)} "
                              "would hold on both" + (f", and perplexity (below) would still turn {names_md(over)} away"
                                                      if over else ""))
    values["low_held_offered"] = [f for f in low_held if _plain_low_bit(f) and any(engine_options(f).values())]
    from .formats import engines_offering

    claims = {
        "no engine stores int4, the INT4 layout chapter 5 prices": _claim(engines_offering(["int4"])["int4"] == []),
        "the L4's memory is its datasheet figure in 10^9 bytes (no CUDA figure in the presets)":
            _claim(gpu.memory_bytes == int(gpu.nominal_gb * 1e9), (gpu.memory_bytes, gpu.nominal_gb)),
        "FP8 holds twice BF16's blocks, INT4 about 3.5 times":
            _claim(1.99 < values["fp8_blocks_x"] < 2.01 and 3.5 < values["int4_blocks_x"] < 3.6, blocks),
        "smaller KV hits more when memory is tight": _claim(curves["int4"][0] > curves["fp8_e4m3"][0] > curves["bf16"][0]),
        "the gain vanishes once the working set fits (within 1 point)":
            _claim(max(y[-1] for y in curves.values()) - min(y[-1] for y in curves.values()) < 0.01),
        "a pool that holds the reused blocks is still more than 5 points below the ceiling, in every format":
            _claim(all(ceiling - y > 0.05 for y in at_reused.values()), at_reused),
        "a pool that holds about every distinct block is within 1 point of the ceiling, in every format":
            _claim(all(ceiling - y < 0.01 for y in below_distinct.values()), below_distinct),
        "BF16 in 16/4.5 GiB hits as often as INT4 in 1 GiB (within half a point)":
            _claim(abs(bf16_scaled - int4_at_1) < 0.005, (bf16_scaled, int4_at_1)),
        "FP8 and INT4 save over 15% with no hits at all, INT4 more":
            _claim(0.15 < f8["saving_unshared"] < i4["saving_unshared"], (f8["saving_unshared"], i4["saving_unshared"])),
        "more blocks let more requests run at once":
            _claim(i4["peak_concurrency_unshared"] > f8["peak_concurrency_unshared"] > b["peak_concurrency_unshared"]),
        "smaller formats hit more": _claim(i4["hit_rate"] > f8["hit_rate"] > b["hit_rate"]),
        "with sharing the percentage saving rises by at least 5 points":
            _claim(min(gain["fp8_e4m3"], gain["int4"]) > 0.05, gain),
        "the no-hit saving is the larger part":
            _claim(f8["saving_unshared"] > gain["fp8_e4m3"] and i4["saving_unshared"] > gain["int4"]),
        "sharing cuts BF16's own cost": _claim(b["usd_shared"] < b["usd_unshared"]),
        "as a share of its own cost, sharing saves each smaller format more than BF16":
            _claim(own_drop["int4"] > own_drop["fp8_e4m3"] > own_drop["bf16"], own_drop),
        "in dollars the saving does not grow with sharing":
            _claim(all(usd[n][1] <= usd[n][0] + 1e-9 for n in ["fp8_e4m3", "int4"]), usd),
        "SGLang lists no integer INT4 cache; LMDeploy and llama.cpp store kvlab's INT4 presets; vLLM's is only near one":
            _claim(not {"vLLM", "SGLang"} & set(int4_exact) and {"LMDeploy", "llama.cpp"} <= set(int4_exact)
                   and int4_near == ["vLLM"], (int4_exact, int4_near)),
        "the cheapest rows are the small formats":
            _claim(by_fmt["int4_tensor"]["usd_per_m_tokens"] < by_fmt["bf16"]["usd_per_m_tokens"]),
        "INT4 per tensor was worse than full precision on both models' needles from the shortest length":
            _claim(all(v.startswith("worse in filler at " + mf["shortest_k"]) for v, mf in zip(needle["int4_tensor"].values(), mfs)),
                   needle["int4_tensor"]),
        "chapter 4 scores the same number of prompts in every cell": _claim(values["prompts_per_cell"] is not None,
                                                                           prompts),
        "at the perplexity limit FP8 passes on both models and every INT4 row fails on both":
            _claim(by_fmt["fp8_e4m3"]["ppl_ok"] and all(min(ppl[f].values()) > CH5_PPL_LIMIT for f in int4_rows), ppl),
        "llama.cpp's q4_0 is an INT4 row an engine offers": _claim(offered["q4_0"] and "q4_0" in int4_rows),
        "perplexity ranks the INT4 rows int4 < int4_token < int4_tensor on both models":
            _claim(all(ppl["int4"][m] < ppl["int4_token"][m] < ppl["int4_tensor"][m] for m in short.values()), ppl),
        "the rows that pass both columns at the default limits are BF16, FP8, q8_0 and KIVI-4":
            _claim(both == ["bf16", "fp8_e4m3", "q8_0", "kivi-4"], both),
        "the cheapest row that passes both is KIVI-4, which no engine offers":
            _claim(values["cheapest_pass"] == "kivi-4" and not offered["kivi-4"], values["cheapest_pass"]),
        "the 4-bit formats that held on both models' needles are ones no engine offers":
            _claim(bool(low_held) and not values["low_held_offered"], low_held),
        "no INT4 row held on both models' needles": _claim(not any(by_fmt[f]["needle_ok"] for f in int4_rows),
                                                          values["int4_labels"]),
        "FP8 held on both models' needles": _claim(by_fmt["fp8_e4m3"]["needle_ok"], needle["fp8_e4m3"]),
        "admitting any INT4 row on perplexity alone needs a limit of 10% or more": _claim(values["min_int4_ppl"] > 0.10),
        "the quality-adjusted price (engines' rows) is FP8's, below BF16's and above the cheapest row's":
            _claim(values["qa"] == "fp8_e4m3" and values["cheapest_usd"] < values["qa_usd"] < values["bf16_usd"],
                   (values["qa"], values["qa_usd"], values["cheapest_usd"])),
    }
    return Facts(values, claims)


# --------------------------------------------------------------------------- chapter 6

CH6_DEPLOYMENT = dict(model="llama-3.1-8b", gpu="H100-80GB", weights="bf16", context=32768, concurrency=64)
CH6_FORMATS = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_tensor", "lmdeploy-int8", "q8_0", "kivi-4", "int4", "q4_0",
               "int4_tensor"]
CH6_CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CH6_LADDER_PROMPTS = 50  # prompts a server in the endpoint ladder of 6.4


CH6_OTHER_BARS = (0.10, 0.20, float("inf"))  # looser perplexity bars than PPL_TOLERANCE, and none


def _rotation_ppl(sweeps: dict) -> dict[str, dict]:
    """``{model: {"q4_0": row, "q4_0+rotate": row, "vs q4_0": row}}``: llama.cpp's blocks without and with the
    rotation llama.cpp adds by default, each against full precision and the two against each other, on the same
    held-out passages (:func:`shipped_perplexity`; a model where either has not read every passage is left out)."""
    plain = shipped_perplexity(["q4_0", "q4_0+rotate"], sweeps=sweeps)
    vs = shipped_perplexity(["q4_0+rotate"], reference="q4_0", sweeps=sweeps)["q4_0+rotate"]
    return {m: {"q4_0": plain["q4_0"][m], "q4_0+rotate": plain["q4_0+rotate"][m], "vs q4_0": vs[m]}
            for m in vs if m in plain["q4_0"] and m in plain["q4_0+rotate"]}


def _offered_md(fmt: str) -> str:
    """The engines that store ``fmt`` exactly, else those whose default is near it (llama.cpp's rotated blocks)."""
    from .formats import engine_nearest, engines_offering

    with contextlib.suppress(ValueError):  # a format with a suffix ("q4_0+rotate") is no preset
        if exact := engines_offering([fmt])[fmt]:
            return engines_md(exact)
    near = engine_nearest(fmt)
    return f"{engines_md(list(near))} (near its default)" if near else "no engine"


def _added_status_md(added: list[str], mfs: list[dict], unmeasured: list[str]) -> str:
    """Where the needles of the formats added later stand, in a sentence of 6.4: running on some model (none can
    pass yet; a loss at a finished length already counts) or in on every model."""
    pending = [mf for mf in mfs if not all(f in mf["by"] for f in added)]
    if not pending:
        return "their perplexity and their needles are in on both models (the table below gives those not in 6.2's table)."
    done = " and ".join(short_model_name(mf["name"]) for mf in mfs if mf not in pending) or "neither model"
    waiting = " and ".join(f"{short_model_name(mf['name'])}'s" for mf in pending)
    text = (f"their perplexity is in on both models, their needles on {done} so far, so none of them can pass yet"
            f" ({names_md(unmeasured)} in 6.2's table wait on {waiting} needles; the table below gives the others).")
    found = [(short_model_name(mf["name"]), [f"`{f}` ({st}, at {', '.join(_k(n) for n in at)})"
                                             for f, (st, at) in mf["partial"].items()]) for mf in pending if mf["partial"]]
    if found:
        text += (" A loss at a length already finished counts, though: "
                 + "; ".join(f"on {m} {' and '.join(w)} {'was' if len(w) == 1 else 'were'} already found worse"
                             for m, w in found) + ' (the table below says "so far").')
    return text


def _holm_call_md(extra: list[str], waiting: list[str]) -> str:
    """What Holm's correction would change in chapter 6's call: formats it would let pass (``extra``), or those
    it would clear that still wait for a needle verdict (``waiting``), or nothing."""
    if extra:
        return (f"With that correction {names_md(extra)} would also pass the screen; none needs fewer GPUs than the "
                "call, so under the same rule (GPUs, then throughput, then the tie to the format more engines offer) "
                "the call stays.")
    if waiting:
        return (f"Every format Holm would clear misses the perplexity bar anyway (6.2's table) except {names_md(waiting)}, "
                "added later, which has no needle verdict on Gemma yet, so the shortlist stays as it is.")
    return "Every format Holm would clear misses the perplexity bar anyway (6.2's table), so the shortlist stays as it is."


HELD_ON_BOTH = "held on both models' needles"


def _needles_on_both(fmt: str, mfs) -> str:
    """``fmt``'s needle verdicts on every model (:func:`_model_facts`), as a sentence says them: :data:`HELD_ON_BOTH`,
    or each model's verdict ("worse in filler at 8k on Gemma and held on SmolLM2")."""
    if all(fmt in mf["held"] for mf in mfs):
        return HELD_ON_BOTH
    return " and ".join(f"{needle_label(mf, fmt)} on {short_model_name(mf['name'])}"
                        for mf in mfs if fmt in mf["by"]) or "has no needle verdict"


def _added_md(added: list[str], mfs: list[dict]) -> str:
    """Chapter 6's table of the engine formats added to chapter 4's sweeps later: who offers each, its perplexity
    change and its needle verdict on each model ("not run yet" where that model's needles are still to run)."""
    who = " · ".join(short_model_name(mf["name"]) for mf in mfs)
    rows = [f"| format | offered by | perplexity ({who}) | needle, paired ({who}) |", "|---|---|---|---|"]
    for f in added:
        ppl = " · ".join(_pct(mf["ppl"][f]) if f in mf["ppl"] else "—" for mf in mfs)
        needle = " · ".join(short_needle(needle_label(mf, f) if f in mf["by"] or f in mf["partial"] else None)
                             for mf in mfs)
        rows.append(f"| `{f}` | {_offered_md(f)} | {ppl} | {needle} |")
    return "\n".join(rows)


def choosing_a_format(model=CH6_DEPLOYMENT["model"], gpu=CH6_DEPLOYMENT["gpu"], weights=CH6_DEPLOYMENT["weights"],
                      context=CH6_DEPLOYMENT["context"], concurrency=CH6_DEPLOYMENT["concurrency"],
                      formats=CH6_FORMATS, sweeps: dict | None = None) -> Facts:
    """Chapter 6: what each format buys for one deployment (room, roofline speed), what it risks, the shortlist.

    The risk is chapter 4's paired sweeps (``sweeps``: model id -> :class:`~kvlab.results.LongSweep`, default
    both shipped ones), the same paired test on identical prompts as every other chapter. The claims are about
    the chapter's own deployment; run with yours and :meth:`Facts.failed` names the sentences that no longer
    describe it.
    """
    from . import budget as B
    from . import decide, power
    from .formats import engine_nearest, engine_options, engines_offering, get_format
    from .results import (
        LONG_SWEEPS,
        PPL_TOLERANCE,
        LongSweep,
        exact_upper,
        fewest_prompts_to_detect,
        wilson,
    )
    from .roofline import MBU, MFU

    sweeps = sweeps or {m: LongSweep.load(path) for m, path in LONG_SWEEPS.items()}
    added = list(dict.fromkeys(f for sw in sweeps.values() for f in sw.added_formats))
    # chapter 4's paired sweeps, with the engine formats measured later on the same prompts (--add-formats)
    smol = _model_facts(sweeps["smollm2-135m"], sweeps["smollm2-135m"].all_formats)  # SmolLM2, to 8k
    gemma = _model_facts(sweeps["gemma3-270m"], sweeps["gemma3-270m"].all_formats)  # the long-context model, to 32k
    risk = paired_risk(model_facts=[smol, gemma])
    rows = decide.options(model, gpu, context, concurrency, weights_dtype=weights, formats=formats, risk=risk)
    by = {r["kv_format"]: r for r in rows}
    bf, f8, i4 = by["bf16"], by["fp8_e4m3"], by["int4"]
    steps = [r["step_ms"] for r in rows]
    curves = decide.throughput_curves(model, gpu, context, ["bf16", "fp8_e4m3", "int4"], CH6_CONCURRENCIES,
                                      weights_dtype=weights)
    one = {f: ys[0] for f, (xs, ys) in curves.items()}
    full = {f: xs[-1] for f, (xs, ys) in curves.items()}
    at8 = {f: ys[xs.index(8)] for f, (xs, ys) in curves.items() if 8 in xs}
    share1 = decide.step_time(model, 1, context, "bf16", gpu, weights).cache_share
    picks = decide.shortlist(rows)
    q = {f: by[f]["quality"] for f in by}
    unmeasured = [f for f in formats if not q[f]["measured"]]  # no needle verdict on every model yet
    ppl2 = {f: [smol["ppl"].get(f), gemma["ppl"].get(f)] for f in by}  # perplexity change, SmolLM2 and Gemma
    lo, hi = wilson(CH6_LADDER_PROMPTS // 2, CH6_LADDER_PROMPTS)  # at 50% exact match: the widest interval
    short1 = {f: decide.step_time(model, 1, 4096, f, gpu, weights).seconds for f in ("bf16", "int4")}
    # the reserve vLLM logged, growing with tensor parallelism (decide.plan's default)
    plans = {f: decide.plan(model, gpu, context, concurrency, f, weights_dtype=weights) for f in formats}
    # latency beside throughput (roofline predictions): TTFT of one prompt, TPOT at 1, 8 and each plan's batch
    lat = {f: {b: decide.latency(model, context, f, gpu, weights, batch=b, tp=pl["tp"])
               for b in (1, 8, pl["batch_per_replica"])} for f, pl in plans.items() if pl}
    # the same with one reserve, the single GPU's, on every GPU: what a plan that ignores the growth would say
    plans_flat = {f: decide.plan(model, gpu, context, concurrency, f, weights_dtype=weights,
                                 reserve_gib=B.DEFAULT_RESERVE_GIB) for f in formats}
    eight = [f for f in ("fp8_e4m3", "int8", "q8_0") if f in smol["ppl"] and f in gemma["ppl"]]
    noise = [mf["ppl"][f] for f in eight for mf in (smol, gemma)]  # the 8-bit formats' perplexity changes
    # the call: formats on the shortlist (held on both models' needles, under the perplexity bar on both, offered
    # by an engine); of those, the fewest GPUs; a tie in modelled throughput goes to the format more engines offer
    choice = decide.choose(plans, rows)
    call = choice["call"]
    big = next(x for x in B.published_vllm_logs() if x["id"] == CH1_LOG)["reserve_gib"]  # chapter 1.5's log
    plans_big = {"bf16": decide.plan(model, gpu, context, concurrency, "bf16", weights_dtype=weights, reserve_gib=big),
                 "call": decide.plan(model, gpu, context, concurrency, call, weights_dtype=weights, reserve_gib=big)
                 if call else None}
    fewest_gpus = min(p["gpus"] for p in plans.values() if p)
    at_fewest = [f for f, p in plans.items() if p and p["gpus"] == fewest_gpus]
    import json

    from .paths import RESULTS_DIR
    from .results import llamacpp_time_ratio

    llama = json.loads((RESULTS_DIR / "engines_llamacpp.json").read_text())  # chapter 4's appendix C
    values = {
        "q4_slow": llamacpp_time_ratio(llama["cache_types"], "q4_0"),
        "plans": plans, "plans_md": _plans_md(plans, by), "mbu": MBU, "mfu": MFU, "ppl_bar": PPL_TOLERANCE,
        "noise_lo": min(noise), "noise_hi": max(noise), "eight_md": names_md(eight), "ppl2": ppl2, "risk": risk,
        "nvfp4_bits": get_format("nvfp4").bits_per_element(128),
        "nvfp4_engines": engines_md(engines_offering(["nvfp4"])["nvfp4"]),
        "plans_flat": plans_flat, "big_reserve_gib": big, "plans_big": plans_big, "tp2_reserve_gib": B.TP_RESERVE_GIB[2],
        "reserve_gib": B.DEFAULT_RESERVE_GIB,
        "gpu_gib": B.get_gpu(gpu).memory_bytes / B.GIB, "price": B.hourly_price(gpu), "price_source": B.get_gpu(gpu).price_source,
        "bandwidth_source": B.get_gpu(gpu).source, "eval_ppl_windows": decide.EVAL_PPL_WINDOWS,
        # the answer for a reader whose engine is already chosen: the same rule on that engine's formats
        "by_engine": (engine_picks := decide.by_engine(plans, rows)),
        "by_engine_md": decide.by_engine_md(engine_picks, plans, rows),
        # per-token INT8 against FP8 directly, on the same passages (the paired sign test), each model
        "int8_vs_fp8": {short_model_name(mf["name"]): sweeps[m].paired_perplexity("int8", reference="fp8_e4m3")
                        for m, mf in (("smollm2-135m", smol), ("gemma3-270m", gemma))},
        "bandwidth_tbs": B.get_gpu(gpu).bandwidth_bytes_per_s / 1e12, "utilization": 0.9, "call": call, "call_plan": plans.get(call) if call else None,
        "fewest_gpus": fewest_gpus, "at_fewest_md": names_md(at_fewest), "bf_plan": plans["bf16"],
        "rows": rows, "by": by, "curves": curves, "concurrencies": CH6_CONCURRENCIES, "picks": picks,
        "model": model, "gpu": gpu, "context": context, "concurrency": concurrency,
        "bf": bf, "f8": f8, "i4": i4, "step_lo": min(steps), "step_hi": max(steps),
        "n_formats": len(formats),
        "per_seq_tps": plans[call]["tokens_per_s"] / concurrency if call and plans.get(call) else None,
        "bf_seq_tps": plans["bf16"]["tokens_per_s"] / concurrency if plans.get("bf16") else None,
        # the prompt reading its own quantized cache (chapter 4's cached stage on Gemma, every whole length)
        "cached_lengths_md": "; ".join(
            f"at {_k(L)} " + ", ".join(f"`{f}` {c}/{n}" for f in ("fp8_e4m3", "int8", "q4_0", "int4_token")
                                       for c, n in [sweeps["gemma3-270m"].counts("cached", f, L)] if n)
            + " (full precision {}/{}".format(*sweeps["gemma3-270m"].counts("filler", "fp32", L))
            + "; by the paired test, different from it: " + (names_md([f for f in ("fp8_e4m3", "int8", "q4_0", "int4_token")
                                                           if sweeps["gemma3-270m"].counts("cached", f, L)[1] and
                                                           sweeps["gemma3-270m"].paired("cached", f, L).verdict
                                                           != "not distinguishable"]) or "none") + ")"
            for L in sweeps["gemma3-270m"].lengths("cached")),
        "cached_lengths_k": " and ".join(_k(L) for L in sweeps["gemma3-270m"].lengths("cached")),
        "share1": share1, "small_gain": one["int4"] / one["bf16"], "gain8": at8["int4"] / at8["bf16"] if at8 else None,
        "full": full, "picks_md": names_md([f for f in picks if f not in decide.REFERENCE_FORMATS]), "q": q,
        "ladder_prompts": CH6_LADDER_PROMPTS, "half_width": 100 * (hi - lo) / 2,
        "int4_over_fp8": i4["max_concurrency"] / f8["max_concurrency"], "short1_speedup": short1["bf16"] / short1["int4"],
        "short1": short1, "s": smol, "g": gemma, "sweeps": sweeps,
        "figure_formats": ["fp32"] + [f for f in formats if q[f]["measured"] and not q[f]["reference"]],
        "g_never_md": names_md([f for f in gemma["held"] if f in CH6_FORMATS or f in ("q8_0", "int4_g16")]),
        "s_int4": needle_label(smol, "int4"), "g_int4": needle_label(gemma, "int4"), "s_q4_0": needle_label(smol, "q4_0"),
        "min_detect": fewest_prompts_to_detect(),
        # the paired tests a format must pass on each model: each length in each single-needle haystack, and pooled
        "n_tests": {short_model_name(mf["name"]): min(mf["n_needle_tests"]) for mf in (smol, gemma)},
        # the 4-bit formats (mitigations aside) under the perplexity bar on both models: finer grouping than any engine's
        "low_under_bar_md": names_md(low_under_bar := [f for f in smol["ppl"] if _plain_low_bit(f) and f in gemma["ppl"]
                                                       and max(smol["ppl"][f], gemma["ppl"][f]) <= PPL_TOLERANCE],
                                     notes=_bits_notes(low_under_bar)),
        "low_under_bar_offered": [f for f in low_under_bar if any(engine_options(f).values())],
        # verdicts of worse that Holm's correction for those tests would drop (chapter 4), per model
        "holm_rescued_md": "; ".join(f"{names_md(fs)} on {short_model_name(mf['name'])}" for mf in (smol, gemma)
                                     if (fs := [f for f in mf["holm_rescued"] if f in by])) or "none of this chapter's formats",
        # the same for the formats measured outside 6.2's table (mitigations, engines' variants)
        "holm_rescued_outside_md": "; ".join(f"{names_md(fs)} on {short_model_name(mf['name'])}" for mf in (smol, gemma)
                                             if (fs := [f for f in mf["holm_rescued"] if f not in by])) or "none",
        # NVFP4's needle verdict on each model, and whether a verdict of worse survives Holm's correction
        "nvfp4_needle_md": _needle_with_holm_md("nvfp4", (smol, gemma)),
        # formats added later that Holm would clear and that stay under the bar: without a needle verdict on every
        # model yet, they are what keeps them off the list
        "holm_added": (holm_added := list(dict.fromkeys(
            f for mf in (smol, gemma) for f in mf["holm_rescued"] if f in added
            and all(x is not None and x < PPL_TOLERANCE for x in (smol["ppl"].get(f), gemma["ppl"].get(f)))))),
        "holm_rescued_all_fail_ppl": all(mf["ppl"].get(f, 0) > PPL_TOLERANCE for mf in (smol, gemma)
                                         for f in mf["holm_rescued"] if f not in holm_added),
        # with Holm's correction: formats of the table that would then pass the screen, and those still waiting
        "holm_extra": (holm_extra := [f for f in formats if f not in picks and by[f]["engines"] and q[f]["measured"]
                                      and f not in decide.REFERENCE_FORMATS
                                      and all((f in mf["held"] or f in mf["holm_rescued"]) and mf["ppl"].get(f, 1) < PPL_TOLERANCE
                                              for mf in (smol, gemma))]),
        "holm_call_md": _holm_call_md(holm_extra, [f for f in holm_added if not (q.get(f) or {}).get("measured")]),
        # the one 8-bit format a needle test found worse on SmolLM2
        "added_8bit_worse": [f for f in added if not _low_bit(f) and f in smol["by"] and f not in smol["held"]],
        "e5_pooled": (f"−{smol['pooled']['fp8_e5m2'].lost} +{smol['pooled']['fp8_e5m2'].gained}"
                      if "fp8_e5m2" in smol["pooled"] else "—"),
        "g_e5": needle_label(gemma, "fp8_e5m2") if "fp8_e5m2" in gemma["by"] else "has no verdict yet",
        # the near miss the bar decides: kvlab's emulation of llama.cpp's default (rotated) q4_0 cache
        "q4r_needles_md": _needles_on_both("q4_0+rotate", (smol, gemma)),
        "q4r_plan": decide.plan(model, gpu, context, concurrency, "q4_0+rotate", weights_dtype=weights),
        "q8r_ppl_md": " and ".join(_pct(x) if x is not None else "—" for x in (smol["ppl"].get("q8_0+rotate"),
                                                                            gemma["ppl"].get("q8_0+rotate"))),
        "q8r_needles_md": _needles_on_both("q8_0+rotate", (smol, gemma)),
        "flat_layout": _layout(plans_flat["bf16"]) if plans_flat.get("bf16") else "—",
        "bf_layout": _layout(plans["bf16"]) if plans.get("bf16") else "—",
        "flat_call": plans_flat.get(call) if call else None,
        # the runner-up on the same GPUs: INT8 per token (vLLM's int8_per_token_head)
        "int8_gap": 1 - plans["int8"]["tokens_per_s"] / plans[call]["tokens_per_s"] if call and plans.get("int8") else None,
        "tied_md": names_md(choice["tied"]), "tie_pct": decide.THROUGHPUT_TIE,
        "int8_engines_md": engines_md(by["int8"]["engines"]),
        "f8_engines_md": engines_md(f8["engines"]),
        # what "held" still allows the call to lose: its pooled single-needle prompts, one-sided 95% (exact)
        # ... an average over lengths: the call's own cell at the context served, on the model measured there
        "eval_per_length": len(decide.EVAL_DEPTHS) * decide.EVAL_TRIALS,
        "latency_md": _latency_md(lat, plans), "lat": lat,
        # the same arithmetic in every format: compare prefill at one tensor-parallel size
        "ttft_spread": _spread_at_one_tp(lat, plans),
        # what the printed comparison can see (kvlab.power: exact McNemar, 80% power, no chance flips: its best case)
        "detect_len": power.detectable_loss(len(decide.EVAL_DEPTHS) * decide.EVAL_TRIALS),
        "need_10": power.prompts_needed(0.10),
        # the bar is a choice: the shortlist at looser bars, and with none at all
        "bar_shortlists": {bar: decide.shortlist(rows, max_ppl=bar) for bar in CH6_OTHER_BARS},
        "call_at_context_md": (f"at {_k(context)} on {short_model_name(gemma['name'])}, in the filler haystack, it lost {c['lost']} and gained "
                               f"{c['gained']} of {c['prompts']} prompts, where that one length bounds the loss at "
                               f"{exact_upper(c['lost'], c['prompts']):.0%}"
                               if call and (c := gemma["cell"].get((call, context))) else
                               f"no single length was measured at {_k(context)}"),
        "tie_at_context_md": ("; ".join(f"`{f}` lost {c['lost']} and gained {c['gained']} of {c['prompts']}"
                                        for f in (call, "int8") if (c := gemma["cell"].get((f, context))))
                              if call and all((f, context) in gemma["cell"] for f in (call, "int8")) else
                              f"no single length was measured at {_k(context)}"),
        "call_bound_md": " and ".join(f"{exact_upper(mf['pooled'][call].lost, mf['pooled'][call].prompts):.1%} on "
                                      f"{short_model_name(mf['name'])}" for mf in (smol, gemma)) if call else "—",
        "s_int4_tensor": needle_label(smol, "int4_tensor"), "g_int4_tensor": needle_label(gemma, "int4_tensor"),
        # llama.cpp's default q4_0 rotates first: kvlab's q4_0+rotate on each model's held-out passages, against
        # full precision and against q4_0 (the sweeps' added formats)
        "rots": (rots := _rotation_ppl(sweeps)),
        "rot_md": "; ".join(
            f"on {m}'s {r['q4_0']['windows']} passages kvlab's `q4_0+rotate` costs "
            f"{r['q4_0+rotate']['increase']:+.1%} perplexity against `q4_0`'s {r['q4_0']['increase']:+.1%} (lower on "
            f"{r['vs q4_0']['better_windows']} of {r['q4_0']['windows']} passages), "
            f"{'under' if r['q4_0+rotate']['increase'] < PPL_TOLERANCE else 'still over'} the {PPL_TOLERANCE:.0%} bar"
            for m, r in rots.items()) or "not measured",
        # vLLM 0.26's int4_per_token_head: nearest kvlab format int4_token+rotate (kvlab formats --engines)
        "vllm_int4_near": (vllm_near := next((f for f in INT4_NEAR if "vLLM" in engine_nearest(f)), None)),
        "s_vllm_int4": needle_label(smol, vllm_near) if vllm_near else "—",
        "g_vllm_int4": needle_label(gemma, vllm_near) if vllm_near else "—",
        "ppl_vllm_int4": [smol["ppl"].get(vllm_near), gemma["ppl"].get(vllm_near)] if vllm_near else [None, None],
        "prompts": smol["prompts"] if smol["prompts_all"] == gemma["prompts_all"] and len(smol["prompts_all"]) == 1 else None,
        "unmeasured_md": names_md(unmeasured),
        # the engine formats added to both sweeps later on the same prompts (sweep_long.py --add-formats)
        "added": added,
        "added_md": _added_md([f for f in added if f not in plans], [smol, gemma]),  # 6.2's table has the rest
        "added_status_md": _added_status_md(added, [smol, gemma], unmeasured),
        "unmeasured_plan_md": (
            f"The table's \"not run yet\" rows ({names_md(unmeasured)}) have perplexity on both models but not yet a "
            "needle verdict on each (6.4); none of them needs fewer GPUs than the call, so at best one would tie it."
            if unmeasured else ""),
        "added_dates": " and ".join(sorted({a.get("date", "?") for sw in sweeps.values() for a in sw.header["added"]})),
        "added_ppl": {f: [smol["ppl"].get(f), gemma["ppl"].get(f)] for f in added},
        "added_8bit_md": names_md([f for f in added if not _low_bit(f)]),
        "added_8bit_hi": max((x for f in added if not _low_bit(f) for x in (smol["ppl"].get(f), gemma["ppl"].get(f))
                              if x is not None), default=None),
        "added_4bit_md": names_md([f for f in added if _low_bit(f)]),
        "covers_context": gemma["longest"] >= context, "g_head_dim": CH4_HEAD_DIM["gemma3-270m"],
        "s_head_dim": CH4_HEAD_DIM["smollm2-135m"],
        "head_ratio": CH4_HEAD_DIM["gemma3-270m"] // CH4_HEAD_DIM["smollm2-135m"],
    }
    claims = {
        "BF16 cannot hold the requested load on one GPU": _claim(not bf["fits"]),
        "FP8 holds about twice as many sequences as BF16":
            _claim(1.8 <= f8["max_concurrency"] / bf["max_concurrency"] <= 2.2, (f8["max_concurrency"], bf["max_concurrency"])),
        "INT4 (4.5 bits with scales) holds about 3.5x as many":
            _claim(3.2 <= i4["max_concurrency"] / bf["max_concurrency"] <= 3.8, i4["max_concurrency"]),
        "with memory full, a step takes about the same time in every format (within 10%)":
            _claim(max(steps) < 1.1 * min(steps), steps),
        "so throughput follows the sequences that fit": _claim(abs(f8["speedup"] - f8["running"] / bf["running"]) < 0.1),
        "at one sequence INT4 gains less than 40% over BF16": _claim(values["small_gain"] < 1.4, values["small_gain"]),
        "each curve ends where its pool is full (the table's sequences one GPU holds)":
            _claim(all(full[f] == by[f]["max_concurrency"] for f in full), full),
        "at one sequence the weights are most of the bytes read": _claim(share1 < 0.5, share1),
        "at 8 sequences INT4 is at least 1.5x BF16": _claim(values["gain8"] is not None and values["gain8"] >= 1.5, at8),
        "no INT4 format an engine offers passes the perplexity bar":
            _claim(not ({"int4", "q4_0", "int4_tensor"} & set(picks)), picks),
        "FP8 E4M3 is on the shortlist": _claim("fp8_e4m3" in picks, picks),
        "with Holm's correction q4_0 would hold on both models' needles":
            _claim("q4_0" in smol["holm_rescued"] and "q4_0" in gemma["held"], (smol["holm_rescued"], gemma["held"])),
        "the shortlist of 6.2's formats is the same at a 10% or 20% bar or with none":
            _claim(all(v == picks for v in values["bar_shortlists"].values()), values["bar_shortlists"]),
        "of the formats added later, the 8-bit ones stayed under the perplexity bar on both models and each 4-bit one "
        "went over it on at least one":
            _claim(bool(added) and all(None not in v and (max(v) < PPL_TOLERANCE) != _low_bit(f)
                                       for f, v in values["added_ppl"].items()), values["added_ppl"]),
        "LMDeploy's INT4 (a scale per token and head) costs several times int4's perplexity on Gemma's 256-wide heads, "
        "and the same as int4 on SmolLM2's 64-wide ones":
            _claim("lmdeploy-int4" in added and None not in values["added_ppl"]["lmdeploy-int4"]
                   and values["added_ppl"]["lmdeploy-int4"][1] > 5 * ppl2["int4"][1]
                   and abs(values["added_ppl"]["lmdeploy-int4"][0] - ppl2["int4"][0]) < 1e-3,
                   (values["added_ppl"].get("lmdeploy-int4"), ppl2["int4"])),
        "every format added later has its perplexity on both models, and is on the shortlist only with its needles in on both":
            _claim(all(None not in v for v in values["added_ppl"].values())
                   and all(f not in picks or (f in smol["held"] and f in gemma["held"]) for f in added), values["added_ppl"]),
        "the formats already found worse on Gemma at a finished length are 4-bit ones over the perplexity bar there":
            _claim(all(_low_bit(f) and gemma["ppl"].get(f, 0) > PPL_TOLERANCE for f in gemma["partial"]), gemma["partial"]),
        "the 4-bit formats under the perplexity bar on both models are ones no engine offers":
            _claim(not values["low_under_bar_offered"], values["low_under_bar_md"]),
        "every verdict Holm's correction would drop on the original formats belongs to one that misses the perplexity bar":
            _claim(values["holm_rescued_all_fail_ppl"], values["holm_rescued_md"]),
        "Holm's correction would not change the call: what it would add needs no fewer GPUs":
            _claim(call is not None and all(plans.get(f) is None or plans[f]["gpus"] >= plans[call]["gpus"]
                                            for f in values["holm_extra"] + values["holm_added"]),
                   (values["holm_extra"], values["holm_added"])),
        "of the 8-bit formats added later, only fp8_e5m2 was found worse on SmolLM2's needles (pooled), and the "
        "8-bit formats of the original sweeps all held there":
            _claim(values["added_8bit_worse"] == ["fp8_e5m2"] and smol["pooled"]["fp8_e5m2"].verdict == "worse"
                   and not smol["by"]["fp8_e5m2"]["worse_at"] and not smol["prose"]["by"]["fp8_e5m2"]["worse_at"]
                   and {"fp8_e4m3", "int8", "q8_0"} <= set(smol["held"]), values["added_8bit_worse"]),
        "fp8_e5m2 held on Gemma's needles": _claim(values["g_e5"] == "held", values["g_e5"]),
        "with the prompt reading its own quantized cache at 8k on Gemma, FP8 and INT8 found every needle":
            _claim(all(c == n > 0 for f in ("fp8_e4m3", "int8") for c, n in [sweeps["gemma3-270m"].counts("cached", f, 8192)]),
                   values["cached_lengths_md"]),
        "at the fixed load the call's sequences decode faster than BF16's, by under 1.5x":
            _claim(values["per_seq_tps"] is not None and values["bf_seq_tps"] is not None
                   and 1 < values["per_seq_tps"] / values["bf_seq_tps"] < 1.5, (values["per_seq_tps"], values["bf_seq_tps"])),
        "q8_0+rotate held on both models' needles and stayed under the bar on both":
            _claim(values["q8r_needles_md"] == HELD_ON_BOTH and None not in values["added_ppl"].get("q8_0+rotate", [None])
                   and max(values["added_ppl"]["q8_0+rotate"]) < PPL_TOLERANCE, values["added_ppl"].get("q8_0+rotate")),
        "per-token INT8 and FP8 are not distinguishable on perplexity on either model (paired, same passages), "
        "nor on the needles pooled over every length and both haystacks":
            _claim(set(values["int8_vs_fp8"]) == {"SmolLM2", "Gemma"}
                   and all(r["verdict"] == "not distinguishable" for r in values["int8_vs_fp8"].values())
                   and all(sw.paired_pooled(("filler", "prose"), "int8", reference="fp8_e4m3").verdict
                           == "not distinguishable" for sw in sweeps.values()),
                   {m: r["verdict"] for m, r in values["int8_vs_fp8"].items()}),
        "with its engine chosen, a reader gets the call wherever that engine offers it":
            _claim(call is not None and all(fs[0] == call for fs in engine_picks.values() if call in fs), engine_picks),
        "int8_tensor ties the call, is stored only by TensorRT-LLM, and cost more perplexity than FP8 on Gemma":
            _claim("int8_tensor" in choice["tied"] and list(by["int8_tensor"]["engines"]) == ["TensorRT-LLM"]
                   and ppl2["int8_tensor"][1] > ppl2["fp8_e4m3"][1], (choice["tied"], ppl2["int8_tensor"])),
        "q4_0+rotate held on both models' needles, misses the bar but would clear a 20% one, and needs fewer GPUs "
        "than the call":
            _claim(values["q4r_needles_md"] == HELD_ON_BOTH and None not in values["added_ppl"].get("q4_0+rotate", [None])
                   and PPL_TOLERANCE < max(values["added_ppl"]["q4_0+rotate"]) < 0.20 and call is not None
                   and values["q4r_plan"] is not None and values["q4r_plan"]["gpus"] < plans[call]["gpus"],
                   (values["q4r_needles_md"], values["added_ppl"].get("q4_0+rotate"), values["q4r_plan"])),
        "vLLM, SGLang and TensorRT-LLM all offer FP8 E4M3":
            _claim({"vLLM", "SGLang", "TensorRT-LLM"} <= set(f8["engines"]), f8["engines"]),
        "INT4 holds about 1.8x FP8's sequences": _claim(1.6 < values["int4_over_fp8"] < 2.0, values["int4_over_fp8"]),
        "INT4 with one scale per tensor is not on the shortlist": _claim("int4_tensor" not in picks),
        "with the rotation llama.cpp adds, q4_0 falls under the perplexity bar on SmolLM2, lower on every passage (paired), "
        "but not distinguishably on Gemma, still over the bar there":
            _claim(set(rots) == {"SmolLM2", "Gemma"}
                   and rots["SmolLM2"]["q4_0+rotate"]["increase"] < PPL_TOLERANCE < rots["SmolLM2"]["q4_0"]["increase"]
                   and rots["SmolLM2"]["vs q4_0"]["verdict"] == "better"
                   and rots["SmolLM2"]["vs q4_0"]["better_windows"] == rots["SmolLM2"]["q4_0"]["windows"]
                   and rots["Gemma"]["vs q4_0"]["verdict"] == "not distinguishable"
                   and rots["Gemma"]["q4_0+rotate"]["increase"] > PPL_TOLERANCE,
                   {m: (r["q4_0"]["increase"], r["q4_0+rotate"]["increase"], r["vs q4_0"]["verdict"])
                    for m, r in rots.items()}),
        "the nearest kvlab format to vLLM's INT4 cache held on SmolLM2, was worse on Gemma and missed the bar on both":
            _claim(values["vllm_int4_near"] == "int4_token+rotate" and values["s_vllm_int4"] == "held"
                   and values["g_vllm_int4"].startswith("worse") and min(values["ppl_vllm_int4"]) > PPL_TOLERANCE,
                   (values["s_vllm_int4"], values["g_vllm_int4"], values["ppl_vllm_int4"])),
        "INT4 with a scale and zero per 64 values costs over 10x FP8's perplexity on both models":
            _claim(all(i > 10 * max(f, 1e-3) for i, f in zip(ppl2["int4"], ppl2["fp8_e4m3"])), (ppl2["int4"], ppl2["fp8_e4m3"])),
        "the longest context SmolLM2 was measured at is below the context asked about":
            _claim(smol["longest"] < context, (smol["longest"], context)),
        "chapter 4 measured Gemma up to the context asked about": _claim(values["covers_context"], gemma["longest"]),
        "on Gemma FP8 and INT8 were never worse than full precision": _claim({"fp8_e4m3", "int8"} <= set(gemma["never"])),
        "on Gemma per-token INT4 was already worse at the shortest length": _claim("int4_token" in gemma["short"]),
        "at one tensor-parallel size prefill time barely depends on the cache format (within 1%)":
            _claim(values["ttft_spread"] < 0.01,
                                                                                values["ttft_spread"]),
        "every plan's decode step is bandwidth-bound at its batch":
            _claim(all(v[plans[f]["batch_per_replica"]]["tpot_bound"] == "memory" for f, v in lat.items()), None),
        "at the planned batch a smaller cache decodes faster (INT4 < FP8 < BF16 per output token)":
            _claim(all(f in lat for f in ("int4", "fp8_e4m3", "bf16")) and
                   lat["int4"][plans["int4"]["batch_per_replica"]]["tpot_s"]
                   < lat["fp8_e4m3"][plans["fp8_e4m3"]["batch_per_replica"]]["tpot_s"]
                   < lat["bf16"][plans["bf16"]["batch_per_replica"]]["tpot_s"], None),
        "one length of the comparison misses losses under a tenth of its prompts, at best":
            _claim(values["detect_len"] > 0.10 and values["need_10"] > values["eval_per_length"],
                   (values["detect_len"], values["need_10"])),
        "at 50 prompts a length the 95% interval is about ±13 points": _claim(12 < values["half_width"] < 14
                                                                             and CH6_LADDER_PROMPTS == values["eval_per_length"], (lo, hi)),
        "at one 4k sequence INT4 speeds a step up by less than 10%": _claim(values["short1_speedup"] < 1.1, short1),
        "chapter 4 ran the same number of prompts at every point on both models":
            _claim(values["prompts"] is not None, (smol["prompts_all"], gemma["prompts_all"])),
        "every format of the table without a verdict on both models is one added to the sweeps later":
            _claim(set(unmeasured) <= set(added), values["unmeasured_md"]),
        "every plan holds the whole load": _claim(all(p is None or p["replicas"] * p["per_replica"] >= concurrency
                                                      for p in plans.values()), plans),
        "the call needs fewer GPUs than BF16": _claim(call is not None and plans[call]["gpus"] < plans["bf16"]["gpus"],
                                                      (call, plans.get(call))),
        "no format on the fewest GPUs both passed every test and is offered by an engine":
            _claim(call not in at_fewest, at_fewest),
        "BF16's plan has little spare room, the call's more": _claim(plans["bf16"]["spare"] < plans[call]["spare"],
                                                                     (plans["bf16"]["spare"], plans[call]["spare"])),
        "the largest published reserve costs BF16 GPUs but not the call": _claim(
            values["plans_big"]["bf16"]["gpus"] > plans["bf16"]["gpus"]
            and values["plans_big"]["call"]["gpus"] == plans[call]["gpus"], values["plans_big"]),
        "one reserve for every GPU would save BF16 a GPU (a tensor-parallel group) but not the call":
            _claim(plans_flat["bf16"]["gpus"] < plans["bf16"]["gpus"] and plans_flat["bf16"]["tp"] > 1
                   and plans_flat[call]["gpus"] == plans[call]["gpus"], (plans_flat["bf16"], plans_flat[call])),
        "the quiz's INT4 needs fewer GPUs than the call but was worse on Gemma's needle and over the perplexity bar on both models":
            _claim(plans["int4"]["gpus"] < plans[call]["gpus"] and bool(gemma["by"]["int4"]["worse_at"])
                   and min(ppl2["int4"]) > PPL_TOLERANCE, (plans["int4"], gemma["by"]["int4"]["worse_at"], ppl2["int4"])),
        "of the quiz's four options BF16 needs the most GPUs":
            _claim(plans["bf16"]["gpus"] > max(plans[f]["gpus"] for f in (call, "int4", "kivi-4")), plans),
        "KIVI-4 passed every test on both models and fits the fewest GPUs but no engine offers it":
            _claim("kivi-4" in at_fewest and not by["kivi-4"]["engines"] and "kivi-4" in smol["held"]
                   and "kivi-4" in gemma["held"] and max(ppl2["kivi-4"]) < PPL_TOLERANCE),
        "NVFP4 costs less perplexity than int4 on both models but is over the bar on both":
            _claim(all(n is not None and PPL_TOLERANCE < n < i for n, i in zip(values["added_ppl"].get("nvfp4", [None]), ppl2["int4"])),
                   (values["added_ppl"].get("nvfp4"), ppl2["int4"])),
        "INT8 ties the FP8 call on GPUs and room to spare, within the rule's throughput tie, with lower perplexity on both models, offered by vLLM's Triton backend only, where more engines offer FP8":
            _claim(call == "fp8_e4m3" and "int8" in choice["tied"] and plans["int8"]["gpus"] == plans[call]["gpus"]
                   and plans["int8"]["spare"] == plans[call]["spare"]
                   and 0 <= values["int8_gap"] < decide.THROUGHPUT_TIE and all(i < f for i, f in zip(ppl2["int8"], ppl2[call]))
                   and list(by["int8"]["engines"]) == ["vLLM"] and "Triton" in by["int8"]["engines"]["vLLM"]
                   and len(f8["engines"]) > len(by["int8"]["engines"]),
                   (plans["int8"], values["int8_gap"], ppl2["int8"], ppl2[call], by["int8"]["engines"])),
        "the call held on both models' needles and stayed under the perplexity bar on both":
            _claim(call in smol["held"] and call in gemma["held"] and max(ppl2[call]) < PPL_TOLERANCE, (call, ppl2.get(call))),
        "the formats without a needle verdict on both models need no fewer GPUs than the call":
            _claim(call is not None and all(plans[f] is None or plans[f]["gpus"] >= plans[call]["gpus"]
                                            for f in unmeasured), values["unmeasured_md"]),
        "q4_0+rotate, added later, is over the 5% bar and under 20% on both models":
            _claim(None not in (v := values["added_ppl"].get("q4_0+rotate") or [None]) and PPL_TOLERANCE < max(v) < 0.2, v),
        "the 8-bit formats added later stay under the bar (the bar sits above every 8-bit cache measured)":
            _claim(values["added_8bit_hi"] is not None and max(values["added_8bit_hi"], max(noise)) < PPL_TOLERANCE,
                   values["added_8bit_hi"]),
        "the perplexity bar is several times the spread of the 8-bit formats":
            _claim(PPL_TOLERANCE > 5 * max(abs(min(noise)), abs(max(noise))), noise),
    }
    return Facts(values, claims)


def _spread_at_one_tp(lat: dict, plans: dict) -> float:
    """The largest relative spread of predicted TTFT among formats whose plans share a tensor-parallel size."""
    by_tp: dict[int, list[float]] = {}
    for f, v in lat.items():
        by_tp.setdefault(plans[f]["tp"], []).append(v[1]["ttft_s"])
    return max(max(ts) / min(ts) - 1 for ts in by_tp.values())


def _latency_md(lat: dict, plans: dict) -> str:
    """Chapter 6's latency table: TTFT and TPOT (ms) per format, at batch 1, 8 and each plan's own batch."""
    from .tables import markdown

    rows = [[f"`{f}`", plans[f]["tp"], f"{v[1]['ttft_s'] * 1e3:,.0f}", f"{v[1]['tpot_s'] * 1e3:.1f}", f"{v[8]['tpot_s'] * 1e3:.1f}",
             f"{v[plans[f]['batch_per_replica']]['tpot_s'] * 1e3:.1f} (batch {plans[f]['batch_per_replica']})"]
            for f, v in lat.items()]
    return markdown(["format", "TP", "time to first token (ms)", "per output token, batch 1", "batch 8",
                     "at the plan's batch per replica"], rows, align="lrrrrr")


def _layout(p: dict) -> str:
    """A plan's layout as chapter 6 prints it: "tp=2", or "tp=1 × 3 replicas"."""
    return f"tp={p['tp']}" + (f" × {p['replicas']} replicas" if p["replicas"] > 1 else "")


def _plans_md(plans: dict, by: dict) -> str:
    """The configuration table of chapter 6: fewest GPUs per format, throughput, cost, measured risk on each of
    chapter 4's models (paired needle verdict, perplexity change), the engines that offer it."""
    models = risk_models(by.values())
    who = " · ".join(short_model_name(m) for m in models)
    rows = [f"| format | GPUs | layout | spare | tokens/s, all GPUs | $ / M tokens | needle, paired ({who}) | perplexity ({who}) "
            "| offered by |", "|---|---:|---|---:|---:|---:|---|---|---|"]
    for f, p in plans.items():
        q = by[f]["quality"]
        if q.get("reference"):
            needle, ppl = "reference (fp32 in chapter 4)", "reference"
        elif not q.get("models"):
            needle, ppl = "not in the paired sweeps", "—"
        else:  # a model without a needle verdict yet: "not run yet" (a format added to its sweep, perplexity first)
            ms = per_model(q, models)
            needle = " · ".join(short_needle(x["needle"]) for x in ms)  # the counts are in 6.4
            ppl = " · ".join(_pct(x["ppl_increase"]) if x["ppl_increase"] is not None else "—" for x in ms)
        offered = ", ".join(by[f]["engines"]) or "no engine"
        if p is None:
            rows.append(f"| `{f}` | over 64 | — | — | — | — | {needle} | {ppl} | {offered} |")
            continue
        rows.append(f"| `{f}` | {p['gpus']} | {_layout(p)} | {p['spare']} | {p['tokens_per_s']:,.0f} | "
                    f"${p['usd_per_million_tokens']:.2f} | {needle} | {ppl} | {offered} |")
    return "\n".join(rows)


CHAPTERS: dict[str, Callable[[], Facts]] = {"01_cache_budget": cache_budget, "03_triton_attention": triton_attention, "04_where_int4_breaks": where_int4_breaks,
                                            "05_prefix_cache": prefix_cache, "06_choosing_a_format": choosing_a_format}
