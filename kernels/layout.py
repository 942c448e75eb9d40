"""The cache layout the kernels read, and the plain-torch reference — no triton needed.

:class:`QuantizedKV` is one of K or V as stored: codes ``[batch, kv_heads, capacity, head_dim]``
(``head_dim // 2`` bytes for INT4, element ``2i`` in the low nibble), scales and zeros
``[batch, kv_heads, capacity, n_groups]`` (or one value per tensor). It is the same memory
as :class:`kvlab.cache.KVQuantLayer`'s store. Everything here runs without triton, so the
notebooks and :mod:`kvlab.fusion` work where no triton wheel exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = {"float": 0, "fp8": 1, "int8": 2, "int4": 3}


@dataclass
class QuantizedKV:
    """One of K or V as the kernel reads it. Build with :func:`from_qtensor` or by hand."""

    codes: torch.Tensor  # [B, H, T, D] (fp16/bf16/fp8/uint8) or [B, H, T, D/2] uint8 for int4
    scale: torch.Tensor | None  # [B, H, T, G] or a 1-element tensor; None for plain floats
    zero: torch.Tensor | None  # same shape as scale, asymmetric ints only
    kind: str  # float | fp8 | int8 | int4
    symmetric: bool = True
    head_dim: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.codes.dim() != 4:
            raise ValueError(f"codes must be [batch, kv_heads, tokens, dim], got {tuple(self.codes.shape)}")
        if not self.head_dim:
            self.head_dim = self.codes.shape[-1] * (2 if self.kind == "int4" else 1)
        if self.kind != "float" and self.scale is None:
            raise ValueError(f"{self.kind} codes need a scale")
        if self.kind in ("int8", "int4") and not self.symmetric and self.zero is None:
            raise ValueError("asymmetric integer codes need a zero point")

    @property
    def scale_mode(self) -> str:
        if self.scale is None:
            return "none"
        return "tensor" if self.scale.numel() == 1 else "token"

    @property
    def n_groups(self) -> int:
        return self.scale.shape[-1] if self.scale_mode == "token" else 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """Full-precision float32 copy (what the unfused path materialises)."""
        c = self.codes
        if self.kind == "float":
            return c.float()
        if self.kind == "fp8":
            x = c.float()
        else:
            if self.kind == "int4":
                c = torch.stack([c & 0xF, c >> 4], dim=-1).reshape(*c.shape[:-1], c.shape[-1] * 2)
            x = c.float() - (2 ** (7 if self.kind == "int8" else 3) if self.symmetric else 0)
        g = self.head_dim // self.n_groups
        s = self.scale.float()
        s = s.reshape(1, 1, 1, 1) if self.scale_mode == "tensor" else s.repeat_interleave(g, dim=-1)
        x = x * s
        if self.zero is not None:
            z = self.zero.float()
            x = x + (z.reshape(1, 1, 1, 1) if self.scale_mode == "tensor" else z.repeat_interleave(g, dim=-1))
        return x


def from_qtensor(qt) -> QuantizedKV:
    """View a :class:`kvlab.quant.QTensor` (per-tensor, per-token or channel-grouped) as kernel input."""
    q = qt.quantizer
    if q.is_passthrough:
        return QuantizedKV(qt.data, None, None, "float")
    if q.granularity == "tensor":
        scale, zero = qt.scale.reshape(1), None if qt.zero is None else qt.zero.reshape(1)
    elif q.granularity == "token" or (q.granularity == "group" and q.group_axis == "channel"):
        B, H, T = qt.shape[:3]
        scale = qt.scale.reshape(B, H, T, -1)
        zero = None if qt.zero is None else qt.zero.reshape(B, H, T, -1)
    else:
        raise ValueError(f"the decode kernel reads per-tensor, per-token or channel-grouped scales, "
                         f"not {q.granularity!r} along {q.group_axis!r}")
    if q.kind == "int" and q.bits not in (4, 8):
        raise ValueError(f"the decode kernel reads INT8 and INT4, not INT{q.bits}")
    kind = "fp8" if q.kind == "fp8" else ("int8" if q.bits == 8 else "int4") if q.kind == "int" else "float"
    return QuantizedKV(qt.data, scale, zero, kind, q.symmetric, qt.shape[-1])


def allocate(q, batch: int, kv_heads: int, capacity: int, head_dim: int, device="cpu") -> QuantizedKV:
    """An empty cache buffer for :class:`kvlab.formats.Quantizer` ``q`` (per-token or channel groups)."""
    from kvlab.quant import FLOAT_DTYPES, FP8_DTYPES, SCALE_DTYPES

    shape = (batch, kv_heads, capacity)
    if q.is_passthrough:
        return QuantizedKV(torch.zeros(*shape, head_dim, dtype=FLOAT_DTYPES[q.element], device=device),
                           None, None, "float")
    if q.granularity == "token":
        groups = 1
    elif q.granularity == "group" and q.group_axis == "channel":
        groups = head_dim // q.group_size
    else:
        raise ValueError(f"allocate() supports per-token or channel-grouped scales, not {q.granularity!r}")
    sdt = SCALE_DTYPES[q.scale_bits]
    scale = torch.ones(*shape, groups, dtype=sdt, device=device)
    zero = None if q.symmetric or q.kind != "int" else torch.zeros(*shape, groups, dtype=sdt, device=device)
    if q.kind == "fp8":
        codes = torch.zeros(*shape, head_dim, dtype=FP8_DTYPES[q.element], device=device)
        return QuantizedKV(codes, scale, None, "fp8", True, head_dim)
    if q.bits not in (4, 8):
        raise ValueError(f"the kernels read INT8 and INT4, not INT{q.bits}")
    codes = torch.zeros(*shape, head_dim * q.bits // 8, dtype=torch.uint8, device=device)
    return QuantizedKV(codes, scale, zero, f"int{q.bits}", q.symmetric, head_dim)


# --------------------------------------------------------------------------- reference


def decode_attention_reference(q: torch.Tensor, k: QuantizedKV, v: QuantizedKV, seq_lens: torch.Tensor,
                               scaling: float | None = None) -> torch.Tensor:
    """Plain torch: dequantize everything, then softmax(q k^T * scaling) v per sequence, in float32."""
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
