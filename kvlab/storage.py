"""One of K or V for one layer, stored exactly as the attention kernel reads it.

A :class:`KVStore` is built from a format's :class:`~kvlab.formats.Quantizer` and
holds three preallocated buffers, shaped as its :class:`~kvlab.layout.Layout` declares (the one
description of a format's bytes, which the kernels read too):

* ``codes`` ``[batch, kv_heads, capacity, head_dim * bits / 8]`` — uint8 for
  integers (INT4 packs element ``2i`` in the low nibble), an fp8 dtype for FP8,
  a float dtype for unquantized formats;
* ``scale`` (and ``zero`` for asymmetric integers) — ``[batch, kv_heads, rows,
  n_groups]`` when scales grow with tokens (per-token: one group; channel groups:
  ``head_dim / group_size`` groups; token groups, KIVI's keys: one row per
  ``group_size`` tokens and one value per channel), or the frozen statistics of a
  per-tensor, per-head or per-channel format, calibrated on the first append.

Capacity grows geometrically, so appending is O(new tokens) amortised. The store
never keeps a full-precision copy: :meth:`KVStore.dequantize` expands the tokens
asked for, through :func:`kvlab.quant.dequantize` — the one dequantizer — and
attention reads it a tile at a time (:mod:`kvlab.kernels.reference`).

:func:`kernel_args` gives the kernels a store's compile-time constants (from its layout).
"""

from __future__ import annotations

import math

import torch

from .formats import Quantizer
from .layout import (
    Layout,
    check_kernel_readable,
    grows,
    kernel_head_dim_ok,
    kernel_readable,
    kernel_unreadable,
    token_group,
)
from .quant import QTensor, dequantize, quantize

__all__ = ["KVStore", "kernel_args", "check_kernel_readable", "kernel_head_dim_ok", "kernel_readable",
           "kernel_unreadable"]



class KVStore:
    """K or V of one layer in one quantizer's storage layout (see the module docstring).

    >>> s = KVStore(get_format("int4").key)
    >>> s.append(torch.randn(1, 2, 100, 64))     # quantized into preallocated buffers
    >>> s.tokens, s.nbytes, s.dequantize(0, 32).shape
    """

    def __init__(self, q: Quantizer):
        if not isinstance(q, Quantizer):
            raise TypeError(f"q must be a kvlab.formats.Quantizer, got {type(q).__name__}")
        self.q = q
        self.tokens = 0
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.head_dim = 0
        self._calibrated = False  # frozen (per-tensor/head/channel) statistics have been set

    # ------------------------------------------------------------------ shape
    @property
    def chunk(self) -> int:
        """Appends must come in multiples of this many tokens (a token group's length, else 1)."""
        return token_group(self.q)

    @property
    def layout(self) -> Layout:
        """This store's :class:`~kvlab.layout.Layout` (known once a head_dim has been stored)."""
        if not self.head_dim:
            raise ValueError("the store is empty: its layout is known after the first append")
        return Layout(self.q, self.head_dim)

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    @property
    def kernel_readable(self) -> bool:
        return kernel_readable(self.q)

    def _reserve(self, need: int, like: torch.Tensor, exact: bool = False) -> None:
        """Grow the buffers to hold ``need`` tokens (at least doubling), keeping what is stored."""
        if need <= self.capacity:
            return
        B, H, _, D = like.shape
        lay = Layout(self.q, D)
        g = lay.token_group
        cap = need if exact else max(need, 2 * self.capacity, 64)
        cap = -(-cap // g) * g
        codes = torch.zeros(B, H, cap, lay.code_width, dtype=getattr(torch, lay.code_dtype), device=like.device)
        if self.codes is not None:
            codes[:, :, : self.tokens] = self.codes[:, :, : self.tokens]
        self.codes = codes
        if lay.grows:
            rows, used = cap // g, self.tokens // g
            sdt = getattr(torch, lay.scale_dtype)
            for name in ("scale", "zero"):
                if name == "zero" and not lay.has_zero:
                    continue
                buf = torch.zeros(B, H, rows, lay.n_groups, dtype=sdt, device=like.device)
                old = getattr(self, name)
                if old is not None:
                    buf[:, :, :used] = old[:, :, :used]
                setattr(self, name, buf)

    # ------------------------------------------------------------------ write
    def append(self, x: torch.Tensor) -> None:
        """Quantize ``x`` ``[batch, kv_heads, n, head_dim]`` and store it after the tokens held.

        Per-token and grouped scales are computed for the new tokens; frozen
        (per-tensor, per-head, per-channel) statistics come from the first append.
        On CUDA, kernel-readable integer and FP8 formats quantize with the Triton
        append kernel; everywhere else on the host with :func:`kvlab.quant.quantize`
        (the two agree bit for bit: ``tests/test_quantize_append.py``).
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x must be [batch, kv_heads, tokens, head_dim], got {getattr(x, 'shape', type(x))}")
        B, H, n, D = x.shape
        if self.codes is not None and (self.codes.shape[:2] != (B, H) or D != self.head_dim):
            raise ValueError(f"x {tuple(x.shape)} does not match the store's batch, heads and head_dim "
                             f"({self.codes.shape[0]}, {self.codes.shape[1]}, {self.head_dim})")
        if n % self.chunk:
            raise ValueError(f"this format groups {self.chunk} tokens per scale: append a multiple of "
                             f"{self.chunk} tokens, got {n}")
        if n == 0:
            return
        calibrate = not self._calibrated
        self.head_dim = D
        self._reserve(self.tokens + n, x)
        if not calibrate and self._append_on_device(x):
            from .kernels.quantize_append import quantize_append

            pos = torch.full((B,), self.tokens, dtype=torch.int32, device=x.device)
            quantize_append(self, x, pos)
        else:
            self._append_on_host(x, calibrate)
        self._calibrated = True
        self.tokens += n

    def _append_on_device(self, x: torch.Tensor) -> bool:
        q = self.q
        if not x.is_cuda or not self.kernel_readable or q.full_range or not kernel_head_dim_ok(x.shape[-1]):
            return False
        if q.scale_bits == 32 and q.granularity != "tensor":
            return False  # the kernel rounds the scales it computes to fp16
        if q.kind == "fp8" and torch.cuda.get_device_capability(x.device) < (8, 9):
            return False  # no FP8 conversions before sm_89 (kvlab.kernels.aot): quantize on the host
        return bool(torch.isfinite(x).all())

    def _append_on_host(self, x: torch.Tensor, calibrate: bool) -> None:
        q, t0, n = self.q, self.tokens, x.shape[2]
        frozen = not calibrate and not grows(q) and not q.is_passthrough
        qt = quantize(x, q, scale=self.scale if frozen else None, zero=self.zero if frozen else None)
        self.codes[:, :, t0:t0 + n] = qt.data
        if q.is_passthrough:
            return
        if not grows(q):
            if calibrate:  # calibrate once; later tokens saturate against these statistics
                self.scale, self.zero = qt.scale, qt.zero
            return
        g = self.chunk
        rows = slice(t0 // g, (t0 + n) // g)
        B, H = x.shape[:2]
        self.scale[:, :, rows] = qt.scale.reshape(B, H, n // g, -1)
        if self.zero is not None:
            self.zero[:, :, rows] = qt.zero.reshape(B, H, n // g, -1)

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (a multiple of :attr:`chunk`), as a sliding-window layer does.

        What remains moves to the front of the buffers; frozen statistics are kept.
        """
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.tokens or n % self.chunk:
            raise ValueError(f"n must be a multiple of {self.chunk} in [0, {self.tokens}], got {n!r}")
        if n == 0:
            return
        keep = self.tokens - n
        self.codes[:, :, :keep] = self.codes[:, :, n:self.tokens].clone()
        if grows(self.q):
            g = self.chunk
            for t in (self.scale, self.zero):
                if t is not None:
                    t[:, :, :keep // g] = t[:, :, n // g:self.tokens // g].clone()
        self.tokens = keep

    # ------------------------------------------------------------------ read
    def view(self, start: int = 0, end: int | None = None) -> QTensor:
        """Tokens ``[start, end)`` as a :class:`~kvlab.quant.QTensor` (views, no copy)."""
        if self.codes is None:
            raise ValueError("the store is empty")
        end = self.tokens if end is None else end
        g = self.chunk
        if not 0 <= start <= end <= self.tokens or start % g or (end % g and end != self.tokens):
            raise ValueError(f"token range [{start}, {end}) is outside the {self.tokens} stored tokens "
                             f"or cuts a group of {g}")
        if self.codes is None:
            raise ValueError("the store is empty")
        q = self.q
        B, H = self.codes.shape[:2]
        shape = (B, H, end - start, self.head_dim)
        codes = self.codes[:, :, start:end]
        scale, zero = self.scale, self.zero
        if grows(q):
            rows = slice(start // g, end // g)
            # back to the shapes quantize() returns: [.., T, G, 1] for channel groups, [.., T/g, 1, D] for token groups
            if g > 1:
                cut = lambda t: None if t is None else t[:, :, rows, None, :]
            elif q.granularity == "group":
                cut = lambda t: None if t is None else t[:, :, rows, :, None]
            else:
                cut = lambda t: None if t is None else t[:, :, rows]
            scale, zero = cut(scale), cut(zero)
        return QTensor(codes, scale, zero, shape, q, torch.float32)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens ``[start, end)`` in float32 (the whole store by default): a new tensor of that size only."""
        if self.codes is None:
            raise ValueError("the store is empty")
        return dequantize(self.view(start, end)).float()

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held: codes, plus scales and zeros (frozen statistics counted once)."""
        if self.codes is None:
            return 0
        n, g = self.tokens, self.chunk
        total = n * self.codes.shape[1] * self.codes.shape[0] * self.codes.shape[3] * self.codes.element_size()
        for t in (self.scale, self.zero):
            if t is None:
                continue
            if grows(self.q):
                total += t[:, :, : n // g].numel() * t.element_size()
            else:
                total += t.numel() * t.element_size()
        return total

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated, including capacity not yet filled."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    # ------------------------------------------------------------------ construct
    @classmethod
    def from_qtensor(cls, qt: QTensor) -> KVStore:
        """A store holding exactly what ``qt`` holds (e.g. the result of ``quantize(x, q)``), copied once."""
        if not isinstance(qt, QTensor):
            raise TypeError(f"qt must be a kvlab.quant.QTensor, got {type(qt).__name__}")
        if len(qt.shape) != 4:
            raise ValueError(f"a store holds [batch, kv_heads, tokens, head_dim] tensors, got shape {qt.shape}")
        s = cls(qt.quantizer)
        B, H, T, D = qt.shape
        s.head_dim = D
        like = torch.empty(B, H, 0, D, device=qt.data.device)
        s._reserve(max(T, s.chunk), like, exact=True)
        s.codes[:, :, :T] = qt.data
        if grows(qt.quantizer):
            g = s.chunk
            s.scale[:, :, : T // g] = qt.scale.reshape(B, H, T // g, -1)
            if s.zero is not None:
                s.zero[:, :, : T // g] = qt.zero.reshape(B, H, T // g, -1)
        elif not qt.quantizer.is_passthrough:
            s.scale, s.zero = qt.scale, qt.zero
        s._calibrated = True
        s.tokens = T
        return s

    @classmethod
    def allocate(cls, q: Quantizer, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 device="cpu", *, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> KVStore:
        """An empty store with room for ``capacity`` tokens (for writing with the append kernel).

        A frozen-scale format (per tensor, head or channel) uses ``scale`` (and ``zero``) when given;
        otherwise it holds scale 1 (and zero 0) until its first :meth:`append` calibrates it.
        """
        for name, val in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        s = cls(q)
        s.head_dim = head_dim
        s._reserve(capacity, torch.empty(batch, kv_heads, 0, head_dim, device=device), exact=True)
        lay = s.layout
        shape = lay.frozen_shape(batch, kv_heads)
        if shape is not None:
            sdt = getattr(torch, lay.scale_dtype)
            s.scale = torch.ones(shape, dtype=sdt, device=device)
            s.zero = torch.zeros(shape, dtype=sdt, device=device) if lay.has_zero else None
            if scale is not None:
                s.scale = _frozen("scale", scale, shape, sdt, device, positive=True)
                if zero is not None and s.zero is not None:
                    s.zero = _frozen("zero", zero, shape, sdt, device, positive=False)
                s._calibrated = True
        elif scale is not None or zero is not None:
            raise ValueError("scale and zero can only be given for per-tensor, per-head or per-channel formats")
        return s

    @classmethod
    def from_tensor(cls, x: torch.Tensor, q: Quantizer) -> KVStore:
        """Quantize ``x`` ``[batch, kv_heads, tokens, head_dim]`` into a new store."""
        s = cls(q)
        s.append(x)
        return s

    def to(self, device) -> KVStore:
        """A copy of this store on ``device``."""
        out = KVStore(self.q)
        out.tokens, out.head_dim, out._calibrated = self.tokens, self.head_dim, self._calibrated
        out.codes, out.scale, out.zero = (None if t is None else t.to(device) for t in (self.codes, self.scale, self.zero))
        return out

    def __repr__(self) -> str:
        return f"KVStore({self.q.element}, {self.q.granularity}, tokens={self.tokens}, capacity={self.capacity})"


def kernel_args(store: KVStore, fp8_as_bytes: bool = False) -> dict:
    """The decode and append kernels' compile-time constants for ``store`` (:meth:`Layout.kernel_constants`)."""
    return store.layout.kernel_constants(fp8_as_bytes)


def _frozen(name: str, value, shape: tuple, dtype: torch.dtype, device, *, positive: bool) -> torch.Tensor:
    """A frozen scale or zero point given by the caller: the shape the format needs, finite (scales > 0)."""
    t = torch.as_tensor(value, dtype=torch.float32)
    need = math.prod(shape)
    if t.numel() != need:
        raise ValueError(f"{name} has {t.numel()} values; this format's frozen {name} needs {need} "
                         f"(shape {shape})")
    if not torch.isfinite(t).all() or (positive and (t <= 0).any()):
        raise ValueError(f"{name} must be finite{' and positive' if positive else ''} (a zero scale divides by zero)")
    return t.to(dtype=dtype, device=device).reshape(shape)
