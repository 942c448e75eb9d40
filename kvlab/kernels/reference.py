"""Decode attention over a :class:`kvlab.storage.KVStore` in plain torch — no triton needed.

Three functions sit beside the Triton kernel in :mod:`kvlab.kernels.decode_attention`:

* :func:`decode_attention_reference` — the definition the kernel's tests compare
  against: dequantize each sequence whole, then ``softmax(q k^T * scaling) v``.
* :func:`attend_tiles` — the kernel's algorithm in torch, and the cache's CPU path:
  dequantize ``block`` tokens, fold them into an online softmax (running max ``m``,
  running sum ``l``, accumulator rescaled by ``exp(m_old - m_new)``; Milakov and
  Gimelshein 2018, arXiv:1805.02867), next tile. Memory above the cache is one
  tile, whatever the context.
* :func:`merge_partials` — combine attention computed over disjoint pieces of the
  keys (kernel splits, or the quantized body and the full-precision sinks and
  residual) from each piece's output and log-sum-exp.
"""

from __future__ import annotations

import math

import torch


def decode_attention_reference(q: torch.Tensor, k, v, seq_lens: torch.Tensor,
                               scaling: float | None = None) -> torch.Tensor:
    """Plain torch: dequantize everything, then softmax(q k^T * scaling) v per sequence, in float32.

    ``q`` ``[batch, q_heads, head_dim]``; ``k`` and ``v`` are :class:`~kvlab.storage.KVStore`;
    ``seq_lens[b]`` tokens of sequence ``b`` are attended.
    """
    B, Hq, D = q.shape
    Hkv = k.codes.shape[1]
    scaling = D**-0.5 if scaling is None else scaling
    kf, vf = k.dequantize(), v.dequantize()
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        kb = kf[b, :, :n].repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, D]
        vb = vf[b, :, :n].repeat_interleave(Hq // Hkv, dim=0)
        s = torch.einsum("hd,hnd->hn", q[b].float(), kb) * scaling
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), vb)
    return out


def attend_tiles(q: torch.Tensor, k, v, scaling: float | None = None, *, bias: torch.Tensor | None = None,
                 block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over every token of stores ``k`` and ``v``, a tile at a time.

    ``q`` ``[batch, q_heads, head_dim]``; ``bias`` (optional) ``[batch, tokens]`` is added to
    the logits (0 to keep a token, ``-inf`` to mask it). Returns float32 ``(out [batch,
    q_heads, head_dim], lse [batch, q_heads])``; a sequence with every token masked gets
    ``out = 0`` and ``lse = -inf``, which :func:`merge_partials` ignores.
    """
    B, Hq, D = q.shape
    Hkv, T = k.codes.shape[1], k.tokens
    rep = Hq // Hkv
    scaling = D**-0.5 if scaling is None else float(scaling)
    step = max(block, k.chunk, v.chunk)
    step = -(-step // math.lcm(k.chunk, v.chunk)) * math.lcm(k.chunk, v.chunk)
    qg = q.float().reshape(B, Hkv, rep, D) * scaling
    m = torch.full((B, Hkv, rep), -math.inf, device=q.device)
    l = torch.zeros(B, Hkv, rep, device=q.device)  # noqa: E741
    acc = torch.zeros(B, Hkv, rep, D, device=q.device)
    fast = _foldable(k) and _foldable(v)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        if fast:  # scales folded into the products: no dequantized tile is ever written
            s = _scores(qg, _Tile(k, t0, t1))
        else:
            s = qg @ k.dequantize(t0, t1).transpose(-1, -2)  # [B, Hkv, rep, n]: one tile, never the cache
        if bias is not None:
            s = s + bias[:, None, None, t0:t1]
        m_new = torch.maximum(m, s.amax(-1))
        m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all-masked rows stay finite
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref[..., None])
        acc = acc * alpha[..., None] + (_weighted(p, _Tile(v, t0, t1)) if fast else p @ v.dequantize(t0, t1))
        l = l * alpha + p.sum(-1)  # noqa: E741
        m = m_new
    has = l > 0
    out = torch.where(has[..., None], acc / torch.where(has, l, 1.0)[..., None], 0.0)
    lse = torch.where(has, m + torch.log(torch.where(has, l, 1.0)), -math.inf)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def attend_dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None = None, *,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_tiles` for a few full-precision tokens ``[batch, kv_heads, n, head_dim]``."""
    B, Hq, D = q.shape
    Hkv = keys.shape[1]
    scaling = D**-0.5 if scaling is None else float(scaling)
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D) * scaling
    s = qg @ keys.float().transpose(-1, -2)
    if bias is not None:
        s = s + bias[:, None, None, :]
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return (p @ values.float()).reshape(B, Hq, D), lse.reshape(B, Hq)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i(lse_i)``: attention over the union.

    Each part is ``(out [..., head_dim], lse [...])`` over a disjoint set of keys. Parts
    with ``lse = -inf`` (no keys) get weight 0.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one part")
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])
    w = torch.softmax(lses, dim=0)
    w = torch.nan_to_num(w, nan=0.0)  # every part empty for a row: output 0, never NaN
    return sum(w_i[..., None] * o for w_i, (o, _) in zip(w, parts))


# --------------------------------------------------------------------------- scales folded into the products
#
# For the layouts the kernel reads (per-tensor, per-token or channel-grouped scales), a stored value is
# x = s_g * (c - off) + z_g, with c the code, s_g and z_g the scale and zero of its channel group g, and
# off = 2^(bits-1) for symmetric integers (0 otherwise). Scales are constant along a group of channels,
# so they come out of the dot products:
#   q . k_t          = sum_g s_tg * (q_g . c_tg - off * sum(q_g)) + z_tg * sum(q_g)
#   sum_t p_t v_t[d] = sum_t (p_t s_tg) c_td - off * sum_t p_t s_tg + sum_t p_t z_tg      (d in group g)
# The codes are converted to float once (INT4's two nibbles, and FP8 pairs read through their bits, as
# even and odd channels: see _Tile), and no dequantized copy of the tile is ever materialised.


def _foldable(store) -> bool:
    from kvlab.layout import kernel_readable

    return kernel_readable(store.q)


class _Tile:
    """Tokens [t0, t1) of a store as float codes, scales, zeros and offset (see above).

    ``codes`` is ``[B, H, n, D]`` float32 with channels in *plane order*: for INT4 and FP8 the
    even channels, then the odd ones (``X = 2`` planes, as they come out of the bytes); for the
    rest the natural order (``X = 1``). Viewed as ``[X, G, D / (X G)]`` every scale group is a
    contiguous block in each plane.
    """

    def __init__(self, store, t0: int, t1: int):
        from kvlab.layout import Kind, ScaleMode

        q, c, lay = store.q, store.codes[:, :, t0:t1], store.layout
        B, H, n = c.shape[:3]
        D = store.head_dim
        self.off, self.scale, self.zero, factor = 0.0, None, None, 1.0
        if lay.kind is Kind.INT4:  # both nibble planes side by side, then one conversion
            self.codes, self.planes = torch.stack((c & 0xF, c >> 4), -2).view(B, H, n, D).float(), 2
        elif lay.kind is Kind.FP8:
            self.codes, self.planes = _fp8_planes(c).float(), 2
            factor = 256.0 if c.dtype == torch.float8_e4m3fn else 1.0
        else:
            self.codes, self.planes = c.float(), 1
        if lay.kind in (Kind.INT8, Kind.INT4) and lay.kernel_symmetric:
            self.off = float(2 ** (q.bits - 1))
        self.groups = 1
        if store.scale is not None:
            if lay.scale_mode is ScaleMode.TENSOR:
                cut = lambda t: t.float().reshape(1, 1, 1, 1)
            else:
                self.groups = store.scale.shape[-1]
                cut = lambda t: t[:, :, t0:t1].float()
            self.scale = cut(store.scale) * factor
            self.zero = None if store.zero is None else cut(store.zero)

    def order(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` (natural channel order) in plane order."""
        return x if self.planes == 1 else torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    def unorder(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`order`."""
        if self.planes == 1:
            return x
        return x.reshape(*x.shape[:-1], 2, -1).transpose(-1, -2).reshape(x.shape)


def _fp8_planes(c: torch.Tensor) -> torch.Tensor:
    """FP8 codes ``[..., D / 2 pairs]`` as fp16 ``[..., D]`` in plane order, read through their bits.

    (A plain ``float8 -> float32`` cast is ~10x slower on a CPU.) Two adjacent codes are one
    int16, element ``2i`` in the low byte. e5m2 is the top byte of an fp16, so each byte moved
    to the top is its value. An e4m3 byte's sign, exponent and mantissa placed as
    ``sign | bits << 7`` in an fp16 give ``x * 2^-8`` exactly, subnormals included (the caller
    folds the 256 into the scale): an arithmetic shift right by one and a mask do that, on both
    planes at once. (Stacking the planes, then one conversion, beats writing into strided halves.)
    """
    w = c.view(torch.int16)
    if c.dtype == torch.float8_e5m2:
        planes = torch.stack((w << 8, w & -256), -2)  # -256 = 0xFF00
    else:
        planes = torch.stack((w << 8, w), -2)  # the even byte moved to the top; the odd one is there already
        planes >>= 1  # arithmetic: the sign stays in bit 15 (and is copied into bit 14)
        planes &= 0xBF80 - 0x10000  # keep the sign and bits 13..7
    return planes.view(torch.float16).reshape(*w.shape[:-1], 2 * w.shape[-1])


def _scores(qg: torch.Tensor, t: _Tile) -> torch.Tensor:
    """``qg`` ``[B, H, rep, D]`` dotted with the tile's keys: ``[B, H, rep, n]``."""
    qo = t.order(qg)
    if t.groups == 1:
        raw = qo @ t.codes.transpose(-1, -2)
        if t.scale is None:
            return raw
        qsum = qg.sum(-1, keepdim=True)  # [B, H, rep, 1]
        s = t.scale[..., 0][:, :, None, :]  # [B|1, H|1, 1, n]
        out = s * (raw - t.off * qsum) if t.off else s * raw
        return out if t.zero is None else out + t.zero[..., 0][:, :, None, :] * qsum
    B, H, rep, D = qg.shape
    n, X, G = t.codes.shape[2], t.planes, t.groups
    raw = torch.einsum("bhrxgj,bhnxgj->bhrng", qo.reshape(B, H, rep, X, G, -1), t.codes.reshape(B, H, n, X, G, -1))
    qsum = qg.reshape(B, H, rep, G, -1).sum(-1)[:, :, :, None, :]  # [B, H, rep, 1, G]
    s = t.scale[:, :, None]  # [B, H, 1, n, G]
    out = s * (raw - t.off * qsum) if t.off else s * raw
    if t.zero is not None:
        out = out + t.zero[:, :, None] * qsum
    return out.sum(-1)


def _weighted(p: torch.Tensor, t: _Tile) -> torch.Tensor:
    """Attention weights ``p`` ``[B, H, rep, n]`` times the tile's values: ``[B, H, rep, D]``."""
    if t.groups == 1:
        w = p if t.scale is None else p * t.scale[..., 0][:, :, None, :]
        out = t.unorder(w @ t.codes)
        if t.off:
            out = out - t.off * w.sum(-1, keepdim=True)
        if t.zero is not None:
            out = out + (p * t.zero[..., 0][:, :, None, :]).sum(-1, keepdim=True)
        return out
    B, H, rep, n = p.shape
    X, G = t.planes, t.groups
    w = p[..., None] * t.scale[:, :, None]  # [B, H, rep, n, G]
    out = torch.einsum("bhrng,bhnxgj->bhrxgj", w, t.codes.reshape(B, H, n, X, G, -1))
    shift = torch.zeros(B, H, rep, 1, G, 1, device=p.device)
    if t.off:
        shift = shift - t.off * w.sum(3)[:, :, :, None, :, None]
    if t.zero is not None:
        shift = shift + torch.einsum("bhrn,bhng->bhrg", p, t.zero)[:, :, :, None, :, None]
    return t.unorder((out + shift).reshape(B, H, rep, -1))


def split_plan(max_len: int, batch: int, kv_heads: int, block_n: int = 32, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)``: how :func:`kvlab.kernels.decode_attention.decode_attention` cuts each
    sequence over programs (flash-decoding). With ``num_splits`` None it launches enough programs to fill a device
    (about 128 across batch x KV heads x splits), each split at least 4 tiles of ``block_n`` tokens; a split holds a
    whole number of tiles. Pure arithmetic, so the chapter's diagram of it needs no triton."""
    for name, v in (("max_len", max_len), ("batch", batch), ("kv_heads", kv_heads), ("block_n", block_n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "max_len" else 1):
            raise ValueError(f"{name} must be a whole number{' >= 0' if name == 'max_len' else ' >= 1'}, got {v!r}")
    if num_splits is None:
        want = max(1, 128 // max(1, batch * kv_heads))
        num_splits = max(1, min(want, math.ceil(max_len / (4 * block_n))))
    per_split = max(block_n, math.ceil(max(max_len, 1) / num_splits / block_n) * block_n)
    return max(1, math.ceil(max(max_len, 1) / per_split)), per_split

