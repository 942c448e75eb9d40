"""How wrong is a quantized K or V? Errors on the tensors and on what attention makes of them.

All functions take the reference ``x`` and its quantized-dequantized ``x_hat``
shaped ``[batch, heads, tokens, head_dim]`` and reduce over the axes you do not
name in ``per``: ``per=()`` gives one number, ``per=("head",)`` one per head,
``per=("channel",)`` one per channel, and so on.
"""

from __future__ import annotations

import math

import torch

AXES = {"batch": 0, "head": 1, "token": 2, "channel": 3}


def _reduce_dims(per) -> tuple[int, ...]:
    if isinstance(per, str):
        per = (per,)
    bad = [p for p in per if p not in AXES]
    if bad:
        raise ValueError(f"per must name axes from {list(AXES)}, got {bad}")
    return tuple(d for a, d in AXES.items() if a not in per)


def _check_pair(x, x_hat):
    if not isinstance(x, torch.Tensor) or not isinstance(x_hat, torch.Tensor):
        raise TypeError("x and x_hat must be tensors")
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat shapes differ: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    if x.dim() != 4:
        raise ValueError(f"expected [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")


def mse(x: torch.Tensor, x_hat: torch.Tensor, per=()) -> torch.Tensor:
    _check_pair(x, x_hat)
    return ((x.double() - x_hat.double()) ** 2).mean(dim=_reduce_dims(per))


def snr_db(x: torch.Tensor, x_hat: torch.Tensor, per=()) -> torch.Tensor:
    """Signal-to-noise ratio in dB: 10 log10(sum x^2 / sum (x - x_hat)^2). Inf when exact."""
    _check_pair(x, x_hat)
    dims = _reduce_dims(per)
    sig = (x.double() ** 2).sum(dim=dims)
    noise = ((x.double() - x_hat.double()) ** 2).sum(dim=dims)
    return 10 * torch.log10(sig / noise)


def _expand_kv(t: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """Repeat KV heads for grouped-query attention."""
    rep = n_q_heads // t.shape[1]
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def attention_logits(q: torch.Tensor, k: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Causal attention logits ``q k^T * scaling`` (masked entries are -inf), KV heads expanded for GQA."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[-2] > k.shape[-2]:  # the first queries would see no key at all: a softmax of nothing is NaN
        raise ValueError(f"{q.shape[-2]} queries but only {k.shape[-2]} keys: each query position needs its keys "
                         "(the last queries attend to the last keys); a sliding-window cache keeps too few")
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    s = (q.double() @ _expand_kv(k, q.shape[1]).double().transpose(-1, -2)) * scaling
    tq, tk = q.shape[-2], k.shape[-2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return s.masked_fill(~mask, -math.inf)


def attention_output(q, k, v, scaling=None) -> torch.Tensor:
    p = torch.softmax(attention_logits(q, k, scaling), dim=-1)
    return p @ _expand_kv(v, q.shape[1]).double()


def attention_errors(q, k, v, k_hat, v_hat, scaling=None, per=()) -> dict[str, torch.Tensor]:
    """Error that quantized K/V cause in attention, for real queries.

    * ``logit_rmse`` — RMS error of the (unmasked) logits ``q.k * scaling``;
    * ``output_rel_error`` — ||out_hat - out|| / ||out||, the attention output's relative error.
    ``per`` may name ``"head"`` (query heads) or ``"token"`` (query positions).
    """
    _check_pair(k, k_hat)
    _check_pair(v, v_hat)
    s, s_hat = attention_logits(q, k, scaling), attention_logits(q, k_hat, scaling)
    finite = torch.isfinite(s)
    d = torch.where(finite, s - s_hat, torch.zeros_like(s))
    dims = tuple(x for x in _reduce_dims(per) if x != 3) + (3,)  # logits' last axis is keys
    logit_rmse = torch.sqrt((d**2).sum(dim=dims) / finite.sum(dim=dims))
    o, o_hat = attention_output(q, k, v, scaling), attention_output(q, k_hat, v_hat, scaling)
    odims = _reduce_dims(per)
    rel = torch.sqrt(((o - o_hat) ** 2).sum(dim=odims) / (o**2).sum(dim=odims))
    return {"logit_rmse": logit_rmse, "output_rel_error": rel}


# --------------------------------------------------------------------------- outliers and format sweeps


def absmax(x: torch.Tensor, per: str) -> torch.Tensor:
    """Largest magnitude per ``"channel"`` (over tokens) or per ``"token"`` (over channels), heads kept."""
    if per not in ("channel", "token"):
        raise ValueError(f"per must be 'channel' or 'token', got {per!r}")
    return x.abs().amax(dim=-2 if per == "channel" else -1)


def outlier_ratio(x: torch.Tensor, per: str = "channel") -> float:
    """How much the largest channel (or token) stands out: max of absmax / median of absmax, per head, averaged."""
    a = absmax(x, per).float().flatten(0, -2)  # [batch*heads, channels or tokens]
    return (a.amax(-1) / a.median(-1).values.clamp_min(1e-12)).mean().item()


def format_errors(keys, values, queries=None, formats=("fp8_e4m3", "int8", "int4"), scaling=None):
    """Per-layer error rows for each format: SNR (dB) of K and V, and attention errors if queries are given.

    ``keys``, ``values`` (and ``queries``) are lists with one ``[batch, heads, tokens, head_dim]`` tensor per
    layer, e.g. from :func:`kvlab.models.capture`.
    """
    from .quant import quantize_kv

    rows = []
    for fmt in formats:
        for i, (k, v) in enumerate(zip(keys, values)):
            kh, vh = quantize_kv(k, v, fmt)
            row = {"format": fmt if isinstance(fmt, str) else fmt.name, "layer": i,
                   "k_snr_db": snr_db(k, kh).item(), "v_snr_db": snr_db(v, vh).item()}
            if queries is not None:
                e = attention_errors(queries[i], k, v, kh, vh, scaling[i] if isinstance(scaling, list) else scaling)
                row |= {k_: t.item() for k_, t in e.items()}
            rows.append(row)
    return rows


def mean_by_format(rows: list[dict]) -> dict[str, dict[str, float]]:
    """:func:`format_errors` rows averaged over layers: ``{format: {metric: mean}}``."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("format", "layer"):
                out.setdefault(r["format"], {}).setdefault(k, []).append(v)
    return {f: {k: sum(v) / len(v) for k, v in m.items()} for f, m in out.items()}


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
E4M3_MIN_NORMAL = torch.finfo(torch.float8_e4m3fn).smallest_normal  # 2^-6: below it E4M3 loses relative precision


def fp8_unit_scale(layers: list[torch.Tensor]) -> dict[str, float]:
    """What storing tensors as FP8 E4M3 with a scale of 1.0 (vLLM's default) does to them.

    ``layers`` holds one tensor per layer. Returns ``snr_db`` (mean over layers, values past
    ±448 clipped as a saturating cast would), ``amax`` (largest magnitude) and
    ``subnormal_fraction`` (share of values below 2⁻⁶).
    """
    if not layers or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in layers):
        raise ValueError("layers must be a non-empty list of floating-point tensors, one per layer")
    snr = [snr_db(t, t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()).item() for t in layers]
    return {"snr_db": sum(snr) / len(snr),
            "amax": max(t.abs().max().item() for t in layers),
            "subnormal_fraction": sum((t.abs() < E4M3_MIN_NORMAL).sum().item() for t in layers)
            / sum(t.numel() for t in layers)}


# --------------------------------------------------------------------------- a student model against its teacher


def logit_agreement(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> tuple[float, float]:
    """``(kl, top1)`` over the positions of ``[tokens, vocab]`` logits read on the same tokens: the mean
    per-token KL(teacher || student) in nats, and the share of positions whose argmax agrees."""
    if teacher_logits.shape != student_logits.shape or teacher_logits.dim() != 2:
        raise ValueError(f"teacher and student logits must both be [tokens, vocab], got "
                         f"{tuple(teacher_logits.shape)} and {tuple(student_logits.shape)}")
    pt = torch.log_softmax(teacher_logits.float(), -1)
    ps = torch.log_softmax(student_logits.float(), -1)
    kl = (pt.exp() * (pt - ps)).sum(-1).clamp_min(0).mean().item()
    top1 = (teacher_logits.argmax(-1) == student_logits.argmax(-1)).float().mean().item()
    return kl, top1


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int:
    """The first position where two equally long token sequences differ (their length when they never do)."""
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"a and b must be token sequences of one length, got {tuple(a.shape)} and {tuple(b.shape)}")
    diff = (a != b).nonzero()
    return int(diff[0]) if len(diff) else len(a)
