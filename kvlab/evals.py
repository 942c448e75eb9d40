"""The eval ladder, run through a kvlab cache: perplexity, needle, multi-hop, side by side with the teacher.

Every eval takes a model and tokenizer (the shipped model by default, via
:func:`kvlab.models.load_model`) and a KV format, builds a fresh
:class:`kvlab.cache.KVQuantCache` per batch, and decodes greedily through it —
prefill and every generated token attend over the cache as stored.

* :func:`passkey_sweep` — needle in a haystack over context length x depth;
* :func:`chain_sweep` — multi-hop variable tracking (every hop must be right);
* :func:`perplexity` — held-out text, the cheap smoke test;
* :func:`teacher_comparison` — per-token KL divergence to the full-precision
  model, top-1 agreement, and where greedy generations first diverge.

Sweeps return an :class:`EvalResult` that saves to and loads from JSON and draws
its own heatmap.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import tasks
from .cache import KVQuantCache
from .formats import KVFormat, get_format


@dataclass
class EvalResult:
    """Exact-match counts per (length, depth) cell of one task, model and KV format."""

    task: str
    model: str
    kv_format: str
    rows: list[dict] = field(default_factory=list)  # {length, depth, trials, correct}
    meta: dict = field(default_factory=dict)

    def accuracy(self, length: int | None = None, depth: float | None = None, min_length: int | None = None) -> float:
        """Exact match pooled over the cells that match (all of them by default)."""
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

    def grid(self) -> list[list[float]]:
        """Exact match, rows = depths, columns = lengths."""
        return [[self.accuracy(n, d) for n in self.lengths] for d in self.depths]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EvalResult:
        doc = json.loads(Path(path).read_text())
        missing = {"task", "model", "kv_format", "rows"} - set(doc)
        if missing:
            raise ValueError(f"{path} is not an EvalResult (missing {sorted(missing)})")
        return cls(**doc)

    def figure(self, title: str | None = None):
        import plotly.graph_objects as go

        fig = go.Figure(go.Heatmap(
            z=self.grid(), x=[str(n) for n in self.lengths], y=[f"{d:.2f}" for d in self.depths],
            zmin=0, zmax=1, colorscale="RdYlGn", colorbar=dict(title="exact match"),
            text=[[f"{v:.0%}" for v in row] for row in self.grid()], texttemplate="%{text}"))
        fig.update_layout(title=title or f"{self.task}: {self.kv_format}", xaxis_title="context (tokens)",
                          yaxis_title="needle depth", height=320, margin=dict(t=40, b=40))
        return fig


# --------------------------------------------------------------------------- helpers


def _check_args(lengths, depths, trials):
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths!r}")
    if not depths or any(not isinstance(d, int | float) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be numbers in [0, 1], got {depths!r}")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or model.config.model_type


@torch.no_grad()
def greedy_through_cache(model, input_ids: torch.Tensor, fmt: str | KVFormat, n_new: int) -> torch.Tensor:
    """Prefill ``input_ids`` ``[batch, tokens]`` into a fresh kvlab cache, then decode ``n_new`` tokens greedily."""
    cache = KVQuantCache(fmt)
    dev = next(model.parameters()).device
    out = model(input_ids.to(dev), past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    new = [nxt]
    for _ in range(n_new - 1):
        out = model(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(nxt)
    return torch.cat(new, dim=1).cpu()


def _sweep(task, make, model, tok, fmt, lengths, depths, trials, seed, batch_size, progress):
    _check_args(lengths, depths, trials)
    fmt = get_format(fmt)
    res = EvalResult(task, _model_name(model), fmt.name, meta={"trials": trials, "seed": seed})
    t0 = time.time()
    cells = [(n, d) for n in lengths for d in depths]
    for n, d in tqdm(cells, desc=f"{task} {fmt.name}", disable=not progress, leave=False):
        rng = random.Random(f"{seed}-{n}-{d}")  # same prompts for every format
        exs = [make(tok, n, d, rng) for _ in range(trials)]
        correct = 0
        for i in range(0, trials, batch_size):
            chunk = exs[i : i + batch_size]
            ids = torch.tensor([e.input_ids for e in chunk])
            n_new = max(len(e.answer_ids) for e in chunk)
            gen = greedy_through_cache(model, ids, fmt, n_new)
            correct += sum(gen[j, : len(e.answer_ids)].tolist() == e.answer_ids for j, e in enumerate(chunk))
        res.rows.append({"length": n, "depth": float(d), "trials": trials, "correct": correct})
    res.meta["seconds"] = round(time.time() - t0, 1)
    return res


def passkey_sweep(model, tok, fmt="bf16", lengths=(512, 1024, 2048), depths=(0.0, 0.5, 1.0), trials=5,
                  seed=0, batch_size=8, progress=True) -> EvalResult:
    """Needle-in-a-haystack exact match over lengths x depths (the same prompts for every format)."""
    return _sweep("passkey", lambda t, n, d, r: tasks.passkey(t, n, d, r), model, tok, fmt,
                  list(lengths), list(depths), trials, seed, batch_size, progress)


def chain_sweep(model, tok, fmt="bf16", lengths=(512, 1024, 2048), depths=(1.0,), hops=2, trials=5,
                seed=0, batch_size=8, progress=True) -> EvalResult:
    """Multi-hop variable tracking; ``depths`` here is how far into the context the links spread."""
    if any(d <= 0 for d in depths):
        raise ValueError("chain depths are spreads and must be > 0")
    res = _sweep(f"chain{hops}", lambda t, n, d, r: tasks.variable_chain(t, n, d, r, hops=hops), model, tok,
                 fmt, list(lengths), list(depths), trials, seed, batch_size, progress)
    res.meta["hops"] = hops
    return res


@torch.no_grad()
def perplexity(model, tok, fmt="bf16", text: str | None = None, window: int = 512, max_windows: int = 16) -> float:
    """Held-out perplexity with every window's attention reading the quantized cache."""
    if text is None:
        import gzip

        from .models import MODEL_DIR

        text = gzip.open(MODEL_DIR.parent / "corpus" / "heldout.txt.gz", "rt").read()
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < window + 1:
        raise ValueError(f"text has {len(ids)} tokens, fewer than window + 1 = {window + 1}")
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    for s in range(0, len(ids) - window, window)[:max_windows]:
        x = torch.tensor([ids[s : s + window]], device=dev)
        logits = model(x, past_key_values=KVQuantCache(fmt), use_cache=True).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)


@torch.no_grad()
def teacher_comparison(model, tok, fmt, prompts: list[str], max_new_tokens: int = 32, teacher_fmt="fp32") -> dict:
    """Side by side with the full-precision teacher on a golden set of prompts.

    The teacher generates greedily; the student (same weights, quantized cache)
    is scored on the teacher's tokens (teacher forcing): mean per-token KL
    divergence KL(teacher || student), top-1 agreement, and — from the student's
    own greedy generation — the first position where it departs from the teacher.
    """
    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    kls, agree, firsts = [], [], []
    dev = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        teacher = greedy_through_cache(model, ids, teacher_fmt, max_new_tokens)
        full = torch.cat([ids, teacher], dim=1).to(dev)
        lt = model(full, past_key_values=KVQuantCache(teacher_fmt), use_cache=True).logits[0, ids.shape[1] - 1 : -1]
        ls = model(full, past_key_values=KVQuantCache(fmt), use_cache=True).logits[0, ids.shape[1] - 1 : -1]
        pt, log_ps = torch.log_softmax(lt.float(), -1), torch.log_softmax(ls.float(), -1)
        kls.append((pt.exp() * (pt - log_ps)).sum(-1).mean().item())
        agree.append((lt.argmax(-1) == ls.argmax(-1)).float().mean().item())
        student = greedy_through_cache(model, ids, fmt, max_new_tokens)[0]
        diff = (student != teacher[0]).nonzero()
        firsts.append(int(diff[0]) if len(diff) else max_new_tokens)
    return {"kv_format": get_format(fmt).name, "kl": sum(kls) / len(kls), "top1_agreement": sum(agree) / len(agree),
            "first_divergence": firsts, "mean_first_divergence": sum(firsts) / len(firsts),
            "max_new_tokens": max_new_tokens}


# --------------------------------------------------------------------------- the shipped sweep

# The golden set of the teacher comparison in the shipped sweep (``scripts/sweep_evals.py``).
GOLDEN_PROMPTS = [
    "Return the number of items in a container.",
    "The socket module provides access to the BSD socket interface.",
    "Create a new dictionary with keys from iterable and values set to value.",
    "If the file cannot be opened, an OSError is raised.",
    "This module implements pseudo-random number generators for various distributions.",
    "A pass key is a number. The pass key is 48213. Remember it. The grass grows green.",
]

SWEEP_PATH = Path(__file__).resolve().parents[1] / "data" / "results" / "eval_sweep.json"


def load_sweep(path: str | Path | None = None) -> dict:
    """Chapter 4's full sweep (``scripts/sweep_evals.py``): per format, every rung of the eval ladder.

    Each format's ``passkey`` and ``chain2`` cells come back as :class:`EvalResult` objects.
    """
    path = Path(path) if path is not None else SWEEP_PATH
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; run scripts/sweep_evals.py to create it")
    doc = json.loads(path.read_text())
    if "formats" not in doc or not isinstance(doc["formats"], dict):
        raise ValueError(f"{path} is not an eval sweep (no 'formats' mapping)")
    for name, row in doc["formats"].items():
        row["passkey_result"] = EvalResult("passkey", doc.get("model", "?"), name, row["passkey"])
        row["chain_result"] = EvalResult("chain2", doc.get("model", "?"), name, row["chain2"])
    return doc


def ladder(sweep: dict, short: int = 512, long_min: int = 2048, reference: str = "fp32") -> list[dict]:
    """One row per format: what each rung of the eval ladder reports.

    ``ppl_increase`` is relative to ``reference``; ``needle_short`` is passkey exact match at
    ``short`` tokens; ``needle_long`` pools every length >= ``long_min``; ``chain`` pools the
    multi-hop cells; ``kl``, ``top1`` and ``first_divergence`` come from the teacher comparison.
    """
    fmts = sweep["formats"]
    if reference not in fmts:
        raise KeyError(f"reference format {reference!r} is not in the sweep ({sorted(fmts)})")
    base = fmts[reference]["perplexity"]
    rows = []
    for name, r in fmts.items():
        pk, ch = EvalResult("passkey", "", name, r["passkey"]), EvalResult("chain2", "", name, r["chain2"])
        try:
            short_acc, long_acc = pk.accuracy(short), pk.accuracy(min_length=long_min)
        except KeyError:
            raise KeyError(f"{name}: the sweep has no passkey cells at {short} or at >= {long_min} tokens") from None
        rows.append({
            "kv_format": name,
            "bits": r["bits_per_element"],
            "ppl_increase": r["perplexity"] / base - 1,
            "needle_short": short_acc,
            "needle_long": long_acc,
            "chain": ch.accuracy() if ch.rows else None,
            "kl": r["teacher"]["kl"],
            "top1": r["teacher"]["top1_agreement"],
            "first_divergence": r["teacher"]["mean_first_divergence"],
        })
    return rows


_LADDER_COLUMNS = {"bits": "{:.2f}", "ppl_increase": "{:+.1%}", "needle_short": "{:.0%}", "needle_long": "{:.0%}",
                   "chain": "{:.0%}", "kl": "{:.4f}", "top1": "{:.1%}", "first_divergence": "{:.1f}"}


def ladder_markdown(ladder_rows: list[dict]) -> str:
    """:func:`ladder` rows as a Markdown table (a dash where a rung was not measured)."""
    cols = list(_LADDER_COLUMNS)
    head = "| format | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    return head + "\n".join(
        f"| {r['kv_format']} | " + " | ".join("—" if r[c] is None else _LADDER_COLUMNS[c].format(r[c]) for c in cols)
        + " |" for r in ladder_rows)


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


def smoke_test_passes(ladder_rows: list[dict], *, ppl_tol: float = 0.05, short_min: float = 0.9,
                      long_drop: float = 0.2, reference: str = "fp32") -> list[str]:
    """Formats that pass the cheap rungs but fail the long one: the trap a short eval cannot see.

    A format qualifies when its perplexity is within ``ppl_tol`` (relative) of ``reference``, its
    short needle exact match is at least ``short_min``, and its long-context exact match is at
    least ``long_drop`` below the reference's.
    """
    for name, v in (("ppl_tol", ppl_tol), ("short_min", short_min), ("long_drop", long_drop)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    rows = {r["kv_format"]: r for r in ladder_rows}
    if reference not in rows:
        raise KeyError(f"reference format {reference!r} is not among the rows")
    ref = rows[reference]["needle_long"]
    return [n for n, r in rows.items() if r["ppl_increase"] <= ppl_tol and r["needle_short"] >= short_min
            and r["needle_long"] <= ref - long_drop]
