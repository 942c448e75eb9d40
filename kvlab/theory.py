"""Why quantization noise hurts retrieval more as the context grows: a small model of one attention head.

A retrieval head must put its attention on the needle. Its logit for the needle
beats the logit of each of ``n`` distractor tokens by a *margin* ``Δ`` (in logit
units, i.e. after the ``1/sqrt(d)`` scaling). Quantizing K adds noise to every
logit; call its standard deviation ``σ``. Two things then get worse with ``n``:

1. **The largest distractor.** The max of ``n`` independent N(0, σ²) noises grows
   like ``σ sqrt(2 ln n)`` (exactly: ``σ E[max of n standard normals]``), so a
   fixed margin that is safe among 500 tokens can be overtaken among 30,000.
   ``p_argmax(Δ, σ, n)`` is the probability that the needle still wins.
2. **The leaked mass.** Even when the needle wins, softmax gives the distractors
   total weight ``n e^{-Δ} E[e^{ε}] = n e^{-Δ} e^{σ²/2}`` relative to the
   needle's 1: linear in ``n``, and noise makes it worse by ``e^{σ²/2}``.
   ``needle_mass(Δ, σ, n)`` is the needle's share of attention.

Both are checked against Monte-Carlo simulation (:func:`simulate`) and against
SmolLM2's own retrieval heads in chapter 4.
"""

from __future__ import annotations

import math

import torch


def _check(margin, sigma, n):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (distractors) must be a positive integer, got {n!r}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma!r}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin!r}")


def _grid(points: int = 4001, lim: float = 9.0):
    z = torch.linspace(-lim, lim, points, dtype=torch.float64)
    phi = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    return z, phi, z[1] - z[0]


def _cdf(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] = ∫ z n φ(z) Φ(z)^(n-1) dz, by quadrature."""
    _check(0.0, 0.0, n)
    z, phi, dz = _grid()
    log_pdf_max = math.log(n) + torch.log(phi) + (n - 1) * torch.log(_cdf(z).clamp_min(1e-300))
    return float((z * torch.exp(log_pdf_max)).sum() * dz)


def p_argmax(margin: float, sigma: float, n: int) -> float:
    """P(needle logit Δ + σ ε₀ exceeds all n distractor logits σ ε_i), ε ~ N(0, 1) iid.

    = ∫ φ(z) Φ(Δ/σ + z)^n dz  (and 1 when σ = 0 and Δ > 0).
    """
    _check(margin, sigma, n)
    if sigma == 0:
        return 1.0 if margin > 0 else 0.0
    z, phi, dz = _grid()
    return float((phi * torch.exp(n * torch.log(_cdf(margin / sigma + z).clamp_min(1e-300)))).sum() * dz)


def needle_mass(margin: float, sigma: float, n: int) -> float:
    """The needle's expected share of softmax attention, to first order: 1 / (1 + n e^(σ²/2 - Δ))."""
    _check(margin, sigma, n)
    return 1.0 / (1.0 + n * math.exp(sigma**2 / 2 - margin))


def simulate(margin: float, sigma: float, n: int, trials: int = 2000, seed: int = 0) -> dict:
    """Monte-Carlo of the same model: how often the needle is the argmax, and its mean attention share."""
    _check(margin, sigma, n)
    g = torch.Generator().manual_seed(seed)
    wins, mass = 0, 0.0
    chunk = max(1, min(trials, 2_000_000 // (n + 1)))
    done = 0
    while done < trials:
        t = min(chunk, trials - done)
        eps = torch.randn(t, n + 1, generator=g, dtype=torch.float64) * sigma
        logits = eps
        logits[:, 0] += margin  # column 0 is the needle
        wins += int((logits.argmax(1) == 0).sum())
        mass += float(torch.softmax(logits, 1)[:, 0].sum())
        done += t
    return {"p_argmax": wins / trials, "needle_mass": mass / trials}


def effective_margin(logits: torch.Tensor, needle: int) -> tuple[float, int]:
    """The margin Δ and count n for which the equal-distractor model is exact without noise.

    Real distractors do not share one logit. Choosing ``Δ = s_needle - (logsumexp(s_others) - ln n)``
    makes ``1 / (1 + n e^-Δ)`` equal to the needle's true softmax share, so the theory's noise
    term ``e^(σ²/2)`` is the only approximation left.
    """
    s = logits.double().flatten()
    if not 0 <= needle < s.numel():
        raise ValueError(f"needle index {needle} is outside the {s.numel()} logits")
    others = torch.cat([s[:needle], s[needle + 1 :]])
    if others.numel() == 0:
        raise ValueError("need at least one distractor logit")
    n = others.numel()
    return float(s[needle] - (torch.logsumexp(others, 0) - math.log(n))), n


@torch.no_grad()
def retrieval_head_stats(model, tok, fmt, length: int, depth: float = 0.5, seed: int = 0, step: int = 1,
                         layer_head: tuple[int, int] | None = None) -> dict:
    """Measure the theory's inputs on the model's own retrieval head, for one passkey prompt.

    Teacher-forces the prompt plus its answer, and looks at answer step ``step`` (the
    position that must emit ``answer_ids[step]``). The retrieval head is the (layer,
    query head) with the most attention on the needle's copy of that token (or
    ``layer_head``). Its post-RoPE logits give the effective margin Δ and n
    (:func:`effective_margin`); K quantized with ``fmt`` gives the logit noise σ
    over the distractors, the theory's prediction of the needle's share
    (:func:`needle_mass`) and the share actually measured with quantized keys.
    """

    from . import models, tasks
    from .metrics import attention_logits
    from .quant import quantize_kv

    ex = tasks.sweep_prompts(tasks.passkey, tok, length, depth, 1, seed)[0]  # the sweeps' own first prompt
    if not 0 <= step < len(ex.answer_ids):
        raise ValueError(f"step must be in [0, {len(ex.answer_ids)}), got {step}")
    ids = ex.input_ids + ex.answer_ids[:step]
    pos = len(ids) - 1  # the query position that predicts answer_ids[step]
    needle = ex.input_ids[ex.needle_start:]
    src = ex.needle_start + next(i for i, t in enumerate(needle) if t == ex.answer_ids[step])
    cap = models.capture(model, torch.tensor([ids]))

    def logits(layer, keys):  # [Hq, T]: the query at ``pos`` against every key
        return attention_logits(cap.queries[layer][:, :, pos : pos + 1], keys, cap.scaling[layer])[0, :, 0]

    if layer_head is None:
        best = max(((li, h, torch.softmax(logits(li, cap.keys[li]), -1)[h, src].item())
                    for li in range(cap.num_layers) for h in range(cap.queries[li].shape[1])),
                   key=lambda t: t[2])
        layer_head = best[:2]
    li, h = layer_head
    clean = logits(li, cap.keys[li])[h]
    k_hat, _ = quantize_kv(cap.keys[li], cap.values[li], fmt)
    noisy = logits(li, k_hat)[h]
    margin, n = effective_margin(clean, src)
    noise = torch.cat([noisy[:src] - clean[:src], noisy[src + 1 :] - clean[src + 1 :]])
    sigma = float(noise.std())
    return {
        "length": length, "depth": depth, "layer": li, "head": h, "n": n, "margin": margin, "sigma": sigma,
        "mass_clean": float(torch.softmax(clean.double(), 0)[src]),
        "mass_measured": float(torch.softmax(noisy.double(), 0)[src]),
        "mass_predicted": needle_mass(margin, sigma, n),
        # The same comparison in log space, informative even when the share is ~1: the log of the
        # total distractor weight relative to the needle's, predicted ln n + σ²/2 - Δ.
        "log_leak_clean": math.log(n) - margin,  # exact by the choice of margin (effective_margin)
        "log_leak_predicted": math.log(n) + sigma**2 / 2 - margin,
        "log_leak_measured": float(torch.logsumexp(torch.cat([noisy[:src], noisy[src + 1 :]]).double(), 0)
                                   - noisy[src].double()),
        "needle_wins": bool(noisy.argmax().item() == src),
    }


def retrieval_head_table(model, tok, formats, lengths, depth: float = 0.5, step: int = 2, seed: int = 0) -> dict:
    """:func:`retrieval_head_stats` for every (length, format), all on one head.

    The head is found on the shortest prompt with the first format, then followed at every
    length and format, so the rows differ only in what the theory says they differ in. Returns
    the per-cell ``stats`` keyed ``(length, format)`` and, derived from them: the clean margin,
    needle share and log-leak per length (``margin``, ``share``, ``clean_leak``; lists in the
    order of ``lengths``), each format's logit noise σ at the longest length (``sigma``) and its
    ratio between the longest and shortest (``drift``; None for a format without noise), and the measured minus predicted log-leak
    per cell (``gap``, nats).
    """
    formats, lengths = list(formats), sorted(lengths)
    if not formats or not lengths:
        raise ValueError("need at least one format and one length")
    first = retrieval_head_stats(model, tok, formats[0], lengths[0], depth=depth, step=step, seed=seed)
    head = (first["layer"], first["head"])
    stats = {(n, f): retrieval_head_stats(model, tok, f, n, depth=depth, step=step, seed=seed, layer_head=head)
             for n in lengths for f in formats}
    clean = [stats[n, formats[0]] for n in lengths]
    lo, hi = lengths[0], lengths[-1]
    return {
        "head": head, "lengths": lengths, "formats": formats, "stats": stats,
        "margin": [c["margin"] for c in clean],
        "share": [c["mass_clean"] for c in clean],
        "clean_leak": [c["log_leak_clean"] for c in clean],
        "sigma": {f: stats[hi, f]["sigma"] for f in formats},
        "drift": {f: stats[hi, f]["sigma"] / stats[lo, f]["sigma"] if stats[lo, f]["sigma"] > 0 else None
                  for f in formats},
        "gap": {(n, f): stats[n, f]["log_leak_measured"] - stats[n, f]["log_leak_predicted"]
                for n in lengths for f in formats},
    }
