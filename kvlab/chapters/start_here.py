"""Chapter 0's start page: what the workbook found, each number read from the chapter that measured it.

The sentences are in ``notebooks/prose/00_start_here.md``; this module supplies their values and claims.
"""

from __future__ import annotations

from ..facts import Facts
from . import where_int4_breaks as ch4


def gpu_runs(folder=None) -> list:
    """The GPU checks shipped in ``data/results/`` (``scripts/gpu_check.py`` writes ``gpu_<GPU>_<date>.json``)."""
    from ..paths import RESULTS_DIR

    return sorted((folder or RESULTS_DIR).glob("gpu_*.json"))


def found(budget=None, int4=None, prefix=None, kernel=None) -> Facts:
    """The findings of chapters 1, 3, 4 and 5 in one place (each chapter's facts computed if not given)."""
    from .. import facts

    budget = budget if budget is not None else facts.cache_budget()
    int4 = int4 if int4 is not None else facts.where_int4_breaks()
    prefix = prefix if prefix is not None else facts.prefix_cache()
    kernel = kernel if kernel is not None else facts.triton_attention()
    answer = ch4.answer(int4)
    values = {"B": budget, "A": answer, "S": answer["S"], "G": answer["G"], "f8": prefix["f8"], "i4": prefix["i4"],
              "gpu_measured": bool(gpu_runs())}
    claims = {"a hundred long chats need more cache than the GPU has left after FP8 weights":
              (budget["chats_gib"] > budget["free_gib"], (budget["chats_gib"], budget["free_gib"])),
              "FP8 and INT4 caches cost less per token than BF16 even without prefix hits":
              (0 < prefix["f8"]["saving_unshared"] < prefix["i4"]["saving_unshared"], None)}
    return Facts(values, claims | answer.claims)


SECTIONS = {"found": found}
