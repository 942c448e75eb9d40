"""The Triton side of :mod:`kvlab.layout`'s INT4 byte order, shared by both kernels.

``kvlab.layout`` states it: element ``2i`` of a row sits in the low nibble of byte ``i`` and element
``2i + 1`` in the high nibble (as ``kvlab.quant.pack_int`` writes it and ``kernels.reference`` reads it).
The append kernel packs with :func:`pack_int4`; the decode kernel unpacks with :func:`int4_codes`.
"""

from __future__ import annotations

from . import HAVE_TRITON, tl, triton

if not HAVE_TRITON:
    raise ImportError("kvlab.kernels.packing needs triton (no wheel for this platform)")


@triton.jit
def pack_int4(q, HEAD_DIM: tl.constexpr):
    """``HEAD_DIM`` codes (uint8, each < 16) -> ``HEAD_DIM // 2`` bytes: even elements low, odd high."""
    lo, hi = tl.split(tl.reshape(q, (HEAD_DIM // 2, 2)))
    return lo | (hi << 4)


@triton.jit
def int4_codes(codes_ptr, rows, offs_d, stride_t, mask_n):
    """The codes of ``rows`` x ``offs_d`` from packed bytes: element ``d`` in byte ``d // 2``, nibble ``d % 2``."""
    byte = tl.load(codes_ptr + rows[:, None] * stride_t + (offs_d // 2)[None, :], mask=mask_n[:, None])
    return (byte >> ((offs_d % 2) * 4)[None, :]) & 0xF
