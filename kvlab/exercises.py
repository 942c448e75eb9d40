"""The chapter 2 exercises: reference solutions and the usual mistakes, as runnable code.

Each ``*_exercise()`` returns a :class:`kvlab.check.Exercise` whose ``mistakes``
are real implementations of the bug, so the checker can tell the reader which
one they made. Tests run every mistake through its exercise.
"""

from __future__ import annotations

from functools import partial

import torch

from .check import Exercise


def _cases_rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g) * 3,), (torch.randn(2, 3, 8, generator=g),),
            (torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]]),)]


# ----- chapter 1: bytes per token of a plain (non-MLA, non-windowed) cache ---------------------
def bytes_per_token(layers, kv_heads, head_dim, bits):
    """K and V, every layer, every KV head: ``layers * 2 * kv_heads * head_dim * bits / 8``."""
    return layers * 2 * kv_heads * head_dim * bits / 8


def bytes_per_token_exercise() -> Exercise:
    return Exercise(
        "bytes_per_token", bytes_per_token,
        [(32, 8, 128, 16), (80, 8, 128, 8), (28, 4, 128, 4.5), (1, 1, 64, 16)],
        mistakes={"Both K and V are cached: multiply by 2.": lambda L, h, d, b: L * h * d * b / 8,
                  "`bits` is in bits; divide by 8 for bytes.": lambda L, h, d, b: L * 2 * h * d * b,
                  "Every layer has its own cache: multiply by layers.": lambda L, h, d, b: 2 * h * d * b / 8},
    )


# ----- INT8, symmetric, one scale per token (row) --------------------------------------------


def _int8_rows(x, *, axis=-1, levels=127, lo=-127, guard_zero=True, rounding=True):
    """Symmetric INT8 with one scale per slice along ``axis``; the keywords reproduce the usual mistakes."""
    scale = x.abs().amax(dim=axis, keepdim=True) / levels
    if guard_zero:
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / scale
    return (torch.round(y) if rounding else y).clamp(lo, 127).to(torch.int8), scale


def int8_per_token(x):
    """Codes in [-127, 127] (int8) and one scale per row: ``x ~= codes * scale``."""
    return _int8_rows(x)


def int8_per_token_exercise() -> Exercise:
    return Exercise(
        "int8_per_token", int8_per_token, _cases_rows(),
        mistakes={
            "Wrong axis: a per-token scale is the max over each token's channels (the last axis), "
            "not over tokens.": partial(_int8_rows, axis=-2),
            "Range: symmetric INT8 uses -127..127 (scale = max/127), so +max and -max both fit; "
            "dividing by 128 lets -128 in and shifts every step.": partial(_int8_rows, levels=128, lo=-128),
            "An all-zero row gives scale 0 and 0/0 = NaN: use scale 1 for such rows.": partial(_int8_rows, guard_zero=False),
            "`.to(torch.int8)` truncates toward zero: round first with torch.round.": partial(_int8_rows, rounding=False),
        },
    )


# ----- INT4 packing: two codes per byte, element 2i in the low nibble -------------------------


def pack_int4(codes):
    """uint8 codes in [0, 15], even-length last axis -> uint8 bytes, element 2i in bits 0-3."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed):
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _pack_swapped(codes):
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def _pack_halves(codes):
    n = codes.shape[-1] // 2
    return codes[..., :n] | (codes[..., n:] << 4)


def pack_int4_exercise() -> Exercise:
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randint(0, 16, (3, 8), generator=g, dtype=torch.uint8),),
             (torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8),)]
    return Exercise(
        "pack_int4", pack_int4, cases,
        mistakes={
            "Nibble order: element 2i goes in the low nibble (bits 0-3) and 2i+1 in the high one; "
            "yours is swapped.": _pack_swapped,
            "Pairing: pack neighbours (2i, 2i+1) together, not the first half with the second half "
            "(that is llama.cpp's q4_0 block layout, a different convention).": _pack_halves,
        },
    )


# ----- INT4 asymmetric quantize-dequantize ----------------------------------------------------


def int4_asym_roundtrip(x):
    """Per-row asymmetric INT4: codes 0..15, scale = (max - min) / 15, zero = min; returns the dequantized x."""
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (mx - mn) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - mn) / scale).clamp(0, 15)
    return q * scale + mn


def _asym_forgot_zero(x):
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (mx - mn) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - mn) / scale).clamp(0, 15)
    return q * scale


def _asym_symmetric_8(x):
    scale = x.abs().amax(-1, keepdim=True) / 8
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-8, 7) * scale


def _asym_symmetric_7(x):
    scale = x.abs().amax(-1, keepdim=True) / 7
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-7, 7) * scale


def int4_asym_exercise() -> Exercise:
    return Exercise(
        "int4_asym_roundtrip", int4_asym_roundtrip, _cases_rows(2), atol=1e-5,
        mistakes={
            "Forgotten zero point: dequantize as codes * scale + min, not codes * scale.": _asym_forgot_zero,
            "That is symmetric INT4 with range -8..7 (scale = max/8): the largest positive value "
            "clips at 7 steps. The exercise asks for asymmetric codes 0..15 with a zero point.": _asym_symmetric_8,
            "That is symmetric INT4 over -7..7: it wastes one of the 16 levels and ignores where the "
            "values actually lie. Use min and max: scale = (max - min) / 15, zero = min.": _asym_symmetric_7,
        },
    )
