"""kvlab: measure KV-cache quantization."""

import os
import warnings

import torch

# Without CUDA, Triton kernels run under Triton's interpreter, which is chosen when triton is first imported.
# Set it here, before anything can import triton: loading a transformers config pulls in torch ops that
# import triton, so waiting for kvlab.kernels (which sets it too) is not early enough.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers 5.x renames generate()/forward()'s `past_key_values` to `cache` and warns on every
# call; kvlab keeps the old name (accepted across 5.x), so silence that one warning.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
