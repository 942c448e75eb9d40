"""Side by side with the real engines kvlab's presets mirror.

``transformers``' ``QuantizedCache`` with the quanto backend (``optimum-quanto``) is the engine behind
the ``hf-int4`` preset. :func:`quanto_side_by_side` runs the real thing and kvlab's emulation on the
same model and the same passkey prompts, from one shared full-precision prefill (both engines attend
over full-precision K and V during the prompt and quantize what they store), and reports: how often
greedy decoding gives identical tokens, the KL divergence between their next-token distributions
(both teacher-forced on the engine's tokens), and passkey exact match for each.

Where the two differ by design (read from ``transformers.cache_utils.QuantizedLayer``):

* **Which tokens stay in full precision.** ``QuantizedCache`` quantizes the whole prompt at prefill and
  keeps only tokens generated since its last flush in full precision; once that residual reaches
  ``residual_length`` (128) it dequantizes everything, appends the residual and re-quantizes it all.
  kvlab keeps the most recent 128 tokens in full precision at all times (KIVI's streaming residual), so
  the end of the prompt — the passkey question — is read in full precision by kvlab and in INT4 by
  ``QuantizedCache``.
* **Rounding.** Both are asymmetric with groups of 64 channels (``axis=0`` in quanto's terms), but quanto
  stores its scale and shift in its own dtypes and rounds with its own kernels, so codes can differ by
  one level where a value falls on a rounding boundary.
* **Re-quantization.** ``QuantizedCache`` re-quantizes already-quantized tokens at every flush; with
  min/max groups that is close to idempotent, but not bit-exact.

The same ``QuantizedCache`` with ``backend="hqq"`` (the ``hqq`` package) is compared with the same
presets, and differs more by design: HQQ's ``axis=0`` (``QuantizedCache``'s default) reshapes the whole
K or V tensor to ``[group_size, -1]`` and takes min/max down each column, so each group of 64 is one
*channel* across 64 tokens spaced evenly through every head and position (a per-channel scheme, like
KIVI's keys, but over strided tokens), and HQQ then refines each zero point with its half-quadratic
solver instead of keeping the plain minimum. kvlab has no preset that groups this way; the rows show
how far a per-token emulation is from it.
"""

from __future__ import annotations

import random

import torch

from . import tasks
from .cache import KVQuantCache
from .evals import decode, prefill
from .formats import LLAMA_CACHE_TYPES, get_format
from .metrics import first_divergence, logit_agreement

# kvlab's emulation of QuantizedCache(backend="quanto", nbits=n): asymmetric, 64-channel groups, residual 128.
QUANTO_FORMATS = {
    4: get_format("hf-int4"),
    2: get_format("hf-int2"),
}


BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


def quanto_cache(model, nbits: int = 4, backend: str = "quanto"):
    """The real ``transformers.QuantizedCache`` with the quanto (``optimum-quanto``) or HQQ (``hqq``) backend."""
    import importlib

    from transformers import QuantizedCache

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if nbits not in QUANTO_FORMATS:
        raise ValueError(f"nbits must be one of {sorted(QUANTO_FORMATS)} (quanto's KV cache types), got {nbits!r}")
    module, package = BACKENDS[backend]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ImportError(f"the {backend} backend needs {package}: pip install {package}") from None
    return QuantizedCache(backend=backend, config=model.config, nbits=nbits)


def engine_row_name(backend: str, nbits: int) -> str:
    """The key of one engine's rows: ``hf-int4`` for quanto (the preset it defines), ``hqq-int4`` for HQQ."""
    return QUANTO_FORMATS[nbits].name if backend == "quanto" else f"{backend}-int{nbits}"


def _from_prefill(cache, dyn):
    for i, layer in enumerate(dyn.layers):  # a QuantizedCache quantizes what its first update stores
        cache.update(layer.keys, layer.values, i)
    return cache


@torch.no_grad()
def quanto_side_by_side(model, tok, *, nbits=(4, 2), lengths=(512, 1024), trials: int = 3, depth: float = 0.5,
                        new_tokens: int = 8, seed: int = 0, progress: bool = False, backend: str = "quanto") -> dict:
    """The real ``QuantizedCache`` (``backend`` quanto or hqq) vs kvlab's matching preset, prompt by prompt.

    (See the module docstring for where they differ by design.) Returns ``{"hf-int4": {...},
    "hf-int2": {...}}`` (``"hqq-int4"``, ... for HQQ) with, per format: ``kvlab_format`` (the preset
    it is compared with), ``identical`` (prompts whose
    ``new_tokens`` greedy tokens are the same), ``first_divergence`` per prompt, ``kl`` (mean per-token
    KL(engine || kvlab), teacher-forced on the engine's tokens), ``top1_agreement``, and passkey exact
    match by length for each (``engine`` and ``kvlab``: ``{length: [correct, trials]}``).
    """
    from tqdm.auto import tqdm

    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    if not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2, got {new_tokens!r}")
    if not lengths or any(not isinstance(n, int) or n < 64 for n in lengths):
        raise ValueError(f"lengths must be integers >= 64, got {lengths!r}")
    nbits = list(nbits)
    for n in nbits:
        quanto_cache(model, n, backend)  # checks nbits and the backend before any work
    out = {engine_row_name(backend, n): {"nbits": n, "kvlab_format": QUANTO_FORMATS[n].name, "identical": 0,
                                         "prompts": 0, "first_divergence": [], "kl": [], "top1_agreement": [],
                                         "engine": {}, "kvlab": {}} for n in nbits}
    rng = random.Random(seed)
    dev = next(model.parameters()).device
    cells = [(n, t) for n in lengths for t in range(trials)]
    for length, _ in tqdm(cells, desc="quanto vs kvlab", disable=not progress, leave=False):
        ex = tasks.passkey(tok, length, depth, rng)
        ids = torch.tensor([ex.input_ids], device=dev)
        steps = max(new_tokens, len(ex.answer_ids))
        dyn, first = prefill(model, ids)
        answer = torch.tensor(ex.answer_ids)
        for n in nbits:
            fmt, row = QUANTO_FORMATS[n], out[engine_row_name(backend, n)]
            eng = decode(model, _from_prefill(quanto_cache(model, n, backend), dyn), first, steps)[0]
            ours = decode(model, KVQuantCache.from_prefill(fmt, dyn), first, steps)[0]
            first_diff = first_divergence(eng, ours)
            row["first_divergence"].append(first_diff)
            row["identical"] += int(first_diff == steps)
            row["prompts"] += 1
            forced = eng[None, :-1].to(dev)
            le = model(forced, past_key_values=_from_prefill(quanto_cache(model, n, backend), dyn)).logits[0].float()
            lo = model(forced, past_key_values=KVQuantCache.from_prefill(fmt, dyn)).logits[0].float()
            kl, top1 = logit_agreement(le, lo)
            row["kl"].append(kl)
            row["top1_agreement"].append(top1)
            for side, toks in (("engine", eng), ("kvlab", ours)):
                c = row[side].setdefault(length, [0, 0])
                c[0] += int(torch.equal(toks[: len(answer)], answer))
                c[1] += 1
    for row in out.values():
        row["mean_kl"] = sum(row["kl"]) / len(row["kl"])
        row["mean_top1_agreement"] = sum(row["top1_agreement"]) / len(row["top1_agreement"])
    return out


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_passkey(gguf, tok, *, cache_types=LLAMA_CACHE_TYPES, lengths=(512, 2048), depths=(0.0, 0.5, 1.0),
                     trials: int = 5, seed: int = 0, threads: int | None = None, progress: bool = False,
                     done: dict | None = None, on_row=None, swa_full: bool | None = None) -> dict:
    """Passkey exact match with llama.cpp (``llama-cpp-python``) running the GGUF file itself.

    The prompts are the ones chapter 4's sweep used (:func:`kvlab.tasks.sweep_prompts`), fed as token
    ids (the GGUF carries the same tokenizer). K and V are both stored as each of ``cache_types``, with
    flash attention on (llama.cpp needs it for a quantized V). Returns ``{cache type: {"rows": [{length,
    depth, trials, correct, outcomes}], "seconds": s}}``; ``outcomes`` holds each prompt's exact match in
    the order :func:`~kvlab.tasks.sweep_prompts` made them, so the answers can be paired with kvlab's on the
    same prompts (:func:`kvlab.results.llamacpp_paired`).

    ``done`` is an earlier return value (same seed, depths and trials): its rows are kept and their cells not
    run again, so a long run resumes; a cell cut off part way is kept as ``"partial"`` (its outcomes so far) and
    resumes at its next prompt. ``on_row(result)`` is called with the whole result so far after every prompt (a
    script writes it to disk there: a q4_0 prompt at 32k, from the 8k runs, would take 20 minutes or more on 2 cores, and an
    interruption loses at most one).

    ``swa_full=False`` gives sliding-window layers (Gemma 3) a cache of their window only, as llama.cpp's own
    tools do by default; llama-cpp-python's default (``None``: the library's, a full-size cache) makes those layers
    attend over the whole cache under a mask, which costs quadratic time at 32k tokens on a CPU. With the window
    cache each prompt is prefilled from its first token (llama-cpp-python would otherwise reuse the previous
    prompt's shared prefix, whose early tokens that cache no longer holds, and answer wrongly); each new row
    records the setting.

    What cannot agree bit for bit with kvlab's emulation: llama.cpp runs the file's own Q4_1 weights
    (kvlab dequantizes them to float32 once), and its CPU dot products quantize activations too. Compare
    the patterns (which formats hold up, where they fall), not single prompts.
    """
    import os
    import time

    from tqdm.auto import tqdm

    from .tasks import sweep_prompts

    try:
        import llama_cpp
    except ImportError:
        raise ImportError("llama.cpp comparisons need llama-cpp-python: `make peers` builds it") from None
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    bad = [t for t in cache_types if t not in types]
    if bad:
        raise ValueError(f"cache types must be among {list(types)}, got {bad}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    if len(set(cache_types)) < len(cache_types):
        raise ValueError(f"cache_types lists a type twice: {list(cache_types)}")
    lengths, depths = list(lengths), list(depths)
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths) \
            or len(set(lengths)) < len(lengths):
        raise ValueError(f"lengths must be distinct positive token counts, got {lengths}")
    if not depths or any(not isinstance(d, int | float) or isinstance(d, bool) or not 0 <= d <= 1 for d in depths) \
            or len({float(d) for d in depths}) < len(depths):
        raise ValueError(f"depths must be distinct numbers from 0 to 1, got {depths}")
    from .results import llamacpp_cells_problem, llamacpp_unresumed

    if done is None:
        done = {}
    if not isinstance(done, dict):
        raise ValueError("done must be an earlier result: {cache type: {'rows': [...], 'seconds': s}}")
    if why := llamacpp_cells_problem(done):
        raise ValueError(f"done is not an earlier result of this function: {why}")
    if why := llamacpp_unresumed(done, tuple(cache_types), lengths, depths, trials, swa_full):
        raise ValueError(f"done holds {why} that this call would not resume: run with its length, depth, trials "
                         "and sliding-window setting")
    out = {ct: {"rows": list(v["rows"]), "seconds": float(v.get("seconds", 0.0)),
                **({"partial": v["partial"]} if v.get("partial") else {})} for ct, v in done.items()}
    for ct in cache_types:
        have = {(r["length"], float(r["depth"])) for r in out.get(ct, {}).get("rows", []) if r["trials"] == trials}
        cells = [(n, float(d)) for n in lengths for d in depths if (n, float(d)) not in have]
        if not cells:
            continue
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(n for n, _ in cells) + 64, n_batch=512,
                              type_k=types[ct], type_v=types[ct], flash_attn=True, n_threads=threads or os.cpu_count(),
                              logits_all=False, verbose=False, seed=seed,
                              **({} if swa_full is None else {"swa_full": swa_full}))
        res = out.setdefault(ct, {"rows": [], "seconds": 0.0})
        res["rows"] = [r for r in res["rows"] if r["trials"] == trials]  # rows of another trial count: run again
        swa = {} if swa_full is None else {"swa_full": swa_full}
        for n, d in tqdm(cells, desc=f"llama.cpp {ct}", disable=not progress, leave=False):
            part = res.get("partial") or {}
            same = (part.get("length"), float(part.get("depth", -1)), part.get("trials")) == (n, d, trials) \
                and part.get("swa_full") == swa.get("swa_full") and len(part.get("outcomes", [])) < trials
            outcomes = [bool(x) for x in part["outcomes"]] if same else []  # a cell cut off part way resumes
            for ex in sweep_prompts(tasks.passkey, tok, n, d, trials, seed)[len(outcomes):]:
                t0 = time.time()
                got = []
                if swa_full is False:  # a window-sized cache cannot serve the next prompt's shared prefix: no reuse
                    llm.reset()
                for t in llm.generate(ex.input_ids, top_k=1, temp=0.0, reset=True):
                    got.append(t)
                    if len(got) == len(ex.answer_ids):
                        break
                outcomes.append(got == ex.answer_ids)
                res["seconds"] = round(res["seconds"] + time.time() - t0, 1)
                if len(outcomes) < trials:
                    res["partial"] = {"length": n, "depth": d, "trials": trials, "outcomes": list(outcomes), **swa}
                else:
                    res.pop("partial", None)
                    res["rows"].append({"length": n, "depth": d, "trials": trials, "correct": sum(outcomes),
                                        "outcomes": outcomes, **swa})
                    res["rows"].sort(key=lambda r: (r["length"], r["depth"]))
                if on_row is not None:
                    on_row(out)
        del llm
    return out


