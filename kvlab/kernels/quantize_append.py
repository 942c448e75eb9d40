"""Quantize new K or V tokens and write them into a preallocated cache, in place.

During decode every step produces one new key and value per sequence and KV
head. This kernel computes their per-token (or per-group) scale — and zero
point for asymmetric formats — rounds them to codes, packs INT4 pairs into
bytes, and stores codes and scales at each sequence's current length. The
layout is :class:`kvlab.storage.KVStore`'s, so the decode kernel reads
what this one wrote without any conversion.

The arithmetic is :func:`kvlab.quant.quantize`'s, step for step (fp32 maths,
scales rounded to fp16 before use, round-half-to-even), so codes match the
host path bit for bit; ``quantize_append_reference`` does exactly that on the
host. Inputs must be finite (the host path defines NaN/Inf handling; this
kernel does not check).

FP8 codes are produced with a float -> fp8 cast. Triton's CPU interpreter
rounds that cast differently from CUDA, so on a CPU quantize FP8 on the host
(the reference) and use the kernel for INT8/INT4 and plain floats.
"""

from __future__ import annotations

import torch

from kvlab.layout import Kind, ScaleMode
from kvlab.storage import KVStore, kernel_args

from . import HAVE_TRITON, tl, triton

if not HAVE_TRITON:
    raise ImportError("triton is not installed: the append kernel is unavailable")

from .packing import pack_int4  # noqa: E402  (after the check above, which names this kernel)

# kvlab.layout's kinds and scale modes as compile-time constants the jit function can read
FLOAT: tl.constexpr = tl.constexpr(int(Kind.FLOAT))
FP8: tl.constexpr = tl.constexpr(int(Kind.FP8))
INT8: tl.constexpr = tl.constexpr(int(Kind.INT8))
PER_TENSOR: tl.constexpr = tl.constexpr(int(ScaleMode.TENSOR))


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _fp16_scale(s):
    """Scale as the host stores it: 1 for an all-zero group, clamped to fp16's range, rounded to fp16."""
    s = tl.where(s > 0, s, 1.0)
    s = tl.minimum(tl.maximum(s, 5.960464477539063e-08), 65504.0)
    return s.to(tl.float16).to(tl.float32)


@triton.jit
def _append_kernel(X, CODES, SCALE, ZERO, POS,
                   stride_xb, stride_xh, stride_xt,
                   stride_cb, stride_ch, stride_ct,
                   stride_sb, stride_sh, stride_st,
                   HEAD_DIM: tl.constexpr, N_GROUPS: tl.constexpr, KIND: tl.constexpr,
                   SYMMETRIC: tl.constexpr, SCALE_MODE: tl.constexpr, FP8_MAX: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    row = tl.load(POS + b) + t  # where this token goes
    GS: tl.constexpr = HEAD_DIM // N_GROUPS
    offs = tl.arange(0, HEAD_DIM)
    x = tl.load(X + b * stride_xb + h * stride_xh + t * stride_xt + offs).to(tl.float32)
    c_base = CODES + b * stride_cb + h * stride_ch + row * stride_ct
    s_base = SCALE + b * stride_sb + h * stride_sh + row * stride_st
    z_base = ZERO + b * stride_sb + h * stride_sh + row * stride_st
    if KIND == FLOAT:  # a cast
        tl.store(c_base + offs, x.to(CODES.dtype.element_ty))
    else:
        xg = tl.reshape(x, (N_GROUPS, GS))
        offs_g = tl.arange(0, N_GROUPS)
        if KIND == FP8:  # saturating
            if SCALE_MODE == PER_TENSOR:
                s = tl.zeros((N_GROUPS,), tl.float32) + tl.load(SCALE).to(tl.float32)
            else:
                s = _fp16_scale(tl.max(tl.abs(xg), axis=1) / FP8_MAX)
                tl.store(s_base + offs_g, s.to(SCALE.dtype.element_ty))
            y = tl.minimum(tl.maximum(xg / s[:, None], -FP8_MAX), FP8_MAX)
            tl.store(c_base + offs, tl.reshape(y, (HEAD_DIM,)).to(CODES.dtype.element_ty))
        else:
            BITS: tl.constexpr = 8 if KIND == INT8 else 4
            if SYMMETRIC:
                QMAX: tl.constexpr = 2 ** (BITS - 1) - 1
                if SCALE_MODE == PER_TENSOR:
                    s = tl.zeros((N_GROUPS,), tl.float32) + tl.load(SCALE).to(tl.float32)
                else:
                    s = _fp16_scale(tl.max(tl.abs(xg), axis=1) / QMAX)
                    tl.store(s_base + offs_g, s.to(SCALE.dtype.element_ty))
                q = _round_half_even(xg / s[:, None])
                q = tl.minimum(tl.maximum(q, -QMAX), QMAX) + 2 ** (BITS - 1)
            else:
                LEVELS: tl.constexpr = 2**BITS - 1
                if SCALE_MODE == PER_TENSOR:
                    s = tl.zeros((N_GROUPS,), tl.float32) + tl.load(SCALE).to(tl.float32)
                    z = tl.zeros((N_GROUPS,), tl.float32) + tl.load(ZERO).to(tl.float32)
                else:
                    mn = tl.min(xg, axis=1)
                    mx = tl.max(xg, axis=1)
                    z = tl.minimum(tl.maximum(mn, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
                    s = _fp16_scale((mx - z) / LEVELS)
                    tl.store(s_base + offs_g, s.to(SCALE.dtype.element_ty))
                    tl.store(z_base + offs_g, z.to(ZERO.dtype.element_ty))
                q = _round_half_even((xg - z[:, None]) / s[:, None])
                q = tl.minimum(tl.maximum(q, 0.0), LEVELS)
            q = tl.reshape(q, (HEAD_DIM,)).to(tl.uint8)
            if KIND == INT8:
                tl.store(c_base + offs, q)
            else:  # two codes per byte (kernels.packing: kvlab.layout's nibble order)
                tl.store(c_base + tl.arange(0, HEAD_DIM // 2), pack_int4(q, HEAD_DIM))


def quantize_append(store: KVStore, x: torch.Tensor, positions: torch.Tensor) -> None:
    """Quantize ``x`` ``[batch, kv_heads, n_new, head_dim]`` into ``store`` at ``positions[b]`` onwards.

    Writes into the store's preallocated buffers (its capacity must already hold them;
    :meth:`KVStore.append` reserves it and calls this on CUDA). Per-token/group formats
    compute fresh scales for each new token; a per-tensor store quantizes against its
    frozen scale. Does not move ``store.tokens``.
    """
    a = _validate(store, x, positions)
    B, H, n, D = x.shape
    x = x.contiguous()
    dummy = torch.zeros(1, dtype=torch.float16, device=x.device)
    scale = store.scale if store.scale is not None else dummy
    zero = store.zero if store.zero is not None else dummy
    s_strides = scale.stride()[:3] if a["scale_mode"] == ScaleMode.TOKEN else (0, 0, 0)
    fp8_max = torch.finfo(store.codes.dtype).max if a["kind"] == Kind.FP8 else 1.0
    _append_kernel[(B, H, n)](
        x, store.codes, scale, zero, positions,
        *x.stride()[:3], *store.codes.stride()[:3], *s_strides,
        HEAD_DIM=D, N_GROUPS=a["n_groups"], KIND=a["kind"], SYMMETRIC=a["symmetric"],
        SCALE_MODE=a["scale_mode"], FP8_MAX=float(fp8_max),
    )


def quantize_append_reference(store: KVStore, x: torch.Tensor, positions: torch.Tensor) -> None:
    """The same, on the host with :func:`kvlab.quant.quantize` (the definition the kernel must match)."""
    from kvlab.quant import quantize

    a = _validate(store, x, positions)
    B, H, n, D = x.shape
    q = store.q
    for b in range(B):
        p = int(positions[b])
        frozen = a["scale_mode"] == ScaleMode.TENSOR
        qt = quantize(x[b:b + 1], q, scale=store.scale if frozen else None, zero=store.zero if frozen else None)
        store.codes[b, :, p:p + n] = qt.data[0]
        if a["scale_mode"] == ScaleMode.TOKEN:
            store.scale[b, :, p:p + n] = qt.scale.reshape(H, n, -1)
            if store.zero is not None:
                store.zero[b, :, p:p + n] = qt.zero.reshape(H, n, -1)


def _validate(store, x, positions):
    if not isinstance(store, KVStore):
        raise TypeError(f"store must be a kvlab.storage.KVStore, got {type(store).__name__}")
    if store.codes is None:
        raise ValueError("the store has no buffers yet: append its first tokens with KVStore.append")
    a = kernel_args(store)
    if store.q.full_range:
        raise ValueError("the append kernel does not implement full-range (q4_0) rounding; use KVStore.append")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [batch, kv_heads, n_new, head_dim], got {getattr(x, 'shape', type(x))}")
    B, H, n, D = x.shape
    if D != store.head_dim or store.codes.shape[:2] != (B, H):
        raise ValueError(f"x {tuple(x.shape)} does not fit the store {tuple(store.codes.shape)}")
    if D & (D - 1):
        raise ValueError(f"head_dim must be a power of two, got {D}")
    if not isinstance(positions, torch.Tensor) or positions.shape != (B,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an integer tensor of shape ({B},)")
    if positions.device != x.device or store.codes.device != x.device:
        raise ValueError(f"x, positions and the store must share a device ({x.device}, {positions.device}, "
                         f"{store.codes.device})")
    if int(positions.min()) < 0 or int(positions.max()) + n > store.capacity:
        raise ValueError(f"appending {n} tokens at positions {positions.tolist()} overflows capacity "
                         f"{store.capacity}")
    return a
