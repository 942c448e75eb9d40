"""Chapter 6's main path: the answer, the engine card, a budget to compute by hand, and the exercises.

Each function takes chapter 6's facts (:func:`kvlab.facts.choosing_a_format`, for the deployment in the
chapter's first cell) and returns the values and claims of one section of
``notebooks/prose/06_choosing_a_format.md``. The folded sections below the main path still read the facts'
values directly.
"""

from __future__ import annotations

from .. import budget as B
from ..decide import (
    REFERENCE_FORMATS,
    _quality,
    choose,
    passes_screen,
    pct,
    short_model_name,
    short_needle,
)
from ..facts import Facts
from ..formats import engine_table, get_format
from ..tables import markdown

SKIP_ENGINES = ("transformers",)  # a library, not a server: chapter 4's appendix C compares it
# the GPUs that compute with each element natively (engines.json's 'conditions': FP8 from Ada and Hopper, NVFP4 on
# Blackwell only); the integer formats run on any GPU the engine supports
GPUS = {"float8_e4m3fn": "Ada and newer", "float8_e5m2": "Ada and newer", "float4_e2m1": "Blackwell only"}
SCALES = {"tensor": "per tensor, fixed", "head": "per head, fixed", "token": "per token, on write",
          "group": "per {n} values, on write", "channel": "per channel, on write"}


def short_flag(flag: str) -> str:
    """An engine option without its parenthesised notes: ``--kv-cache-dtype fp8 (= fp8_e4m3)`` -> ``--kv-cache-dtype fp8``."""
    for sep in (" (", ": ", ", ", " with "):  # notes follow a bracket, a colon, a comma or "with"
        flag = flag.split(sep)[0]
    return flag.split(" / ")[-1].strip()  # "Python API / server flag": the server's


def card_rows() -> list[tuple[str, str, str, bool]]:
    """``(engine, flag, kvlab format, exact)`` for every serving engine's quantized KV option in ``engines.json``.

    ``exact`` is False where the engine's option is only near a kvlab format (its 'nearest' entries). A preset is
    left out where the same engine's default replaces it with a nearer format (llama.cpp rotates ``q4_0`` first by
    default: its row is ``q4_0+rotate``).
    """
    t = engine_table()
    rows = []
    for key, engine in t["engines"].items():
        if key in SKIP_ENGINES:
            continue
        near = {f: opts[key] for f, opts in t.get("nearest", {}).items() if opts.get(key)}
        for fmt, opts in t["presets"].items():
            if fmt in REFERENCE_FORMATS or not opts.get(key) or f"{fmt}+rotate" in near:
                continue
            rows.append((engine["name"], short_flag(opts[key]), fmt, True))
        rows += [(engine["name"], short_flag(opt), fmt, False) for fmt, opt in near.items()]
    return rows


def _option(flag: str) -> str:
    """A flag or an API call in code font; a documented procedure ("INT8 KV Cache recipe") as plain text."""
    return f"`{flag}`" if flag.startswith("-") or "(" in flag or "=" in flag else flag


def _scales(fmt: str) -> str:
    q = get_format(fmt).key
    return SCALES[q.granularity].format(n=q.group_size)


def card(F) -> Facts:
    """The engine card: each engine's KV options, the GPUs that run them natively, where their scales come from,
    and chapter 4's verdicts on both models, with whether the option passed chapter 6's screen."""
    bar, models = F["ppl_bar"], list(F["risk"])
    rows, passed = [], {}
    for engine, flag, fmt, exact in card_rows():
        q = _quality(F["risk"], fmt)
        per = [q["models"].get(m, {}) for m in models]
        ran = q["measured"] and all(p.get("ppl_increase") is not None for p in per)
        ok = passes_screen(q, bar)
        passed[engine, fmt] = ok if ran else None
        needles = " / ".join("✓" if p.get("held") else "✗ " + short_needle(p.get("needle")) if ran else "not run"
                             for p in per)
        ppl = " / ".join(pct(p["ppl_increase"]) if ran else "—" for p in per)
        rows.append([engine, _option(flag), f"`{fmt}`" + ("" if exact else " (near)"),
                     GPUS.get(get_format(fmt).key.element, "—"), _scales(fmt), needles, ppl,
                     "—" if not ran else "**passes**" if ok else "fails"])
    names = " / ".join(short_model_name(m) for m in models)
    table = markdown(["engine", "option", "kvlab measured", "FP8/FP4 math on", "scales", f"needles {names}",
                      f"perplexity {names}", "screen"], rows, align="llllllrl")
    fp8 = {e: v for (e, f), v in passed.items() if f == "fp8_e4m3"}
    four = {(e, f): v for (e, f), v in passed.items() if get_format(f).key.element in ("int4", "float4_e2m1")}
    values = {"engine_card_md": table, "bar": bar, "servers": len(serving_engines()), "not_run": sorted({f for (_, f), v in passed.items() if v is None}),
              "four_passed": sorted({f for (_, f), v in four.items() if v})}
    claims = {"every engine's FP8 E4M3 option passed the screen on both models": (bool(fp8) and all(fp8.values()), fp8),
              "no engine's 4-bit option passed the screen": (not any(four.values()), four)}
    return Facts(values, claims)


def serving_engines() -> list[str]:
    """The serving engines of ``engines.json`` by name (``transformers``, a library, left out)."""
    return [e["name"] for k, e in engine_table()["engines"].items() if k not in SKIP_ENGINES]


def serving(row: dict) -> list[str]:
    """The serving engines that offer a row's format (:func:`kvlab.decide.options`' ``engines``)."""
    return [e for e in row["engines"] if e in serving_engines()]


def answer(F) -> Facts:
    """The answer: GPUs for BF16 and for the call, what the cheaper formats lost, and the one-sequence speed."""
    plans, rows = F["plans"], {r["kv_format"]: r for r in F["rows"]}
    call = F["call"]
    fewer = [f for f, p in plans.items() if p and p["gpus"] < plans[call]["gpus"]]
    failed = [f for f in fewer if not passes_screen(rows[f]["quality"], F["ppl_bar"])]
    values = {k: F[k] for k in ("model", "gpu", "context", "concurrency", "call", "call_plan", "bf_plan", "ppl_bar",
                                "short1_speedup")}
    tied = choose(plans, F["rows"])["tied"]
    values |= {"fewer": fewer, "fewer_failed": failed, "fewer_unoffered": [f for f in fewer if f not in failed],
               "saving": 1 - F["call_plan"]["usd_per_million_tokens"] / F["bf_plan"]["usd_per_million_tokens"],
               "call_engines": serving(rows[call]), "servers": len(serving_engines()), "tied": tied,
               "tied_engines": {f: ", ".join(serving(rows[f])) or "no serving engine" for f in tied}}
    claims = {"the call needs fewer GPUs than BF16": (F["call_plan"]["gpus"] < F["bf_plan"]["gpus"], F["call_plan"]),
              "every format that needs fewer GPUs than the call failed the screen or is offered by no engine":
                  (all(f in failed or not rows[f]["engines"] for f in fewer), fewer),
              "one short sequence gains under 5% from INT4": (F["short1_speedup"] < 1.05, F["short1_speedup"])}
    return Facts(values, claims)


def question_context(context: int) -> int:
    """The check's context: three quarters of the chapter's, in whole 16-token blocks, so that its answer is not a
    number the page already shows."""
    return max(16, context * 3 // 4 // 16 * 16)


def by_hand(F) -> Facts:
    """The check-yourself budget: how many sequences of :func:`question_context` tokens fit beside the weights."""
    model, gpu, util = F["model"], F["gpu"], F["utilization"]
    context = question_context(F["context"])
    fit = B.fit(model, gpu, "bf16", memory_utilization=util)
    shape = B.load_shape(model)
    per_seq = B.budget(model, 1, context, "bf16").cache_bytes_per_gpu
    free = fit.free_for_cache_per_gpu
    values = {"model": model, "gpu": gpu, "context": context, "utilization": util,
              "layers": len(shape.layers), "kv_heads": shape.layers[0].kv_heads, "head_dim": shape.layers[0].head_dim,
              "total_gib": F["gpu_gib"], "weights_gib": fit.weights_bytes_per_gpu / B.GIB,
              "reserve_gib": fit.reserve_bytes_per_gpu / B.GIB, "free_gib": free / B.GIB, "per_seq_gib": per_seq / B.GIB,
              "fits": free // per_seq}
    # the two usual slips, for the check's hints: the engine's reserve left in, or the whole GPU counted
    values["fits_no_reserve"] = (free + fit.reserve_bytes_per_gpu) // per_seq
    values["fits_all_memory"] = int((F["gpu_gib"] * B.GIB - fit.weights_bytes_per_gpu - fit.reserve_bytes_per_gpu) // per_seq)
    uniform = all((x.kv_heads, x.head_dim) == (values["kv_heads"], values["head_dim"]) for x in shape.layers)
    most = B.max_concurrency(model, context, "bf16", gpu, "bf16", memory_utilization=util)
    claims = {"every layer caches the same heads (one product gives the bytes)": (uniform, shape.name),
              "the hand count is kvlab's max_concurrency": (values["fits"] == most, (values["fits"], most)),
              "each slip gives a different count": (len({values[k] for k in ("fits", "fits_no_reserve", "fits_all_memory")}) == 3,
                                                    values["fits_no_reserve"])}
    return Facts(values, claims)


EX_CONTEXT = 8192  # exercise 1: the same deployment at a quarter of the context
EX_BIG = ("llama-3.1-70b", "H200", "fp8")  # exercise 2: chapter 1's deployment (model, GPU, weights)


def exercises(F) -> Facts:
    """The exercises' solutions: the plan at a shorter context, chapter 1's 70B by hand, an INT8 pool by hand."""
    from ..facts import choosing_a_format

    short = choosing_a_format(F["model"], F["gpu"], "bf16", EX_CONTEXT, F["concurrency"], [r["kv_format"] for r in F["rows"]])
    fit = B.fit(F["model"], F["gpu"], "bf16", memory_utilization=F["utilization"])
    per_seq = B.budget(F["model"], 1, F["context"], "bf16").cache_bytes_per_gpu / B.GIB
    model, gpu, weights = EX_BIG
    big_fit = B.fit(model, gpu, weights, memory_utilization=F["utilization"])
    big_seq = B.budget(model, 1, F["context"], "bf16").cache_bytes_per_gpu
    big = B.load_shape(model)
    i8 = F["by"]["int8"]
    i8_seq = per_seq * i8["bits_per_element"] / 16
    one_gpu = [f for f, p in short["plans"].items() if p and p["gpus"] == 1]
    values = {
        "context": F["context"], "ex_context": EX_CONTEXT, "ex_bf_gpus": short["bf_plan"]["gpus"],
        "ex_bf_tp": short["bf_plan"]["tp"], "ex_bf_replicas": short["bf_plan"]["replicas"], "ex_call": short["call"],
        "ex_call_gpus": short["call_plan"]["gpus"], "ex_same_call": short["call"] == F["call"], "ex_one_gpu": one_gpu,
        "ex_fastest": max(one_gpu, key=lambda f: short["plans"][f]["tokens_per_s"]) if one_gpu else None,
        "big_model": model, "big_gpu": gpu, "big_weights": weights, "big_layers": len(big.layers),
        "big_kv_heads": big.layers[0].kv_heads, "big_head_dim": big.layers[0].head_dim,
        "big_usable_gib": big_fit.usable_bytes_per_gpu / B.GIB, "big_weights_gib": big_fit.weights_bytes_per_gpu / B.GIB,
        "big_reserve_gib": big_fit.reserve_bytes_per_gpu / B.GIB,
        "big_free_gib": big_fit.free_for_cache_per_gpu / B.GIB, "big_seq_gib": big_seq / B.GIB,
        "big_fits": big_fit.free_for_cache_per_gpu // big_seq, "free_gib": fit.free_for_cache_per_gpu / B.GIB,
        "per_seq_gib": per_seq, "i8_bits": i8["bits_per_element"], "i8_seq_gib": i8_seq,
        "i8_fits": int(fit.free_for_cache_per_gpu / B.GIB // i8_seq), "i8_pool": i8["max_concurrency"],
        "f8_pool": F["f8"]["max_concurrency"]}
    claims = {"every layer of the 70B caches the same heads": (
                  len({(x.kv_heads, x.head_dim) for x in big.layers}) == 1, big.name),
              "INT8's pool by hand is the chapter's own count": (values["i8_fits"] == values["i8_pool"], values["i8_fits"]),
              "INT8's scales cost no whole sequence against FP8": (values["i8_pool"] == values["f8_pool"], values["i8_pool"]),
              "the 70B count by hand is kvlab's max_concurrency": (
                  values["big_fits"] == B.max_concurrency(model, F["context"], "bf16", gpu, weights,
                                                          memory_utilization=F["utilization"]), values["big_fits"]),
              "free memory is usable minus weights minus reserve": (abs(
                  values["big_usable_gib"] - values["big_weights_gib"] - values["big_reserve_gib"] - values["big_free_gib"])
                  < 0.01, values["big_free_gib"])}
    return Facts(values, claims)


def loose_bar(F) -> Facts:
    """The prediction question: the call under a perplexity bar four times looser (does the bar decide it?)."""
    bar = 4 * F["ppl_bar"]
    call = choose(F["plans"], F["rows"], max_ppl=bar)["call"]
    options = {"bf16": "bf16", "call": F["call"], "int4": "int4", "kivi4": "kivi-4"}  # q-call's option sections
    key = next((k for k, f in options.items() if f == call), None)
    values = dict(F) | {"loose": bar, "loose_call": call, "loose_key": key}
    return Facts(values, {"the loose bar's call is one of the question's options": (key is not None, call)})


def switches(F) -> Facts:
    """The flags to switch to each format that passed the screen (the call first), and the call as vLLM replicas."""
    from ..decide import switch_md, vllm_command

    order = [F["call"]] + [f for f in F["picks"] if f not in ("bf16", F["call"])]
    values = {"call": F["call"], "switches": [(f, switch_md(F["by"][f])) for f in order],
              "vllm_cmd": vllm_command(F["call_plan"], F["context"])}
    return Facts(values, {"the call is on the shortlist": (F["call"] in F["picks"], F["picks"])})


# the template sections these functions fill (the chapter's other sections still read kvlab.facts' values)
SECTIONS = {"answer": answer, "engine-card": card, "q-by-hand": by_hand, "q-by-hand-why": by_hand,
            "q-by-hand-no-reserve": by_hand, "q-by-hand-all-memory": by_hand,
            "exercises": exercises, "commands": switches, "q-call": loose_bar, "q-call-bf16": loose_bar,
            "q-call-call": loose_bar, "q-call-int4": loose_bar, "q-call-kivi4": loose_bar}


def throughput_figure(F):
    """The chapter's figure: roofline decode throughput by sequences running, one line a format (6.3)."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=xs, y=ys, name=f, mode="lines+markers") for f, (xs, ys) in F["curves"].items()])
    fig.update_layout(height=380, legend=dict(orientation="h", y=1.12),
                      title=f"Roofline decode throughput, {F['model']} on one {F['gpu']}, {F['context']:,}-token sequences",
                      xaxis=dict(title="sequences running at once", type="log", tickvals=F["concurrencies"]),
                      yaxis=dict(title="generated tokens per second (roofline)"))
    return fig
