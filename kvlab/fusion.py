"""Why the attention kernel must read the quantized cache itself: peak memory, measured.

Two ways to attend over a quantized cache:

* **unfused** — dequantize the whole cache into a full-precision tensor, then call
  ``torch.nn.functional.scaled_dot_product_attention``. Simple, and it
  temporarily re-creates the full-precision cache you quantized to get rid of.
* **fused** — read codes tile by tile, dequantize each tile in registers (or, in
  :func:`tiled_decode`, in a small temporary), and fold it into an online
  softmax. Only one tile is ever expanded. :mod:`kvlab.kernels.decode_attention`
  does this on the GPU; :func:`tiled_decode` is the same algorithm in torch, so
  the memory effect can be measured on any device.

:func:`peak_memory` measures the peak of torch's allocations during a call: with
``torch.cuda.max_memory_allocated`` on a GPU, and from the allocation and free
events of ``torch.profiler`` (``profile_memory=True``) on a CPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import torch


@contextlib.contextmanager
def _native_stderr_silenced():
    """Silence file descriptor 2 for a moment: torch's CPU profiler prints "USDT ... profiler_start/stop"
    from C++ straight to it, which would land in every chapter that measures memory."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory(fn: Callable, *args, device: str | torch.device | None = None, **kwargs):
    """``(result, peak_bytes)``: the most memory torch held at once during ``fn``, above what was held before.

    ``device`` defaults to the device of the first tensor argument (CPU if there is none).
    """
    if device is None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = first.device if first is not None else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    live = peak = 0
    # Allocations are charged to the op that made them (its *self* usage); frees appear as
    # "[memory]" events with negative sizes. Replaying them in time order gives the live bytes.
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak


def unfused_decode(q: torch.Tensor, k, v, scaling: float | None = None, dtype=torch.float32) -> torch.Tensor:
    """Dequantize all of K and V (:class:`~kvlab.storage.KVStore`), then SDPA. ``q``: ``[batch, q_heads, head_dim]``."""
    kf, vf = k.dequantize().to(dtype), v.dequantize().to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None].to(dtype), kf, vf, scale=scaling, enable_gqa=True)
    return out[:, :, 0].float()


def tiled_decode(q: torch.Tensor, k, v, scaling: float | None = None, block: int = 256) -> torch.Tensor:
    """The fused kernel's algorithm in torch: dequantize ``block`` tokens at a time, online softmax.

    Every sequence is taken to be the store's full length. (This is
    :func:`kvlab.kernels.reference.attend_tiles`, the path :class:`kvlab.cache.KVQuantCache`
    decodes through on a CPU.)
    """
    from kvlab.kernels.reference import attend_tiles
    from kvlab.storage import KVStore

    if not isinstance(k, KVStore) or not isinstance(v, KVStore):
        raise TypeError("k and v must be kvlab.storage.KVStore")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    return attend_tiles(q, k, v, scaling, block=block)[0]
