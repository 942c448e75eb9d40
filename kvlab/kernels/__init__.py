"""Triton kernels, installed as ``kvlab.kernels``.

* :mod:`~kvlab.kernels.decode_attention` — split-KV decode attention that reads a
  :class:`kvlab.storage.KVStore` (FP16/BF16, FP8, INT8, INT4) without expanding it;
* :mod:`~kvlab.kernels.quantize_append` — quantizes new tokens straight into a store;
* :mod:`~kvlab.kernels.reference` — the plain-torch reference, the tile-by-tile torch
  path the cache uses on a CPU, and the log-sum-exp merge. Needs no triton.

On a machine without CUDA the kernels run under Triton's interpreter: this module
sets ``TRITON_INTERPRET=1`` *before* importing triton (the interpreter is chosen when
a kernel is decorated). Without triton at all (e.g. macOS), ``HAVE_TRITON`` is False
and the two kernel modules raise ImportError with a reason; ``reference`` still works.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # no wheel for this platform
    triton = tl = None
    HAVE_TRITON = False
