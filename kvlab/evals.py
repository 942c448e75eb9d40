"""The eval ladder, run through a kvlab cache: perplexity, needle, multi-hop, side by side with the teacher.

Every eval takes a model and tokenizer (SmolLM2-135M-Instruct by default, via
:func:`kvlab.models.load_model`) and one or more KV formats. By default a prompt
batch is prefilled once in full precision and each format's
:class:`kvlab.cache.KVQuantCache` is filled from it, as a serving engine stores a
fresh prompt; every generated token then reads the quantized cache
(``prefill="cached"`` quantizes the prompt's own attention too).

* :func:`passkey_sweeps` / :func:`passkey_sweep` — needle in a haystack (filler or
  prose) over context length x depth, many formats on the same prompts;
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
from .paths import RESULTS_DIR


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

PREFILL_MODES = ("full", "cached")
HAYSTACKS = ("filler", "prose")


def wilson(correct: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion (95% by default): ``(low, high)``."""
    if not isinstance(trials, int) or trials < 1 or not 0 <= correct <= trials:
        raise ValueError(f"need 0 <= correct <= trials and trials >= 1, got {correct}/{trials}")
    p, n = correct / trials, trials
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if correct == 0 else max(0.0, mid - half)  # exact at the ends (no 1e-17 rounding residue)
    hi = 1.0 if correct == trials else min(1.0, mid + half)
    return lo, hi


def _check_args(lengths, depths, trials):
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths!r}")
    if not depths or any(not isinstance(d, int | float) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be numbers in [0, 1], got {depths!r}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")


def _check_mode(prefill, haystack="filler"):
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or model.config.model_type


def _device(model):
    return next(model.parameters()).device


def _formats(fmts) -> list[KVFormat]:
    """One format or a list of them, looked up."""
    fmts = [get_format(f) for f in ([fmts] if isinstance(fmts, str | KVFormat) else fmts)]
    if not fmts:
        raise ValueError("give at least one KV format")
    return fmts


def _last_logits(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt into ``cache``; logits of its last position only (not a [batch, tokens, vocab] tensor)."""
    ids = input_ids.to(_device(model))
    try:
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    except TypeError:  # a model without logits_to_keep
        out = model(ids, past_key_values=cache, use_cache=True)
    return out.logits[:, -1]


@torch.no_grad()
def run_prompt(model, input_ids: torch.Tensor, cache, chunk: int | None = None) -> torch.Tensor:
    """Feed ``input_ids`` into ``cache``, ``chunk`` tokens per forward (all at once by default), as an engine's
    chunked prefill does; the logits of the last position. Chunks keep a 32k prompt's attention scores small."""
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer or None, got {chunk!r}")
    n = input_ids.shape[1]
    step = chunk or n
    for s in range(0, n, step):
        logits = _last_logits(model, input_ids[:, s:s + step], cache)
    return logits


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, chunk: int | None = None):
    """Full-precision prefill: ``(DynamicCache, logits of the last position)``, shared by every format."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if hasattr(model.config, "num_hidden_layers") else DynamicCache()
    return cache, run_prompt(model, input_ids, cache, chunk)


@torch.no_grad()
def decode(model, cache, first_logits: torch.Tensor, n_new: int, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy decoding of ``n_new`` tokens from ``cache``, the first picked from ``first_logits``.

    With ``targets`` (``[batch, n_new]``), stops early once every row has left its
    target (exact match is already lost), padding the rest with -1.
    """
    nxt = first_logits.argmax(-1, keepdim=True)
    new = [nxt]
    for i in range(n_new - 1):
        if targets is not None and not (torch.cat(new, 1) == targets[:, : i + 1].to(nxt.device)).all(1).any():
            new += [torch.full_like(nxt, -1)] * (n_new - 1 - i)
            break
        out = model(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(nxt)
    return torch.cat(new, dim=1).cpu()


@torch.no_grad()
def greedy_through_cache(model, input_ids: torch.Tensor, fmt: str | KVFormat, n_new: int,
                         prefill_mode: str = "full") -> torch.Tensor:
    """Prefill ``input_ids`` ``[batch, tokens]`` and decode ``n_new`` tokens greedily from a kvlab cache.

    ``prefill_mode="full"`` (what ``transformers``' ``QuantizedCache`` does with a fresh
    prompt): the prompt attends over full-precision K and V and only the stored copy is
    quantized; every generated token reads the quantized cache.
    ``"cached"``: the prompt's own attention already reads the quantized cache, as in vLLM's
    V1 attention backends and llama.cpp, which write K and V to the cache first and attend
    over it (``vllm/v1/attention/backends/flash_attn.py``; ``build_attn`` in llama.cpp's
    ``src/llama-graph.cpp``).
    """
    _check_mode(prefill_mode)
    return _generate(model, input_ids, [get_format(fmt)], n_new, prefill_mode)[get_format(fmt).name]


def _generate(model, input_ids, fmts, n_new, prefill_mode, targets=None) -> dict[str, torch.Tensor]:
    """Greedy answers for every format from one prompt batch (one shared prefill in ``"full"`` mode)."""
    out = {}
    if prefill_mode == "full":
        dyn, first = prefill(model, input_ids)
        for f in fmts:
            out[f.name] = decode(model, KVQuantCache.from_prefill(f, dyn), first, n_new, targets)
        return out
    for f in fmts:
        cache = KVQuantCache(f, quantize_prefill=True)
        out[f.name] = decode(model, cache, _last_logits(model, input_ids, cache), n_new, targets)
    return out


def sweep_prompts(make, tok, length: int, depth: float, trials: int, seed: int = 0) -> list:
    """The ``trials`` prompts a sweep uses at one (length, depth): every format, and every engine compared
    with kvlab (``scripts/compare_engines.py``), sees exactly these. ``make`` is e.g. :func:`kvlab.tasks.passkey`."""
    rng = random.Random(f"{seed}-{length}-{float(depth)}")  # 0 and 0.0 give the same prompts
    return [make(tok, length, depth, rng) for _ in range(trials)]


def _sweeps(task, make, model, tok, fmts, lengths, depths, trials, seed, batch_size, progress, prefill_mode,
            meta=None) -> dict[str, EvalResult]:
    _check_args(lengths, depths, trials)
    _check_mode(prefill_mode)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    fmts = _formats(fmts)
    info = {"trials": trials, "seed": seed, "prefill": prefill_mode} | (meta or {})
    res = {f.name: EvalResult(task, _model_name(model), f.name, meta=dict(info)) for f in fmts}
    t0 = time.time()
    cells = [(n, d) for n in lengths for d in depths]
    for n, d in tqdm(cells, desc=f"{task} x {len(fmts)} formats", disable=not progress, leave=False):
        exs = sweep_prompts(make, tok, n, d, trials, seed)
        correct = dict.fromkeys(res, 0)
        for i in range(0, trials, batch_size):
            chunk = exs[i : i + batch_size]
            ids = torch.tensor([e.input_ids for e in chunk])
            n_new = max(len(e.answer_ids) for e in chunk)
            want = torch.tensor([e.answer_ids + [-2] * (n_new - len(e.answer_ids)) for e in chunk])
            for name, gen in _generate(model, ids, fmts, n_new, prefill_mode, want).items():
                correct[name] += sum(gen[j, : len(e.answer_ids)].tolist() == e.answer_ids for j, e in enumerate(chunk))
        for name, r in res.items():
            r.rows.append({"length": n, "depth": float(d), "trials": trials, "correct": correct[name]})
    for r in res.values():
        r.meta["seconds"] = round(time.time() - t0, 1)
    return res


def passkey_sweeps(model, tok, fmts, lengths=(512, 1024, 2048), depths=(0.0, 0.5, 1.0), trials=5, seed=0,
                   batch_size=5, progress=True, prefill="full", haystack="filler") -> dict[str, EvalResult]:
    """Needle-in-a-haystack exact match for several formats on the same prompts: ``{format: EvalResult}``.

    In ``prefill="full"`` mode one full-precision prefill per prompt batch serves every
    format (see :func:`greedy_through_cache`). ``haystack="prose"`` cuts the haystack from
    held-out text instead of repeating filler sentences.
    """
    _check_mode(prefill, haystack)
    hay = tasks.prose_tokens(tok) if haystack == "prose" else None
    return _sweeps("passkey", lambda t, n, d, r: tasks.passkey(t, n, d, r, haystack=hay), model, tok, fmts,
                   list(lengths), list(depths), trials, seed, batch_size, progress, prefill, {"haystack": haystack})


def passkey_sweep(model, tok, fmt="bf16", lengths=(512, 1024, 2048), depths=(0.0, 0.5, 1.0), trials=5,
                  seed=0, batch_size=5, progress=True, prefill="full", haystack="filler") -> EvalResult:
    """Needle-in-a-haystack exact match over lengths x depths for one format (see :func:`passkey_sweeps`)."""
    return next(iter(passkey_sweeps(model, tok, [fmt], lengths, depths, trials, seed, batch_size, progress,
                                    prefill, haystack).values()))


def chain_sweeps(model, tok, fmts, lengths=(512, 1024, 2048), depths=(1.0,), hops=2, trials=5, seed=0,
                 batch_size=5, progress=True, prefill="full") -> dict[str, EvalResult]:
    """Multi-hop variable tracking for several formats; ``depths`` here is how far into the context the links spread."""
    if any(not isinstance(d, int | float) or d <= 0 for d in depths):
        raise ValueError(f"chain depths are spreads and must be > 0, got {depths!r}")
    return _sweeps(f"chain{hops}", lambda t, n, d, r: tasks.variable_chain(t, n, d, r, hops=hops), model, tok,
                   fmts, list(lengths), list(depths), trials, seed, batch_size, progress, prefill, {"hops": hops})


def chain_sweep(model, tok, fmt="bf16", lengths=(512, 1024, 2048), depths=(1.0,), hops=2, trials=5,
                seed=0, batch_size=5, progress=True, prefill="full") -> EvalResult:
    """Multi-hop variable tracking for one format (see :func:`chain_sweeps`)."""
    return next(iter(chain_sweeps(model, tok, [fmt], lengths, depths, hops, trials, seed, batch_size, progress,
                                  prefill).values()))


@torch.no_grad()
def perplexity(model, tok, fmt="bf16", text: str | None = None, window: int = 512, max_windows: int = 16) -> float:
    """Held-out perplexity with every token's attention reading the quantized cache.

    Each window runs in ``prefill="cached"`` mode: every token attends over the
    dequantized cache, its own K and V included, as if the window had been decoded
    one token at a time (teacher forcing). That equivalence is exact for formats
    without a residual window; with one, the *window's* last ``residual`` tokens stay
    in full precision for every query (not each query's own last tokens), so the
    rung under-credits residual windows. A full-precision prefill would leave
    perplexity untouched by the format, which is why this rung cannot use it.
    """
    if text is None:
        import gzip

        from .models import DATA_DIR

        text = gzip.open(DATA_DIR / "corpus" / "heldout.txt.gz", "rt").read()
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < window + 1:
        raise ValueError(f"text has {len(ids)} tokens, fewer than window + 1 = {window + 1}")
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    for s in range(0, len(ids) - window, window)[:max_windows]:
        x = torch.tensor([ids[s : s + window]], device=dev)
        logits = model(x, past_key_values=KVQuantCache(fmt, quantize_prefill=True), use_cache=True).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)


@torch.no_grad()
def teacher_comparisons(model, tok, fmts, prompts: list, max_new_tokens: int = 32, teacher_fmt="fp32",
                        progress: bool = False) -> dict[str, dict]:
    """Side by side with the full-precision teacher on a golden set, for several formats at once.

    Each prompt (a string or a list of token ids) is prefilled once in full
    precision, as ``transformers``' ``QuantizedCache`` does. The teacher (``teacher_fmt`` cache) generates
    greedily; each student (same weights, same prefill, cache in its format) is
    scored on the teacher's tokens (teacher forcing): mean per-token KL divergence
    KL(teacher || student), top-1 agreement, and — from the student's own greedy
    generation — the first position where it departs from the teacher. The first
    generated token comes from the shared prefill, so it always agrees; KL and top-1
    average over the tokens that read the cache.
    """
    if not prompts or not isinstance(prompts, list | tuple):
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an integer >= 2, got {max_new_tokens!r}")
    fmts, teacher_fmt = _formats(fmts), get_format(teacher_fmt)
    acc = {f.name: {"kl": [], "agree": [], "first": []} for f in fmts}
    dev, lens = _device(model), []
    for p in tqdm(prompts, desc="teacher", disable=not progress, leave=False):
        ids = torch.tensor([tok.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)])
        lens.append(ids.shape[1])
        dyn, first = prefill(model, ids)
        teacher = decode(model, KVQuantCache.from_prefill(teacher_fmt, dyn), first, max_new_tokens)
        forced = teacher[:, :-1].to(dev)  # the student reads these back through its cache
        lt = model(forced, past_key_values=KVQuantCache.from_prefill(teacher_fmt, dyn), use_cache=True).logits[0]
        pt = torch.log_softmax(lt.float(), -1)
        for f in fmts:
            ls = model(forced, past_key_values=KVQuantCache.from_prefill(f, dyn), use_cache=True).logits[0]
            log_ps = torch.log_softmax(ls.float(), -1)
            acc[f.name]["kl"].append((pt.exp() * (pt - log_ps)).sum(-1).clamp_min(0).mean().item())
            acc[f.name]["agree"].append((lt.argmax(-1) == ls.argmax(-1)).float().mean().item())
            student = decode(model, KVQuantCache.from_prefill(f, dyn), first, max_new_tokens)[0]
            diff = (student != teacher[0]).nonzero()
            acc[f.name]["first"].append(int(diff[0]) if len(diff) else max_new_tokens)
    mean = lambda xs: sum(xs) / len(xs)
    return {name: {"kv_format": name, "kl": mean(a["kl"]), "top1_agreement": mean(a["agree"]),
                   "first_divergence": a["first"], "mean_first_divergence": mean(a["first"]),
                   "max_new_tokens": max_new_tokens, "prompt_tokens": lens}
            for name, a in acc.items()}


def teacher_comparison(model, tok, fmt, prompts: list, max_new_tokens: int = 32, teacher_fmt="fp32") -> dict:
    """:func:`teacher_comparisons` for one format."""
    return teacher_comparisons(model, tok, [fmt], prompts, max_new_tokens, teacher_fmt)[get_format(fmt).name]


def golden_prompts(tok, n: int = 3, length: int = 1024, seed: int = 0) -> list[list[int]]:
    """A golden set as long as the contexts under test: ``n`` slices of held-out prose, ``length`` tokens each.

    Short golden prompts fit inside a residual window and cannot see the quantized cache at all.
    """
    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 2:
        raise ValueError(f"n and length must be positive integers, got n={n!r}, length={length!r}")
    hay = tasks.prose_tokens(tok)
    if len(hay) < length:
        raise ValueError(f"the held-out text has {len(hay)} tokens, fewer than length={length}")
    rng = random.Random(seed)
    return [hay[s : s + length] for s in (rng.randrange(0, len(hay) - length + 1) for _ in range(n))]


# --------------------------------------------------------------------------- the shipped sweep

SWEEP_PATH = RESULTS_DIR / "eval_sweep.json"


def load_sweep(path: str | Path | None = None) -> dict:
    """Chapter 4's full sweep (``scripts/sweep_evals.py``): per format, every rung of the eval ladder.

    Each format's passkey cells come back as :class:`EvalResult` objects too:
    ``passkey_result`` (filler haystack) and ``prose_result`` (held-out prose).
    """
    path = Path(path) if path is not None else SWEEP_PATH
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; run scripts/sweep_evals.py to create it")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON eval sweep: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("formats"), dict):
        raise ValueError(f"{path} is not an eval sweep (no 'formats' mapping)")
    model = doc.get("model", "?")
    for name, row in doc["formats"].items():
        row["passkey_result"] = EvalResult("passkey", model, name, row.get("passkey", []))
        row["prose_result"] = EvalResult("passkey", model, name, row.get("passkey_prose", []))
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
        })
    return rows


_LADDER_COLUMNS = {"bits": "{:.2f}", "ppl_increase": "{:+.1%}", "needle_short": "{:.0%}", "needle_long": "{:.0%}",
                   "prose_long": "{:.0%}", "chain": "{:.0%}", "kl": "{:.4f}", "top1": "{:.1%}",
                   "first_divergence": "{:.1f}"}


def ladder_markdown(ladder_rows: list[dict]) -> str:
    """:func:`ladder` rows as a Markdown table (a dash where a rung was not measured)."""
    cols = [c for c in _LADDER_COLUMNS if any(r.get(c) is not None for r in ladder_rows)]

    def cell(r, c):
        if r.get(c) is None:
            return "—"
        text = _LADDER_COLUMNS[c].format(r[c])
        if f"{c}_lo" in r:  # a 95% interval beside the rate
            text += f" ({r[c + '_lo']:.0%}–{r[c + '_hi']:.0%})"
        return text

    head = "| format | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
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


def trapped_formats(ladder_rows: list[dict], *, ppl_tol: float = 0.05, short_min: float = 0.9,
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
