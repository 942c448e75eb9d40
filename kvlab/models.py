"""Load a causal LM and capture the K, V (and Q) it really computes.

``load_model()`` returns the model the project ships in ``data/model`` (a small
Llama trained by ``scripts/train_model.py``); ``load_model("org/name")`` or a local
path loads any Hugging Face causal LM with the ordinary ``from_pretrained`` code.

``capture(model, input_ids)`` runs one forward pass and returns, per layer:

* ``keys`` and ``values`` after RoPE — what the cache stores — read from a
  ``DynamicCache`` filled by the forward pass itself;
* ``queries`` after RoPE, recorded by a registered ``transformers`` attention
  function that records its inputs and then runs the standard SDPA attention;
* ``keys_pre_rope`` — the ``k_proj`` output before rotation, where the model has
  one (Llama, Mistral, Qwen, Gemma ...; KVQuant, Hooper et al. 2024,
  arXiv:2401.18079, quantizes keys at this point).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_DIR = Path(__file__).resolve().parents[1] / "data" / "model"
_CAPTURE = "kvlab_capture"
_records: list | None = None


def load_model(name_or_path: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` in eval mode. Default: the shipped kvlab-tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    src = MODEL_DIR if name_or_path is None else name_or_path
    if name_or_path is None and not (MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(f"the shipped model is missing from {MODEL_DIR}; run scripts/train_model.py")
    if not isinstance(src, str | Path):
        raise TypeError(f"name_or_path must be a model name or a path, got {type(src).__name__}")
    try:
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load model {str(src)!r}: {str(e).splitlines()[0]} "
            "(a hub name needs network access; offline, pass a local folder)"
        ) from None
    return model, tok


@dataclass
class Capture:
    """Per-layer tensors shaped ``[batch, heads, tokens, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    keys_pre_rope: list[torch.Tensor] | None
    scaling: list[float]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _records is not None:
        _records.append((query.detach(), kwargs.get("scaling") or query.shape[-1] ** -0.5))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register():
    from transformers import AttentionInterface

    AttentionInterface.register(_CAPTURE, _recording_attention)


@torch.no_grad()
def capture(model, input_ids: torch.Tensor) -> Capture:
    """One forward pass; K, V, Q per layer as the model computed them (see module docstring)."""
    from transformers import DynamicCache

    global _records
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a 2-D LongTensor [batch, tokens]")
    _register()
    pre, hooks = [], []
    for layer in _attention_modules(model):
        if hasattr(layer, "k_proj"):
            hd = getattr(layer, "head_dim", None)
            hooks.append(layer.k_proj.register_forward_hook(
                lambda m, i, o, hd=hd: pre.append(o.view(*o.shape[:-1], -1, hd).transpose(1, 2))))
    old = model.config._attn_implementation
    _records = []
    try:
        model.set_attn_implementation(_CAPTURE)
        cache = DynamicCache(config=model.config)
        model(input_ids.to(model.device), past_key_values=cache, use_cache=True)
        queries, scaling = [q for q, _ in _records], [s for _, s in _records]
    finally:
        _records = None
        model.set_attn_implementation(old)
        for h in hooks:
            h.remove()
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Capture(keys, values, queries, pre if len(pre) == len(keys) else None, scaling)


def _attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]
