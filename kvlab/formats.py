"""KV-cache storage formats: what each one stores, and what it costs in bits.

A :class:`KVFormat` is a *description* — element type, how scales are shared
(granularity), whether there is a zero point, and research options (a
full-precision window of recent tokens, attention sinks, a Hadamard rotation).
:mod:`kvlab.quant` does the arithmetic; :mod:`kvlab.budget` turns the bit
counts below into bytes. Both read the numbers from here, so chapter 1's
arithmetic and chapter 2's measured cache bytes come from one source of truth.

Granularity names the set of values that share one scale (and zero point):

=============  ===========================================================
``tensor``     one scale for the whole K (or V) tensor of a layer
``head``       one per KV head
``token``      one per token per KV head (a row of ``head_dim`` values)
``channel``    one per channel per KV head, over all tokens
``group``      one per ``group_size`` consecutive values along ``group_axis``:
               ``"channel"`` groups run along head_dim inside one token;
               ``"token"`` groups run along the sequence inside one channel
=============  ===========================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .paths import PRESETS_DIR

GRANULARITIES = ("tensor", "head", "token", "channel", "group")
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' config.layer_types
# "int4_token@global": the named format on one layer type only, the other layers in full precision (fp32)
# llama.cpp --cache-type-k/-v values kvlab runs beside its own presets of the same names (f16: fp16)
LLAMA_CACHE_TYPES = ("f16", "q8_0", "q4_0")
MIX_SUFFIXES = {"global": "full_attention", "sliding": "sliding_attention"}
ELEMENTS = {
    # name: (storage bits, kind)
    "float32": (32, "float"),
    "float16": (16, "float"),
    "bfloat16": (16, "float"),
    "float8_e4m3fn": (8, "fp8"),
    "float8_e5m2": (8, "fp8"),
    "float4_e2m1": (4, "fp4"),  # NVFP4's element: sign, 2 exponent bits, 1 mantissa bit (0, 0.5, ..., 6)
    "int8": (8, "int"),
    "int4": (4, "int"),
    "int2": (2, "int"),
}


@dataclass(frozen=True)
class Quantizer:
    """How one of K or V is stored."""

    element: str = "float16"
    granularity: str = "tensor"
    group_size: int | None = None
    group_axis: str = "channel"
    symmetric: bool = True
    scale_bits: int = 16  # bits of each stored scale (fp16 = 16, fp32 = 32, FP8 E4M3 = 8)
    full_range: bool = False  # symmetric ints use -2^(b-1)..2^(b-1)-1 (llama.cpp q4_0), not +-(2^(b-1)-1)

    def __post_init__(self):
        for arg in ("symmetric", "full_range"):  # "no" or 0 is not a yes/no answer here
            if not isinstance(getattr(self, arg), bool):
                raise TypeError(f"{arg} must be True or False, got {getattr(self, arg)!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)):
            raise TypeError(f"group_size must be an integer number of values or None, got {self.group_size!r}")
        if self.element not in ELEMENTS:
            raise ValueError(f"element must be one of {sorted(ELEMENTS)}, got {self.element!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise ValueError(f"group granularity needs a positive integer group_size, got {self.group_size!r}")
            if self.group_axis not in ("channel", "token"):
                raise ValueError(f"group_axis must be 'channel' or 'token', got {self.group_axis!r}")
        if self.group_size is not None and self.granularity != "group":
            raise ValueError(f"group_size is for granularity 'group'; {self.granularity!r} takes none, got {self.group_size!r}")
        if isinstance(self.scale_bits, bool) or self.scale_bits not in (8, 16, 32):
            raise ValueError(f"scale_bits must be 8 (FP8 E4M3), 16 or 32, got {self.scale_bits!r}")
        if self.kind == "fp4" and (self.granularity != "group" or self.group_axis != "channel" or not self.symmetric):
            raise ValueError("FP4 values need symmetric scales in groups along head_dim (NVFP4: 16 values a scale)")

    @property
    def bits(self) -> int:
        return ELEMENTS[self.element][0]

    @property
    def kind(self) -> str:
        return ELEMENTS[self.element][1]

    @property
    def is_passthrough(self) -> bool:
        """Stored as a plain float dtype, no scale."""
        return self.kind == "float"

    @property
    def zero_bits(self) -> int:
        return 0 if (self.symmetric or self.kind != "int") else self.scale_bits

    def bits_per_element(self, head_dim: int) -> float:
        """Average bits per stored value, scales and zero points included (:class:`kvlab.layout.Layout`).

        Scales shared over a whole tensor, head or channel (growing with no
        token) are amortised to zero; per-token and grouped scales are not.
        """
        from .layout import Layout

        return Layout(self, head_dim).bits_per_element


@dataclass(frozen=True)
class KVFormat:
    """A KV-cache format: one :class:`Quantizer` for keys, one for values, and options."""

    name: str
    key: Quantizer
    value: Quantizer
    residual: int = 0  # most recent tokens kept in full precision (KIVI, HF QuantizedCache)
    sinks: int = 0  # first tokens kept in full precision (StreamingLLM's attention sinks)
    rotate: bool = False  # Hadamard-rotate head_dim before quantizing (QuaRot-style)
    source: str = ""
    notes: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)
    # per-layer-type overrides on a hybrid model: (("full_attention", fmt), ...); other layers use this format
    layers: tuple[tuple[str, KVFormat], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for arg in ("key", "value"):  # a format name here would fail later, far from the mistake
            if not isinstance(getattr(self, arg), Quantizer):
                raise TypeError(f"{arg} must be a Quantizer (get_format(name).{arg} gives one), got {getattr(self, arg)!r}")
        if not isinstance(self.rotate, bool):
            raise TypeError(f"rotate must be True or False, got {self.rotate!r}")
        for arg in ("residual", "sinks"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 10**7:
                raise ValueError(f"{arg} must be an integer number of tokens from 0 to 10,000,000, got {v!r}")
        if not isinstance(self.layers, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in self.layers):
            raise ValueError("layers must be a tuple of (layer type, KVFormat) pairs")
        for t, f in self.layers:
            if t not in LAYER_TYPES or not isinstance(f, KVFormat) or f.layers:
                raise ValueError(f"layers must pair a layer type in {LAYER_TYPES} with a plain KVFormat, got {t!r}")
        if len({t for t, _ in self.layers}) < len(self.layers):
            raise ValueError("layers names a layer type twice")

    def for_layer(self, window: int | None) -> KVFormat:
        """The plain format one layer stores: a sliding-window layer (``window`` set) or a global one.

        A layer type with no override stores this format's own quantizers and options; a named mix
        (``"int4_token@global"``) is built on full precision, so its other layers are plain ``fp32``."""
        if not self.layers:
            return self
        own = replace(self, layers=(), aliases=())
        fp32 = FORMATS["fp32"]
        if (own.key, own.value, own.residual, own.sinks, own.rotate) == (
                fp32.key, fp32.value, fp32.residual, fp32.sinks, fp32.rotate):
            own = fp32
        return dict(self.layers).get("sliding_attention" if window else "full_attention", own)

    @property
    def layer_names(self) -> dict[str, str]:
        """``{layer type: format name}`` of the per-layer-type overrides (empty for a plain format)."""
        return {t: f.name for t, f in self.layers}

    @property
    def lossless(self) -> bool:
        return self.key.is_passthrough and self.value.is_passthrough

    def bits_per_element(self, head_dim: int) -> float:
        """Mean of K and V bits per element (full-precision windows not included)."""
        return (self.key.bits_per_element(head_dim) + self.value.bits_per_element(head_dim)) / 2

    def bytes_per_token_head(self, head_dim: int) -> float:
        """Bytes of K plus V for one token of one KV head, scales included."""
        from .layout import Layout

        return Layout(self.key, head_dim).token_bytes + Layout(self.value, head_dim).token_bytes

    def with_options(self, *, residual=None, sinks=None, rotate=None, name=None) -> KVFormat:
        """A copy with research options changed, e.g. ``fmt.with_options(sinks=4)``. Its name is the base preset's
        with a suffix for each option that differs from the base (``int4_token+sinks4``), so that
        :func:`get_format` reads the name back to the same format, however many times options were changed."""
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        changes = {k: v for k, v in dict(residual=residual, sinks=sinks, rotate=rotate).items() if v is not None}
        new = replace(self, **changes)  # checks each option's type and range
        if name is None:
            base_name = self.name.split("+")[0]
            base = FORMATS.get(base_name)
            if base is None or (base.key, base.value) != (self.key, self.value):  # not a preset's options: append
                name = self.name + "".join(f"+{k}{'' if v is True else v}" for k, v in changes.items() if v)
            else:
                name = base_name + "".join(f"+{k}{'' if v is True else v}" for k in ("residual", "sinks", "rotate")
                                           if (v := getattr(new, k)) != getattr(base, k))
        return replace(new, name=name)


def _q(element, granularity="tensor", group_size=None, group_axis="channel", symmetric=True, scale_bits=16,
       full_range=False):
    return Quantizer(element, granularity, group_size, group_axis, symmetric, scale_bits, full_range)


def _same(name, q, **kw):
    return KVFormat(name, q, q, **kw)


FORMATS: dict[str, KVFormat] = {}


def register(fmt: KVFormat) -> KVFormat:
    for n in (fmt.name, *fmt.aliases):
        FORMATS[n] = fmt
    return fmt


_VLLM_FP8 = (
    "vLLM --kv-cache-dtype fp8 / fp8_e4m3: FP8 E4M3 with one fp32 scale per tensor "
    "(vLLM docs, 'Quantized KV Cache'); kvlab computes the scale from the data, vLLM uses 1.0 unless the "
    "checkpoint ships scales (its run-time estimate, --calculate-kv-scales, was removed in 2026: vllm PR #49389; "
    "chapter 2 measures what a scale of 1.0 costs)"
)
# llama.cpp's block caches as kvlab stores them, and what llama.cpp itself adds by default
_LLAMACPP_ROTATION = ("Since PR #21038 (April 2026) llama.cpp also Hadamard-rotates Q, K and V whenever the cache is "
                      "quantized, unless LLAMA_ATTN_ROT_DISABLE is set; this preset does not rotate ({0}+rotate is "
                      "nearer to llama.cpp's default)")
for _fmt in (
    _same("fp32", _q("float32"), source="full precision"),
    _same("fp16", _q("float16"), source="IEEE half precision; the usual unquantized cache", aliases=("float16", "half")),
    _same("bf16", _q("bfloat16"), source="bfloat16; the usual unquantized cache", aliases=("bfloat16", "auto")),
    _same("fp8_e4m3", _q("float8_e4m3fn", scale_bits=32), source=_VLLM_FP8, aliases=("fp8", "fp8-e4m3", "vllm-fp8")),
    _same("fp8_e5m2", _q("float8_e5m2", scale_bits=32), source="vLLM --kv-cache-dtype fp8_e5m2: FP8 E5M2, per-tensor scale", aliases=("fp8-e5m2",)),
    _same("fp8_e4m3_head", _q("float8_e4m3fn", "head", scale_bits=32), source="FP8 E4M3 with one scale per KV head"),
    _same("fp8_e4m3_token", _q("float8_e4m3fn", "token"), source="FP8 E4M3 with one fp16 scale per token and head"),
    _same("int8", _q("int8", "token"), source="symmetric INT8, one fp16 scale per token and head"),
    _same("int8_tensor", _q("int8"), source="symmetric INT8, one scale per tensor"),
    _same("int4", _q("int4", "group", 64, symmetric=False),
          source="asymmetric INT4, fp16 scale and zero per 64 values along head_dim (4.5 bits)"),
    _same("int4_g16", _q("int4", "group", 16, symmetric=False),
          source="asymmetric INT4, fp16 scale and zero per 16 values along head_dim (6 bits)"),
    _same("int4_token", _q("int4", "token"), source="symmetric INT4, one fp16 scale per token and head"),
    _same("int4_tensor", _q("int4"), source="symmetric INT4, one scale per tensor"),
    _same("q8_0", _q("int8", "group", 32),
          source="llama.cpp GGML_TYPE_Q8_0: blocks of 32 int8 values with one fp16 scale, 34 bytes per block "
                 "(ggml-common.h block_q8_0); selected with --cache-type-k/-v q8_0. " + _LLAMACPP_ROTATION.format("q8_0")),
    _same("q4_0", _q("int4", "group", 32, full_range=True),
          source="llama.cpp GGML_TYPE_Q4_0: blocks of 32 4-bit values (q - 8) with one fp16 scale, 18 bytes per "
                 "block (ggml-common.h block_q4_0); selected with --cache-type-k/-v q4_0. kvlab keeps the same 18 bytes a "
                 "block, but codes and scales in separate buffers (kvlab.layout), not interleaved as ggml does. "
                 + _LLAMACPP_ROTATION.format("q4_0")),
    _same("hf-int4", _q("int4", "group", 64, symmetric=False), residual=128,
          source="transformers QuantizedCache (quanto backend): nbits=4, q_group_size=64, residual_length=128 "
                 "(transformers docs, 'KV cache strategies'); kvlab keeps the newest 128 tokens in full precision at "
                 "all times, where transformers 5.24 quantizes the whole prompt at prefill and keeps up to 128 generated "
                 "tokens (chapter 4's appendix compares them)", aliases=("hf_quanto_int4",)),
    KVFormat("kivi-4", _q("int4", "group", 32, "token", symmetric=False), _q("int4", "group", 32, symmetric=False),
             residual=128,
             source="KIVI (Liu et al. 2024, arXiv:2402.02750): keys per-channel and values per-token, asymmetric, "
                    "group size 32, full-precision residual of 128 tokens", aliases=("kivi4",)),
    KVFormat("kivi-2", _q("int2", "group", 32, "token", symmetric=False), _q("int2", "group", 32, symmetric=False),
             residual=128, source="KIVI-2 (Liu et al. 2024, arXiv:2402.02750): as KIVI-4 with 2-bit keys and values",
             aliases=("kivi2",)),
    _same("hf-int2", _q("int2", "group", 64, symmetric=False), residual=128,
          source="transformers QuantizedCache (quanto backend): nbits=2, q_group_size=64, residual_length=128 "
                 "(transformers docs, 'KV cache strategies')"),
    _same("nvfp4", _q("float4_e2m1", "group", 16, scale_bits=8),
          source="NVIDIA NVFP4: FP4 E2M1 values in blocks of 16, one FP8 E4M3 scale a block (4.5 bits), plus one fp32 "
                 "scale per tensor that kvlab omits (NVIDIA's format as tabled in Intel Neural Compressor's 'NVFP4 "
                 "Quantization'); TensorRT-LLM's 'NVFP4 KV Cache' (Blackwell, a checkpoint quantized offline with "
                 "ModelOpt) and SGLang's FP4 KV cache"),
    _same("lmdeploy-int8", _q("int8", "token", symmetric=False),
          source="LMDeploy quant_policy=8: asymmetric INT8 per token and head with scale and zero point "
                 "(LMDeploy docs, 'INT4/INT8 KV Cache')"),
    _same("lmdeploy-int4", _q("int4", "token", symmetric=False),
          source="LMDeploy quant_policy=4: asymmetric INT4 per token and head with scale and zero point "
                 "(LMDeploy docs, 'INT4/INT8 KV Cache')"),
):
    register(_fmt)


def nvfp4_steps() -> list[KVFormat]:
    """NVFP4's three differences from llama.cpp's ``q4_0``, taken one at a time (chapter 2).

    From ``q4_0`` (4-bit integers -8..7 in blocks of 32 values, an fp16 scale: 4.5 bits): blocks of 16 (5 bits),
    then their scale in FP8 E4M3 instead of fp16 (4.5 bits again), then the E2M1 grid instead of the integer one,
    which is ``nvfp4``. Each step changes one thing, so the differences between neighbours add up to NVFP4's lead
    over ``q4_0``, split into block size, scale and grid. Not registered: they exist to be compared, not offered.
    """
    steps = [("q4_0: int4 /32, fp16 scale", FORMATS["q4_0"].key),
             ("int4 /16, fp16 scale", _q("int4", "group", 16, full_range=True)),
             ("int4 /16, fp8 scale", _q("int4", "group", 16, scale_bits=8, full_range=True)),
             ("nvfp4: e2m1 /16, fp8 scale", FORMATS["nvfp4"].key)]
    return [KVFormat(name, q, q, source="a step from q4_0 to NVFP4 (formats.nvfp4_steps)") for name, q in steps]


def get_format(fmt: str | KVFormat) -> KVFormat:
    """Look a format up by name (or pass a :class:`KVFormat` through).

    The one parser of format names: every name the shipped results use resolves here.
    A preset's name may carry the options :meth:`KVFormat.with_options` writes into names
    (``"int4_token+sinks4"``, ``"int4_token+residual128"``, ``"kivi-2+rotate"``), and may end in
    ``@global`` or ``@sliding``: that format on one layer type of a hybrid model, every other
    layer in full precision (``"int4_token@global"``).
    """
    if isinstance(fmt, KVFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"kv format must be a name or a KVFormat, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    if key in FORMATS:
        return FORMATS[key]
    shown = repr(fmt[:80] + ("..." if len(fmt) > 80 else ""))
    if re.search(r"\s", key) or len(key) > 200:
        raise ValueError(f"KV format {shown}: a format name has no spaces and at most 200 characters")
    body, at, where = key.partition("@")
    if at:
        if where not in MIX_SUFFIXES:
            raise ValueError(f"unknown layer type {where[:40]!r} in KV format {shown}: use @global or @sliding")
        try:
            inner = get_format(body)
        except ValueError as e:
            raise ValueError(f"KV format {shown}: {e}") from None
        return replace(FORMATS["fp32"], name=key, aliases=(), layers=((MIX_SUFFIXES[where], inner),),
                       source=f"{body} on the {where} layers only, full precision (fp32) on the others")
    base, *opts = key.split("+")
    if base not in FORMATS:
        raise ValueError(f"unknown KV format {shown}; choose one of: {', '.join(format_names())} "
                         "(optionally with +sinksN, +residualN or +rotate, and @global or @sliding)")
    out, seen = FORMATS[base], set()
    for opt in opts:
        m = re.fullmatch(r"(sinks|residual)([0-9]+)|rotate", opt)
        if m and m[2] and len(m[2].lstrip("0")) > 6:
            raise ValueError(f"option +{m[1]} in KV format {shown}: at most 999,999 tokens, got {m[2][:40]}")
        if not m:
            raise ValueError(f"unknown option {opt[:40]!r} in KV format {shown}: use +sinksN, +residualN or +rotate")
        kind = m[1] or "rotate"
        if kind in seen:
            raise ValueError(f"KV format {shown} gives +{kind} twice")
        seen.add(kind)
        out = out.with_options(rotate=True) if opt == "rotate" else out.with_options(**{m[1]: int(m[2])})
    return out


def mitigations() -> list[KVFormat]:
    """INT4 variants with one mitigation each: sinks, a residual window, rotation, smaller groups."""
    return [get_format(n) for n in ("int4_token+sinks4", "int4_token+residual128", "int4_token+rotate",
                                    "int4_tensor+rotate", "kivi-2+rotate", "int4_g16")]


def format_names() -> list[str]:
    """Canonical names (no aliases), in registration order."""
    seen = []
    for f in FORMATS.values():
        if f.name not in seen:
            seen.append(f.name)
    return seen


ENGINES_FILE = PRESETS_DIR / "engines.json"


def engine_table() -> dict:
    """How each preset is selected in vLLM, SGLang, TensorRT-LLM, llama.cpp, LMDeploy and ``transformers``.

    ``{"engines": {key: {"name", "source"}}, "presets": {preset: {engine key: flag or None}}, "notes": {...}}``,
    read from ``data/presets/engines.json`` (every entry cites the engine's own documentation).
    """
    import json

    return json.loads(ENGINES_FILE.read_text())


def engine_options(fmt: str | KVFormat) -> dict[str, str | None]:
    """``{engine name: flag or None}`` for one preset (None: no documented option stores exactly it)."""
    f = get_format(fmt)
    t = engine_table()
    if f.name not in t["presets"]:
        raise ValueError(f"{f.name!r} is not a preset; engine options exist for: {', '.join(t['presets'])}")
    return {t["engines"][k]["name"]: v for k, v in t["presets"][f.name].items()}


def engine_nearest(fmt: str | KVFormat) -> dict[str, str]:
    """``{engine name: option}`` for engine formats that are close to ``fmt`` but not exactly it (e.g. vLLM's
    ``int4_per_token_head`` to kvlab's ``int4_token+rotate``); each option says how it differs. Empty for most."""
    f = get_format(fmt)
    t = engine_table()
    return {t["engines"][k]["name"]: v for k, v in t.get("nearest", {}).get(f.name, {}).items() if v}


def engine_conditions(fmt: str | KVFormat) -> str | None:
    """What an engine needs before it stores preset ``fmt`` (a GPU generation, an attention backend, a calibrated
    checkpoint, a default rotation to turn off), in one line; None where the flag alone does it."""
    f = get_format(fmt)
    if f.name not in (t := engine_table())["presets"]:
        raise ValueError(f"{f.name!r} is not a preset; engine conditions exist for presets: {', '.join(t['presets'])}")
    return t.get("conditions", {}).get(f.name)


def engines_offering(formats) -> dict[str, list[str]]:
    """``{format: [engines with a documented option that stores exactly it]}`` for preset names."""
    return {str(n): [e for e, flag in engine_options(n).items() if flag] for n in formats}
