"""Triton kernels, installed as ``kvlab.kernels``.

On a machine without CUDA the kernels run under Triton's interpreter: this
module sets ``TRITON_INTERPRET=1`` *before* importing triton (the interpreter
is chosen when a kernel is decorated). Without triton at all (e.g. macOS),
``HAVE_TRITON`` is False and the kernel modules raise ImportError with a reason;
their torch references live in the same files' callers' reach via
``kvlab.quant`` and ``kvlab.metrics``.
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

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
