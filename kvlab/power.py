"""How many prompts a paired test needs: the power of the workbook's exact McNemar rule.

A verdict of "not distinguishable" means little unless we know what the test could have seen. This module
answers that for the one rule every chapter uses (:func:`kvlab.results.verdict`: exact two-sided McNemar at
:data:`~kvlab.results.ALPHA`). The model of a format on ``n`` identical prompts is the simplest that fits a
paired sweep: each prompt independently

* is **lost** (full precision right, the format wrong) with probability ``loss + flips``,
* is **gained** (the reverse) with probability ``flips``,
* and otherwise both agree.

``loss`` is the net drop in accuracy (0.10 = ten points); ``flips`` is the chance noise that moves prompts both
ways (a harmless format still flips a few greedy answers). The power is the probability that the test then
calls the format ``"worse"``. It is computed exactly, by summing over the number of discordant prompts ``m``
(binomial in ``n``) and, for each ``m``, the chance that enough of them are losses (binomial in ``m``); the
rejection threshold for each ``m`` comes from :func:`kvlab.results.mcnemar` itself, so the two cannot drift.

Power is not monotone in ``n`` for an exact test (the reachable p-values jump), so :func:`prompts_needed`
returns the *smallest* ``n`` that reaches the target, as sample-size tables for exact tests do
(Fagerland, Lydersen & Laake 2013, *BMC Med Res Methodol* 13:91, discuss the same saw-tooth).

    >>> from kvlab import power
    >>> round(power.power(25, loss=0.20), 3)   # 25 prompts, a 20-point loss, no chance flips
    0.383
    >>> power.prompts_needed(0.20)             # the same loss, 80% power
    39
"""

from __future__ import annotations

import math

from .results import ALPHA, fewest_prompts_to_detect

POWER = 0.8  # the conventional target: a real loss of the stated size is called "worse" four times in five
LIMIT = 20_000  # the most prompts prompts_needed searches (a 1-point loss with no flips needs about 800)
MAX_PROMPTS = 50_000  # the most prompts power() and detectable_loss() take (about a second); far past any eval run
MIN_LOSS = 0.005  # the smallest loss prompts_needed asks about (half a point needs about 1,600 prompts)


def _rate(name: str, v, low: float = 0.0, high: float = 1.0, open_low: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 < v < 2 or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {str(v)[:30]}")  # (a huge int
        # is compared first: math.isfinite would raise OverflowError on it)
    if v < low or v > high or (open_low and v == low):
        raise ValueError(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {v!r}")
    return float(v)


def _prompts(name: str, v, most: int = MAX_PROMPTS) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive whole number, got {v!r}")
    if v > most:
        raise ValueError(f"{name} must be at most {most:,} (the exact sums grow with it), got {v:,}")
    return v


def _alpha(alpha) -> float:
    return _rate("alpha", alpha, open_low=True, high=0.5)


_THRESHOLDS: dict[float, list[int]] = {}  # alpha -> k[m], grown on demand


def _threshold(m: int, alpha: float) -> int:
    """The fewest losses among ``m`` discordant prompts that the exact test calls worse (``m + 1`` when none
    does); the arithmetic is :func:`kvlab.results.mcnemar`'s own, so the two agree exactly."""
    ks = _THRESHOLDS.setdefault(alpha, [])
    while len(ks) <= m:
        n = len(ks)
        # with b losses and c = n - b gains, p = 2 * P(X <= c) for X ~ Bin(n, 1/2), as results.mcnemar sums it
        cum, term, k = 0, 1, n + 1
        for c in range(n + 1):
            cum += term
            if c >= n - c or min(1.0, 2 * (cum / 2 ** n)) >= alpha:
                break
            k = n - c  # c gains or fewer, so n - c losses or more, still rejects
            term = term * (n - c) // (c + 1)
        ks.append(k)
    return ks[m]


def _log_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p))


_TAILS: dict[tuple[float, float], list[float]] = {}  # (q, alpha) -> reject[m], grown on demand


def _reject(m: int, q: float, alpha: float) -> float:
    """The chance that ``m`` discordant prompts, each a loss with probability ``q``, hold enough losses for the
    test to call the format worse: P(B >= k[m]) for B ~ Binomial(m, q). Cached, so a scan over sizes is cheap."""
    ts = _TAILS.setdefault((q, alpha), [])
    while len(ts) <= m:
        n = len(ts)
        k = _threshold(n, alpha)
        ts.append(0.0 if k > n else min(1.0, sum(math.exp(_log_pmf(b, n, q)) for b in range(k, n + 1))))
    return ts[m]


def power(prompts: int, loss: float, flips: float = 0.0, alpha: float = ALPHA) -> float:
    """The chance that ``prompts`` paired prompts call a format ``"worse"`` when it loses ``loss`` (net, as a
    fraction of prompts) and flips ``flips`` of them each way by chance."""
    n = _prompts("prompts", prompts)
    loss, flips = _rate("loss", loss), _rate("flips", flips)
    alpha = _alpha(alpha)
    if loss + 2 * flips > 1:
        raise ValueError(f"loss + 2 * flips must be at most 1 (every prompt lost or flipped), got {loss + 2 * flips:g}")
    pd = loss + 2 * flips  # a prompt is discordant
    if pd == 0:
        return 0.0
    q = (loss + flips) / pd  # a discordant prompt is a loss
    total = 0.0
    for m in range(n + 1):
        w = math.exp(_log_pmf(m, n, pd))
        if w > 0:
            total += w * _reject(m, q, alpha)
    return min(1.0, total)


def prompts_needed(loss: float, flips: float = 0.0, target: float = POWER, alpha: float = ALPHA,
                   limit: int = LIMIT) -> int | None:
    """The fewest paired prompts with which the test calls a format that loses ``loss`` "worse" at least a
    ``target`` share of the time; ``None`` when more than ``limit`` would be needed."""
    loss = _rate("loss", loss, low=MIN_LOSS)
    flips = _rate("flips", flips, high=0.5)
    target = _rate("target", target, open_low=True, high=0.999)
    alpha = _alpha(alpha)
    limit = _prompts("limit", limit, most=LIMIT)
    if loss + 2 * flips > 1:
        raise ValueError(f"loss + 2 * flips must be at most 1 (every prompt lost or flipped), got {loss + 2 * flips:g}")
    # a binomial's median is at most its mean rounded up, so while n * (loss + flips) <= k_min - 1 (k_min: the
    # fewest losses that can ever be called worse) the power is at most 1/2: skip those sizes when target > 1/2
    lo = math.floor((fewest_prompts_to_detect(alpha) - 1) / (loss + flips)) if target > 0.5 else 1
    for n in range(max(1, lo), limit + 1):
        if power(n, loss, flips, alpha) >= target:
            return n
    return None


def detectable_loss(prompts: int, flips: float = 0.0, target: float = POWER, alpha: float = ALPHA,
                    step: float = 0.005) -> float | None:
    """The smallest net loss (a multiple of ``step``, as a fraction of prompts) that ``prompts`` paired prompts
    call "worse" with at least ``target`` power; ``None`` when even losing every prompt is not enough."""
    n = _prompts("prompts", prompts)
    flips = _rate("flips", flips, high=0.5)
    target = _rate("target", target, open_low=True, high=0.999)
    alpha = _alpha(alpha)
    step = _rate("step", step, low=0.001, high=0.5)  # at most 1,000 losses tried
    for i in range(1, int(round((1 - 2 * flips) / step)) + 1):
        if power(n, i * step, flips, alpha) >= target:
            return round(i * step, 10)
    return None


def table(losses=(0.05, 0.10, 0.20), flips=(0.0, 0.02), target: float = POWER) -> list[dict]:
    """Rows ``{"loss", "flips", "prompts"}``: the prompts needed for each loss at each chance-flip rate."""
    try:
        losses, flips = list(losses), list(flips)
    except TypeError:
        raise TypeError("losses and flips must each be a sequence of fractions, e.g. (0.05, 0.10)") from None
    return [{"loss": d, "flips": f, "prompts": prompts_needed(d, f, target)} for f in flips for d in losses]
