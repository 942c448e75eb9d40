"""Synthetic serving workloads with shared prefixes, for :func:`kvlab.simulator.simulate`.

Each generator returns :class:`~kvlab.simulator.Request` objects whose prompts share
prefixes the way one kind of traffic does: one long system prompt, multi-turn chats
that resend their history, RAG prompts built from a Zipf-popular document set, and
few-shot templates. Arrivals are Poisson at ``rate`` requests per second; ``seed`` fixes
everything.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from .simulator import Request, request_from_tokens


def _zipf(rng: random.Random, n: int, s: float) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


def shared_system_prompt(n=200, system_len=2000, user_len=(50, 400), output_len=200, rate=5.0,
                         block_size=16, seed=0) -> list[Request]:
    """Every request starts with the same long system prompt."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    reqs, t = [], 0.0
    for k in range(n):
        t += rng.expovariate(rate)
        reqs.append(request_from_tokens(t, system + _tokens(rng, rng.randint(*user_len)),
                                        _tokens(rng, output_len), block_size, k))
    return reqs


def multi_turn_chat(conversations=40, turns=5, first_len=(200, 800), user_len=(30, 200), output_len=(100, 300),
                    think_time=20.0, rate=1.0, block_size=16, seed=0) -> list[Request]:
    """Each turn's prompt is the whole conversation so far plus a new user message."""
    rng = random.Random(seed)
    reqs, k = [], 0
    for c in range(conversations):
        t = rng.expovariate(rate) + c / rate
        history = _tokens(rng, rng.randint(*first_len))
        for _ in range(turns):
            out = _tokens(rng, rng.randint(*output_len))
            reqs.append(request_from_tokens(t, list(history), out, block_size, k))
            k += 1
            history = history + out + _tokens(rng, rng.randint(*user_len))
            t += think_time * rng.uniform(0.5, 1.5)
    return sorted(reqs, key=lambda r: r.arrival)


def rag(n=300, docs=200, doc_len=1000, per_request=3, zipf_s=1.1, system_len=300, question_len=(20, 80),
        output_len=150, rate=5.0, block_size=16, seed=0) -> list[Request]:
    """A system prompt, then retrieved documents (Zipf popularity, most popular first), then a question."""
    rng = random.Random(seed)
    system, pool = _tokens(rng, system_len), [_tokens(rng, doc_len) for _ in range(docs)]
    reqs, t = [], 0.0
    for k in range(n):
        t += rng.expovariate(rate)
        picked = sorted({_zipf(rng, docs, zipf_s) for _ in range(per_request)})
        prompt = system + [tok for d in picked for tok in pool[d]] + _tokens(rng, rng.randint(*question_len))
        reqs.append(request_from_tokens(t, prompt, _tokens(rng, output_len), block_size, k))
    return reqs


def few_shot(n=300, templates=5, template_len=1500, query_len=(20, 100), output_len=50, rate=10.0,
             block_size=16, seed=0) -> list[Request]:
    """A handful of few-shot templates, each reused by many queries."""
    rng = random.Random(seed)
    tmpl = [_tokens(rng, template_len) for _ in range(templates)]
    reqs, t = [], 0.0
    for k in range(n):
        t += rng.expovariate(rate)
        prompt = tmpl[rng.randrange(templates)] + _tokens(rng, rng.randint(*query_len))
        reqs.append(request_from_tokens(t, prompt, _tokens(rng, output_len), block_size, k))
    return reqs


WORKLOADS = {"system-prompt": shared_system_prompt, "chat": multi_turn_chat, "rag": rag, "few-shot": few_shot}


def without_sharing(requests: list[Request]) -> list[Request]:
    """The same requests (arrivals, lengths) with every block hash made unique: no prefix is ever reused.

    Replaying both separates what a smaller KV format buys through concurrency alone (more
    sequences fit at once) from what it buys through prefix hits (more popular blocks stay cached).
    """
    fresh = itertools.count(2**64)  # above every 64-bit hash and trace id: never equal to a real block
    return [dataclasses.replace(
        r, prompt_hashes=[next(fresh) for _ in r.prompt_hashes],
        output_hashes=None if r.output_hashes is None else [next(fresh) for _ in r.output_hashes])
        for r in requests]


def cost_split(requests: list[Request], model, gpu, formats, *, reference: str = "bf16", gpu_hour_usd: float | None = None,
               **kw) -> list[dict]:
    """What each format saves against ``reference``, with the trace's prefix sharing and without it.

    Without sharing the saving is what the smaller cache does by itself (more sequences per decode
    step, fewer cache bytes read per sequence); the difference between the two savings, each a
    fraction of its own reference cost, is what the extra prefix hits add. Rows: ``kv_format``, ``usd_shared``,
    ``usd_unshared`` ($ per million output tokens), ``saving_shared``, ``saving_unshared``
    (fractions of the reference's cost), ``hit_rate`` and ``peak_concurrency`` with sharing,
    and ``peak_concurrency_unshared``.
    """
    from .simulator import cost_table

    formats = list(formats)
    if reference not in formats:
        formats = [reference, *formats]
    both = {name: {r["kv_format"]: r for r in cost_table(rs, model, gpu, formats, gpu_hour_usd=gpu_hour_usd, **kw)}
            for name, rs in (("shared", requests), ("unshared", without_sharing(requests)))}
    ref = {name: rows[reference]["usd_per_m_tokens"] for name, rows in both.items()}
    return [{"kv_format": f, "usd_shared": both["shared"][f]["usd_per_m_tokens"],
             "usd_unshared": both["unshared"][f]["usd_per_m_tokens"],
             "saving_shared": 1 - both["shared"][f]["usd_per_m_tokens"] / ref["shared"],
             "saving_unshared": 1 - both["unshared"][f]["usd_per_m_tokens"] / ref["unshared"],
             "hit_rate": both["shared"][f]["hit_rate"], "peak_concurrency": both["shared"][f]["peak_concurrency"],
             "peak_concurrency_unshared": both["unshared"][f]["peak_concurrency"]} for f in formats]
