"""Cache-byte arithmetic: how much memory the KV cache needs, and what fits on a GPU.

The whole chapter rests on one product. For a model whose every layer caches a
key and a value vector per KV head per token::

    cache bytes = batch x tokens x layers x 2 (K and V) x kv_heads x head_dim x bits / 8

Real models bend it in a few ways, each handled here from the model's
``transformers`` config:

* grouped-query / multi-query attention — ``num_key_value_heads`` < query heads;
  ``head_dim`` read from the config when it is not ``hidden_size / heads``;
* multi-head latent attention (DeepSeek-V2/V3) — each layer caches one
  compressed latent (``kv_lora_rank``) plus one decoupled RoPE key
  (``qk_rope_head_dim``), shared by all heads, instead of per-head K and V;
* sliding-window layers (Mistral 7B v0.1, Gemma 2/3 local layers) stop growing
  at their window;
* tensor parallelism splits KV heads over ranks (replicated when ranks exceed
  heads; an MLA latent is replicated on every rank);
* paged allocation rounds every sequence up to whole blocks;
* quantized formats add scales and zero points (:mod:`kvlab.formats`), and may
  keep a window of recent tokens or a few sink tokens in full precision.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .formats import KVFormat, get_format
from .layout import Layout, token_group
from .paths import DATA_DIR as DATA
from .paths import PRESETS_DIR as PRESETS

GIB = 1 << 30  # memory is counted in GiB, as nvidia-smi (MiB), torch and vLLM's start-up log print it
# what vLLM keeps out of its share for itself (vllm PR#10511: Llama-3-8B on an H100 with default flags,
# non-torch memory 1.79 GiB + profiled activation peak 1.26 GiB); see engine_cache
DEFAULT_RESERVE_GIB = 3.05
# the same model on two H100s in that PR logged non-torch 3.58 GiB + activation peak 1.26 GiB on each GPU: a reserve
# grows with tensor parallelism (NCCL buffers). By tensor-parallel size; a size not listed takes the largest below it.
TP_RESERVE_GIB = {1: DEFAULT_RESERVE_GIB, 2: 3.58 + 1.26}
RESERVE_SOURCE = "vLLM's start-up log of Llama-3-8B on {tp} H100 (vllm PR #10511: non-torch memory + activation peak)"
VLLM_BLOCK_SIZE = 16  # tokens a paged block holds in vLLM by default on CUDA


def default_reserve(tp: int = 1) -> tuple[float, str]:
    """``(GiB, where it comes from)``: the reserve logged at this tensor-parallel size, or the largest size below it
    (a reserve grows with TP: NCCL buffers). Logged for an 8B model; a larger model's activation peak is larger,
    so pass your own engine's figure (``reserve_gib=``, ``kvlab budget --reserve-gib``) where you have one."""
    logged = logged_size(TP_RESERVE_GIB, _positive_int("tp", tp))
    return TP_RESERVE_GIB[logged], RESERVE_SOURCE.format(tp=logged)


def logged_size(reserves: dict[int, float], tp: int) -> int:
    """The tensor-parallel size whose reserve applies at ``tp``: the largest logged size not above it."""
    return max(t for t in reserves if t <= tp)


def blocks(model, kv_format, free_bytes: int, context: int, *, tp: int = 1, block_size: int = VLLM_BLOCK_SIZE) -> dict:
    """How a paged engine splits ``free_bytes`` of one GPU into blocks of ``block_size`` tokens:
    ``{"block_bytes", "blocks", "tokens", "blocks_per_sequence", "max_concurrency"}``, the last counted in whole
    blocks (a sequence of ``context`` tokens takes ``ceil(context / block_size)`` of them), as vLLM's start-up log
    counts "# GPU blocks" and "Maximum concurrency"."""
    free_bytes = _positive_int("free_bytes", free_bytes, zero_ok=True)
    context, block_size = _positive_int("context", context), _positive_int("block_size", block_size)
    # a block's bytes are a sequence's bytes over its blocks: for a plain format exactly block_size tokens' worth;
    # a format with a full-precision window (KIVI, hf-int4) spreads that window's cost over the sequence's blocks
    per_seq_blocks = math.ceil(context / block_size)
    per_seq = budget(model, 1, context, kv_format, tp=tp, block_size=block_size).cache_bytes_per_gpu
    block_bytes = max(1, math.ceil(per_seq / per_seq_blocks))
    n = free_bytes // block_bytes
    return {"block_bytes": block_bytes, "blocks": n, "tokens": n * block_size, "blocks_per_sequence": per_seq_blocks,
            "max_concurrency": n // per_seq_blocks}
# bits per weight, scales included as they are for the cache: INT4 weights carry an fp16 scale and zero per 128
# (AWQ / GPTQ-style groups: 4 + 32/128); FP8 and INT8 scales are per tensor or channel (negligible). Below 16
# bits the embedding and the output layer stay in 16-bit, as quantized checkpoints keep them (weights_bytes).
WEIGHT_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4.25}


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer caches per token (for batch 1, one copy of the model)."""

    kv_heads: int  # 0 for MLA layers
    head_dim: int
    window: int | None = None  # sliding window in tokens; None = full attention
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim, cached once (not per head, not K and V)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: tuple[LayerSpec, ...]
    num_parameters: int | None = None
    max_position_embeddings: int | None = None
    attention: str = "mha"  # mha | gqa | mqa | mla
    source: str = ""
    q_heads: int = 0
    extras: dict = field(default_factory=dict, compare=False)
    embedding_parameters: int = 0  # the input embedding and the LM head (once when tied): 16-bit in quantized checkpoints

    @property
    def num_layers(self) -> int:
        return len(self.layers)


# --------------------------------------------------------------------------- configs


def preset_names() -> list[str]:
    names = sorted(p.stem for p in (PRESETS / "models").glob("*.json"))
    if (DATA / "model" / "config.json").exists():
        names.append("kvlab-tiny")
    return names


def _gib(name: str, value, *, positive: bool = False) -> float:
    """A number of GiB: finite, at least 0 (above 0 with ``positive``), at most a million."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or value > 1e6 or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):  # (a 400-digit int is compared before math.isfinite sees it)
        raise ValueError(f"{name} must be a finite number of GiB{' above 0' if positive else ', 0 or more'} "
                         f"(at most 1e6), got {value!r}")
    return float(value)


def _fraction(name: str, value) -> float:
    """A share of GPU memory, in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


MAX_INT = 1 << 40  # any count or size here (a batch, a context, a block): a trillion is past every real deployment


def _positive_int(name: str, value, *, zero_ok: bool = False) -> int:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
    if value > MAX_INT:
        raise ValueError(f"{name} must be at most {MAX_INT:,}, got {str(value)[:30]}{'...' if value >= 10**30 else ''}")
    return value


def load_shape(model) -> ModelShape:
    """A :class:`ModelShape` from a preset name, a ``config.json`` path, a dict or a ``PretrainedConfig``."""
    if isinstance(model, str | Path):
        return _load_shape_cached(str(model), _mtime(model))
    return _load_shape(model)


def _mtime(model) -> float:
    try:
        return Path(model).stat().st_mtime
    except (OSError, ValueError):  # missing, a name too long for the file system, a NUL byte: not a file
        return 0.0


@functools.lru_cache(maxsize=64)
def _load_shape_cached(model: str, mtime: float) -> ModelShape:
    return _load_shape(model)


def _is_hf_config(obj) -> bool:
    """A ``transformers`` config, recognised without importing transformers (it takes seconds to import)."""
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(obj, hf.PretrainedConfig)


def _load_shape(model) -> ModelShape:
    name, source, n_params = str(model), "", None
    if isinstance(model, ModelShape):
        return model
    if _is_hf_config(model):
        cfg = model
        name = getattr(cfg, "_name_or_path", "") or cfg.model_type
    elif isinstance(model, dict):
        if bad := [k for k in model if not isinstance(k, str)]:
            raise TypeError(f"a config dict's keys must be field names (strings), got {bad[0]!r}")
        cfg = _config_from_dict(model)
        name = model.get("_name_or_path", model.get("model_type", "config"))
    elif isinstance(model, str | Path):
        key = str(model).lower()
        preset = PRESETS / "models" / f"{key}.json"
        if key == "kvlab-tiny":
            model = DATA / "model" / "config.json"
        if key in preset_names() and preset.exists():  # a name, never a path that walks out of presets/
            doc = json.loads(preset.read_text())
            # A preset states every size it needs (layer_types included), so it is read as it is, without
            # importing transformers: `kvlab budget` answers at once (tests/test_budget.py checks that
            # transformers reads each preset to the same shapes).
            cfg = _plain_config(doc["config"])
            name, source, n_params = doc["name"], doc["source"], doc.get("num_parameters")
        else:
            path = Path(model)
            try:
                if path.is_dir():
                    path = path / "config.json"
                readable = path.is_file()
            except OSError:  # a name too long for the file system, and its relatives
                readable = False
            if not readable:
                raise ValueError(
                    f"model {str(model)[:200]!r} is neither a preset ({', '.join(preset_names())}) "
                    f"nor a readable config.json path"
                )
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise ValueError(f"model config {str(path)!r} is over {MAX_CONFIG_BYTES >> 20} MiB: not a config.json")
            try:
                doc = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Windows editors) is read past
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"model config {str(path)!r} could not be read as JSON: {e}") from None
            except RecursionError:
                raise ValueError(f"model config {str(path)!r} nests JSON too deeply to be a config") from None
            except ValueError:  # Python refuses to read an integer of over 4,300 digits
                raise ValueError(f"model config {str(path)!r} holds a number too long to be a size") from None
            if not isinstance(doc, dict):
                raise ValueError(f"model config {str(path)!r} must hold a JSON object")
            try:
                cfg = _config_from_dict(doc)
            except ValueError as e:
                raise ValueError(f"model config {str(path)!r}: {e}") from None
            name, source = path.parent.name or str(path), str(path)
            # a folder name that is not UTF-8 (surrogate escapes) is shown with replacement characters
            name, source = (x.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for x in (name, source))
            if path.resolve() == (DATA / "model" / "config.json").resolve():
                name = "kvlab-tiny"
    else:
        raise TypeError(f"model must be a preset name, a path, a dict or a PretrainedConfig, got {type(model).__name__}")
    try:
        shape = shape_from_config(cfg, name=name)
    except ValueError as e:
        if not source.endswith(".json"):
            raise
        # a config file the reader gave: name the file, then the field (the folder's name alone can be ambiguous)
        why = str(e).removeprefix(f"config for {name!r}").removeprefix(":").strip()
        raise ValueError(f"model config {source!r}: {why}") from None
    try:
        n_params = n_params or estimate_parameters(cfg)
    except ValueError as e:  # a field only the parameter count reads (tie_word_embeddings): named with the file too
        if not source.endswith(".json"):
            raise
        raise ValueError(f"model config {source!r}: {str(e).removeprefix('config: ')}") from None
    return ModelShape(shape.name, shape.layers, n_params, shape.max_position_embeddings, shape.attention, source,
                      q_heads=shape.q_heads, embedding_parameters=embedding_parameters(cfg))


def embedding_parameters(cfg) -> int:
    """Parameters of the input embedding and the LM head, ``vocab_size x hidden_size`` each (one matrix when
    ``tie_word_embeddings``); 0 when the config does not state both sizes."""
    vocab, hidden = getattr(cfg, "vocab_size", None), getattr(cfg, "hidden_size", None)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 10**7 for x in (vocab, hidden)):
        return 0
    # tied unless the config says otherwise, as estimate_parameters counts them (one default for both)
    return vocab * hidden * (1 if getattr(cfg, "tie_word_embeddings", True) is not False else 2)


MAX_CONFIG_BYTES = 16 << 20

# Sizes a config must state itself: transformers fills what is missing with a default model's
# (32 layers x 4096 for "llama"), which would size a model nobody described.
_STATED = (("num_hidden_layers", "n_layer", "num_layers"), ("num_attention_heads", "n_head"),
           ("hidden_size", "head_dim", "n_embd", "kv_lora_rank"))


def _check_stated(d: dict) -> dict:
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    missing = [" / ".join(keys) for keys in _STATED if not any(k in d for k in keys)]
    if missing:
        raise ValueError(f"the config does not state {', '.join(missing)} (kvlab does not fill in defaults)")
    return d


def _plain_config(d: dict):
    """A shipped preset's config as attributes, exactly as written (no defaults filled in)."""
    from types import SimpleNamespace

    return SimpleNamespace(**_check_stated(d))


# What a config must state, under these names, for transformers to have nothing to derive that the shape
# reads: a missing head_dim is 256 for Gemma but hidden/heads for Llama, and a sliding_window without
# layer_types becomes a per-layer pattern for Gemma 2/3 and Qwen 2 (max_window_layers, use_sliding_window).
_FULLY_STATED = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


def _states_its_shape(d: dict) -> bool:
    if any(not isinstance(d.get(k), int) or isinstance(d.get(k), bool) for k in _FULLY_STATED):
        return False
    windowed = any(d.get(k) not in (None, False) for k in ("sliding_window", "use_sliding_window"))
    return not windowed or isinstance(d.get("layer_types"), list)


def _config_from_dict(d: dict):
    """A config dict as the attributes the shape reads: as written where it states its whole shape (no
    transformers import: `kvlab budget` on a folder answers at once), else through transformers' config class."""
    d = _check_stated(d)
    return _plain_config(d) if _states_its_shape(d) else _hf_config(d)


def _hf_config(d: dict):
    """A config dict through transformers' config class for its ``model_type`` (which fills in derived fields)."""
    from transformers import AutoConfig, PretrainedConfig

    d = _check_stated(d)
    try:
        try:
            return AutoConfig.for_model(**d) if "model_type" in d else PretrainedConfig(**d)
        except (ValueError, KeyError):  # a model_type this transformers does not know
            return PretrainedConfig(**d)
    except Exception as e:  # transformers' own validators (their error types vary by version)
        msg = str(getattr(e, "__cause__", None) or e).strip().splitlines()[-1]
        raise ValueError(f"transformers rejects this config: {msg}") from None


# Far above any real model (the largest published have a few hundred layers and heads, head_dim <= 1k):
# a config past these is a typo or garbage, and a per-layer table of 1e308 layers would never finish.
_CONFIG_LIMITS = {"num_hidden_layers": 100_000, "n_layer": 100_000, "num_layers": 100_000,
                  "num_attention_heads": 1 << 20, "n_head": 1 << 20, "num_key_value_heads": 1 << 20,
                  # a head vector (layout.MAX_HEAD_DIM: 2**20 values); MLA caches kv_lora_rank + qk_rope_head_dim
                  "head_dim": 1 << 20, "kv_lora_rank": 1 << 19, "qk_rope_head_dim": 1 << 19}
_CONFIG_LIMIT = 1 << 40  # any other size (hidden_size, head_dim, window, ranks)


def _field(cfg, name: str, keys: tuple[str, ...], *, required: bool = True, zero_ok: bool = False):
    """The first of ``keys`` the config sets (not None), checked to be a positive integer of a sane size."""
    for k in keys:
        v = getattr(cfg, k, None)
        if v is not None:
            try:
                v = _positive_int(k, v, zero_ok=zero_ok)
            except ValueError as e:
                raise ValueError(f"config for {name!r}: {e}") from None
            if v > _CONFIG_LIMITS.get(k, _CONFIG_LIMIT):
                raise ValueError(f"config for {name!r}: {k} = {v} is larger than any model "
                                 f"(at most {_CONFIG_LIMITS.get(k, _CONFIG_LIMIT):,})")
            return v
    if required:
        raise ValueError(f"config for {name!r} lacks {' / '.join(keys)}")
    return None


def shape_from_config(cfg, name: str = "model") -> ModelShape:
    """Per-layer cache shapes from a ``transformers`` config (every size checked: positive integers,
    query heads a multiple of KV heads)."""
    n_layers = _field(cfg, name, ("num_hidden_layers", "n_layer", "num_layers"))
    heads = _field(cfg, name, ("num_attention_heads", "n_head"))
    max_pos = _field(cfg, name, ("max_position_embeddings",), required=False)
    if getattr(cfg, "kv_lora_rank", None) is not None:  # multi-head latent attention
        latent = _field(cfg, name, ("kv_lora_rank",))
        latent += _field(cfg, name, ("qk_rope_head_dim",), required=False, zero_ok=True) or 0
        layers = tuple(LayerSpec(0, 0, None, latent) for _ in range(n_layers))
        return ModelShape(name, layers, None, max_pos, "mla", q_heads=heads)
    kv_heads = _field(cfg, name, ("num_key_value_heads",), required=False) or heads
    if heads % kv_heads:
        raise ValueError(f"config for {name!r}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    head_dim = _field(cfg, name, ("head_dim",), required=False)
    if head_dim is None:
        hidden = _field(cfg, name, ("hidden_size",))
        if hidden % heads:
            raise ValueError(f"config for {name!r}: hidden_size {hidden} is not a multiple of {heads} heads "
                             f"(and head_dim is not set)")
        head_dim = hidden // heads
    window = _field(cfg, name, ("sliding_window",), required=False)
    types = getattr(cfg, "layer_types", None)
    if types:
        if not isinstance(types, list | tuple) or len(types) != n_layers:
            raise ValueError(f"config for {name!r}: layer_types must list one type for each of {n_layers} layers")
        if unknown := sorted({str(t)[:40] for t in types} - {"full_attention", "sliding_attention", "chunked_attention"}):
            raise ValueError(f"config for {name!r}: layer_types {unknown} are not attention layers kvlab can size "
                             "(full_attention, sliding_attention, chunked_attention)")
        chunk = _field(cfg, name, ("attention_chunk_size",), required=False) or window  # Llama 4's chunked layers
        for kind, size, key in (("sliding_attention", window, "sliding_window"),
                                ("chunked_attention", chunk, "attention_chunk_size")):
            if kind in types and size is None:
                raise ValueError(f"config for {name!r}: layer_types has {kind} layers but {key} is not set")
        wins = [window if t == "sliding_attention" else chunk if t == "chunked_attention" else None for t in types]
    else:  # e.g. Mistral 7B v0.1: the window applies to every layer
        wins = [window] * n_layers
    layers = tuple(LayerSpec(kv_heads, head_dim, w) for w in wins)
    kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    return ModelShape(name, layers, None, max_pos, kind, q_heads=heads)


def estimate_parameters(cfg) -> int | None:
    """Rough parameter count of a dense decoder (used when a config has no stated count); None when
    the config lacks (or has impossible values for) the sizes it needs."""
    def g(k):
        v = getattr(cfg, k, None)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= _CONFIG_LIMIT else None

    h, L, V = g("hidden_size"), g("num_hidden_layers"), g("vocab_size")
    heads, inter = g("num_attention_heads"), g("intermediate_size")
    if not all((h, L, V, heads, inter)):
        return None
    kvh = g("num_key_value_heads") or heads
    hd = g("head_dim") or h // heads
    attn = h * hd * heads * 2 + h * hd * kvh * 2
    mlp = 3 * h * inter
    tied = getattr(cfg, "tie_word_embeddings", True)
    if not isinstance(tied, bool):  # "no" is truthy: a config that means false must say false
        raise ValueError(f"config: tie_word_embeddings must be true or false, got {str(tied)[:40]!r}")
    emb = V * h * (1 if tied else 2)
    return int(L * (attn + mlp + 2 * h) + emb + h)


# --------------------------------------------------------------------------- arithmetic


def _check_tp(shape: ModelShape, tp: int) -> None:
    """vLLM's rule: the query heads must divide evenly over the ``tp`` ranks (and the KV heads split or replicate)."""
    if shape.q_heads and shape.q_heads % tp:
        raise ValueError(f"tp={tp} must divide the model's {shape.q_heads} attention heads")
    for layer in shape.layers:
        if not layer.latent_dim:
            _split_heads(layer.kv_heads, tp)


def _split_heads(kv_heads: int, tp: int) -> int:
    """KV heads held by one tensor-parallel rank."""
    if kv_heads % tp == 0:
        return kv_heads // tp
    if tp % kv_heads == 0:
        return 1  # more ranks than heads: each head is replicated tp / kv_heads times
    raise ValueError(f"tp={tp} must divide, or be a multiple of, the {kv_heads} KV heads")


def _layer_bits_per_token(layer: LayerSpec, fmt: KVFormat, tp: int, full_bits: int | None) -> float:
    """Bits one token costs in one layer on one rank; ``full_bits`` set = kept in full precision."""
    if layer.latent_dim:  # MLA latent: one vector, replicated on every rank
        bits = full_bits if full_bits else fmt.key.bits_per_element(layer.latent_dim)
        return layer.latent_dim * bits
    heads = _split_heads(layer.kv_heads, tp)
    if full_bits:
        return heads * layer.head_dim * 2 * full_bits
    return heads * fmt.bytes_per_token_head(layer.head_dim) * 8


def full_precision_tokens(fmt: KVFormat, held: int) -> int:
    """Tokens a cache keeps unquantized: sinks, the residual window, and (for formats whose
    groups run along tokens) the tokens still waiting to fill a group."""
    n = min(held, fmt.sinks + fmt.residual)
    return n + (held - n) % max(token_group(fmt.key), token_group(fmt.value))


def _static_scale_bits(layer: LayerSpec, fmt: KVFormat, batch: int, tp: int) -> int:
    """Scales shared by all tokens (per tensor, head or channel): a constant per layer."""
    if layer.latent_dim:
        return 0
    heads = _split_heads(layer.kv_heads, tp)
    return 8 * sum(Layout(q, layer.head_dim).frozen_bytes(batch, heads) for q in (fmt.key, fmt.value))


@dataclass(frozen=True)
class Budget:
    model: str
    kv_format: str
    batch: int
    context: int
    tp: int
    block_size: int
    bytes_per_token: int  # one token in every layer (before windows), whole model
    cache_bytes: int  # batch x context, whole model (all ranks)
    cache_bytes_per_gpu: int
    per_layer_bytes: tuple[int, ...] = ()


def bits_held(model, context: int, kv_format) -> float:
    """Bits an element that ``context`` tokens really hold in ``kv_format`` on a server whose full precision is
    16-bit: the cache's bytes over a bf16 cache's, times 16. Unlike
    :meth:`~kvlab.formats.KVFormat.bits_per_element` it counts what a real cache of that length also stores:
    scales, KIVI's full-precision residual and a partial token group, windows."""
    context = _positive_int("context", context)  # no tokens hold no bits: the ratio is undefined
    return 16 * budget(model, 1, context, kv_format).cache_bytes / budget(model, 1, context, "bf16").cache_bytes


def check_layer_types(model, kv_format) -> None:
    """``ValueError`` when ``kv_format`` mixes formats by layer type (``int4@sliding``) and ``model`` has no layer
    of a type it names: such a format would quantize nothing, or fail at the first request."""
    shape, fmt = load_shape(model), get_format(kv_format)
    present = {"sliding_attention" if layer.window else "full_attention" for layer in shape.layers}
    if missing := [t for t, _ in fmt.layers if t not in present]:
        raise ValueError(f"kv_format {fmt.name!r} quantizes {missing[0].replace('_', ' ')} layers; "
                         f"{shape.name} has none")


def budget(model, batch: int, context: int, kv_format="bf16", *, tp: int = 1, block_size: int = 1,
           full_precision_bits: int = 16) -> Budget:
    """Cache bytes for ``batch`` sequences of ``context`` tokens each.

    ``bytes_per_token`` is what one more token costs when every layer still
    stores it; ``cache_bytes`` applies windows, paging, full-precision
    residual/sink tokens (stored at ``full_precision_bits``, the model's
    activation dtype), constant per-tensor/head/channel scales, and sums K and V
    over all layers (and over all ranks; ``cache_bytes_per_gpu`` is one rank's share).
    """
    shape = load_shape(model)
    fmt = get_format(kv_format)
    check_layer_types(shape, fmt)
    batch = _positive_int("batch", batch)
    context = _positive_int("context", context, zero_ok=True)
    tp = _positive_int("tp", tp)
    _check_tp(shape, tp)
    block_size = _positive_int("block_size", block_size)
    if full_precision_bits not in (16, 32):
        raise ValueError(f"full_precision_bits must be 16 or 32, got {full_precision_bits!r}")

    kinds = Counter(shape.layers)  # identical layers cost the same: each kind is worked out once, whatever the depth

    def layer_bytes(layer: LayerSpec, ranks: int) -> int:
        f = fmt.for_layer(layer.window)  # a per-layer-type mix stores each layer type its own way
        held = context if layer.window is None else min(context, layer.window)
        slots = math.ceil(held / block_size) * block_size  # paged: whole blocks
        n_full = full_precision_tokens(f, slots)
        bits = (slots - n_full) * _layer_bits_per_token(layer, f, ranks, None)
        bits += n_full * _layer_bits_per_token(layer, f, ranks, full_precision_bits)
        static = _static_scale_bits(layer, f, batch, ranks) if slots > n_full else 0
        return math.ceil(batch * bits / 8) + static // 8

    def cache(ranks: int) -> list[int]:
        cost = {kind: layer_bytes(kind, ranks) for kind in kinds}
        return [cost[layer] for layer in shape.layers]

    per_token_bits = sum(n * _layer_bits_per_token(kind, fmt.for_layer(kind.window), 1, None) for kind, n in kinds.items())
    per_layer = cache(1)
    return Budget(
        shape.name, fmt.name, batch, context, tp, block_size,
        bytes_per_token=math.ceil(per_token_bits / 8),
        cache_bytes=sum(per_layer),
        cache_bytes_per_gpu=sum(cache(tp)),
        per_layer_bytes=tuple(per_layer),
    )


# --------------------------------------------------------------------------- fitting on a GPU


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    source: str
    peak_bf16_flops: float = 0.0  # dense BF16 tensor-core peak, FLOP/s
    usd_per_hour: float | None = None  # one public list price, see price_source
    price_source: str = ""
    nominal_gb: float = 0.0  # the vendor's figure ("141 GB"); memory_bytes is what the software reports


def gpus() -> dict[str, GPU]:
    doc = json.loads((PRESETS / "gpus.json").read_text())["gpus"]
    return {
        # the total the software reports (GiB) where a log gives it, else the vendor's GB as 1e9 bytes
        k: GPU(k, int(v["memory_gib"] * GIB) if "memory_gib" in v else int(v["memory_gb"] * 1e9),
               v["bandwidth_gbs"] * 1e9, v["source"], v["bf16_dense_tflops"] * 1e12,
               v.get("usd_per_hour"), v.get("price_source", ""), v["memory_gb"])
        for k, v in doc.items()
    }


def get_gpu(gpu) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    table = gpus()
    by_lower = {k.lower(): v for k, v in table.items()}
    if not isinstance(gpu, str) or gpu.lower() not in by_lower:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of: {', '.join(table)}")
    return by_lower[gpu.lower()]


def hourly_price(gpu, usd: float | None = None) -> float:
    """Dollars per GPU-hour: ``usd`` when given, else the GPU's listed price (``GPU.price_source``)."""
    if usd is None:
        g = get_gpu(gpu)
        if g.usd_per_hour is None:
            raise ValueError(f"GPU {g.name!r} has no listed price; pass gpu_hour_usd")
        return g.usd_per_hour
    shown = repr(usd) if len(repr(usd)) <= 40 else repr(usd)[:40] + "..."
    if isinstance(usd, bool) or not isinstance(usd, numbers.Real):  # numpy's floats and ints are Real too
        raise ValueError(f"gpu_hour_usd must be a real number of dollars, got {type(usd).__name__} {shown}")
    try:
        v = float(usd)
    except OverflowError:  # an int past float's range
        v = math.inf
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"gpu_hour_usd must be a positive finite number of dollars, got {shown}")
    if v > MAX_HOURLY_USD:  # costs multiply it by hours and GPUs: past this they overflow to inf
        raise ValueError(f"gpu_hour_usd must be at most ${MAX_HOURLY_USD:,.0f} per GPU-hour, got {shown}")
    if v < MIN_HOURLY_USD:  # costs divide it by millions of tokens: far below this they round to $0
        raise ValueError(f"gpu_hour_usd must be at least ${MIN_HOURLY_USD:g} per GPU-hour, got {shown}")
    return v


MAX_HOURLY_USD = 1e6  # a thousand times any listed rate
MIN_HOURLY_USD = 1e-3  # a tenth of a cent: below any rental price, and above where a cost per token underflows


def weights_bytes(model, weights_dtype: str = "bf16") -> int:
    """Bytes of the model's weights in ``weights_dtype``, at :data:`WEIGHT_BITS` (INT4's group scales included).

    Below 16 bits the embedding and the LM head stay in 16-bit, as W8A8, FP8, AWQ and GPTQ checkpoints keep them
    (a tied pair counted once): for Llama-3.1-70B in FP8 that is 2 x 128,256 x 8,192 parameters at 2 bytes, about
    2 GiB more than counting every weight at 8 bits. ``kvlab budget --weights-gib`` takes your engine's own figure.
    """
    if not isinstance(weights_dtype, str) or weights_dtype not in WEIGHT_BITS:
        raise ValueError(f"weights dtype must be one of {', '.join(WEIGHT_BITS)}, got {weights_dtype!r}")
    shape = load_shape(model)
    if not shape.num_parameters:
        raise ValueError(f"model {shape.name!r} has no parameter count; cannot size its weights")
    bits = WEIGHT_BITS[weights_dtype]
    if bits >= 16:
        return math.ceil(shape.num_parameters * bits / 8)
    kept = min(shape.embedding_parameters, shape.num_parameters)  # 16-bit in quantized checkpoints
    return math.ceil((shape.num_parameters - kept) * bits / 8) + 2 * kept


@dataclass(frozen=True)
class Fit:
    gpu: str
    tp: int
    weights_bytes_per_gpu: int
    usable_bytes_per_gpu: int  # memory x utilization
    free_for_cache_per_gpu: int  # usable - weights - reserve; negative when they do not fit
    weights_fit: bool
    reserve_bytes_per_gpu: int = 0  # the engine's own: activation peak, CUDA graphs, NCCL (see engine_cache)


def fit(model, gpu, weights_dtype="bf16", *, tp: int = 1, memory_utilization: float = 0.9,
        reserve_gib: float = DEFAULT_RESERVE_GIB, weights_gib: float | None = None) -> Fit:
    """How much of each GPU is left for the cache once the weights are loaded.

    ``memory_utilization`` follows vLLM's ``--gpu-memory-utilization`` (the fraction of memory the
    engine may use). Out of it come the weights, split evenly over ``tp`` ranks, and ``reserve_gib``:
    what the engine keeps for itself (its profiled activation peak and memory torch does not manage;
    3.05 GiB by default, as vLLM logged for Llama-3-8B on an H100, vllm PR#10511). ``weights_gib``, when given,
    is the weights' size on each GPU as your engine logged it ("Model loading took ... GiB"), used instead of
    :func:`weights_bytes`.
    """
    memory_utilization = _fraction("memory_utilization", memory_utilization)
    reserve_gib = _gib("reserve_gib", reserve_gib)
    tp = _positive_int("tp", tp)
    g = get_gpu(gpu)
    _check_tp(load_shape(model), tp)
    w = math.ceil(weights_bytes(model, weights_dtype) / tp) if weights_gib is None else \
        int(_gib("weights_gib", weights_gib) * GIB)
    usable = int(g.memory_bytes * memory_utilization)
    reserve = int(reserve_gib * GIB)
    return Fit(g.name, tp, w, usable, usable - w - reserve, w + reserve <= usable, reserve)


def max_concurrency(model, context: int, kv_format="bf16", gpu="H100-80GB", weights_dtype="bf16", *,
                    tp: int = 1, memory_utilization: float = 0.9, block_size: int = 1,
                    reserve_gib: float = DEFAULT_RESERVE_GIB) -> int:
    """Most sequences of ``context`` tokens whose cache fits beside the weights and the reserve (0 if none)."""
    context = _positive_int("context", context)
    f = fit(model, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization, reserve_gib=reserve_gib)
    per_seq = budget(model, 1, context, kv_format, tp=tp, block_size=block_size).cache_bytes_per_gpu
    if f.free_for_cache_per_gpu <= 0:
        return 0
    return f.free_for_cache_per_gpu // max(per_seq, 1)


def max_context(model, batch: int, kv_format="bf16", gpu="H100-80GB", weights_dtype="bf16", *,
                tp: int = 1, memory_utilization: float = 0.9, block_size: int = 1, limit: int = 1 << 24,
                reserve_gib: float = DEFAULT_RESERVE_GIB, weights_gib: float | None = None) -> int:
    """Longest context (tokens) at which ``batch`` sequences fit; capped at ``limit``.

    Windowed layers stop growing, so a model of only windowed layers can reach
    ``limit``. Not capped at ``max_position_embeddings``: compare it yourself.
    """
    limit = _positive_int("limit", limit)
    batch = _positive_int("batch", batch)
    f = fit(model, gpu, weights_dtype, tp=tp, memory_utilization=memory_utilization, reserve_gib=reserve_gib,
            weights_gib=weights_gib)
    if f.free_for_cache_per_gpu <= 0:
        return 0

    fmt = get_format(kv_format)
    # A format that quantizes whole groups of tokens (KIVI's keys) holds a group in full precision until it
    # fills, so its bytes fall a little when a group closes: they grow only across whole groups. A sequence
    # must fit at every length it passes through, so test every length of the group that ends at t.
    period = max(token_group(fmt.key), token_group(fmt.value))

    def fits_one(t):
        return budget(model, batch, t, kv_format, tp=tp, block_size=block_size).cache_bytes_per_gpu <= f.free_for_cache_per_gpu

    def fits(t):  # every length from t - period + 1 to t fits; monotone in t, so bisection is sound
        return all(fits_one(s) for s in range(max(0, t - period + 1), t + 1))

    if not fits(0):
        return 0
    lo, hi = 0, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- what an engine gives the cache
#
# vLLM sizes its cache at start-up: it may use ``--gpu-memory-utilization`` x the GPU's total memory; it loads
# the weights, runs a profile forward pass at the largest batch it will schedule, and subtracts the weights,
# that pass's activation peak and the memory torch does not manage (NCCL, the CUDA context, CUDA graphs). What
# is left becomes blocks of ``block_size`` tokens, each holding every layer's K and V for those tokens on this
# rank. Its start-up log prints each step ("Available KV cache memory", "GPU KV cache size: N tokens", "Maximum
# concurrency"); tests/test_budget.py reconciles this model with published logs (data/presets/vllm_logs.json).


@dataclass(frozen=True)
class EngineCache:
    """The KV cache a vLLM-style engine allocates on one GPU (one tensor-parallel rank)."""

    available_bytes: int  # memory given to the cache
    bytes_per_token: int  # one token in every layer on this rank (K and V)
    block_size: int
    blocks: int

    @property
    def tokens(self) -> int:
        """What vLLM prints as "GPU KV cache size: N tokens"."""
        return self.blocks * self.block_size

    def concurrency(self, max_model_len: int) -> float:
        """What vLLM prints as "Maximum concurrency for L tokens per request: Cx"."""
        return self.tokens / _positive_int("max_model_len", max_model_len)


def engine_available_bytes(total_gib: float, gpu_memory_utilization: float = 0.9, weights_gib: float = 0.0,
                           reserve_gib: float = DEFAULT_RESERVE_GIB) -> int:
    """Memory left for the cache: ``utilization x total - weights - reserve`` (activation peak and
    non-torch memory), in bytes, never below zero."""
    total_gib = _gib("total_gib", total_gib, positive=True)
    weights_gib, reserve_gib = _gib("weights_gib", weights_gib), _gib("reserve_gib", reserve_gib)
    share = _fraction("gpu_memory_utilization", gpu_memory_utilization)
    return max(0, int((share * total_gib - weights_gib - reserve_gib) * GIB))


def engine_cache(model, kv_format="bf16", available_bytes: int | None = None, *, tp: int = 1,
                 block_size: int = 16) -> EngineCache:
    """The cache an engine builds from ``available_bytes`` (see :func:`engine_available_bytes`):
    whole blocks of ``block_size`` tokens, every layer's K and V on this rank (KV heads split over
    ``tp`` ranks, or replicated when there are fewer heads than ranks).

    vLLM allocates sliding-window layers from their own block pool, so models with windows are refused.
    """
    shape = load_shape(model)
    fmt = get_format(kv_format)
    tp = _positive_int("tp", tp)
    _check_tp(shape, tp)
    block_size = _positive_int("block_size", block_size)
    available_bytes = _positive_int("available_bytes", available_bytes, zero_ok=True)
    if any(layer.window for layer in shape.layers):
        raise ValueError(f"{shape.name} has sliding-window layers: vLLM sizes their blocks apart, not modelled here")
    if fmt.residual or fmt.sinks or fmt.layers:
        raise ValueError(f"kv_format {fmt.name!r} keeps some tokens or layers in another precision; "
                         "an engine's paged cache stores one format")
    per_token = math.ceil(sum(_layer_bits_per_token(layer, fmt, tp, None) for layer in shape.layers) / 8)
    return EngineCache(available_bytes, per_token, block_size, available_bytes // (per_token * block_size))


_VLLM_LINES = {  # what vLLM's start-up log prints, across versions (V0 2024-25 and V1)
    "total_gib": r"total_gpu_memory[ =(]+([\d.]+) ?GiB",
    "utilization": r"gpu_memory_utilization[ =(]+([\d.]+)",
    "weights_gib": r"model weights take ([\d.]+) ?GiB",
    "non_torch_gib": r"non_torch_memory(?: takes|=)\s*([\d.]+) ?GiB",
    "activation_gib": r"activation peak memory takes ([\d.]+) ?GiB",
    "peak_torch_gib": r"peak_torch_memory=([\d.]+) ?GiB",
    "available_gib": r"(?:Available KV cache memory:|reserved for KV Cache is|kv_cache_size=) ?([\d.]+) ?GiB",
    "tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "blocks": r"# (?:GPU|CUDA) blocks: (\d+)|^GPU blocks: (\d+)",
    "max_model_len": r"Maximum concurrency for ([\d,]+) tokens per request",
    "concurrency": r"tokens per request: ([\d.]+)x",
}


def read_vllm_log(lines) -> dict[str, float]:
    """The numbers in vLLM start-up lines (``"GPU KV cache size: 175,856 tokens"`` -> ``{"tokens": 175856}``).

    Paste your own server's log to compare it with :func:`engine_cache`. Only the fields found are returned.
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    if not isinstance(lines, list | tuple) or not all(isinstance(x, str) for x in lines):
        raise TypeError("lines must be a string or a list of strings")
    out = {}
    for n, line in enumerate(lines, 1):
        for key, pat in _VLLM_LINES.items():
            m = re.search(pat, line)
            if m and key not in out:
                text = next(g for g in m.groups() if g is not None).replace(",", "")
                try:
                    value = float(text)
                except ValueError:
                    value = math.nan
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"line {n}: {key} reads {text[:40]!r}, not a number vLLM prints")
                out[key] = value
    return out


VLLM_LOGS = PRESETS / "vllm_logs.json"
LOG_ROUNDING_GIB = 0.005  # the logs print GiB to two decimals


def published_vllm_logs() -> list[dict]:
    """The published start-up logs of ``data/presets/vllm_logs.json``, each read (``numbers``, from
    :func:`read_vllm_log`) and set beside :func:`engine_cache`: ``logged_tokens`` (vLLM's count),
    ``kvlab_tokens`` (from the printed cache memory), ``bytes_per_token``, ``ratio`` (vLLM / kvlab),
    ``reserve_gib`` (non-torch + activation peak, where the log prints them) and ``within_rounding`` (vLLM's
    count lies in what the printed GiB, +-0.005, allows)."""
    out = []
    for log in json.loads(VLLM_LOGS.read_text())["logs"]:
        n = read_vllm_log(log["lines"])
        fmt = "fp8_e4m3" if log["kv_cache_dtype"] == "fp8" else "bf16"
        logged = int(n.get("tokens") or n["blocks"] * 16)

        ours, lo, hi = (engine_cache(log["model"], fmt, int((n["available_gib"] + d) * GIB), tp=log["tp"])
                        for d in (0, -LOG_ROUNDING_GIB, LOG_ROUNDING_GIB))
        out.append(log | {"numbers": n, "fmt": fmt, "logged_tokens": logged, "kvlab_tokens": ours.tokens,
                          "bytes_per_token": ours.bytes_per_token, "ratio": logged / ours.tokens,
                          "within_rounding": lo.tokens <= logged <= hi.tokens,
                          "reserve_gib": n["non_torch_gib"] + n["activation_gib"] if "activation_gib" in n else None})
    return out
