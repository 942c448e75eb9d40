"""Chapter 4's main path: the answer, the verdict card, and how many prompts a verdict needs.

Each function takes chapter 4's facts (:func:`kvlab.facts.where_int4_breaks`, the paired sweeps read once) and
returns the values and claims of one section of ``notebooks/prose/04_where_int4_breaks.md``.
"""

from __future__ import annotations

from .. import power
from ..facts import Facts, _k
from ..tables import markdown

# the verdict card's rows, from the formats engines ship to kvlab's own: 8-bit, then 4-bit by scale width
CARD = ("fp8_e4m3", "int8", "q8_0", "kivi-4", "int4_g16", "q4_0", "int4", "int4_token+rotate", "int4_token",
        "kivi-2", "int4_tensor")
EIGHT_BIT = ("fp8_e4m3", "int8", "q8_0")
LOSSES = (0.05, 0.10, 0.20, 0.30)  # the losses the power table asks about (points of accuracy)


def values_a_scale(fmt: str, head_dim: int) -> float:
    """How many of a key's values share one scale (``inf`` for one scale per tensor or channel over all tokens)."""
    from ..formats import get_format

    q = get_format(fmt).key
    return {"token": head_dim, "group": q.group_size}.get(q.granularity, float("inf"))


def needle_cell(m: dict, fmt: str) -> str:
    """``✓`` when the paired tests never found ``fmt`` worse on model ``m``; else ``✗`` and where they did."""
    if fmt in m["held"]:
        return "✓"
    filler, prose = m["by"][fmt]["worse_at"], m["prose"]["by"].get(fmt, {}).get("worse_at", [])
    if filler == prose == m["lengths"]:
        return "✗ every length"
    where = [", ".join(_k(n) for n in filler)] if filler else []
    where += [f"prose {', '.join(_k(n) for n in prose)}"] if prose else []
    if not where and m["pooled"][fmt].verdict == "worse":
        where = ["pooled"]
    return "✗ " + "; ".join(where)


def _ppl(x: float, bar: float) -> str:
    return f"**{x:+.0%}**" if x > bar else f"{x:+.1%}"


def card(F) -> str:
    """The verdict card: one row a format, needles and perplexity on both models, bits and scale width."""
    from ..facts import values_per_scale

    S, G, bar = F["S"], F["G"], F["ppl_tolerance"]
    from ..formats import engines_offering

    stored = engines_offering([f for f in CARD if "+" not in f])  # a mitigation ("+rotate") is kvlab's variant
    rows = [[f"`{f}`", f"{S['bits'][f]:.3g} / {G['bits'][f]:.3g}",
             f"{values_per_scale(f, S['head_dim'])} / {values_per_scale(f, G['head_dim'])}",
             needle_cell(S, f), needle_cell(G, f), _ppl(S["ppl"][f], bar), _ppl(G["ppl"][f], bar),
             ", ".join(stored.get(f, [])) or "kvlab only"] for f in CARD]
    return markdown(["format", "bits a value", "values a scale", f"needles: SmolLM2 (to {S['longest_k']})",
                     f"Gemma (to {G['longest_k']})", "perplexity: SmolLM2", "Gemma", "stored by"], rows,
                    align="lrrllrrl")


def answer(F) -> Facts:
    """The answer section: which formats held on both models, which 4-bit formats held at 32k, and the trap."""
    S, G, bar = F["S"], F["G"], F["ppl_tolerance"]
    held_both = [f for f in CARD if f in S["held"] and f in G["held"]]
    four_bit = [f for f in CARD if f not in EIGHT_BIT]
    held_long = [f for f in four_bit if f in G["held"]]  # 4-bit formats Gemma never lost a needle with, to 32k
    values = {"S": S, "G": G, "bar": bar, "card_md": card(F),
              "eight_ppl": max(m["ppl"][f] for m in (S, G) for f in EIGHT_BIT), "held_both": held_both, "held_long": held_long,
              "eight_held": all(f in held_both for f in EIGHT_BIT),
              "tensor_failed": "int4_tensor" not in S["held"] and "int4_tensor" not in G["held"],
              "token_failed_long": "int4_token" not in G["held"], "traps": len(F["q"]["false"]["ppl"]),
              "token_smol": needle_cell(S, "int4_token"), "gemma_layers": F["gemma_layers"], "trap_at": F["trap_at"],
              "caught_short": F["q"]["n_false"]["short"], "n_failed": F["q"]["n_failed"]}
    hm = how_many_prompts(F)  # the same detectable losses as the power section states
    values |= {k: hm[k] for k in ("pooled", "pooled_s", "detect_one_flips", "detect_pooled", "detect_pooled_s")}
    claims = {
        "every 8-bit format held on both models": (values["eight_held"], held_both),
        "one scale per tensor failed on both models": (values["tensor_failed"], None),
        "to 32k on Gemma the 4-bit formats that held share each key scale among at most 32 values":
            (bool(held_long) and all(values_a_scale(f, G["head_dim"]) <= 32 for f in held_long), held_long),
        "perplexity through the cache flagged every format a longer needle caught (no trap)":
            (values["traps"] == 0, F["q"]["false_md"]["ppl"]),
    }
    return Facts(values, claims)


def flip_rate(F) -> float:
    """The chance flips of a harmless format: the most prompts an 8-bit format lost or gained against full
    precision, pooled, as a share of the prompts (no 8-bit format lost anything the test could detect, so its
    flips either way are taken as noise; the larger side is the cautious choice)."""
    return max(max(m["pooled"][f].lost, m["pooled"][f].gained) / m["pooled"][f].prompts
               for m in (F["S"], F["G"]) for f in EIGHT_BIT)


def how_many_prompts(F) -> Facts:
    """The power section: prompts needed for each loss with and without the measured chance flips."""
    flips = round(flip_rate(F), 3)
    need = {(r["loss"], r["flips"]): r["prompts"] for r in power.table(LOSSES, (0.0, flips))}
    rows = [[f"{d:.0%}", need[d, 0.0], need[d, flips]] for d in LOSSES]
    G = F["G"]
    values = {"flips": flips, "power_md": markdown(
        ["loss to detect (points)", "prompts needed, no chance flips", f"with {flips:.1%} flips each way"],
        rows, align="rrr"), "prompts": G["prompts"], "pooled": G["pooled"]["int8"].prompts,
        "min_detect": F["min_detect"], "detect_one": power.detectable_loss(G["prompts"]),
        "detect_one_flips": power.detectable_loss(G["prompts"], flips),
        "detect_pooled": power.detectable_loss(G["pooled"]["int8"].prompts, flips),
        "pooled_s": F["S"]["pooled"]["int8"].prompts,
        "detect_pooled_s": power.detectable_loss(F["S"]["pooled"]["int8"].prompts, flips),
        "detect_one_none": power.detectable_loss(G["prompts"]),
        "need_10": power.prompts_needed(0.10), "target": power.POWER}
    claims = {"25 prompts a length miss losses smaller than about 30% of the prompts":
              (values["detect_one"] >= 0.2, values["detect_one"]),
              "pooling the lengths detects a loss of well under ten points on both models":
                  (max(values["detect_pooled"], values["detect_pooled_s"]) < 0.1, values["detect_pooled_s"]),
              "the 8-bit formats' chance flips are small (under 2% of prompts either way)": (flips < 0.02, flips)}
    return Facts(values, claims)


def prefill(F) -> Facts:
    """The cache-reading prefill in brief: which formats stayed never worse in that mode on both models."""
    S, G = F["S"], F["G"]
    ran = [f for f in S["cached"]["status"] if f in G["cached"]["status"]]
    held = [f for f in ran if not S["cached"]["by"][f]["worse_at"] and not G["cached"]["by"][f]["worse_at"]]
    values = {"S": S, "G": G, "cached_held": held, "cached_lost": [f for f in ran if f not in held]}
    return Facts(values, {"the formats that held in the cache-reading mode include q4_0 and both 8-bit formats run":
                          (all(f in held for f in ("fp8_e4m3", "int8", "q4_0")), held)})


def check_yourself(F) -> Facts:
    """The chapter's computed question and exercises: a p-value by hand, and a pooled verdict to recompute."""
    from ..results import mcnemar

    S = F["S"]
    q40 = S["pooled"]["q4_0"]
    values = {"S": S, "q_lost": F["min_detect"] - 1, "q_p": mcnemar(F["min_detect"] - 1, 0), "q40": q40,
              "q40_p": mcnemar(q40.lost, q40.gained), "need_5_flips": power.prompts_needed(0.05, flip_rate(F)),
              "flips": round(flip_rate(F), 3), "alpha": 0.05, "min_detect": F["min_detect"],
              "S_longest": S["longest"]}
    return Facts(values, {"one lost prompt fewer than the minimum cannot reach p < 0.05":
                          (values["q_p"] >= 0.05, values["q_p"]),
                          "q4_0 on SmolLM2 is worse pooled and at no single length":
                          (q40.verdict == "worse" and not S["by"]["q4_0"]["worse_at"], q40)})


# the template sections these functions fill (the chapter's other sections still read kvlab.facts' values)
SECTIONS = {"answer": answer, "card": answer, "how-many": how_many_prompts, "prefill-short": prefill,
            "q-pvalue": check_yourself, "q-pvalue-why": check_yourself, "exercises": check_yourself}
