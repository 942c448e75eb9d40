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

import math
import random
import time

import torch
from tqdm.auto import tqdm

from . import tasks
from .cache import KVQuantCache
from .formats import KVFormat, get_format
from .metrics import first_divergence, logit_agreement
from .results import EvalResult
from .tasks import sweep_prompts

# --------------------------------------------------------------------------- helpers

PREFILL_MODES = ("full", "cached")
HAYSTACKS = ("filler", "prose")


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
def run_prompt(model, input_ids: torch.Tensor, cache, chunk: int | None = None, between=None) -> torch.Tensor:
    """Feed ``input_ids`` into ``cache``, ``chunk`` tokens per forward (all at once by default), as an engine's
    chunked prefill does; the logits of the last position. Chunks keep a 32k prompt's attention scores small.
    ``between``: called before every chunk but the first (a server checks there whether to stop)."""
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer or None, got {chunk!r}")
    n = input_ids.shape[1]
    step = chunk or n
    for s in range(0, n, step):
        if s and between is not None:
            between()
        logits = _last_logits(model, input_ids[:, s:s + step], cache)
    return logits


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, chunk: int | None = None, between=None):
    """Full-precision prefill: ``(DynamicCache, logits of the last position)``, shared by every format
    (``chunk`` and ``between`` as in :func:`run_prompt`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if hasattr(model.config, "num_hidden_layers") else DynamicCache()
    return cache, run_prompt(model, input_ids, cache, chunk, between)


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
    return answers(model, input_ids, [get_format(fmt)], n_new, prefill_mode)[get_format(fmt).name]


def answers(model, input_ids: torch.Tensor, fmts, n_new: int, prefill_mode: str = "full", targets=None,
            chunk: int | None = None) -> dict[str, torch.Tensor]:
    """Greedy answers ``{format name: [batch, n_new]}`` for every format from one prompt batch.

    ``"full"`` mode shares one full-precision prefill among all formats; ``"cached"`` prefills once per
    format, the prompt reading its own quantized cache (see :func:`greedy_through_cache`). ``targets``
    stops a format's decoding once every row has missed (:func:`decode`); ``chunk`` prefills in chunks
    (:func:`run_prompt`). A per-layer-type mix (``"int4_token@global"``) carries its layers in the format.
    """
    _check_mode(prefill_mode)
    fmts = _formats(fmts)
    out = {}
    if prefill_mode == "full":
        dyn, first = prefill(model, input_ids, chunk)
        for f in fmts:
            cache = KVQuantCache.from_prefill(f, dyn)
            out[f.name] = decode(model, cache, first, n_new, targets)
        return out
    config = model.config if hasattr(model.config, "num_hidden_layers") else None
    for f in fmts:
        cache = KVQuantCache(f, quantize_prefill=True, config=config)
        out[f.name] = decode(model, cache, run_prompt(model, input_ids, cache, chunk), n_new, targets)
    return out


def check_lengths(model, lengths) -> None:
    """Refuse context lengths past the model's positions (it would run, then answer nothing useful)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max(lengths) > limit:
        raise ValueError(f"lengths: {max(lengths)} tokens is past the model's {limit}-token window")


def _sweeps(task, make, model, tok, fmts, lengths, depths, trials, seed, batch_size, progress, prefill_mode,
            meta=None, chunk=None) -> dict[str, EvalResult]:
    _check_args(lengths, depths, trials)
    _check_mode(prefill_mode)
    check_lengths(model, lengths)
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
            batch = exs[i : i + batch_size]
            ids = torch.tensor([e.input_ids for e in batch])
            n_new = max(len(e.answer_ids) for e in batch)
            want = torch.tensor([e.answer_ids + [-2] * (n_new - len(e.answer_ids)) for e in batch])
            for name, gen in answers(model, ids, fmts, n_new, prefill_mode, want, chunk).items():
                correct[name] += sum(gen[j, : len(e.answer_ids)].tolist() == e.answer_ids for j, e in enumerate(batch))
        for name, r in res.items():
            r.rows.append({"length": n, "depth": float(d), "trials": trials, "correct": correct[name]})
    for r in res.values():
        r.meta["seconds"] = round(time.time() - t0, 1)
    return res


def passkey_sweeps(model, tok, fmts, lengths=(512, 1024, 2048), depths=(0.0, 0.5, 1.0), trials=5, seed=0,
                   batch_size=5, progress=True, prefill="full", haystack="filler", haystack_text: str | None = None,
                   chunk: int | None = None) -> dict[str, EvalResult]:
    """Needle-in-a-haystack exact match for several formats on the same prompts: ``{format: EvalResult}``.

    In ``prefill="full"`` mode one full-precision prefill per prompt batch serves every
    format (see :func:`greedy_through_cache`). ``haystack="prose"`` cuts the haystack from
    held-out text (:data:`kvlab.tasks.CORPUS_SOURCE`) instead of repeating filler sentences;
    ``haystack_text`` cuts it from your own text (say, logs of your traffic) instead.
    ``chunk`` prefills that many tokens per forward, as engines do, so 32k fits on a laptop.
    """
    _check_mode(prefill, haystack)
    make, haystack = _passkey_maker(tok, lengths, haystack, haystack_text)
    return _sweeps("passkey", make, model, tok, fmts, list(lengths), list(depths), trials, seed, batch_size,
                   progress, prefill, {"haystack": haystack}, chunk)


HAYSTACK_CHARS = 64  # characters of a haystack text read per token of the longest prompt


def _passkey_maker(tok, lengths, haystack: str, haystack_text: str | None):
    """The passkey prompts' maker for a haystack, and the haystack's name (``"text"`` for a user's own text)."""
    if haystack_text is not None:
        if not isinstance(haystack_text, str) or not haystack_text.strip():
            raise ValueError("haystack_text must be a non-empty string")
        haystack = "text"
        # only its start is read: HAYSTACK_CHARS characters a token of the longest prompt (a token is rarely more
        # than a dozen), so a large file costs no more than a small one
        haystack_text = haystack_text[:HAYSTACK_CHARS * max(lengths)]
    hay = tasks.prose_tokens(tok, haystack_text) if haystack in ("prose", "text") else None
    if hay is not None and len(hay) < max(lengths):
        raise ValueError(f"the haystack text (haystack_text, --haystack-file) has {len(hay)} tokens, fewer than the "
                         f"longest length {max(lengths)}")
    return (lambda t, n, d, r: tasks.passkey(t, n, d, r, haystack=hay)), haystack


def check_prompts(tok, task: str, lengths, depths, *, hops: int = 2, haystack: str = "filler",
                  haystack_text: str | None = None) -> None:
    """Build one prompt of each (length, depth) a sweep would run, with the tokenizer alone: a length too short
    for the task (or a haystack too short for a length) is refused before any model loads. ``task`` is
    ``"passkey"`` or ``"chain"``; the other arguments are the sweep's."""
    _check_args(lengths, depths, 1)
    if task == "passkey":
        _check_mode("full", haystack)
        make = _passkey_maker(tok, lengths, haystack, haystack_text)[0]
    elif task == "chain":
        make = lambda t, n, d, r: tasks.variable_chain(t, n, d, r, hops=hops)  # noqa: E731
    else:
        raise ValueError(f"task must be 'passkey' or 'chain', got {task!r}")
    for n in lengths:
        for d in depths:
            sweep_prompts(make, tok, n, d, 1)


def passkey_sweep(model, tok, fmt="bf16", lengths=(512, 1024, 2048), depths=(0.0, 0.5, 1.0), trials=5,
                  seed=0, batch_size=5, progress=True, prefill="full", haystack="filler",
                  haystack_text: str | None = None, chunk: int | None = None) -> EvalResult:
    """Needle-in-a-haystack exact match over lengths x depths for one format (see :func:`passkey_sweeps`)."""
    return next(iter(passkey_sweeps(model, tok, [fmt], lengths, depths, trials, seed, batch_size, progress,
                                    prefill, haystack, haystack_text, chunk).values()))


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
    nll, count = 0.0, 0
    for x in perplexity_windows(tok, text, window, max_windows):
        nll += window_nll(model, x, fmt)
        count += x.shape[1] - 1
    return math.exp(nll / count)


def perplexity_windows(tok, text: str | None = None, window: int = 512, max_windows: int = 16) -> list[torch.Tensor]:
    """The held-out windows perplexity reads: ``[1, tokens]`` each, ``window`` tokens of text after the
    tokenizer's own start tokens (Gemma's ``<bos>``: the model was trained with it; none for SmolLM2)."""
    from .tasks import bos

    return [torch.tensor([bos(tok) + w]) for w in tasks.heldout_windows(tok, text, window, max_windows)]


@torch.no_grad()
def window_nll(model, x: torch.Tensor, fmt) -> float:
    """Summed next-token negative log-likelihood (nats) of one window ``[1, tokens]``, every token
    attending over the quantized cache (``prefill="cached"``)."""
    config = model.config if hasattr(model.config, "num_hidden_layers") else None
    cache = KVQuantCache(fmt, quantize_prefill=True, config=config)
    x = x.to(_device(model))
    logits = model(x, past_key_values=cache, use_cache=True).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()


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
        for f in fmts:
            ls = model(forced, past_key_values=KVQuantCache.from_prefill(f, dyn), use_cache=True).logits[0]
            kl, top1 = logit_agreement(lt, ls)
            acc[f.name]["kl"].append(kl)
            acc[f.name]["agree"].append(top1)
            student = decode(model, KVQuantCache.from_prefill(f, dyn), first, max_new_tokens)[0]
            acc[f.name]["first"].append(first_divergence(student, teacher[0]))
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


