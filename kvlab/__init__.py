"""kvlab: measure KV-cache quantization.

Importing ``kvlab`` (or a module that only reads results, such as :mod:`kvlab.results`,
:mod:`kvlab.budget`'s arithmetic or :mod:`kvlab.decide`) does not import torch.
"""

import os
import shutil
import warnings


def _gpu_present() -> bool:
    """An NVIDIA driver on this machine: ``nvidia-smi`` (the Makefile's test for installing CUDA torch) or the
    kernel driver's ``/proc`` entry. Without one, torch cannot use CUDA, so Triton must interpret."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")


# Without CUDA, Triton kernels run under Triton's interpreter, which is chosen when triton is first imported.
# Set it here, before anything can import triton: loading a transformers config pulls in torch ops that
# import triton, so waiting for kvlab.kernels (which checks torch.cuda itself) is not early enough.
if not _gpu_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers 5.x renames generate()/forward()'s `past_key_values` to `cache` and warns on every
# call; kvlab keeps the old name (accepted across 5.x), so silence that one warning.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
