"""Shipped results, read without torch: intervals, paired tests, and the long-context sweep.

Everything here is plain Python (plotly is imported only by the figure function), so reading
a result answers at once, on any machine, without loading a model.

**One decision rule** for every comparison of a format with full precision: the two are run on
*identical prompts*, and the exact McNemar test on the discordant pairs decides (two-sided,
:data:`ALPHA` = 0.05). A format is ``"worse"`` (or ``"better"``) only when that test rejects;
otherwise it is ``"not distinguishable"`` at the number of prompts run. McNemar (1947) is the
standard test for paired binary outcomes; the exact version is a binomial test on the pairs
where the two disagree (Fagerland, Lydersen & Laake 2013, *BMC Med Res Methodol* 13:91).

    >>> from kvlab import results
    >>> results.mcnemar(6, 0)           # full precision right, format wrong on 6 prompts; never the reverse
    0.03125
    >>> results.verdict(6, 0)
    'worse'
    >>> results.verdict(0, 6)           # the reverse: the format right where full precision was wrong
    'better'
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .formats import LLAMA_CACHE_TYPES
from .paths import RESULTS_DIR

ALPHA = 0.05  # the one significance level of the workbook's paired comparisons
LONG_SWEEP = RESULTS_DIR / "long_sweep.jsonl"
LONG_SWEEPS = {"smollm2-135m": RESULTS_DIR / "long_sweep_smollm2.jsonl", "gemma3-270m": LONG_SWEEP}  # one per model
# "looks fine on perplexity": a paired test on 16 windows detects even FP8's tiny increase, so the trap's
# first rung needs a tolerance; 5% is the limit chapter 5's quality-adjusted cost also uses
PPL_TOLERANCE = 0.05
# answer stages (multikey: two named pass keys, kvlab.tasks.multikey; orders: a 5-digit order ID copied from order records in prose,
# kvlab.tasks.order_lookup); each is paired within its own prompts, "cached" with the "filler" stage's
STAGES = ("filler", "prose", "cached", "multikey", "orders")
PPL_STAGE = "perplexity"  # held-out windows: summed NLL per format


def outcome_field(stage: str) -> str:
    """The field of a sweep record that holds each format's outcome: ``"nll"`` for held-out windows, else
    ``"correct"``."""
    return "nll" if stage == PPL_STAGE else "correct"


class Incomplete(KeyError):
    """A format added to a sweep later has reached only some of the prompts it is asked about."""


def wilson(correct: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion (95% by default): ``(low, high)``."""
    trials, correct = _count("trials", trials), _count("correct", correct)
    if trials < 1 or correct > trials:
        raise ValueError(f"need 0 <= correct <= trials and trials >= 1, got {correct}/{trials}")
    if isinstance(z, bool) or not isinstance(z, int | float) or not 0 < z <= 10:
        raise ValueError(f"z must be a number of standard errors in (0, 10] (1.96 for 95%), got {str(z)[:30]}")
    p, n = correct / trials, trials
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if correct == 0 else max(0.0, mid - half)  # exact at the ends (no 1e-17 rounding residue)
    hi = 1.0 if correct == trials else min(1.0, mid + half)
    return lo, hi


def _log_binom_cdf(k: int, n: int, p: float) -> float:
    """log P(X <= k) for X ~ Binomial(n, p), 0 < p < 1, summed in log space from i = k down: no term overflows or
    underflows whatever n is (the plain sum of comb(n, i) p^i (1-p)^(n-i) overflows a float near n = 1,000). Below
    the mode the terms fall as i falls, so the sum stops once they are 1e-22 of the largest."""
    lp, lq = math.log(p), math.log1p(-p)
    log_term = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
    top, total, mode = log_term, 1.0, (n + 1) * p
    for i in range(k, 0, -1):  # term(i - 1) = term(i) * i / (n - i + 1) * (1 - p) / p
        log_term += math.log(i) - math.log(n - i + 1) + lq - lp
        if log_term > top:  # above the mode (not a case this module meets): rescale to the new largest term
            total, top = total * math.exp(top - log_term) + 1.0, log_term
            continue
        total += math.exp(log_term - top)
        if i <= mode and log_term < top - 50:
            break
    return top + math.log(total)


def exact_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) upper bound on a proportion after ``k`` events in ``n`` trials: the
    largest rate under which seeing ``k`` or fewer still has probability ``1 - confidence``."""
    n, k = _count("n", n), _count("k", k)
    if n < 1 or k > n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got {k}/{n}")
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if k == n:
        return 1.0
    target = math.log(1 - confidence)
    lo, hi = k / n, 1.0
    for _ in range(60):  # bisection to far below any printed digit; P(X <= k) falls as the rate rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _log_binom_cdf(k, n, mid) > target else (lo, mid)
    return hi


MAX_NATS = 100  # a mean NLL a token beyond any model (exp(100) is a perplexity of 2.7e43); exp() overflows at 709
EXACT_UP_TO = 1000  # discordant pairs summed as exact integers; above, in log space (a relative error near 1e-12)


MAX_COUNT = 10**6  # prompts or windows in one test: far past any eval run, and the exact tails stay under a second


def _count(name: str, v) -> int:
    if hasattr(v, "__index__") and not isinstance(v, bool | int) and type(v).__module__ == "numpy":
        v = int(v)  # a numpy integer (a count from an array) is a count
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if v > MAX_COUNT:
        raise ValueError(f"{name} must be at most {MAX_COUNT:,}, got {v:,}")
    return v


def mcnemar(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    ``lost``: prompts full precision got right and the format got wrong; ``gained``: the reverse.
    Under the null hypothesis each discordant pair goes either way with probability 1/2, so the
    p-value is twice the binomial tail of the smaller count (capped at 1).
    """
    lost, gained = _count("lost", lost), _count("gained", gained)
    n = lost + gained
    if n == 0:
        return 1.0
    if n <= EXACT_UP_TO:  # exact rational arithmetic: the small counts every chapter reads give exact p-values
        tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
        return min(1.0, 2 * tail)
    return min(1.0, 2 * math.exp(_log_binom_cdf(min(lost, gained), n, 0.5)))  # large counts: the same tail in log space


def verdict(lost: int, gained: int, alpha: float = ALPHA) -> str:
    """``"worse"``, ``"better"`` or ``"not distinguishable"``: the workbook's one decision rule."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if mcnemar(lost, gained) >= alpha:
        return "not distinguishable"
    return "worse" if lost > gained else "better"


def holm(pvalues, alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down correction (Holm 1979): which of ``pvalues`` are rejected so that the chance of any false
    rejection in the whole family stays at ``alpha``. The smallest p is compared with alpha / m, the next with
    alpha / (m - 1), and so on, stopping at the first that is not below its bar."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    ps = list(pvalues)
    if any(isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1 for x in ps):
        raise ValueError(f"p-values must be numbers in [0, 1], got {ps!r}")
    out = [False] * len(ps)
    for rank, i in enumerate(sorted(range(len(ps)), key=ps.__getitem__)):
        if ps[i] >= alpha / (len(ps) - rank):
            break
        out[i] = True
    return out


def holm_worse(tests: dict[str, Paired]) -> list[str]:
    """The names of ``tests`` (one format's paired tests) that still call it worse after :func:`holm`."""
    keep = holm([t.p for t in tests.values()])
    return [k for (k, t), r in zip(tests.items(), keep) if r and t.lost > t.gained]


def fewest_prompts_to_detect(alpha: float = ALPHA) -> int:
    """The fewest discordant pairs (all one way) for which the exact test can reject at ``alpha``."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 0.5:
        raise ValueError(f"alpha must be a significance level in (0, 0.5], got {alpha!r}")
    n = 1
    while mcnemar(n, 0) >= alpha:
        n += 1
    return n


@dataclass(frozen=True)
class Paired:
    """One format against the reference on the same prompts."""

    fmt: str
    reference: str
    prompts: int
    correct: int  # the format
    ref_correct: int  # the reference
    lost: int  # reference right, format wrong
    gained: int  # format right, reference wrong

    @property
    def rate(self) -> float:
        return self.correct / self.prompts

    @property
    def ref_rate(self) -> float:
        return self.ref_correct / self.prompts

    @property
    def p(self) -> float:
        return mcnemar(self.lost, self.gained)

    @property
    def verdict(self) -> str:
        return verdict(self.lost, self.gained)

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.correct, self.prompts)


def paired_nll(nll: list[float], ref_nll: list[float], tokens: list[int]) -> dict:
    """One format's summed NLL per window against a reference's on the same windows: the perplexity increase, and
    the book's paired rule on the windows (a two-sided sign test on those where the format did worse vs better)."""
    if not all(isinstance(x, list | tuple) for x in (nll, ref_nll, tokens)):
        raise TypeError("nll, ref_nll and tokens must be lists (one number a window; tensor.tolist() gives one)")
    if not nll or not len(nll) == len(ref_nll) == len(tokens):
        raise ValueError(f"need one NLL per window for both formats and one token count each, got {len(nll)}, "
                         f"{len(ref_nll)} and {len(tokens)}")
    for name, xs in (("nll", nll), ("ref_nll", ref_nll)):
        bad = [x for x in xs if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1e15
               or not math.isfinite(x)]  # (a 400-digit integer is refused by the bound before isfinite sees it)
        if bad:
            raise ValueError(f"{name} must hold finite, non-negative summed NLLs, got {str(bad[0])[:30]}")
    for t in tokens:
        if _count("tokens", t) < 1:
            raise ValueError(f"every window needs at least one token, got {t!r}")
    worse = sum(a > b for a, b in zip(nll, ref_nll))
    better = sum(a < b for a, b in zip(nll, ref_nll))
    tok = sum(tokens)
    if max(sum(nll), sum(ref_nll)) / tok > MAX_NATS:
        raise ValueError(f"a mean NLL above {MAX_NATS} nats a token is not a language model's (uniform over a "
                         f"million-token vocabulary is 13.8): check the summed NLLs and token counts")
    ppl, ref = math.exp(sum(nll) / tok), math.exp(sum(ref_nll) / tok)
    return {"windows": len(nll), "tokens": tok, "perplexity": ppl, "ref_perplexity": ref, "increase": ppl / ref - 1,
            "worse_windows": worse, "better_windows": better, "p": mcnemar(worse, better), "verdict": verdict(worse, better)}


class LongSweep:
    """The long-context sweep (``scripts/sweep_long.py``): one record per prompt, every format's outcome.

    Formats measured later on the same prompts (``sweep_long.py --add-formats``) come as a ``{"kind": "formats"}``
    line and records marked ``"added"``; loading merges each into its prompt's record and lists the added formats
    apart (:attr:`added_formats`; provenance in ``header["added"]``), so the tables and figures of the sweep's own
    formats stay as they were and the paired tests reach every format. An added format that has reached only
    some prompts of a length (or some perplexity windows) is refused there until it has them all.

    >>> sweep = LongSweep.load()                       # data/results/long_sweep.jsonl
    >>> sweep.paired("filler", "int4_token", 8192).verdict   # Gemma 3 270M: one scale per token loses needles
    'worse'
    """

    def __init__(self, header: dict, records: list[dict]):
        self.header, self.records = header, records

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None) -> LongSweep:
        """Read and check a sweep file; a malformed one is refused with the line that is wrong."""
        from .paths import read_text

        path = Path(path) if path is not None else LONG_SWEEP
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; run scripts/sweep_long.py to create it")
        text = read_text(path, "long sweep")  # a regular file of at most 64 MiB, UTF-8 (the shipped ones: under 2 MiB)
        lines = []
        for i, x in enumerate(text.splitlines(), start=1):
            if not x.strip():
                continue
            try:
                lines.append(json.loads(x))
            except RecursionError:
                raise ValueError(f"{path}:{i} nests too deeply to be a sweep line") from None
            except ValueError as e:  # not JSON, or an integer of thousands of digits
                raise ValueError(f"{path}:{i} is not a JSON sweep line: {str(e)[:120]}") from None
        if not lines or not isinstance(lines[0], dict) or lines[0].get("kind") != "header":
            raise ValueError(f"{path}: the first line must be the sweep's header")
        header = dict(lines[0])
        fmts = header.get("formats")
        if not isinstance(fmts, dict) or not fmts:
            raise ValueError(f"{path}: the header names no formats")
        if not isinstance(header.get("model"), str):
            raise ValueError(f"{path}: the header's model must be a name, got {header.get('model')!r}")
        for k in ("lengths", "depths"):
            if k in header and not (isinstance(header[k], list) and all(
                    isinstance(x, int | float) and not isinstance(x, bool) for x in header[k])):
                raise ValueError(f"{path}: the header's {k} must be a list of numbers, got {str(header[k])[:40]}")
        header["added"], header["added_formats"] = [], {}
        known = dict(fmts)  # the sweep's own formats and those added later
        records, where = [], {}  # where: a prompt's key -> its index in records
        for i, r in enumerate(lines[1:], start=2):
            at = f"{path}:{i}"
            if isinstance(r, dict) and r.get("kind") == "formats":  # formats added later (sweep_long --add-formats)
                header["added"].append(cls._added(r, known, at))
                header["added_formats"] |= r["formats"]
                continue
            cls._check(r, known, at)
            key = (r["stage"], r["length"], r["depth"], r["index"])
            if not r.get("added"):
                if key in where:  # a resumed run that wrote a prompt twice: which outcome is right is unknowable
                    raise ValueError(f"{at}: the prompt {key} is already recorded on an earlier line")
                where[key] = len(records)
                records.append(r)
                continue
            if key not in where:
                raise ValueError(f"{at}: an added record for a prompt the sweep never measured ({key})")
            base = records[where[key]]
            field = outcome_field(r["stage"])
            if field == "nll" and r["tokens"] != base["tokens"]:
                raise ValueError(f"{at}: the added window has {r['tokens']} tokens, the sweep's {base['tokens']}")
            if set(r[field]) & set(base[field]):
                raise ValueError(f"{at}: formats {sorted(set(r[field]) & set(base[field]))} measured twice on {key}")
            if r.get("key") != base.get("key"):
                raise ValueError(f"{at}: the added record's pass key {r.get('key')!r} is not the prompt's "
                                 f"{base.get('key')!r}: a different prompt")
            records[where[key]] = base | {field: base[field] | r[field],
                                          "seconds": base.get("seconds", 0) + r.get("seconds", 0)}
        return cls(header, records)

    @staticmethod
    def _added(r: dict, fmts: dict, where: str) -> dict:
        """A ``{"kind": "formats"}`` line: formats measured after the sweep on the prompts it holds. Their
        entries join ``fmts``; the line's provenance (date, machine, versions) is returned."""
        new = r.get("formats")
        if not isinstance(new, dict) or not new:
            raise ValueError(f"{where}: a formats line must name formats")
        if clash := sorted(n for n in new if n in fmts):
            raise ValueError(f"{where}: formats {clash} are already in the sweep")
        fmts.update(new)
        return {k: v for k, v in r.items() if k != "kind"} | {"formats": list(new)}

    @staticmethod
    def _check(r, fmts: dict, where: str) -> None:
        if not isinstance(r, dict):
            raise ValueError(f"{where}: a record must be a JSON object")
        if r.get("stage") not in STAGES + (PPL_STAGE,):
            raise ValueError(f"{where}: stage must be one of {STAGES + (PPL_STAGE,)}, got {r.get('stage')!r}")
        for k in ("length", "index"):
            _count(f"{where}: {k}", r.get(k))
        sec = r.get("seconds", 0)
        if isinstance(sec, bool) or not isinstance(sec, int | float) or not 0 <= sec <= 1e9:
            raise ValueError(f"{where}: seconds must be a number of seconds >= 0, got {str(sec)[:30]}")
        d = r.get("depth")
        if not isinstance(d, int | float) or isinstance(d, bool) or not 0 <= d <= 1:
            raise ValueError(f"{where}: depth must be a number in [0, 1], got {d!r}")
        if r["stage"] == PPL_STAGE:
            if _count(f"{where}: tokens", r.get("tokens")) < 1:
                raise ValueError(f"{where}: tokens must be at least 1, got 0")
            c = r.get("nll")
            if not isinstance(c, dict) or not c or any(
                    not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v <= MAX_NATS * r["tokens"]
                    or not math.isfinite(v) for v in c.values()):
                raise ValueError(f"{where}: nll must map formats to summed NLLs from 0 to {MAX_NATS} nats a token")
        else:
            c = r.get("correct")
            if not isinstance(c, dict) or not c or any(not isinstance(v, bool) for v in c.values()):
                raise ValueError(f"{where}: correct must map formats to true/false")
        unknown = set(c) - set(fmts)
        if unknown:
            raise ValueError(f"{where}: formats {sorted(unknown)} are not in the header")

    # ------------------------------------------------------------------ queries
    @property
    def model(self) -> str:
        return self.header["model"]

    @property
    def formats(self) -> list[str]:
        """The formats the sweep itself measured (its header's): chapter 4's."""
        return list(self.header["formats"])

    @property
    def added_formats(self) -> list[str]:
        """Formats measured later on the same prompts (``sweep_long.py --add-formats``), some perhaps not on every
        prompt yet."""
        return list(self.header.get("added_formats", {}))

    @property
    def all_formats(self) -> list[str]:
        return self.formats + self.added_formats

    def format_entry(self, fmt: str) -> dict:
        """What the sweep recorded about ``fmt`` (its source and bits per element)."""
        return (self.header["formats"] | self.header.get("added_formats", {}))[fmt]

    @staticmethod
    def _whole(fmt: str, outcomes: list[dict], where: str) -> None:
        """Refuse a format added to the sweep (``--add-formats``) that has reached only some of the prompts
        at ``where`` so far: its rate or test would rest on whichever prompts came first."""
        have = sum(fmt in c for c in outcomes)
        if 0 < have < len(outcomes):
            raise Incomplete(f"{fmt!r} has {have} of the {len(outcomes)} prompts at {where} so far (still being swept)")

    def _ppl_rows(self, *fmts: str) -> list[dict]:
        rows = [r for r in self.records if r["stage"] == PPL_STAGE]
        for f in fmts:
            self._whole(f, [r["nll"] for r in rows], "the perplexity windows")
        return [r for r in rows if all(f in r["nll"] for f in fmts)]

    def perplexity(self, fmt: str) -> float:
        """Held-out perplexity of ``fmt`` over the windows it was measured on (every token reading its cache)."""
        rows = self._ppl_rows(fmt)
        if not rows:
            raise KeyError(f"no perplexity windows for {fmt!r}")
        return math.exp(sum(r["nll"][fmt] for r in rows) / sum(r["tokens"] for r in rows))

    def paired_perplexity(self, fmt: str, reference: str = "fp32", windows: int | None = None) -> dict:
        """``fmt`` against ``reference`` window by window: the perplexity increase, and the same paired
        rule as the passkey (a two-sided sign test on the windows where ``fmt`` did worse vs better).
        ``windows`` keeps only the first that many held-out windows (to compare with a run that read fewer)."""
        rows = [r for r in self._ppl_rows(fmt, reference) if windows is None or r["index"] < windows]
        if not rows:
            raise KeyError(f"no perplexity windows where {fmt!r} and {reference!r} both ran")
        return {"kv_format": fmt} | paired_nll([r["nll"][fmt] for r in rows], [r["nll"][reference] for r in rows],
                                               [r["tokens"] for r in rows])

    def perplexity_interval(self, fmt: str, reference: str = "fp32", level: float = 0.90,
                            resamples: int = 2000) -> tuple[float, float]:
        """How much the perplexity increase of ``fmt`` over ``reference`` depends on which passages were read: a
        percentile bootstrap over the held-out windows (resampled with their pairs kept, seeded, so the same data
        give the same interval), ``(low, high)`` covering ``level`` of the resamples."""
        import random

        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level!r}")
        rows = [(r["nll"][fmt] - r["nll"][reference], r["tokens"]) for r in self._ppl_rows(fmt, reference)]
        if not rows:
            raise KeyError(f"no perplexity windows where {fmt!r} and {reference!r} both ran")
        rng = random.Random(0)
        boots = []
        for _ in range(resamples):
            pick = [rows[rng.randrange(len(rows))] for _ in rows]
            boots.append(math.exp(sum(d for d, _ in pick) / sum(t for _, t in pick)) - 1)
        boots.sort()
        tail = (1 - level) / 2
        return boots[int(tail * resamples)], boots[min(resamples - 1, int((1 - tail) * resamples))]

    def lengths(self, stage: str = "filler", complete: bool = True) -> list[int]:
        """The lengths measured in ``stage``; by default only those with every prompt of the design (a length
        still being swept is left out until it is whole: its prompts are not a sample of every depth yet)."""
        found = sorted({r["length"] for r in self.records if r["stage"] == stage})
        want = len(self.header.get("depths") or []) * (self.header.get("per_depth") or 0)
        if not complete or not want:
            return found
        return [n for n in found if len(self.outcomes(stage, n)) >= want]

    def outcomes(self, stage: str, length: int) -> dict[tuple, dict]:
        """Each prompt's outcome at ``length`` in ``stage``: ``{(depth, index): {format: correct}}``; a key names
        the same prompt in every format (and in the filler and cached stages, which share their prompts)."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        return {(r["depth"], r["index"]): r["correct"] for r in self.records
                if r["stage"] == stage and r["length"] == length}

    def counts(self, stage: str, fmt: str, length: int) -> tuple[int, int]:
        """``(correct, prompts)`` of ``fmt`` at ``length`` in ``stage``; ``(0, 0)`` where it did not run, or is an
        added format that has not reached every prompt there yet."""
        mine = self.outcomes(stage, length)
        outs = [c[fmt] for c in mine.values() if fmt in c]
        if len(outs) < len(mine):
            return 0, 0
        return sum(outs), len(outs)

    def paired(self, stage: str, fmt: str, length: int, reference: str = "fp32",
               reference_stage: str | None = None) -> Paired:
        """``fmt`` against ``reference`` on the prompts both answered. In the ``"cached"`` stage the
        reference's answers come from the ``"filler"`` stage: the same prompts, and a lossless cache
        gives the same answer whichever way the prompt attends. ``reference_stage`` takes the reference's
        answers from another stage with the same prompts: ``paired("cached", "q4_0", n, "q4_0", "filler")``
        sets one format's two prefill modes side by side."""
        mine = self.outcomes(stage, length)
        if reference_stage is None:
            reference_stage = "filler" if stage == "cached" else stage
        if {stage, reference_stage} - {"filler", "cached"} and stage != reference_stage:
            raise ValueError(f"{stage!r} and {reference_stage!r} do not share prompts (only filler and cached do)")
        ref = self.outcomes(reference_stage, length)
        keys = [k for k in mine if fmt in mine[k] and k in ref and reference in ref[k]]
        if not keys:
            raise KeyError(f"no prompts where {fmt!r} and {reference!r} both ran at {length} tokens in {stage!r}")
        self._whole(fmt, list(mine.values()), f"{length} tokens in {stage!r}")
        self._whole(reference, list(ref.values()), f"{length} tokens in {reference_stage!r}")
        a = [mine[k][fmt] for k in keys]
        b = [ref[k][reference] for k in keys]
        return Paired(fmt, reference, len(keys), sum(a), sum(b),
                      lost=sum(y and not x for x, y in zip(a, b)), gained=sum(x and not y for x, y in zip(a, b)))

    def _paired_if_run(self, stage: str, fmt: str, length: int, reference: str,
                       reference_stage: str | None = None) -> Paired | None:
        """:meth:`paired`, or None where the two did not both run; a format still being added (:class:`Incomplete`)
        is not "did not run": that error goes on, so no pooled or per-length verdict rests on part of a length."""
        try:
            return self.paired(stage, fmt, length, reference, reference_stage)
        except Incomplete:
            raise
        except KeyError:
            return None

    def paired_pooled(self, stage: str | tuple[str, ...], fmt: str, reference: str = "fp32",
                      reference_stage: str | None = None) -> Paired:
        """``fmt`` against ``reference`` on every prompt of every complete length of ``stage`` (or of each stage
        in a tuple, e.g. both haystacks) at once: the same paired test with more prompts (each prompt is still
        compared with itself), so a loss too small for one length's test can show. Lengths where either did not
        run are skipped; a format added later that has reached only some prompts of a length is refused
        (:class:`Incomplete`), not pooled over the lengths it has finished. ``reference_stage`` is
        :meth:`paired`'s: ``paired_pooled("cached", "q4_0", "q4_0", "filler")`` pools one format's two prefill
        modes over every length the cached stage ran."""
        parts = []
        for st in (stage,) if isinstance(stage, str) else stage:
            for n in self.lengths(st):
                if (pr := self._paired_if_run(st, fmt, n, reference, reference_stage)) is not None:
                    parts.append(pr)
        if not parts:
            raise KeyError(f"no prompts where {fmt!r} and {reference!r} both ran in {stage!r}")
        return Paired(fmt, reference, *(sum(getattr(x, a) for x in parts)
                                         for a in ("prompts", "correct", "ref_correct", "lost", "gained")))

    def needle_tests(self, fmt: str, stages: tuple[str, ...] = ("filler", "prose"), reference: str = "fp32"
                     ) -> dict[str, Paired]:
        """Every paired test a format's single-needle verdict rests on: each complete length of each stage
        (``"filler 8192"``) and all of them pooled (``"pooled"``)."""
        tests = {}
        for st in stages:
            for n in self.lengths(st):
                if (pr := self._paired_if_run(st, fmt, n, reference)) is not None:
                    tests[f"{st} {n}"] = pr
        if not tests:
            raise KeyError(f"no prompts where {fmt!r} and {reference!r} both ran in {stages!r}")
        tests["pooled"] = self.paired_pooled(stages, fmt, reference)
        return tests

    def worse_after_holm(self, fmt: str, stages: tuple[str, ...] = ("filler", "prose"), reference: str = "fp32"
                         ) -> list[str]:
        """The tests of :meth:`needle_tests` that still call ``fmt`` worse once :func:`holm` corrects for their
        number (a harmless format facing many tests would fail one of them by chance more often than 5%)."""
        return holm_worse(self.needle_tests(fmt, stages, reference))

    def table(self, stage: str = "filler", reference: str = "fp32") -> list[dict]:
        """One row per (format, length) measured in ``stage``: rate, interval, and the paired verdict."""
        rows = []
        for fmt in self.all_formats:  # an added format where it has every prompt
            for n in self.lengths(stage):
                try:
                    pr = self.paired(stage, fmt, n, reference)
                except KeyError:
                    continue
                lo, hi = pr.interval
                rows.append({"kv_format": fmt, "length": n, "prompts": pr.prompts, "correct": pr.correct,
                             "rate": pr.rate, "lo": lo, "hi": hi, "ref_rate": pr.ref_rate, "lost": pr.lost,
                             "gained": pr.gained, "p": pr.p, "verdict": pr.verdict})
        return rows

    def fails_at(self, stage: str, fmt: str, reference: str = "fp32") -> int | None:
        """The shortest length at which ``fmt`` is ``"worse"`` than ``reference`` (None: at no length measured)."""
        for n in self.lengths(stage):
            if (pr := self._paired_if_run(stage, fmt, n, reference)) is not None and pr.verdict == "worse":
                return n
        return None

    def figure(self, stage: str = "filler", formats: list[str] | None = None, reference: str = "fp32"):
        """Exact match by context length for this one model (:func:`figure_by_model` with one panel)."""
        return figure_by_model({self.model: self}, formats or self.formats, stage, reference)


def load_long_sweeps() -> dict[str, LongSweep]:
    """``{model: LongSweep}`` for every model whose long sweep is shipped (:data:`LONG_SWEEPS`)."""
    return {m: LongSweep.load(p) for m, p in LONG_SWEEPS.items() if p.is_file()}


def rungs(sweep: LongSweep, stage: str = "filler", reference: str = "fp32",
          ppl_tolerance: float = PPL_TOLERANCE, formats: list[str] | None = None) -> list[dict]:
    """What each eval rung says of each format on one model, all on identical prompts or windows.

    ``formats`` defaults to the sweep's own (:attr:`LongSweep.formats`); a format is left out where it has not
    run at every complete length of ``stage``.

    Per format: the perplexity increase (None if not measured) and whether it is within
    ``ppl_tolerance``; the paired verdict at the shortest passkey length (*the short needle*); the
    first length where the paired test finds it worse (*falls_at*, None: never) and every such length
    (*worse_at*: a format can be worse at one length and not distinguishable at the next); and ``trap``: it
    looks fine on perplexity and on the short needle, and is worse at some longer length, which only
    a long-context eval catches.
    """
    if not 0 <= ppl_tolerance < 10 or isinstance(ppl_tolerance, bool):
        raise ValueError(f"ppl_tolerance must be a fraction in [0, 10), got {ppl_tolerance!r}")
    lengths = sweep.lengths(stage)
    if not lengths:
        raise ValueError(f"the {sweep.model} sweep has no {stage!r} prompts")
    rows = []
    for fmt in sweep.formats if formats is None else formats:
        if fmt == reference:
            continue
        try:
            ppl = sweep.paired_perplexity(fmt, reference)["increase"]
        except KeyError:
            ppl = None
        verdicts = [_verdict_or_none(sweep, stage, fmt, n, reference) for n in lengths]
        if None in verdicts:  # not run here, or (added later) not at every length yet
            continue
        short = verdicts[0]
        worse_at = [n for n, v in zip(lengths, verdicts) if v == "worse"]
        falls = worse_at[0] if worse_at else None
        ppl_ok = ppl is not None and ppl <= ppl_tolerance
        rows.append({"kv_format": fmt, "ppl_increase": ppl, "ppl_ok": ppl_ok, "short": lengths[0],
                     "short_verdict": short, "falls_at": falls, "worse_at": worse_at,
                     "trap": bool(ppl_ok and short != "worse" and falls is not None and falls > lengths[0])})
    return rows


def _verdict_or_none(sweep, stage, fmt, n, reference):
    try:
        return sweep.paired(stage, fmt, n, reference).verdict
    except KeyError:
        return None


def figure_by_model(sweeps: dict[str, LongSweep], formats: list[str], stage: str = "filler",
                    reference: str = "fp32"):
    """Exact match by context length, one panel per model, one line per format (the same colour in each
    panel), 95% Wilson bars; a hollow marker where the paired test finds the format worse than ``reference``."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    if not sweeps:
        raise ValueError("give at least one sweep")
    fig = make_subplots(rows=1, cols=len(sweeps), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{m} ({max(s.lengths(stage)):,} tokens max)" for m, s in sweeps.items()])
    colours = qualitative.Plotly + qualitative.D3
    for col, sw in enumerate(sweeps.values(), start=1):
        table = sw.table(stage, reference)
        for k, fmt in enumerate(formats):
            rows = [r for r in table if r["kv_format"] == fmt]
            if not rows:
                continue
            fig.add_trace(go.Scatter(
                x=[r["length"] for r in rows], y=[r["rate"] for r in rows], name=fmt, legendgroup=fmt,
                showlegend=col == 1, mode="lines+markers", line=dict(color=colours[k % len(colours)]),
                marker=dict(symbol=["circle-open" if r["verdict"] == "worse" else "circle" for r in rows], size=9),
                error_y=dict(type="data", symmetric=False, array=[r["hi"] - r["rate"] for r in rows],
                             arrayminus=[r["rate"] - r["lo"] for r in rows], thickness=1),
                customdata=[[r["prompts"], r["verdict"], r["p"]] for r in rows],
                hovertemplate="%{x} tokens: %{y:.0%} of %{customdata[0]} prompts<br>"
                              "%{customdata[1]} (McNemar p=%{customdata[2]:.3f})<extra>" + fmt + "</extra>"), 1, col)
        fig.update_xaxes(type="log", title_text="context (tokens)", tickvals=sw.lengths(stage),
                         ticktext=[f"{n // 1024}k" for n in sw.lengths(stage)], row=1, col=col)
    fig.update_yaxes(title_text="passkey exact match", range=[-0.05, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_layout(height=440, margin=dict(t=70, b=40), legend=dict(orientation="h", y=-0.22),
                      title=f"Passkey by context length, {stage} haystack; hollow = worse than {reference} "
                            f"on the same prompts (exact McNemar, p < {ALPHA})")
    return fig


def verdict_markdown(sweeps: dict[str, LongSweep], formats: list[str], stage: str = "filler",
                     reference: str = "fp32") -> str:
    """A Markdown table: one row per format, one column per (model, length), ``correct/prompts`` and, where
    any, the discordant prompts the paired test reads (``−lost +gained`` against ``reference``), bold with a ✗
    where it finds the format worse."""
    cols = [(m, n) for m, s in sweeps.items() for n in s.lengths(stage)]
    cells = {(m, r["kv_format"], r["length"]): r for m, s in sweeps.items() for r in s.table(stage, reference)}
    head = "| format | " + " | ".join(f"{m.split('-')[0]} {n // 1024}k" for m, n in cols) + " |"
    out = [head, "|---" * (len(cols) + 1) + "|"]
    for fmt in formats:
        row = []
        for m, n in cols:
            r = cells.get((m, fmt, n))
            if r is None:
                row.append("—")
                continue
            text = f"{r['correct']}/{r['prompts']}" + (f" −{r['lost']} +{r['gained']}" if r["lost"] or r["gained"] else "")
            row.append(f"**{text} ✗**" if r["verdict"] == "worse" else text)
        out.append(f"| `{fmt}` | " + " | ".join(row) + " |")
    what = {"filler": "passkey in the filler haystack", "prose": "passkey in the prose haystack",
            "cached": "passkey in the filler haystack, the prompt reading its own quantized cache",
            "multikey": "two named pass keys in the filler haystack",
            "orders": "an order ID copied from one of several order records in the prose haystack"}[stage]
    caption = (f"*{what.capitalize()}: needles found / prompts, then −lost +gained against `{reference}` on the same "
               f"prompts; **✗**: worse (exact McNemar, p < {ALPHA}), at that length alone.*")
    return caption + "\n\n" + "\n".join(out)


# --------------------------------------------------------------------------- per-cell results


def check_cell(r, where: str) -> None:
    """One exact-match cell ``{length, depth, trials, correct}``: positive length and trials, a depth in [0, 1],
    ``0 <= correct <= trials``; ``ValueError`` naming ``where`` and the field."""
    if not isinstance(r, dict):
        raise ValueError(f"{where}: a cell must be an object {{length, depth, trials, correct}}, got {type(r).__name__}")
    for k in ("length", "trials", "correct"):
        _count(f"{where}.{k}", r.get(k))
    if r["length"] < 1 or r["trials"] < 1:
        raise ValueError(f"{where}: length and trials must be positive, got {r['length']} and {r['trials']}")
    if r["correct"] > r["trials"]:
        raise ValueError(f"{where}: correct {r['correct']} is more than its {r['trials']} trials")
    d = r.get("depth")
    if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 1:
        raise ValueError(f"{where}.depth must be a number in [0, 1], got {d!r}")

@dataclass
class EvalResult:
    """Exact-match counts per (length, depth) cell of one task, model and KV format."""

    task: str
    model: str
    kv_format: str
    rows: list[dict] = field(default_factory=list)  # {length, depth, trials, correct}
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.rows, list):
            raise ValueError(f"rows must be a list of cells, got {type(self.rows).__name__}")
        seen = set()
        for i, r in enumerate(self.rows):
            check_cell(r, f"rows[{i}]")
            if (r["length"], r["depth"]) in seen:  # a cell counted twice would weigh double in every pooled rate
                raise ValueError(f"rows[{i}]: the cell length={r['length']}, depth={r['depth']} appears twice")
            seen.add((r["length"], r["depth"]))

    def accuracy(self, length: int | None = None, depth: float | None = None, min_length: int | None = None) -> float:
        """Exact match pooled over the cells that match (all of them by default); ``KeyError`` where none does."""
        for arg, v in (("length", length), ("depth", depth), ("min_length", min_length)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v != v):
                raise TypeError(f"{arg} must be a number or None, got {v!r}")
        rows = [r for r in self.rows if (length is None or r["length"] == length)
                and (depth is None or r["depth"] == depth) and (min_length is None or r["length"] >= min_length)]
        if not rows:
            raise KeyError(f"no cells for length={length}, depth={depth}, min_length={min_length}")
        return sum(r["correct"] for r in rows) / sum(r["trials"] for r in rows)

    @property
    def lengths(self) -> list[int]:
        return sorted({r["length"] for r in self.rows})

    @property
    def depths(self) -> list[float]:
        return sorted({r["depth"] for r in self.rows})

    def grid(self) -> list[list[float | None]]:
        """Exact match, rows = depths, columns = lengths; None where a result has no cell (a sweep that skipped it)."""
        have = {(r["length"], r["depth"]) for r in self.rows}
        return [[self.accuracy(n, d) if (n, d) in have else None for n in self.lengths] for d in self.depths]

    def save(self, path: str | Path) -> None:
        """Write this result as JSON, atomically (:func:`kvlab.paths.write_json`)."""
        from .paths import write_json

        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> EvalResult:
        """Read a result :meth:`save` wrote; a file of another shape is refused naming the file and the field."""
        from .paths import load_json, shown_path

        doc = load_json(path, "eval result")
        fields = {"task": str, "model": str, "kv_format": str, "rows": list, "meta": dict}
        if missing := sorted({"task", "model", "kv_format", "rows"} - set(doc)):
            raise ValueError(f"eval result {shown_path(path)}: not an EvalResult (missing {', '.join(missing)})")
        if extra := sorted(set(doc) - set(fields)):
            raise ValueError(f"eval result {shown_path(path)}: unknown fields {', '.join(extra)}")
        if wrong := [k for k, t in fields.items() if k in doc and not isinstance(doc[k], t)]:
            raise ValueError(f"eval result {shown_path(path)}: {', '.join(wrong)} of the wrong type")
        try:
            return cls(**doc)
        except ValueError as e:
            raise ValueError(f"eval result {shown_path(path)}: {e}") from None

    def figure(self, title: str | None = None):
        import plotly.graph_objects as go

        fig = go.Figure(go.Heatmap(
            z=self.grid(), x=[str(n) for n in self.lengths], y=[f"{d:.2f}" for d in self.depths],
            zmin=0, zmax=1, colorscale="RdYlGn", colorbar=dict(title="exact match"),
            text=[["" if v is None else f"{v:.0%}" for v in row] for row in self.grid()], texttemplate="%{text}"))
        fig.update_layout(title=title or f"{self.task}: {self.kv_format}", xaxis_title="context (tokens)",
                          yaxis_title="needle depth", height=320, margin=dict(t=40, b=40))
        return fig


# --------------------------------------------------------------------------- chapter 4's SmolLM2 sweep

SWEEP_PATH = RESULTS_DIR / "eval_sweep.json"


def load_sweep(path: str | Path | None = None) -> dict:
    """Chapter 4's full sweep (``scripts/sweep_evals.py``): per format, every rung of the eval ladder.

    Each format's passkey cells come back as :class:`EvalResult` objects too:
    ``passkey_result`` (filler haystack) and ``prose_result`` (held-out prose).
    """
    from .paths import load_json, shown_path

    path = Path(path) if path is not None else SWEEP_PATH
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; run scripts/sweep_evals.py to create it")
    doc = load_json(path, "eval sweep")
    if not isinstance(doc.get("formats"), dict) or not all(isinstance(r, dict) for r in doc["formats"].values()):
        raise ValueError(f"eval sweep {shown_path(path)}: not an eval sweep (no 'formats' mapping of objects)")
    model = doc.get("model", "?")
    for name, row in doc["formats"].items():
        for key, out in (("passkey", "passkey_result"), ("passkey_prose", "prose_result")):
            try:
                row[out] = EvalResult("passkey", model, name, row.get(key, []))
            except ValueError as e:
                raise ValueError(f"eval sweep {shown_path(path)}: formats.{name}.{key}: {e}") from None
    return doc


def counts(rows: list[dict], length: int | None = None, min_length: int | None = None) -> tuple[int, int]:
    """``(correct, trials)`` pooled over the cells of ``rows`` at ``length`` (or at every length >= ``min_length``)."""
    cells = [r for r in rows if (length is None or r["length"] == length)
             and (min_length is None or r["length"] >= min_length)]
    return sum(r["correct"] for r in cells), sum(r["trials"] for r in cells)


def rates_with_intervals(pairs: list[tuple[int, int]]) -> tuple[list[float], dict]:
    """Rates of ``(correct, trials)`` pairs and a plotly ``error_y`` dict drawing their 95% Wilson intervals."""
    rates = [c / t for c, t in pairs]
    ci = [wilson(c, t) for c, t in pairs]
    return rates, dict(type="data", symmetric=False, array=[hi - r for (_, hi), r in zip(ci, rates)],
                       arrayminus=[r - lo for (lo, _), r in zip(ci, rates)])


def falls_at(result: EvalResult, reference: EvalResult, drop: float = 0.2) -> int | None:
    """The shortest context length where ``result`` is at least ``drop`` below ``reference`` (None: never)."""
    if not 0 < drop <= 1:
        raise ValueError(f"drop must be in (0, 1], got {drop!r}")
    for n in result.lengths:
        if n in reference.lengths and result.accuracy(n) <= reference.accuracy(n) - drop:
            return n
    return None


def ladder(sweep: dict, short: int = 512, long_min: int = 2048, reference: str = "fp32") -> list[dict]:
    """One row per format: what each rung of the eval ladder reports.

    ``ppl_increase`` is relative to ``reference``; ``needle_short`` is passkey exact match at
    ``short`` tokens and ``needle_long`` pools every length >= ``long_min`` (filler haystack),
    each with its 95% Wilson interval (``*_lo``, ``*_hi``); ``prose_long`` is exact match at the
    longest length swept in held-out prose (None where the format was not swept there); ``chain`` pools the multi-hop cells (None
    where absent); ``kl``, ``top1`` and ``first_divergence`` come from the teacher comparison.
    """
    fmts = sweep["formats"]
    if reference not in fmts:
        raise KeyError(f"reference format {reference!r} is not in the sweep ({sorted(fmts)})")
    base = fmts[reference]["perplexity"]
    rows = []
    for name, r in fmts.items():
        (cs, ts), (cl, tl) = counts(r["passkey"], length=short), counts(r["passkey"], min_length=long_min)
        if not ts or not tl:
            raise KeyError(f"{name}: the sweep has no passkey cells at {short} or at >= {long_min} tokens")
        prose = r.get("passkey_prose") or []
        cp, tp = counts(prose, length=max(c["length"] for c in prose)) if prose else (0, 0)
        chain = r.get("chain2") or []
        rows.append({
            "kv_format": name,
            "bits": r["bits_per_element"],
            "ppl_increase": r["perplexity"] / base - 1,
            "needle_short": cs / ts, "needle_short_lo": wilson(cs, ts)[0], "needle_short_hi": wilson(cs, ts)[1],
            "needle_long": cl / tl, "needle_long_lo": wilson(cl, tl)[0], "needle_long_hi": wilson(cl, tl)[1],
            "prose_long": cp / tp if tp else None,
            "chain": counts(chain)[0] / counts(chain)[1] if chain else None,
            "kl": r["teacher"]["kl"],
            "top1": r["teacher"]["top1_agreement"],
            "first_divergence": r["teacher"]["mean_first_divergence"],
            # what the labels need: the lengths of the two needles, the teacher's prompts and tokens
            "short": short, "long_min": long_min, "reference": reference,
            "teacher_prompts": len(r["teacher"]["first_divergence"]), "teacher_tokens": r["teacher"]["max_new_tokens"],
        })
    return rows


_LADDER_COLUMNS = {"bits": "{:.2f}", "ppl_increase": "{:+.1%}", "needle_short": "{:.0%}", "needle_long": "{:.0%}",
                   "prose_long": "{:.0%}", "chain": "{:.0%}", "kl": "{:.4f}", "top1": "{:.1%}",
                   "first_divergence": "{:.1f}"}


def _ladder_labels(r: dict) -> dict[str, str]:
    """Column headings that say what each rung measured (lengths, units, how many prompts)."""
    k = lambda n: f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
    return {"bits": "bits / value", "ppl_increase": f"perplexity vs {r['reference']}",
            "needle_short": f"needle at {k(r['short'])} (95% CI)",
            "needle_long": f"needle at ≥{k(r['long_min'])}, all depths (95% CI)",
            "prose_long": "prose needle, longest", "chain": "2-hop chain",
            "kl": "KL to teacher (nats / token)", "top1": "top-1 agreement",
            "first_divergence": f"first divergent token (mean of {r['teacher_prompts']} prompts; "
                                f"{r['teacher_tokens']} = none)"}


def ladder_markdown(ladder_rows: list[dict]) -> str:
    """:func:`ladder` rows as a Markdown table (a dash where a rung was not measured)."""
    cols = [c for c in _LADDER_COLUMNS if any(r.get(c) is not None for r in ladder_rows)]
    labels = _ladder_labels(ladder_rows[0])

    def cell(r, c):
        if r.get(c) is None:
            return "—"
        text = _LADDER_COLUMNS[c].format(r[c])
        if f"{c}_lo" in r:  # a 95% interval beside the rate
            text += f" ({r[c + '_lo']:.0%}–{r[c + '_hi']:.0%})"
        return text

    head = "| format | " + " | ".join(labels[c] for c in cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    return head + "\n".join(f"| {r['kv_format']} | " + " | ".join(cell(r, c) for c in cols) + " |"
                             for r in ladder_rows)


def cell_agreement(sweep: dict, reference: str = "fp32", tol: float = 0.25) -> float:
    """Fraction of all formats' passkey cells within ``tol`` of the reference format's same cell."""
    fmts = sweep["formats"]
    if reference not in fmts:
        raise KeyError(f"reference format {reference!r} is not in the sweep")
    ref = EvalResult("passkey", "", reference, fmts[reference]["passkey"])
    diffs = []
    for name, r in fmts.items():
        res = EvalResult("passkey", "", name, r["passkey"])
        diffs += [abs(res.accuracy(c["length"], c["depth"]) - ref.accuracy(c["length"], c["depth"])) for c in r["passkey"]]
    if not diffs:
        raise ValueError("the sweep has no passkey cells")
    return sum(d <= tol for d in diffs) / len(diffs)


def quality_by_length(sweep: dict, formats) -> dict[str, dict[int, float | None]]:
    """Passkey exact match per format and context length, from chapter 4's ``eval_sweep.json``.

    Every format gets every length the sweep measured (None where it measured no cell).
    """
    fmts = sweep.get("formats", {})
    lengths = sorted({c["length"] for r in fmts.values() for c in r.get("passkey", [])})
    out = {}
    for fmt in formats:
        cells = fmts.get(str(fmt), {}).get("passkey", [])
        out[str(fmt)] = {}
        for n in lengths:
            at = [c for c in cells if c["length"] == n]
            trials = sum(c["trials"] for c in at)
            out[str(fmt)][n] = sum(c["correct"] for c in at) / trials if trials else None
    return out


# --------------------------------------------------------------------------- engines beside kvlab

LLAMA_TO_PRESET = {"f16": "fp16", "q8_0": "q8_0", "q4_0": "q4_0"}


def llamacpp_vs_kvlab(llama: dict, sweep: dict) -> dict:
    """Passkey exact match per context length, llama.cpp beside kvlab's emulation of the same cache type.

    ``llama`` is ``data/results/engines_llamacpp.json``, ``sweep`` chapter 4's ``eval_sweep.json`` (same prompts).
    Returns ``{cache type: {"preset", "lengths": {n: {"llama.cpp": (correct, trials), "kvlab": (correct,
    trials)}}, "seconds"}}`` over the cells both measured.
    """
    out = {}
    for ct, res in llama["cache_types"].items():
        preset = LLAMA_TO_PRESET[ct]
        ours = sweep["formats"][preset]["passkey"]
        cells = {(r["length"], r["depth"]) for r in res["rows"]} & {(r["length"], r["depth"]) for r in ours}
        if not cells:
            raise ValueError(f"llama.cpp {ct} and kvlab's {preset} share no (length, depth) cell")
        pick = lambda rows, cells=cells: [r for r in rows if (r["length"], r["depth"]) in cells]
        out[ct] = {"preset": preset, "seconds": res["seconds"], "lengths": {
            n: {"llama.cpp": counts(pick(res["rows"]), length=n), "kvlab": counts(pick(ours), length=n)}
            for n in sorted({n for n, _ in cells})}}
    return out


def _paired(fmt: str, reference: str, a: list[bool], b: list[bool]) -> Paired:
    return Paired(fmt, reference, len(a), sum(a), sum(b), lost=sum(y and not x for x, y in zip(a, b)),
                  gained=sum(x and not y for x, y in zip(a, b)))


def _int_at_least(x, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _finite(x, low: float = 0.0, high: float = math.inf) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def llamacpp_cells_problem(cache_types) -> str | None:
    """What is wrong with a llama.cpp run's ``cache_types`` (``{cache type: {"rows", "seconds", "partial"?}}``), or
    None: a resumed run trusts these cells, so each row must be one this code wrote (a length, a depth in [0, 1], a
    count of trials, one boolean outcome a trial and ``correct`` their sum), each cell once, and a cut-off cell short
    of its trials."""
    if not isinstance(cache_types, dict):
        return "cache_types must be an object {cache type: cell}"
    for ct, v in cache_types.items():
        if ct not in LLAMA_CACHE_TYPES:
            return f"cache type {str(ct)[:40]!r} is not one of {', '.join(LLAMA_CACHE_TYPES)}"
        if not isinstance(v, dict) or not isinstance(v.get("rows"), list) or not _finite(v.get("seconds", 0.0)):
            return f"{ct}: a cell must hold its rows (a list) and seconds (a finite number >= 0)"
        seen = set()
        for r in v["rows"]:
            if not (isinstance(r, dict) and _int_at_least(r.get("length"), 1) and _finite(r.get("depth"), 0, 1)
                    and _int_at_least(r.get("trials"), 1) and _int_at_least(r.get("correct")) and r["correct"] <= r["trials"]
                    and ("outcomes" not in r  # rows written before outcomes were kept hold the count alone
                         or (isinstance(r["outcomes"], list) and len(r["outcomes"]) == r["trials"]
                             and all(isinstance(o, bool) for o in r["outcomes"]) and r["correct"] == sum(r["outcomes"])))):
                return (f"{ct}: each row needs length, depth (0 to 1), trials, correct (0 to trials) and, if it keeps "
                        f"them, one true/false outcome a trial summing to correct; got {str(r)[:80]}")
            if (r["length"], float(r["depth"])) in seen:
                return f"{ct}: the cell at {r['length']} tokens, depth {r['depth']} is there twice"
            seen.add((r["length"], float(r["depth"])))
        part = v.get("partial")
        if part is not None and not (
                isinstance(part, dict) and _int_at_least(part.get("length"), 1) and _finite(part.get("depth"), 0, 1)
                and _int_at_least(part.get("trials"), 1) and isinstance(part.get("outcomes"), list)
                and len(part["outcomes"]) < part["trials"] and all(isinstance(o, bool) for o in part["outcomes"])):
            return (f"{ct}: a 'partial' cell must hold its length, depth, trials and fewer true/false outcomes than "
                    f"trials; got {str(part)[:80]}")
    return None


def llamacpp_doc_problem(doc) -> str | None:
    """What is wrong with a llama.cpp result file as :func:`kvlab.engines.llamacpp_passkey`'s script writes it, or
    None: its cells (:func:`llamacpp_cells_problem`), lengths, depths, trials and its log of sessions."""
    if not isinstance(doc, dict) or not {"cache_types", "lengths", "depths", "trials"} <= set(doc):
        return "not a llama.cpp result (it needs cache_types, lengths, depths and trials)"
    if why := llamacpp_cells_problem(doc["cache_types"]):
        return why
    if not (isinstance(doc["lengths"], list) and all(_int_at_least(n, 1) for n in doc["lengths"])):
        return "lengths must be a list of token counts"
    if not (isinstance(doc["depths"], list) and doc["depths"] and all(_finite(d, 0, 1) for d in doc["depths"])
            and len(set(doc["depths"])) == len(doc["depths"])):
        return "depths must be a list of distinct numbers from 0 to 1"
    if not _int_at_least(doc["trials"], 1):
        return "trials must be a whole number >= 1"
    if any(r["trials"] != doc["trials"] for v in doc["cache_types"].values() for r in v["rows"]):
        return f"a row ran another number of trials than the file's {doc['trials']}"
    for r in doc.get("runs", []) if isinstance(doc.get("runs", []), list) else [None]:
        if not (isinstance(r, dict) and isinstance(r.get("machine"), str) and isinstance(r.get("dates"), list)
                and len(r["dates"]) == 2 and all(isinstance(d, str) for d in r["dates"])
                and isinstance(r.get("prompts"), dict)
                and all(k in LLAMA_CACHE_TYPES and _int_at_least(n) for k, n in r["prompts"].items())
                and all(k in LLAMA_CACHE_TYPES and _finite(x) for k, x in (r.get("seconds") or {}).items())):
            return f"its 'runs' log is not one this script wrote (each needs machine, two dates, prompts); got {str(r)[:80]}"
    return None


def llamacpp_unresumed(cache_types: dict, run: tuple, lengths, depths, trials: int, swa_full) -> str | None:
    """A cut-off cell among ``cache_types`` of the types in ``run`` that a run of these lengths, depths, trials and
    sliding-window setting would not resume (its next cut-off cell would overwrite it), described; else None."""
    cells = {(n, float(d)) for n in lengths for d in depths}
    for ct in run:
        part = (cache_types.get(ct) or {}).get("partial")
        if part and ((part["length"], float(part["depth"])) not in cells or part["trials"] != trials
                     or part.get("swa_full") != swa_full):
            return (f"a cut-off {ct} cell ({part['length']} tokens, depth {part['depth']}, {part['trials']} trials, "
                    f"swa_full={part.get('swa_full')})")
    return None


def llamacpp_time_ratio(cache_types: dict, cache_type: str, reference: str = "f16") -> float:
    """How many times ``reference``'s run time ``cache_type``'s llama.cpp run took (prompts and answers, wall time)."""
    return cache_types[cache_type]["seconds"] / cache_types[reference]["seconds"]


def llamacpp_answered(cache_types: dict) -> dict[str, int]:
    """Prompts a llama.cpp run has answered so far, per cache type: its rows' trials and a cut-off cell's outcomes."""
    return {ct: sum(r["trials"] for r in v["rows"]) + len((v.get("partial") or {}).get("outcomes", []))
            for ct, v in cache_types.items()}


def llamacpp_log_run(runs: list, before: dict, cache_types: dict, seconds_before: dict, **where) -> list:
    """``runs`` (the sessions a resumable llama.cpp file already lists) with this session's entry: ``where`` (machine,
    threads, dates) and, per cache type, the prompts it answered and the seconds it spent since ``before`` and
    ``seconds_before``. A run resumed on another machine is then not labelled with one machine for every row;
    a session that answered nothing adds no entry."""
    now = llamacpp_answered(cache_types)
    prompts = {ct: n - before.get(ct, 0) for ct, n in now.items() if n > before.get(ct, 0)}
    if not prompts:
        return list(runs)
    seconds = {ct: round(cache_types[ct]["seconds"] - seconds_before.get(ct, 0.0), 1) for ct in prompts}
    return list(runs) + [{**where, "prompts": prompts, "seconds": seconds}]


def _md_text(value) -> str:
    """``value`` as literal Markdown text: a machine name such as ``Xeon_*v4*`` must not turn into emphasis or a
    table cell border in a chapter."""
    return re.sub(r"([\\`*_{}\[\]<>#|~])", r"\\\1", str(value))


def llamacpp_machines_md(doc: dict) -> str:
    """Where a llama.cpp file's prompts ran: "AMD EPYC, 2026-12-02 to 2026-12-03 (50 f16, 25 q4_0 prompts) and ..."
    from its ``runs``; a file without them names its one machine and date."""
    runs = doc.get("runs") or []
    if not runs:
        return f"{_md_text(doc.get('machine', '?'))}, {_md_text(doc.get('date', '?'))}"

    merged = []  # consecutive sessions on the same kind of machine read as one stretch
    for r in runs:
        if merged and merged[-1]["machine"] == r["machine"]:
            m = merged[-1]
            m["dates"] = [min(m["dates"][0], r["dates"][0]), max(m["dates"][1], r["dates"][1])]
            m["prompts"] = {ct: m["prompts"].get(ct, 0) + r["prompts"].get(ct, 0) for ct in {**m["prompts"], **r["prompts"]}}
        else:
            merged.append({"machine": r["machine"], "dates": list(r["dates"]), "prompts": dict(r["prompts"])})

    def one(r):
        d0, d1 = r["dates"]
        when = d0 if d0 == d1 else f"{d0} to {d1}"
        word = "prompt" if sum(r["prompts"].values()) == 1 else "prompts"
        return f"{_md_text(r['machine'])}, {when} ({', '.join(f'{n} {ct}' for ct, n in r['prompts'].items())} {word})"
    parts = [one(r) for r in merged]
    return parts[0] if len(parts) == 1 else "; ".join(parts[:-1]) + "; and " + parts[-1]


def llamacpp_pending(llama: dict) -> dict:
    """The lengths a llama.cpp run has not finished: ``{cache type: {length: prompts answered so far}}`` for every
    cache type and length of ``llama["lengths"]`` whose rows do not cover all of ``llama["depths"]`` (a resumable run
    writes after each prompt, so a file can hold part of a length, and a cell's prompts so far as ``"partial"``)."""
    rows_all = [r for res in llama["cache_types"].values() for r in res["rows"]]
    want = {float(d) for d in (llama.get("depths") or [r["depth"] for r in rows_all])}
    out = {}
    for ct, res in llama["cache_types"].items():
        for n in llama.get("lengths") or sorted({r["length"] for r in rows_all}):
            rows = [r for r in res["rows"] if r["length"] == n]
            if {float(r["depth"]) for r in rows} != want:
                part = res.get("partial") or {}  # a cell cut off part way (written after every prompt)
                out.setdefault(ct, {})[n] = sum(r["trials"] for r in rows) + (
                    len(part.get("outcomes", [])) if part.get("length") == n else 0)
    return out


def llamacpp_paired(llama: dict, sweep: LongSweep) -> dict:
    """llama.cpp's cache types against kvlab's on the identical prompts of a long sweep, prompt by prompt.

    ``llama`` is ``data/results/engines_llamacpp_gemma3.json`` (rows with per-prompt ``outcomes``, made by
    ``scripts/compare_engines.py --llama-cpp --model gemma3-270m`` on the sweep's filler prompts); ``sweep``
    the model's :class:`LongSweep`. llama.cpp writes K and V to its cache before the prompt attends, so its
    quantized types are set beside kvlab's ``"cached"`` stage where the sweep has that format at that length,
    and beside the ``"filler"`` stage (prompt attending in full precision) otherwise: ``kvlab_stage`` says
    which. Returns ``{cache type: {length: {"preset", "kvlab_stage", "engine": Paired (cache type vs llama.cpp's
    f16), "kvlab": Paired (preset vs kvlab's fp32), "between": Paired (llama.cpp vs kvlab, same cache)}}}`` over the
    lengths both the cache type and f16 finished (:func:`llamacpp_pending` lists the others).
    """
    def mine(rows, n):
        got = {}
        for r in rows:
            if r["length"] == n:
                if len(r.get("outcomes") or []) != r["trials"]:
                    raise ValueError(f"llama.cpp row at {n} tokens, depth {r['depth']}: no per-prompt outcomes "
                                     "(rerun scripts/compare_engines.py --llama-cpp --model gemma3-270m)")
                got |= {(float(r["depth"]), i): bool(x) for i, x in enumerate(r["outcomes"])}
        return got

    types = llama["cache_types"]
    if "f16" not in types:
        raise ValueError("the llama.cpp results need its f16 cache as the reference")
    pending = llamacpp_pending(llama)
    out = {}
    for ct, res in types.items():
        preset = LLAMA_TO_PRESET[ct]
        for n in sorted({r["length"] for r in res["rows"]}):
            if n in pending.get(ct, {}) or n in pending.get("f16", {}):
                continue  # a length still running (or never finished) is not paired
            eng, ref = mine(res["rows"], n), mine(types["f16"]["rows"], n)
            if preset == "fp16":  # each side's full-precision cache: llama.cpp's f16, the sweep's fp32
                stage, col = "filler", "fp32"
            else:
                stage, col = ("cached" if sweep.counts("cached", preset, n)[1] else "filler"), preset
            ours = {k: c[col] for k, c in sweep.outcomes(stage, n).items() if col in c}
            if not ours:
                raise ValueError(f"the long sweep has no {col!r} at {n} tokens")
            base = {k: c["fp32"] for k, c in sweep.outcomes("filler", n).items() if "fp32" in c}
            keys = sorted(set(eng) & set(ref) & set(ours) & set(base))
            if not keys:
                raise ValueError(f"llama.cpp {ct} and the long sweep share no prompt at {n} tokens")
            out.setdefault(ct, {})[n] = {
                "preset": preset, "kvlab_stage": stage,
                "engine": _paired(f"llama.cpp {ct}", "llama.cpp f16", [eng[k] for k in keys], [ref[k] for k in keys]),
                "kvlab": _paired(f"kvlab {preset}", "kvlab fp32", [ours[k] for k in keys], [base[k] for k in keys]),
                "between": _paired(f"llama.cpp {ct}", f"kvlab {preset}", [eng[k] for k in keys],
                                   [ours[k] for k in keys])}
    return out

