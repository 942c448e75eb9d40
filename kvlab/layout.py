"""A format's bytes, declared once.

Everything that touches a quantized cache needs the same handful of facts about one of K or V at a
given ``head_dim``: what the codes are (a float dtype, FP8, or packed integer bytes) and how many there
are per token, how many scales (and zero points) each token row carries, whether those scales grow
with the tokens or were frozen at calibration, how many tokens share one scale row (KIVI's key groups),
and which of the kernels' specialisations reads it. :class:`Layout` derives them from a
:class:`~kvlab.formats.Quantizer` and a head_dim; :mod:`kvlab.storage` allocates from it, the budget
counts it, the CPU tile path and both Triton kernels read its :class:`Kind` and :class:`ScaleMode`, and
the ahead-of-time compile matrix (``kvlab.kernels.aot``) enumerates it over every preset.

Packed integers: element ``2i`` of an INT4 row sits in the low nibble of byte ``i`` (INT2: element
``4i + j`` in bits ``2j..2j+1``), the order :func:`kvlab.quant.pack_int` writes and ``kvlab.kernels.packing``
packs and unpacks inside the Triton kernels. Symmetric integers are
stored unsigned, offset by ``2^(bits-1)``.

This module imports no torch: dtypes are named by the strings torch uses for them.

>>> from kvlab.formats import get_format
>>> lay = Layout(get_format("int4").key, 128)
>>> lay.code_width, lay.n_groups, lay.kind, lay.scale_mode
(64, 2, <Kind.INT4: 3>, <ScaleMode.TOKEN: 2>)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .formats import Quantizer


class Kind(IntEnum):
    """The element kind the kernels specialise on (their ``KIND`` compile-time constant)."""

    FLOAT = 0  # a plain float dtype, loaded as is
    FP8 = 1  # FP8 codes, converted by the GPU's FP8 instructions (sm_89 and newer)
    INT8 = 2  # one unsigned byte a value
    INT4 = 3  # two values a byte, element 2i in the low nibble
    FP8_E4M3_BYTES = 4  # FP8 E4M3 codes loaded as bytes and converted with integer operations (before sm_89)
    FP8_E5M2_BYTES = 5  # the same for E5M2


class ScaleMode(IntEnum):
    """Where a stored value's scale (and zero point) comes from (the kernels' ``SCALE_MODE``)."""

    NONE = 0  # no scale: a plain float
    TENSOR = 1  # one scale for the whole tensor, frozen at calibration
    TOKEN = 2  # a scale per token per group of channels, stored as each token arrives


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}
SCALE_DTYPES = {8: "float8_e4m3fn", 16: "float16", 32: "float32"}


def kernel_unreadable(q: Quantizer) -> str | None:
    """Why the Triton decode kernel cannot read ``q``'s storage, or None when it can."""
    if not isinstance(q, Quantizer):
        raise TypeError(f"q must be a kvlab.formats.Quantizer, got {type(q).__name__}")
    if q.is_passthrough:
        return None
    if q.granularity in ("head", "channel") or (q.granularity == "group" and q.group_axis == "token"):
        axis = f"groups along {q.group_axis}" if q.granularity == "group" else f"per-{q.granularity} scales"
        return f"{axis}: the kernel reads per-tensor, per-token or channel-grouped scales"
    if q.kind == "int" and q.bits not in (4, 8):
        return f"INT{q.bits}: the kernel reads INT8 and INT4"
    if q.kind == "fp4":
        return "FP4 (NVFP4): the kernel reads FP8, INT8 and INT4 codes, not E2M1"
    return None


def kernel_readable(q: Quantizer) -> bool:
    """True when the kernels can attend over (and append to) this quantizer's storage."""
    return kernel_unreadable(q) is None


def check_kernel_readable(q: Quantizer, name: str = "format") -> None:
    """Raise ``ValueError`` naming ``name`` when the kernel cannot read ``q``."""
    why = kernel_unreadable(q)
    if why:
        raise ValueError(f"the kernel does not read this {name}: {why}")


def kernel_head_dim_ok(head_dim: int) -> bool:
    """The kernels' shape rule: head_dim a power of two, at least 16 (``tl.arange`` and ``tl.dot`` need it)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def grows(q: Quantizer) -> bool:
    """True when ``q``'s scales are stored per token (or token group) as tokens arrive; False when frozen."""
    return not q.is_passthrough and q.granularity in ("token", "group")


def token_group(q: Quantizer) -> int:
    """Tokens that share one scale row (KIVI-style groups along tokens), else 1: appends come in multiples."""
    return q.group_size if (q.granularity == "group" and q.group_axis == "token") else 1


MAX_HEAD_DIM = 1 << 20  # values in one head vector: published models use at most a few thousand (MLA's latent: 576)


@dataclass(frozen=True)
class Layout:
    """How one of K or V is stored at ``head_dim``: see the module docstring."""

    quantizer: Quantizer
    head_dim: int

    def __post_init__(self):
        q, d = self.quantizer, self.head_dim
        if not isinstance(q, Quantizer):
            raise TypeError(f"quantizer must be a kvlab.formats.Quantizer, got {type(q).__name__}")
        if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be an integer from 1 to {MAX_HEAD_DIM:,}, got {str(d)[:30]}")
        if q.granularity == "group" and q.group_axis == "channel" and d % q.group_size:
            raise ValueError(f"group_size={q.group_size} does not divide head_dim={d}")
        if q.kind in ("int", "fp4") and (d * q.bits) % 8:
            raise ValueError(f"head_dim={d} values of {q.bits} bits do not fill whole bytes")

    # ------------------------------------------------------------------ codes
    @property
    def code_dtype(self) -> str:
        """The codes' element type: the float or FP8 dtype itself, else ``"uint8"`` (packed integers, FP4)."""
        q = self.quantizer
        return q.element if q.kind in ("float", "fp8") else "uint8"

    @property
    def code_width(self) -> int:
        """Code elements one token of one head occupies (packed integers: ``head_dim * bits / 8`` bytes)."""
        q = self.quantizer
        return self.head_dim * q.bits // 8 if q.kind in ("int", "fp4") else self.head_dim

    @property
    def code_bytes(self) -> int:
        """Bytes of one token's codes in one head."""
        return self.code_width * ITEMSIZE[self.code_dtype]

    # ------------------------------------------------------------------ scales
    @property
    def grows(self) -> bool:
        return grows(self.quantizer)

    @property
    def token_group(self) -> int:
        return token_group(self.quantizer)

    @property
    def n_groups(self) -> int:
        """Scale values in one stored scale row: ``head_dim / group_size`` channel groups, ``head_dim`` for a
        row shared by a token group, else 1."""
        q = self.quantizer
        if q.granularity == "group":
            return self.head_dim // q.group_size if q.group_axis == "channel" else self.head_dim
        return 1

    @property
    def has_zero(self) -> bool:
        """Asymmetric integers store a zero point beside each scale."""
        q = self.quantizer
        return not q.is_passthrough and q.kind == "int" and not q.symmetric

    @property
    def scale_dtype(self) -> str | None:
        return None if self.quantizer.is_passthrough else SCALE_DTYPES[self.quantizer.scale_bits]

    @property
    def _meta_bytes(self) -> int:
        """Bytes of one scale plus its zero point."""
        q = self.quantizer
        return 0 if q.is_passthrough else (q.scale_bits + q.zero_bits) // 8

    def frozen_shape(self, batch: int, heads: int) -> tuple[int, int, int, int] | None:
        """Shape of the frozen statistics of a per-tensor, per-head or per-channel format; None otherwise."""
        q = self.quantizer
        if q.is_passthrough or self.grows:
            return None
        return {"tensor": (1, 1, 1, 1), "head": (1, heads, 1, 1),
                "channel": (batch, heads, 1, self.head_dim)}[q.granularity]

    def frozen_bytes(self, batch: int, heads: int) -> int:
        """Bytes of the frozen statistics (scales and zeros), held once whatever the context."""
        shape = self.frozen_shape(batch, heads)
        if shape is None:
            return 0
        a, b, c, d = shape
        return a * b * c * d * self._meta_bytes

    # ------------------------------------------------------------------ totals
    @property
    def token_bytes(self) -> float:
        """Bytes one token costs in one head, growing scales amortised over their token group."""
        grown = self.n_groups * self._meta_bytes / self.token_group if self.grows else 0.0
        return self.code_bytes + grown

    @property
    def bits_per_element(self) -> float:
        """Average bits per stored value, growing scales and zero points included (frozen ones amortise to 0)."""
        return 8 * self.token_bytes / self.head_dim

    def nbytes(self, batch: int, heads: int, tokens: int) -> int:
        """Exact bytes a store holding ``tokens`` tokens keeps: codes, the scale rows of whole token groups
        (a group still filling has none yet), and the frozen statistics."""
        rows = tokens // self.token_group
        grown = rows * self.n_groups * self._meta_bytes if self.grows else 0
        return batch * heads * (tokens * self.code_bytes + grown) + self.frozen_bytes(batch, heads)

    # ------------------------------------------------------------------ kernels
    def _kernel_spec(self) -> tuple[Kind, ScaleMode] | None:
        """The kernels' element kind (natively converted FP8) and scale mode, or None for a format they do not read."""
        q = self.quantizer
        if kernel_unreadable(q):
            return None
        if q.is_passthrough:
            return Kind.FLOAT, ScaleMode.NONE
        kind = Kind.FP8 if q.kind == "fp8" else Kind.INT8 if q.bits == 8 else Kind.INT4
        return kind, ScaleMode.TENSOR if q.granularity == "tensor" else ScaleMode.TOKEN

    @property
    def kind(self) -> Kind | None:
        spec = self._kernel_spec()
        return spec and spec[0]

    @property
    def scale_mode(self) -> ScaleMode | None:
        spec = self._kernel_spec()
        return spec and spec[1]

    def kernel_kind(self, fp8_as_bytes: bool = False) -> Kind:
        """:attr:`kind`, with FP8 read as bytes where the GPU has no FP8 conversions."""
        kind = self.kind
        if kind is None:
            check_kernel_readable(self.quantizer)
        if kind is Kind.FP8 and fp8_as_bytes:
            return Kind.FP8_E4M3_BYTES if self.quantizer.element == "float8_e4m3fn" else Kind.FP8_E5M2_BYTES
        return kind

    @property
    def kernel_symmetric(self) -> bool:
        """What the kernels' SYMMETRIC flag means: no zero point to add."""
        return not self.has_zero

    def kernel_constants(self, fp8_as_bytes: bool = False) -> dict:
        """The compile-time constants both kernels take for this layout (raises if they cannot read it)."""
        check_kernel_readable(self.quantizer)
        return dict(kind=self.kernel_kind(fp8_as_bytes), symmetric=self.kernel_symmetric,
                    scale_mode=self.scale_mode, n_groups=self.n_groups if self.scale_mode is ScaleMode.TOKEN else 1)
