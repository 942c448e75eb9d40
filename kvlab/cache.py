"""A ``transformers`` cache that stores K and V in any kvlab format.

:class:`KVQuantCache` is a ``transformers.Cache`` made of :class:`KVQuantLayer`
objects, one per decoder layer, each with the library's one-method contract:
``update(new_keys, new_values) -> (keys, values)``. It therefore works with
``model(..., past_key_values=cache)`` and ``model.generate(past_key_values=cache)``.

Storage per layer, oldest tokens first:

* ``sinks`` — the first tokens, kept in full precision (StreamingLLM's attention
  sinks, Xiao et al. 2023, arXiv:2309.17453);
* the quantized body — two :class:`~kvlab.storage.KVStore` (K and V): codes, scales
  and zeros in preallocated buffers, in the layout the Triton kernel reads;
* the residual — the most recent tokens, in full precision, flushed into the
  body once more than ``residual`` are waiting (KIVI's streaming residual,
  Liu et al. 2024, arXiv:2402.02750). Formats whose groups run along tokens
  flush whole groups only, so up to ``residual + group_size - 1`` wait.

Scales shared over a whole tensor, head or channel are *calibrated once*, on the
first tokens that reach the body, then frozen; later values saturate. This mirrors
static-scale FP8 in vLLM and ``transformers``' ``Fp8QuantizedLayer``. Per-token and
grouped scales are computed for each token (or group) as it arrives.

**How attention reads it.** No full-precision copy of the cache is kept. A model
whose attention implementation is ``"kvlab"`` (:func:`kvlab.load_model` sets it;
:func:`use_kvlab_attention` sets it on any model) hands each decode step to the
layer, which attends over the stores a tile at a time (:func:`kvlab.kernels.reference.attend_tiles`
on a CPU; the Triton kernel on CUDA or inside :class:`fused_attention`) and merges
the full-precision sinks and residual by log-sum-exp. Prefill (several query tokens)
and any model with another attention implementation get the dequantized cache back
from ``update``, built for that call only.

``quantize_prefill`` (default True): the first forward also attends over the
dequantized cache, as a server whose attention kernel reads the cache does. With
False, the first call returns the incoming states untouched, as
``transformers.QuantizedCache`` does.
"""

from __future__ import annotations

import math
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .formats import LAYER_TYPES, KVFormat, get_format
from .kernels.reference import attend_dense, attend_tiles, merge_partials
from .quant import hadamard
from .storage import KVStore, check_kernel_readable, kernel_head_dim_ok

ATTENTION = "kvlab"


class CacheKeys(torch.Tensor):
    """The keys :meth:`KVQuantLayer.update` returns, and the hand-off from the cache to attention.

    It is the key tensor itself (any code that reads keys reads it as it would a plain tensor, and every
    operation on it returns a plain tensor), plus two fields that :func:`kvlab_attention` reads:

    * ``layer`` — the :class:`KVQuantLayer` holding this layer's cache (None once that layer is gone);
    * ``complete`` — True when the tensor holds every key the query may attend to (attention can read it
      as usual). False for a decode step whose quantized body was *not* expanded: the tensor is just the
      new token's keys, and only ``layer.attend(query)`` gives the right answer.
    """

    # operations on CacheKeys return plain tensors, as they do on nn.Parameter
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(keys: torch.Tensor, layer: KVQuantLayer, complete: bool) -> CacheKeys:
        out = keys.as_subclass(CacheKeys)
        out._layer, out.complete = weakref.ref(layer), complete  # weak: the cache owns its layers
        return out

    @property
    def layer(self) -> KVQuantLayer | None:
        return self._layer()


class KVQuantLayer(DynamicLayer):
    """One decoder layer's cache in a kvlab format (see the module docstring)."""

    is_croppable = False

    def __init__(self, fmt: str | KVFormat = "fp16", quantize_prefill: bool = True, kernel: bool | None = None,
                 window: int | None = None):
        super().__init__()
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 2):
            raise ValueError(f"window must be an integer >= 2 or None, got {window!r}")
        self.window = window  # a sliding-window layer keeps its last `window` tokens (the mask hides the oldest)
        self.fmt = get_format(fmt)
        self.quantize_prefill = quantize_prefill
        self.kernel = kernel  # None: the Triton kernel on CUDA for formats it reads; True/False: always/never
        self.cumulative_length = 0
        self.k_store, self.v_store = KVStore(self.fmt.key), KVStore(self.fmt.value)
        self.sink_k = self.sink_v = self.res_k = self.res_v = None
        # The attention side of the hand-off (see CacheKeys): set by attended_by(), cleared by stop_attending()
        self.attends = False  # the model's attention reads this layer through kvlab_attention
        self._pending = False  # a decode step's incomplete keys were handed out and not yet attended
        self._config = None  # weakref to the config of the model that attends through this layer

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self.sink_k, self.sink_v = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
        self.res_k, self.res_v = self.sink_k.clone(), self.sink_v.clone()
        self.keys = self.values = self.sink_k  # transformers reads these for dtype/device only
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        if self._pending:  # the last step's keys were handed out for attend(), and nobody attended
            raise RuntimeError("the model stopped attending through kvlab (its attention implementation changed "
                               "mid-generation?): call kvlab.cache.use_kvlab_attention(model), or start a new cache")
        if key_states.shape[-2] != value_states.shape[-2]:
            raise ValueError(f"keys and values must hold the same tokens, got {key_states.shape[-2]} and "
                             f"{value_states.shape[-2]}")
        if not first:
            self._check_same_stream(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        k, v = key_states, value_states
        # 1. the first `sinks` tokens stay in full precision (a windowed layer forgets them like any token)
        room = (0 if self.window else self.fmt.sinks) - self.sink_k.shape[-2]
        if room > 0:
            self.sink_k = torch.cat([self.sink_k, k[..., :room, :]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v[..., :room, :]], dim=-2)
            k, v = k[..., room:, :], v[..., room:, :]
        # 2. everything else enters the residual; the overflow is quantized in whole chunks
        self.res_k = torch.cat([self.res_k, k], dim=-2)
        self.res_v = torch.cat([self.res_v, v], dim=-2)
        self._flush()
        if first and not self.quantize_prefill:
            out = key_states, value_states
        elif key_states.shape[-2] == 1 and not self.window and self._attends_now():
            self._pending = True  # attend() reads the stores instead of an expanded copy
            return CacheKeys.wrap(key_states, self, complete=False), value_states
        else:
            out = self.dequantized()
        if self.window:  # the next token's window: `window` tokens, its own included, so window - 1 would do;
            # kvlab keeps `window` (as the budget and engines count it) and the mask hides the oldest one
            self._forget(self.held - self.window)
        return CacheKeys.wrap(out[0], self, complete=True), out[1]

    def attended_by(self, config) -> None:
        """Attention's side of the hand-off: ``kvlab_attention`` received this layer's keys.

        From then on, while ``config`` still names the kvlab implementation, decode steps hand out
        incomplete keys and expect :meth:`attend` (a model without a config keeps getting complete keys)."""
        self.attends, self._pending = True, False
        self._config = weakref.ref(config) if config is not None else None

    def stop_attending(self) -> None:
        """The model went back to another attention implementation: hand out complete keys again."""
        self.attends = False

    def _check_same_stream(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer holds one batch of one model: later tokens must match the first in every way but length."""
        for name, x, ref in (("key_states", k, self.res_k), ("value_states", v, self.res_v)):
            if x.dim() != 4 or x.shape[:2] != ref.shape[:2] or x.shape[-1] != ref.shape[-1]:
                raise ValueError(f"{name} {tuple(x.shape)} does not continue this cache's "
                                 f"[batch={ref.shape[0]}, kv_heads={ref.shape[1]}, tokens, head_dim={ref.shape[-1]}]: "
                                 "a new batch or model needs a new cache")
            if x.dtype != self.dtype or x.device != self.device:
                raise ValueError(f"{name} is {x.dtype} on {x.device}, but this cache holds {self.dtype} on "
                                 f"{self.device}: a new dtype or device needs a new cache")

    @property
    def is_sliding(self) -> bool:  # transformers reads it to pick each mask's layer
        return self.window is not None

    @property
    def held(self) -> int:
        """Tokens this layer holds now (all of them, or a window's worth for a sliding layer)."""
        return 0 if self.sink_k is None else self.sink_k.shape[-2] + self.k_store.tokens + self.res_k.shape[-2]

    def _forget(self, n: int) -> None:
        """Drop the oldest ``n`` tokens: whole groups from the quantized body, then from the residual.

        A token group that still holds a token inside the window stays whole, so a token-grouped
        format may hold up to ``group - 1`` tokens more than the window (the mask hides them).
        """
        if n <= 0:
            return
        chunk = math.lcm(self.k_store.chunk, self.v_store.chunk)
        body = min(n, self.k_store.tokens) // chunk * chunk
        self.k_store.drop_front(body)
        self.v_store.drop_front(body)
        if self.k_store.tokens == 0:
            rest = n - body
            self.res_k, self.res_v = self.res_k[..., rest:, :], self.res_v[..., rest:, :]

    def _attends_now(self) -> bool:
        """True while the model that last attended through this layer still uses the "kvlab" implementation."""
        config = self._config() if self._config is not None else None
        return self.attends and config is not None and config._attn_implementation == ATTENTION

    def _rotate(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        H = hadamard(x.shape[-1], device=x.device)
        return (x.float() @ (H.T if inverse else H)).to(x.dtype)

    def _flush(self) -> None:
        chunk = math.lcm(self.k_store.chunk, self.v_store.chunk)  # K and V must flush the same tokens
        over = self.res_k.shape[-2] - self.fmt.residual
        n = over // chunk * chunk
        if n <= 0:
            return
        k, v = self.res_k[..., :n, :], self.res_v[..., :n, :]
        if self.fmt.rotate:  # store K H and V H; attend() rotates q and un-rotates the output
            k, v = self._rotate(k), self._rotate(v)
        self.k_store.append(k)
        self.v_store.append(v)
        self.res_k, self.res_v = self.res_k[..., n:, :], self.res_v[..., n:, :]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values as unfused attention reads them: sinks, dequantized body, residual.

        Built on demand (a full-precision tensor of the whole context); the decode path does not call it.
        """
        parts_k, parts_v = [self.sink_k], [self.sink_v]
        if self.k_store.tokens:
            bk, bv = self.k_store.dequantize(), self.v_store.dequantize()
            if self.fmt.rotate:
                bk, bv = self._rotate(bk, inverse=True), self._rotate(bv, inverse=True)
            parts_k.append(bk.to(self.dtype))
            parts_v.append(bv.to(self.dtype))
        parts_k.append(self.res_k)
        parts_v.append(self.res_v)
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def attend(self, q: torch.Tensor, scaling: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of ``q`` ``[batch, q_heads, head_dim]`` over everything this layer holds.

        ``bias`` ``[batch, tokens]`` (0 keeps a token, -inf masks it) follows the cache's
        token order. Returns float32 ``[batch, q_heads, head_dim]``. The quantized body is read
        by the Triton kernel (see ``kernel``) or tile by tile in torch; the few full-precision
        sinks and residual tokens in torch; the pieces are merged by log-sum-exp.
        """
        scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
        S, T = self.sink_k.shape[-2], self.k_store.tokens
        cut = lambda a, b: None if bias is None else bias[:, a:b]
        parts = []
        if S:
            parts.append(attend_dense(q, self.sink_k, self.sink_v, scaling, bias=cut(0, S)))
        if T:
            qr = self._rotate(q) if self.fmt.rotate else q
            if self._use_kernel(q, cut(S, S + T)):
                from .kernels.decode_attention import decode_attention

                lens = torch.full((q.shape[0],), T, dtype=torch.int32, device=q.device)
                out, lse = decode_attention(qr, self.k_store, self.v_store, lens, scaling, return_lse=True)
            else:
                out, lse = attend_tiles(qr, self.k_store, self.v_store, scaling, bias=cut(S, S + T))
            parts.append((self._rotate(out, inverse=True) if self.fmt.rotate else out, lse))
        if self.res_k.shape[-2]:
            parts.append(attend_dense(q, self.res_k, self.res_v, scaling, bias=cut(S + T, None)))
        return merge_partials(parts)

    def _use_kernel(self, q: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if self.kernel is False or not (self.k_store.kernel_readable and self.v_store.kernel_readable):
            return False
        if not kernel_head_dim_ok(q.shape[-1]):
            return False  # the kernels need a power-of-two head_dim: torch reads the rest
        if bias is not None and not bool((bias == 0).all()):
            return False  # the kernel takes lengths, not masks: padded batches go through torch
        return bool(self.kernel) or q.is_cuda

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the tokens held are the last `held` of `cumulative_length`: their absolute positions start there
        return self.held + query_length, self.cumulative_length - self.held

    def get_max_length(self) -> int:
        return self.window if self.window else -1

    def reset(self) -> None:
        self.__init__(self.fmt, self.quantize_prefill, self.kernel, self.window)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KVQuantCache does not support beam search; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVQuantCache cannot drop tokens (no assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVQuantCache cannot expand its batch; expand the inputs before the prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KVQuantCache cannot select batch rows; start a new cache")

    @property
    def nbytes(self) -> int:
        """Bytes this layer really holds: full-precision sinks and residual, codes, scales and zeros."""
        full = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.res_k, self.res_v)
                   if t is not None)
        return full + self.k_store.nbytes + self.v_store.nbytes


def _kernel_mode(fmt: KVFormat, kernel):
    """``kernel`` checked: None, True or False, and True only for a format the kernel reads."""
    if kernel not in (None, True, False):
        raise TypeError(f"kernel must be None, True or False, got {kernel!r}")
    if kernel:
        check_kernel_readable(fmt.key, "format's keys")
        check_kernel_readable(fmt.value, "format's values")
    return kernel


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, its sliding window in tokens (None: the layer attends to the whole context)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    if not hasattr(config, "get_text_config"):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(kwargs, dict):  # transformers before 5.2x: one kwargs dict for every layer, not one per layer
        kwargs = [kwargs] * len(types)
    return [kw.get("sliding_window") if t in ("sliding_attention", "chunked_attention") else None
            for t, kw in zip(types, kwargs)]


def _layer_formats(fmt: KVFormat, layer_formats, kernel) -> dict[str, KVFormat]:
    """``{"sliding_attention" | "full_attention": format}`` checked; a type not named uses the cache's
    format. Without ``layer_formats``, the format's own per-layer-type overrides (``"int4_token@global"``)."""
    if layer_formats is None:
        layer_formats = dict(fmt.layers)
    if not isinstance(layer_formats, dict) or set(layer_formats) - set(LAYER_TYPES):
        raise ValueError(f"layer_formats must map some of {LAYER_TYPES} to formats, got {layer_formats!r}")
    out = {t: get_format(f) for t, f in layer_formats.items()}
    for f in out.values():
        if f.layers:
            raise ValueError(f"layer_formats: {f.name!r} is itself a per-layer-type mix; give a plain format")
        _kernel_mode(f, kernel)
    return out


class _LayerFactory:
    """Makes a cache's layers on demand. Holds the cache weakly: a closure over the cache would be a
    reference cycle, freed only by the garbage collector, so sweeps would pile up dead caches."""

    def __init__(self, cache: KVQuantCache):
        self.cache = weakref.ref(cache)

    def __call__(self) -> KVQuantLayer:
        c = self.cache()
        return c._layer(None)


class KVQuantCache(Cache):
    """A ``transformers`` cache storing K and V in a kvlab format.

    >>> model = kvlab.load_model()          # attention implementation "kvlab"
    >>> cache = KVQuantCache("int4")
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    >>> cache.nbytes            # bytes the cache really holds

    ``kernel``: None (default) reads the quantized body with the Triton kernel when the
    query is on CUDA and the format is one the kernel reads, else tile by tile in torch;
    True always uses the kernel (under Triton's interpreter on a CPU: slow, exact);
    False never does.
    """

    def __init__(self, fmt: str | KVFormat = "fp16", num_layers: int | None = None, *,
                 quantize_prefill: bool = True, kernel: bool | None = None, config=None,
                 layer_formats: dict | None = None, _layers_from_prefill: bool = False):
        self.fmt = get_format(fmt)
        if not isinstance(quantize_prefill, bool):
            raise TypeError(f"quantize_prefill must be a bool, got {quantize_prefill!r}")
        self._kernel = kernel = _kernel_mode(self.fmt, kernel)
        self.quantize_prefill = quantize_prefill
        self.layer_formats = _layer_formats(self.fmt, layer_formats, kernel)
        if config is not None:  # one layer per decoder layer, windowed where the model's layer is
            windows = layer_windows(config)
            if num_layers is not None and num_layers != len(windows):
                raise ValueError(f"num_layers={num_layers} but the config has {len(windows)} layers")
            self._check_layer_types(windows)
            super().__init__(layers=[self._layer(w) for w in windows])
        elif self.layer_formats and not _layers_from_prefill:
            raise ValueError(f"{self.fmt.name!r} stores each layer type its own way: pass config=model.config so "
                             "the cache knows which layers slide (or build it with from_prefill)")
        elif num_layers is None:
            super().__init__(layer_class_to_replicate=_LayerFactory(self))
        else:
            if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
            super().__init__(layers=[self._layer(None) for _ in range(num_layers)])

    def _check_layer_types(self, windows: list) -> None:
        """A per-layer-type format must name layer types the model has (else it silently stores fp32)."""
        present = {"sliding_attention" if w else "full_attention" for w in windows}
        if missing := [t for t in self.layer_formats if t not in present]:
            raise ValueError(f"KV format {self.fmt.name!r} quantizes {missing[0].replace('_', ' ')} layers; "
                             "this model has none")

    def _layer(self, window: int | None) -> KVQuantLayer:
        fmt = self.layer_formats.get("sliding_attention" if window else "full_attention", self.fmt.for_layer(window))
        return KVQuantLayer(fmt, self.quantize_prefill, self._kernel, window)

    @classmethod
    def from_prefill(cls, fmt: str | KVFormat, prefill, *, kernel: bool | None = None,
                     layer_formats: dict | None = None) -> KVQuantCache:
        """A cache in ``fmt`` holding the K and V of a full-precision prefill.

        ``prefill`` is a ``transformers`` cache (e.g. the ``DynamicCache`` a forward
        pass filled). This is how a serving engine stores a fresh prompt: attention
        during the prefill used the full-precision K and V, and only the stored copy
        is quantized; every later decode step reads it back. One prefill can fill
        caches in many formats. Sliding-window layers stay sliding, at the same positions.
        """
        layers = getattr(prefill, "layers", None)
        if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
            raise ValueError("prefill must be a transformers cache that a forward pass has filled")
        cache = cls(fmt, quantize_prefill=False, kernel=kernel, layer_formats=layer_formats, _layers_from_prefill=True)
        windows = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                   for layer in layers]
        cache._check_layer_types(windows)
        cache.layers = [cache._layer(w) for w in windows]
        for i, layer in enumerate(layers):
            cache.update(layer.keys, layer.values, i)
            # a windowed prefill layer holds only its last tokens: keep their true positions
            cache.layers[i].cumulative_length = layer.get_seq_length()
        return cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        if self.layer_class_to_replicate is None and layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is past this cache's {len(self.layers)} layers")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kernel(self) -> bool | None:
        return self._kernel

    @kernel.setter
    def kernel(self, on: bool | None) -> None:
        self._kernel = on = _kernel_mode(self.fmt, on)
        for layer in self.layers:
            layer.kernel = on


# --------------------------------------------------------------------------- attention


def kvlab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"kvlab"`` attention implementation: SDPA, except for decode steps over a :class:`KVQuantCache`.

    ``KVQuantLayer.update`` returns its keys as :class:`CacheKeys`, which name the layer. An
    incomplete single-token step is answered by that layer's :meth:`KVQuantLayer.attend`, so each
    cache serves its own layers (two caches in one process never meet). Everything else
    — plain keys (``DynamicCache``), prefill, sliding windows, soft-capping — is SDPA.
    """
    layer = key.layer if isinstance(key, CacheKeys) else None
    if layer is not None:
        layer.attended_by(getattr(module, "config", None))
    plain = (layer is None or key.complete or query.shape[-2] != 1 or kwargs.get("sliding_window")
             or kwargs.get("softcap") or (dropout and module.training))
    if plain:
        if layer is not None and not key.complete:  # an option attend() does not take: expand the cache
            key, value = layer.dequantized()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    bias = None
    if attention_mask is not None:  # [batch, 1, 1, tokens], boolean (keep) or additive
        m = attention_mask[:, 0, -1, : layer.cumulative_length]
        bias = torch.where(m, 0.0, float("-inf")) if m.dtype == torch.bool else m.float()
    out = layer.attend(query[:, :, 0], scaling, bias)
    return out[:, None].to(query.dtype), None  # [batch, 1 query token, heads, head_dim]


AttentionInterface.register(ATTENTION, kvlab_attention)
# Masks as for SDPA: without a registered mask function, transformers builds no mask at all for a
# custom attention implementation, and padded batches would silently attend to their padding.
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_kvlab_attention(model) -> None:
    """Route ``model``'s attention through :func:`kvlab_attention` (SDPA for every other cache)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    model.set_attn_implementation(ATTENTION)


class fused_attention:
    """Context manager: decode steps through ``cache`` read its quantized body with the Triton kernel.

    >>> with fused_attention(model, cache):
    ...     model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)

    Prefill attends over the dequantized cache as usual; each decode step calls
    :func:`kvlab.kernels.decode_attention` on the codes and scales the cache holds
    (under Triton's interpreter on a CPU), and plain torch on the few full-precision
    sink and residual tokens, merging the two by log-sum-exp. Padded rows fall back to
    torch (the kernel takes lengths, not masks). Needs a format the kernel reads
    (:func:`kvlab.storage.kernel_readable`).
    """

    def __init__(self, model, cache: KVQuantCache):
        from .kernels.decode_attention import decode_attention  # noqa: F401  (fails early without triton)

        if not isinstance(cache, KVQuantCache):
            raise TypeError(f"cache must be a KVQuantCache, got {type(cache).__name__}")
        _kernel_mode(cache.fmt, True)
        if not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        self.model, self.cache = model, cache

    def __enter__(self):
        self._old_attn = self.model.config._attn_implementation
        self._old_kernel = self.cache.kernel
        use_kvlab_attention(self.model)
        self.cache.kernel = True
        return self

    def __exit__(self, *exc):
        self.cache.kernel = self._old_kernel
        self.model.set_attn_implementation(self._old_attn)
        if self._old_attn != ATTENTION:  # back to plain SDPA: the cache must hand out complete keys again
            for layer in self.cache.layers:
                layer.stop_attending()
        return False
