"""A ``transformers`` cache that stores K and V in any kvlab format.

:class:`KVQuantCache` is a ``transformers.Cache`` made of :class:`KVQuantLayer`
objects, one per decoder layer, each with the library's one-method contract:
``update(new_keys, new_values) -> (all_keys, all_values)``. It therefore works
with ``model(..., past_key_values=cache)`` and ``model.generate(past_key_values=cache)``.

Storage per layer, oldest tokens first:

* ``sinks`` — the first tokens, kept in full precision (StreamingLLM's attention
  sinks, Xiao et al. 2023, arXiv:2309.17453);
* the quantized body — codes, scales and zeros in one contiguous tensor each
  (``[batch, kv_heads, tokens, ...]``; the layout the Triton kernel reads);
* the residual — the most recent tokens, in full precision, flushed into the
  body once more than ``residual`` are waiting (KIVI's streaming residual,
  Liu et al. 2024, arXiv:2402.02750). Formats whose groups run along tokens
  flush whole groups only, so up to ``residual + group_size - 1`` wait.

Scales shared over a whole tensor, head or channel (they would change with every
token) are *calibrated once*, on the first tokens that reach the body, then
frozen; later values saturate. This mirrors static-scale FP8 in vLLM and
``transformers``' ``Fp8QuantizedLayer``. Per-token and grouped scales are computed
for each token (or group) as it arrives.

``quantize_prefill`` (default True): the first forward also attends over the
dequantized cache, as a server whose attention kernel reads the cache does. With
False, the first call returns the incoming states untouched, as
``transformers.QuantizedCache`` does.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .formats import KVFormat, Quantizer, get_format
from .quant import QTensor, dequantize, hadamard, quantize


def _token_dim(q: Quantizer) -> int | None:
    """Axis of a scale tensor that grows with tokens; None when the scale is frozen."""
    if q.granularity == "token":
        return -2
    if q.granularity == "group":
        return -3  # [..., T, D/g, 1] for channel groups, [..., T/g, 1, D] for token groups
    return None


class _Store:
    """The quantized body of K or V for one layer: appendable codes, scales, zeros.

    Appends are kept as a list of chunks and merged into one :class:`QTensor`
    only when someone reads :attr:`qt` (the fused kernel, or ``nbytes``), so a
    decode step never re-copies the whole store.
    """

    def __init__(self, q: Quantizer, rotate: bool):
        self.q, self.rotate = q, rotate
        self._chunks: list[QTensor] = []
        self.tokens = 0

    @property
    def chunk(self) -> int:
        return self.q.group_size if (self.q.granularity == "group" and self.q.group_axis == "token") else 1

    @property
    def qt(self) -> QTensor | None:
        """Everything stored, as one QTensor (chunks merged on first read after an append)."""
        if len(self._chunks) > 1:
            td = _token_dim(self.q)
            first = self._chunks[0]
            cat = lambda ts: torch.cat(ts, dim=td) if td is not None else ts[0]
            shape = (*first.shape[:-2], self.tokens, first.shape[-1])
            self._chunks = [QTensor(
                torch.cat([c.data for c in self._chunks], dim=-2),
                None if first.scale is None else cat([c.scale for c in self._chunks]),
                None if first.zero is None else cat([c.zero for c in self._chunks]),
                shape, self.q, first.dtype)]
        return self._chunks[0] if self._chunks else None

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize and store ``x``; return what the cache now holds for it, dequantized."""
        if self.rotate:
            x = (x.float() @ hadamard(x.shape[-1], device=x.device)).to(x.dtype)
        frozen = self._chunks[0] if self._chunks and _token_dim(self.q) is None else None
        new = quantize(x, self.q, scale=frozen.scale if frozen else None, zero=frozen.zero if frozen else None)
        self._chunks.append(new)
        self.tokens += x.shape[-2]
        out = dequantize(new)
        if self.rotate:
            out = (out.float() @ hadamard(out.shape[-1], device=out.device).T).to(out.dtype)
        return out

    @property
    def nbytes(self) -> int:
        if not self._chunks:
            return 0
        if _token_dim(self.q) is None:  # one frozen scale shared by every chunk
            first = self._chunks[0]
            meta = sum(t.numel() * t.element_size() for t in (first.scale, first.zero) if t is not None)
            return meta + sum(c.data.numel() * c.data.element_size() for c in self._chunks)
        return sum(c.nbytes for c in self._chunks)


class _Mirror:
    """What unfused attention reads: every token of the layer, in full precision, at its position.

    Sinks and residual tokens are written as they arrive; when tokens move from the
    residual into the quantized body, their slots are overwritten with the
    dequantized values. Capacity grows geometrically, so an append costs O(new tokens).
    """

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def write(self, start: int, x: torch.Tensor) -> None:
        end = start + x.shape[-2]
        if self.buf is None or end > self.buf.shape[-2]:
            cap = max(end, 2 * (0 if self.buf is None else self.buf.shape[-2]), 64)
            new = x.new_empty((*x.shape[:-2], cap, x.shape[-1]))
            if self.buf is not None:
                new[..., : self.buf.shape[-2], :] = self.buf
            self.buf = new
        self.buf[..., start:end, :] = x.to(self.buf.dtype)

    def view(self, n: int) -> torch.Tensor:
        return self.buf[..., :n, :]


class KVQuantLayer(DynamicLayer):
    """One decoder layer's cache in a kvlab format (see the module docstring)."""

    is_croppable = False

    def __init__(self, fmt: str | KVFormat = "fp16", quantize_prefill: bool = True, fused: bool = False):
        super().__init__()
        self.fused = fused  # decode steps attend through the kernel: skip dequantizing the cache
        self.fmt = get_format(fmt)
        self.quantize_prefill = quantize_prefill
        self.cumulative_length = 0
        self.k_store = _Store(self.fmt.key, self.fmt.rotate)
        self.v_store = _Store(self.fmt.value, self.fmt.rotate)
        self.sink_k = self.sink_v = self.res_k = self.res_v = None
        self.mirror_k, self.mirror_v = _Mirror(), _Mirror()

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = key_states[..., :0, :]
        self.sink_k, self.sink_v = empty.clone(), value_states[..., :0, :].clone()
        self.res_k, self.res_v = empty.clone(), value_states[..., :0, :].clone()
        self.keys = self.values = empty  # transformers reads these for dtype/device only
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        k, v = key_states, value_states
        # 1. the first `sinks` tokens stay in full precision
        room = self.fmt.sinks - self.sink_k.shape[-2]
        if room > 0:
            self.sink_k = torch.cat([self.sink_k, k[..., :room, :]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v[..., :room, :]], dim=-2)
            k, v = k[..., room:, :], v[..., room:, :]
        # 2. everything else enters the residual; the overflow is quantized in whole chunks
        self.res_k = torch.cat([self.res_k, k], dim=-2)
        self.res_v = torch.cat([self.res_v, v], dim=-2)
        self.mirror_k.write(start, key_states)
        self.mirror_v.write(start, value_states)
        self._flush()
        if (first and not self.quantize_prefill) or (self.fused and key_states.shape[-2] == 1 and not first):
            return key_states, value_states  # fused decode: attend() reads the stored codes instead
        return self._gather()

    def _flush(self) -> None:
        chunk = self.k_store.chunk
        over = self.res_k.shape[-2] - self.fmt.residual
        n = over // chunk * chunk
        if n <= 0:
            return
        at = self.sink_k.shape[-2] + self.k_store.tokens  # position of the first flushed token
        self.mirror_k.write(at, self.k_store.append(self.res_k[..., :n, :]))
        self.mirror_v.write(at, self.v_store.append(self.res_v[..., :n, :]))
        self.res_k, self.res_v = self.res_k[..., n:, :], self.res_v[..., n:, :]

    def _gather(self):
        """All keys and values, as attention reads them: sinks, dequantized body, residual."""
        n = self.cumulative_length
        return self.mirror_k.view(n).to(self.dtype), self.mirror_v.view(n).to(self.dtype)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def reset(self) -> None:
        self.__init__(self.fmt, self.quantize_prefill, self.fused)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KVQuantCache does not support beam search; use greedy or sampling")

    def attend(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention of ``q`` ``[batch, q_heads, head_dim]`` over everything this layer holds."""
        from .kernels.decode_attention import decode_attention, from_qtensor

        parts = []
        if self.k_store.tokens:
            kq, vq = from_qtensor(self.k_store.qt), from_qtensor(self.v_store.qt)
            qr = q
            if self.fmt.rotate:  # stored K' = K H, so q.k = (q H).(K H); V' = V H, undone on the output
                H = hadamard(q.shape[-1], device=q.device)
                qr = (q.float() @ H).to(q.dtype)
            lens = torch.full((q.shape[0],), self.k_store.tokens, dtype=torch.int32, device=q.device)
            out, lse = decode_attention(qr, kq, vq, lens, scaling, return_lse=True)
            if self.fmt.rotate:
                out = out @ H.T
            parts.append((out, lse))
        k_full = torch.cat([self.sink_k, self.res_k], dim=-2).float()
        if k_full.shape[-2]:
            v_full = torch.cat([self.sink_v, self.res_v], dim=-2).float()
            rep = q.shape[1] // k_full.shape[1]
            s = torch.einsum("bhd,bhnd->bhn", q.float(), k_full.repeat_interleave(rep, 1)) * scaling
            lse = torch.logsumexp(s, dim=-1)
            parts.append((torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), v_full.repeat_interleave(rep, 1)), lse))
        lses = torch.stack([lse for _, lse in parts])  # merge the pieces, as the split kernel's merge does
        w = torch.softmax(lses, dim=0)
        return sum(w_i[..., None] * o for w_i, (o, _) in zip(w, parts))

    @property
    def nbytes(self) -> int:
        """Bytes this layer really holds: full-precision sinks and residual, codes, scales and zeros."""
        full = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.res_k, self.res_v)
                   if t is not None)
        return full + self.k_store.nbytes + self.v_store.nbytes


class _LayerFactory:
    """Makes a cache's layers on demand. Holds the cache weakly: a closure over the cache would be a
    reference cycle, freed only by the garbage collector, so sweeps would pile up dead caches."""

    def __init__(self, cache: KVQuantCache):
        self.cache = weakref.ref(cache)

    def __call__(self) -> KVQuantLayer:
        c = self.cache()
        return KVQuantLayer(c.fmt, c.quantize_prefill, c._fused)


class KVQuantCache(Cache):
    """A ``transformers`` cache storing K and V in a kvlab format.

    >>> cache = KVQuantCache("int4")
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    >>> cache.nbytes            # bytes the cache really holds
    """

    def __init__(self, fmt: str | KVFormat = "fp16", num_layers: int | None = None, *,
                 quantize_prefill: bool = True):
        self.fmt = get_format(fmt)
        if not isinstance(quantize_prefill, bool):
            raise TypeError(f"quantize_prefill must be a bool, got {quantize_prefill!r}")
        self._fused = False
        self.quantize_prefill = quantize_prefill
        if num_layers is None:
            super().__init__(layer_class_to_replicate=_LayerFactory(self))
        else:
            if not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
            super().__init__(layers=[KVQuantLayer(self.fmt, quantize_prefill) for _ in range(num_layers)])

    @classmethod
    def from_prefill(cls, fmt: str | KVFormat, prefill) -> KVQuantCache:
        """A cache in ``fmt`` holding the K and V of a full-precision prefill.

        ``prefill`` is a ``transformers`` cache (e.g. the ``DynamicCache`` a forward
        pass filled). This is how a serving engine stores a fresh prompt: attention
        during the prefill used the full-precision K and V, and only the stored copy
        is quantized; every later decode step reads it back. One prefill can fill
        caches in many formats.
        """
        layers = getattr(prefill, "layers", None)
        if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
            raise ValueError("prefill must be a transformers cache that a forward pass has filled")
        cache = cls(fmt, quantize_prefill=False)
        for i, layer in enumerate(layers):
            cache.update(layer.keys, layer.values, i)
        return cache

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def fused(self) -> bool:
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self._fused = bool(on)
        for layer in self.layers:
            layer.fused = self._fused


# --------------------------------------------------------------------------- fused decode


_FUSED = "kvlab_fused"
_active: KVQuantCache | None = None


class fused_attention:
    """Context manager: decode steps through ``cache`` use the Triton kernel on the quantized body.

    >>> with fused_attention(model, cache):
    ...     model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)

    Prefill (several query tokens) attends over the dequantized cache as usual;
    each decode step (one query token) calls :func:`kvlab.kernels.decode_attention`
    on the codes and scales the cache holds, and plain torch on the few
    full-precision sink and residual tokens, merging the two by log-sum-exp.
    Needs unpadded batches, and a format the kernel reads (per-tensor,
    per-token or channel-grouped scales; not KIVI's token-grouped keys).
    """

    def __init__(self, model, cache: KVQuantCache):
        from .kernels.decode_attention import KINDS  # noqa: F401  (fails early without triton)

        if not isinstance(cache, KVQuantCache):
            raise TypeError(f"cache must be a KVQuantCache, got {type(cache).__name__}")
        for q in (cache.fmt.key, cache.fmt.value):
            if (q.granularity == "group" and q.group_axis == "token") or q.granularity in ("channel", "head"):
                raise ValueError(f"format {cache.fmt.name!r} has {q.granularity} scales, which the kernel does not read")
            if q.kind == "int" and q.bits not in (4, 8):
                raise ValueError(f"the kernel reads INT8 and INT4, not INT{q.bits}")
        self.model, self.cache = model, cache

    def __enter__(self):
        global _active
        from transformers import AttentionInterface

        AttentionInterface.register(_FUSED, _fused_attention_fn)
        self._old = self.model.config._attn_implementation
        self.model.set_attn_implementation(_FUSED)
        self.cache.fused = True
        _active = self.cache
        return self

    def __exit__(self, *exc):
        global _active
        _active = None
        self.cache.fused = False
        self.model.set_attn_implementation(self._old)
        return False


def _fused_attention_fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _active is None or query.shape[-2] != 1 or _active.layers[module.layer_idx].get_seq_length() <= 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    out = _active.layers[module.layer_idx].attend(query[:, :, 0], scaling or query.shape[-1] ** -0.5)
    return out[:, None].to(query.dtype), None  # [batch, 1 query token, heads, head_dim]


