"""Chapter 5's main path: the answer, its two figures, a block count and a pool to compute by hand, the exercises.

Each function takes chapter 5's facts (:func:`kvlab.facts.prefix_cache`: the RAG trace replayed through one
replica, and chapter 4's verdicts) and returns the values and claims of one section of
``notebooks/prose/05_prefix_cache.md``. The folded sections below the main path still read the facts' values.
"""

from __future__ import annotations

from .. import budget as B
from ..facts import Facts

Q_POOL_GIB = 3  # the check's FP8 pool: how much INT4 memory holds as many blocks?
LIGHT_RATE = 0.3  # requests a second: the same trace arriving slowly enough that the replica is seldom full
Q_BLOCKS = ("llama-3.1-8b", "fp8_e4m3", 10)  # the check's block count: model, format, pool in GiB


def answer(F) -> Facts:
    """The answer: hits shift with the pool, most of the saving needs no hit, FP8 is the price at the quality bar."""
    f8, i4, b = F["f8"], F["i4"], F["b"]
    values = {k: F[k] for k in ("gpu", "model", "int4_pool_gib", "int4_hit_1gib", "bf16_scaled_hit", "ceiling", "ws",
                                "qa_usd", "qa_saving", "bf16_usd", "cheapest_pass", "ppl_limit", "int4_rows_md")}
    values |= {"f8": f8, "i4": i4, "b": b, "n": F["trace"]["n"], "free_gib": F["free_gib"], "rate": F["trace"]["rate"],
               "own_drop": F["own_drop"], "gain_f8": F["gain_f8"], "gain_i4": F["gain_i4"], "usd_f8": F["usd_f8"],
               "usd_i4": F["usd_i4"], "int4_engines": F["int4_engines"], "int4_near": F["int4_near"]}
    values |= light_load(F)
    claims = {
        "INT4 in 1 GiB hits as often as BF16 in 16/4.5 GiB (within a point)":
            (abs(F["int4_hit_1gib"] - F["bf16_scaled_hit"]) < 0.01, (F["int4_hit_1gib"], F["bf16_scaled_hit"])),
        "most of each format's saving comes with no hit at all": (
            all(x["saving_unshared"] > x["saving_shared"] / 2 for x in (f8, i4)), (f8["saving_unshared"], i4["saving_unshared"])),
        "sharing adds to each smaller format's saving": (
            all(x["saving_shared"] > x["saving_unshared"] for x in (f8, i4)), (f8["saving_shared"], i4["saving_shared"])),
        "FP8 is the quality-adjusted price among the rows an engine offers": (
            abs(F["qa_usd"] - f8["usd_shared"]) < 1e-9, F["qa_usd"]),
        "the cheapest row that passes is not one an engine stores": (F["cheapest_pass"] == "kivi-4", F["cheapest_pass"]),
        "hits narrow the dollar gap to BF16 (BF16 gets cheaper too)": (
            F["usd_f8"][1] < F["usd_f8"][0] and F["usd_i4"][1] < F["usd_i4"][0], (F["usd_f8"], F["usd_i4"])),
        "at a light load FP8 saves next to nothing with the trace as it is": (values["light_f8"] < 0.05, values["light_f8"]),
    }
    return Facts(values, claims)


def light_load(F) -> dict:
    """FP8's and INT4's savings when the same trace arrives at :data:`LIGHT_RATE` requests a second."""
    from ..facts import CH5_TRACE
    from ..workloads import cost_split, rag

    reqs = rag(**(CH5_TRACE | {"rate": LIGHT_RATE}))
    rows = {r["kv_format"]: r for r in cost_split(reqs, F["model"], F["gpu"], ("bf16", "fp8_e4m3", "int4"))}
    return {"light_rate": LIGHT_RATE, "light_f8": rows["fp8_e4m3"]["saving_shared"],
            "light_i4": rows["int4"]["saving_shared"]}


def pool(F) -> Facts:
    """Where the {gpu}'s cache pool comes from: usable memory less the weights and the engine's reserve."""
    fit = B.fit(F["model"], F["gpu"], "bf16")
    values = {"gpu": F["gpu"], "gpu_gib": F["gpu_gib"], "util": 0.9, "weights_gib": fit.weights_bytes_per_gpu / B.GIB,
              "reserve_gib": fit.reserve_bytes_per_gpu / B.GIB, "free_gib": fit.free_for_cache_per_gpu / B.GIB,
              "f8": F["f8"], "i4": F["i4"], "b": F["b"], "rate": F["trace"]["rate"]}
    return Facts(values, {"the pool is the chapter's": (abs(values["free_gib"] - F["free_gib"]) < 1e-9, values["free_gib"])})


def by_hand(F) -> Facts:
    """The check-yourself items: blocks in a pool, and the BF16 memory that holds an INT4 pool's blocks."""
    from ..simulator import pool_blocks

    model, fmt, gib = Q_BLOCKS
    shape = B.load_shape(model)
    n, block_bytes, _ = pool_blocks(model, "H100-80GB", fmt, pool_bytes=gib * B.GIB)
    layer = shape.layers[0]
    bits = {f: B.budget(F["model"], 1, 16, f).bytes_per_token for f in ("fp8_e4m3", "int4")}
    values = {"q_model": model, "q_fmt": fmt, "q_gib": gib, "layers": len(shape.layers), "kv_heads": layer.kv_heads,
              "head_dim": layer.head_dim, "block_mib": block_bytes / 2**20, "blocks": n,
              "q_pool": Q_POOL_GIB, "ratio": bits["fp8_e4m3"] / bits["int4"],
              "int4_gib": Q_POOL_GIB * bits["int4"] / bits["fp8_e4m3"]}
    claims = {"every layer caches the same heads": (len({(x.kv_heads, x.head_dim) for x in shape.layers}) == 1, shape.name),
              "the block count is pool / block bytes": (n == gib * B.GIB // block_bytes, n),
              "INT4's bytes are 4.5/8 of FP8's": (abs(values["ratio"] - 8 / 4.5) < 1e-9, values["ratio"])}
    return Facts(values, claims)


def exercises(F) -> Facts:
    """The exercises' solutions: the working set by format, a doubled price, INT4's cost as an upper bound."""
    from ..workloads import cost_split

    price = F["price"]
    doubled = {r["kv_format"]: r for r in cost_split(F["requests"], F["model"], F["gpu"], ("bf16", "fp8_e4m3"),
                                                      gpu_hour_usd=2 * price)}
    f8 = doubled["fp8_e4m3"]
    values = {"ws": F["ws"], "ceiling": F["ceiling"], "price": price, "f8": F["f8"], "i4": F["i4"], "gpu": F["gpu"],
              "model": F["model"],
              "usd2": f8["usd_shared"], "saving2": f8["saving_shared"]}
    claims = {"doubling the price doubles the dollars": (abs(f8["usd_shared"] / F["f8"]["usd_shared"] - 2) < 1e-9,
                                                         f8["usd_shared"]),
              "doubling the price leaves the saving in percent": (abs(f8["saving_shared"] - F["f8"]["saving_shared"]) < 1e-9,
                                                                  f8["saving_shared"])}
    return Facts(values, claims)


def hit_rate_figure(F):
    """Prefix hit rate against the pool's size, one line a format (the RAG trace)."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(name=f, x=F["pools"], y=ys, mode="lines+markers") for f, ys in F["curves"].items()])
    fig.update_layout(height=360, title=f"Prefix hit rate vs KV pool size (RAG trace, {F['model']})",
                      xaxis=dict(type="log", title="KV pool (GiB)"), yaxis=dict(title="prefix hit rate", tickformat=".0%"))
    return fig


def cost_figure(F):
    """Cost per million output tokens by format, with every prefix unique and with the trace as it is."""
    import plotly.graph_objects as go

    split = F["split"]
    bars = [("usd_unshared", "every prefix unique: no hits"), ("usd_shared", "the RAG trace as it is")]
    fig = go.Figure([go.Bar(name=label, x=list(split), y=[r[key] for r in split.values()], texttemplate="$%{y:.2f}")
                     for key, label in bars])
    fig.update_layout(height=380, barmode="group", legend=dict(orientation="h", y=1.12), xaxis_title="KV format",
                      title=f"Cost per million output tokens: {F['model']} on an {F['gpu']}, {F['trace']['n']} RAG requests",
                      yaxis_title=f"$ per million output tokens (at ${F['price']:.2f}/GPU-hour)")
    return fig


# the template sections these functions fill (the chapter's other sections still read kvlab.facts' values)
SECTIONS = {"answer": answer, "costs-read": pool, "q-blocks": by_hand, "q-blocks-why": by_hand, "q-blocks-bf16": by_hand,
            "q-blocks-tokens": by_hand, "q-pool": by_hand, "q-pool-why": by_hand, "q-pool-inverse": by_hand,
            "exercises": exercises}
