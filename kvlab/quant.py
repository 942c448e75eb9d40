"""Quantize and dequantize K and V tensors in any :mod:`kvlab.formats` format.

Tensors follow ``transformers``' cache layout, ``[batch, kv_heads, tokens, head_dim]``
(any tensor with tokens and head_dim as its last two axes works, except for
per-head scales, which need all four).

The arithmetic, for a set of values ``x`` that share one scale:

* **symmetric integer**, ``b`` bits: ``s = max|x| / (2^(b-1) - 1)``,
  ``q = round(x / s)`` in ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` (so INT4 uses -7..7
  and INT8 -127..127, a range symmetric about zero). ``full_range`` formats
  (llama.cpp's q4_0) use all of -8..7: ``s = m / -8`` where ``m`` is the value of
  largest magnitude, sign included, so that value lands exactly on -8.
* **asymmetric integer**: ``s = (max - min) / (2^b - 1)``, ``q = round((x - min) / s)``
  in ``[0, 2^b - 1]``; the stored "zero" is ``min`` itself (as KIVI and HF's
  quanto backend do), so ``x ≈ q * s + min``.
* **FP8**: ``s = max|x| / fp8_max`` (448 for e4m3fn, 57344 for e5m2), then a cast
  of ``x / s``, clamped to ±fp8_max first — saturating, never Inf or NaN.

Scales and zeros are stored at ``scale_bits`` (fp16 or fp32) and the values are
quantized against the *stored* scale, so dequantization is exactly what a
kernel reading the cache computes.

Edge cases, by design (and tested): a group of all zeros gets scale 1 (never 0,
never NaN) and dequantizes to zeros; NaN inputs are quantized as 0 (exactly 0
in symmetric formats, the nearest level to 0 in asymmetric ones); ±Inf saturate
to the largest finite magnitude their group can hold; fp16 scales are clamped
to fp16's finite range, so values beyond ``65504 * qmax`` saturate.

INT4 (and INT2) values are packed into bytes along the last axis as unsigned
codes, lowest bits first: element ``2i`` in bits 0-3, element ``2i + 1`` in bits
4-7. Symmetric codes are stored offset by ``2^(b-1)`` (q4_0's convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import layout
from .formats import KVFormat, Quantizer, get_format

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCALE_DTYPES = {bits: getattr(torch, name) for bits, name in layout.SCALE_DTYPES.items()}  # kvlab.layout's
# FP4 E2M1's magnitudes, by the 3 low bits of a code (the 4th is the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class QTensor:
    """A quantized tensor: codes (packed for sub-byte ints), scales, zeros, and how to undo them."""

    data: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    shape: tuple[int, ...]
    quantizer: Quantizer
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes actually held: codes plus scales plus zeros."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


# --------------------------------------------------------------------------- validation


def _check_input(x: torch.Tensor, q: Quantizer, whole_token_groups: bool = True) -> None:
    """What :func:`quantize` takes (``whole_token_groups=False``: what :func:`fake_quantize` takes, which keeps a
    partial group of tokens in full precision)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (tokens, head_dim), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)}): there is nothing to quantize")
    if q.granularity == "head" and x.dim() != 4:
        raise ValueError(f"per-head scales need x shaped [batch, heads, tokens, head_dim], got {tuple(x.shape)}")
    tokens, dim = x.shape[-2], x.shape[-1]
    if q.granularity == "group":
        n = dim if q.group_axis == "channel" else tokens
        axis = "head_dim (last axis)" if q.group_axis == "channel" else "tokens (second-to-last axis)"
        if n % q.group_size and (whole_token_groups or q.group_axis == "channel"):
            raise ValueError(f"group_size={q.group_size} does not divide {axis} of length {n}")
    if q.kind in ("int", "fp4") and q.bits < 8 and dim % (8 // q.bits):
        raise ValueError(f"{q.bits}-bit codes pack {8 // q.bits} values per byte: head_dim must be a multiple "
                         f"of {8 // q.bits}, got {dim}")


# --------------------------------------------------------------------------- grouping


def _grouped(x: torch.Tensor, q: Quantizer) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A view of ``x`` and the dims to reduce so that each reduction is one scale's group."""
    if q.granularity == "tensor":
        return x, tuple(range(x.dim()))
    if q.granularity == "head":
        return x, (0, 2, 3)
    if q.granularity == "token":
        return x, (-1,)
    if q.granularity == "channel":
        return x, (-2,)
    g = q.group_size
    if q.group_axis == "channel":
        return x.reshape(*x.shape[:-1], x.shape[-1] // g, g), (-1,)
    return x.reshape(*x.shape[:-2], x.shape[-2] // g, g, x.shape[-1]), (-2,)


def _amax(x, dims):
    return x.abs().amax(dim=dims, keepdim=True)


def _store_scale(s: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """Round a float32 scale to its storage dtype, keeping it finite and > 0."""
    dt = SCALE_DTYPES[q.scale_bits]
    fin = torch.finfo(dt)
    s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero group -> scale 1
    tiny = {torch.float32: fin.smallest_normal, torch.float16: 2.0**-24, torch.float8_e4m3fn: 2.0**-9}[dt]
    return s.clamp(min=tiny, max=fin.max).to(dt)


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> 0; +-Inf kept (they saturate after scaling)."""
    return torch.nan_to_num(x.float(), nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _finite_stats(x: torch.Tensor):
    """x with Inf replaced by the largest finite magnitude of the whole tensor (for range statistics)."""
    if not torch.isinf(x).any():  # the usual case: nothing to replace (NaN is already 0 here)
        return x
    finite = x[torch.isfinite(x)]
    big = finite.abs().max() if finite.numel() else torch.tensor(0.0)
    return torch.where(torch.isinf(x), torch.sign(x) * big, x)


# --------------------------------------------------------------------------- int packing


def pack_int(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, values < 2**bits) along the last axis, low bits first."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"{bits}-bit codes must lie in [0, {(1 << bits) - 1}], got values in "
                         f"[{int(codes.min())}, {int(codes.max())}] (a larger code would spill into its neighbour)")
    return _pack(codes, bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_int` without the checks (no device sync), for codes that are in range by construction."""
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last axis ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit values")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_int(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_int`: uint8 codes, last axis ``8 // bits`` times longer."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        return packed
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


# --------------------------------------------------------------------------- quantize / dequantize


def _check_frozen(scale, zero, view: torch.Tensor, q: Quantizer) -> None:
    """A frozen scale (and zero point) given to :func:`quantize`: tensors that broadcast over the grouped values,
    finite, scales non-zero (positive, except llama.cpp's full-range blocks, whose sign flips the codes), and for
    an asymmetric integer format given together (a scale without its zero point would be ignored)."""
    if scale is None and zero is None:
        return
    if q.kind == "int" and not q.symmetric and (scale is None) != (zero is None):
        raise ValueError(f"an asymmetric format needs scale and zero together, got only the "
                         f"{'scale' if zero is None else 'zero'}")
    if zero is not None and (q.kind != "int" or q.symmetric):
        raise ValueError("zero is for asymmetric integer formats; this format stores no zero point")
    for name, t in (("scale", scale), ("zero", zero)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        try:
            ok = torch.broadcast_shapes(tuple(t.shape), tuple(view.shape)) == tuple(view.shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast over the grouped values "
                             f"{tuple(view.shape)}: use the {name} a previous quantize() returned")
        if t.is_complex() or not (t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
            raise TypeError(f"{name} must be a real-valued tensor, got dtype {t.dtype}")
        if not torch.isfinite(t.float()).all():
            raise ValueError(f"{name} must be finite (as float32, which quantize computes in)")
    used = None if scale is None else scale.float()  # what quantize divides by: a 1e-300 float64 scale is 0 here
    if used is not None and ((used == 0).any() if q.full_range else (used <= 0).any()):
        raise ValueError("scale must be " + ("non-zero" if q.full_range else "positive") + " (a zero scale divides by zero)")


def quantize(x: torch.Tensor, q: Quantizer, *, scale: torch.Tensor | None = None,
             zero: torch.Tensor | None = None) -> QTensor:
    """Quantize ``x`` with ``q``. Pass ``scale`` (and ``zero``) to reuse frozen statistics."""
    if not isinstance(q, Quantizer):
        raise TypeError(f"q must be a kvlab.formats.Quantizer, got {type(q).__name__}")
    _check_input(x, q)
    shape, dtype = tuple(x.shape), x.dtype
    if q.is_passthrough:
        top = torch.finfo(FLOAT_DTYPES[q.element]).max  # a value past float16's range saturates, as int codes do
        return QTensor(x.clamp(-top, top).to(FLOAT_DTYPES[q.element]), None, None, shape, q, dtype)
    xs = _sanitize(x)
    view, dims = _grouped(xs, q)
    _check_frozen(scale, zero, view, q)
    stats = _finite_stats(view)

    if q.kind == "fp8":
        fdt = FP8_DTYPES[q.element]
        fmax = torch.finfo(fdt).max
        if scale is None:
            scale = _store_scale(_amax(stats, dims) / fmax, q)
        y = (view / scale.float()).clamp(-fmax, fmax)
        return QTensor(y.to(fdt).reshape(shape), scale, None, shape, q, dtype)

    if q.kind == "fp4":
        if scale is None:  # the block's largest magnitude maps to E2M1's largest value, 6
            scale = _store_scale(_amax(stats, dims) / FP4_VALUES[-1], q)
        return QTensor(_pack(fp4_encode((view / scale.float()).reshape(shape)), 4), scale, None, shape, q, dtype)

    b = q.bits
    if q.symmetric:
        qmax = 2 ** (b - 1) - 1
        if scale is None:
            if q.full_range:  # llama.cpp q4_0: the largest-magnitude value maps to -2^(b-1)
                s = _signed_absmax(stats, dims) / -(2 ** (b - 1))  # may be negative: the sign flips codes
                scale = torch.where(s < 0, -_store_scale(-s, q).float(), _store_scale(s, q).float())
                scale = scale.to(SCALE_DTYPES[q.scale_bits])
            else:
                scale = _store_scale(_amax(stats, dims) / qmax, q)
        lo = -(2 ** (b - 1)) if q.full_range else -qmax
        codes = torch.round(view / scale.float()).clamp(lo, qmax) + 2 ** (b - 1)
    else:
        levels = 2**b - 1
        if scale is None or zero is None:
            mn = stats.amin(dim=dims, keepdim=True)
            mx = stats.amax(dim=dims, keepdim=True)
            zero = mn.clamp(-torch.finfo(SCALE_DTYPES[q.scale_bits]).max, torch.finfo(SCALE_DTYPES[q.scale_bits]).max)
            zero = zero.to(SCALE_DTYPES[q.scale_bits])
            scale = _store_scale((mx - zero.float()) / levels, q)
        codes = torch.round((view - zero.float()) / scale.float()).clamp(0, levels)
    codes = codes.to(torch.uint8).reshape(shape)
    return QTensor(_pack(codes, b), scale, zero, shape, q, dtype)  # codes are in range by construction


def fp4_encode(y: torch.Tensor) -> torch.Tensor:
    """The FP4 E2M1 codes (uint8, 0-15: sign in bit 3) nearest to ``y``, ties to an even mantissa as NVIDIA's
    conversion rounds; magnitudes past 6 saturate."""
    grid = torch.tensor(FP4_VALUES, device=y.device)
    mag = y.abs().clamp(max=FP4_VALUES[-1])
    mid = (grid[1:] + grid[:-1]) / 2
    idx = torch.bucketize(mag, mid)  # a value on a midpoint goes to the lower neighbour...
    tie = (idx < len(mid)) & (mag == mid[idx.clamp(max=len(mid) - 1)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ...unless that one has an odd mantissa
    return (idx + 8 * (y < 0)).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of FP4 E2M1 codes."""
    grid = torch.tensor(FP4_VALUES, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def _signed_absmax(x, dims):
    """The value of largest magnitude in each group, with its sign."""
    flat = x.movedim(dims, tuple(range(-len(dims), 0))) if dims else x
    flat = flat.reshape(*flat.shape[: flat.dim() - len(dims)], -1)
    idx = flat.abs().argmax(dim=-1, keepdim=True)
    picked = flat.gather(-1, idx)
    keep = list(x.shape)
    for d in dims:
        keep[d] = 1
    return picked.reshape(keep)


def dequantize(qt: QTensor) -> torch.Tensor:
    """Back to ``qt.dtype``: ``codes * scale (+ zero)``, computed in float32."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"dequantize takes what quantize() returned (a QTensor), got {type(qt).__name__}")
    q = qt.quantizer
    if q.is_passthrough:
        return qt.data.to(qt.dtype)
    if q.kind == "fp8":
        view, _ = _grouped(qt.data.float(), q)
        return (view * qt.scale.float()).reshape(qt.shape).to(qt.dtype)
    if q.kind == "fp4":
        view, _ = _grouped(fp4_decode(unpack_int(qt.data, 4)), q)
        return (view * qt.scale.float()).reshape(qt.shape).to(qt.dtype)
    codes = unpack_int(qt.data, q.bits).float()
    view, _ = _grouped(codes, q)
    if q.symmetric:
        y = (view - 2 ** (q.bits - 1)) * qt.scale.float()
    else:
        y = view * qt.scale.float() + qt.zero.float()
    return y.reshape(qt.shape).to(qt.dtype)


# --------------------------------------------------------------------------- rotation


MAX_HADAMARD = 1 << 13  # a head of 8,192 values (a 256 MiB float32 matrix); real heads hold 64 to 576


@torch.no_grad()
def hadamard(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two): ``H @ H.T = I``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"hadamard takes the size as an integer, got {n!r}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise TypeError(f"dtype must be a float type of 16 bits or more (its entries are +-1/sqrt(n)), got {dtype!r}")
    if n > MAX_HADAMARD:
        raise ValueError(f"Hadamard rotation is for a head vector: n must be at most {MAX_HADAMARD:,}, got {str(n)[:30]}")
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs head_dim to be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


# --------------------------------------------------------------------------- whole sequences


def fake_quantize(x: torch.Tensor, q: Quantizer, *, sinks: int = 0, residual: int = 0,
                  rotate: bool = False) -> torch.Tensor:
    """Quantize-dequantize a whole ``[..., tokens, head_dim]`` sequence, as a cache would hold it.

    The first ``sinks`` and the last ``residual`` tokens stay in full precision.
    With token-axis groups, the middle is quantized in whole groups and the
    leftover tokens (fewer than one group) stay in full precision too, as they
    would in KIVI's residual buffer.
    """
    if not isinstance(q, Quantizer):
        raise TypeError(f"q must be a kvlab.formats.Quantizer (get_format(name).key gives one), got {type(q).__name__}")
    _check_input(x, q, whole_token_groups=False)
    for arg, v in (("sinks", sinks), ("residual", residual)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{arg} must be a whole number of tokens >= 0, got {v!r}")
    if not isinstance(rotate, bool):
        raise TypeError(f"rotate must be True or False, got {rotate!r}")
    T = x.shape[-2]
    start = min(sinks, T)
    stop = max(start, T - residual)
    g = layout.token_group(q)
    stop = start + (stop - start) // g * g
    if stop <= start or q.is_passthrough:
        return dequantize(quantize(x, q)) if q.is_passthrough else x.clone()
    mid = x[..., start:stop, :]
    if rotate:
        H = hadamard(x.shape[-1], device=x.device)
        mid = (mid.float() @ H).to(x.dtype)
    deq = dequantize(quantize(mid, q))
    if rotate:
        deq = (deq.float() @ H.T).to(x.dtype)
    return torch.cat([x[..., :start, :], deq, x[..., stop:, :]], dim=-2)


def quantize_kv(keys: torch.Tensor, values: torch.Tensor, fmt: str | KVFormat):
    """Fake-quantize K and V with a format's key and value quantizers and options."""
    f = get_format(fmt)
    kw = dict(sinks=f.sinks, residual=f.residual, rotate=f.rotate)
    return fake_quantize(keys, f.key, **kw), fake_quantize(values, f.value, **kw)
