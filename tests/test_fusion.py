import pytest
import torch

from kvlab.formats import get_format
from kvlab.fusion import peak_memory, tiled_decode, unfused_decode
from kvlab.kernels.reference import decode_attention_reference
from kvlab.quant import quantize
from kvlab.storage import KVStore


def cache(fmt, B=2, H=2, T=600, D=64):
    f = get_format(fmt)
    return (KVStore.from_qtensor(quantize(torch.randn(B, H, T, D), f.key)),
            KVStore.from_qtensor(quantize(torch.randn(B, H, T, D), f.value)))


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4", "fp8_e4m3"])
def test_tiled_and_unfused_match_reference(fmt):
    k, v = cache(fmt)
    q = torch.randn(2, 8, 64)
    ref = decode_attention_reference(q, k, v, torch.tensor([600, 600]))
    torch.testing.assert_close(tiled_decode(q, k, v, block=128), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unfused_decode(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_peak_memory_sees_torch_allocations():
    _, peak = peak_memory(lambda: torch.ones(1_000_000) * 2)
    assert 8_000_000 <= peak < 12_000_000  # two 4 MB tensors alive at once
    _, peak = peak_memory(lambda: [torch.ones(1_000_000) for _ in range(3)])
    assert peak >= 12_000_000


@pytest.mark.slow
def test_fused_peak_is_a_tile_not_the_cache():
    """Unfused peak grows with the context; tile-by-tile peak does not."""
    peaks = {}
    for T in (2048, 4096):
        k, v = cache("int4", B=2, H=4, T=T, D=64)
        q = torch.randn(2, 16, 64)
        peaks[T] = (peak_memory(unfused_decode, q, k, v)[1], peak_memory(tiled_decode, q, k, v, block=256)[1])
    full_precision_cache = 2 * 2 * 4 * 4096 * 64 * 4  # K and V in fp32 at 4096 tokens
    assert peaks[4096][0] >= full_precision_cache
    assert peaks[4096][0] > 1.8 * peaks[2048][0]
    assert peaks[4096][1] < 1.2 * peaks[2048][1]
    assert peaks[4096][1] < peaks[4096][0] / 4


@pytest.mark.slow
def test_everything_but_the_kernels_works_without_triton(tmp_path):
    """Where no triton wheel exists, kvlab imports, the storage and torch paths run, and the kernel says why not."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
import torch, kvlab, kvlab.cache, kvlab.fusion, kvlab.kernels
from kvlab.storage import KVStore
from kvlab.quant import quantize
from kvlab.formats import get_format
assert kvlab.kernels.HAVE_TRITON is False
f = get_format("int4")
k = KVStore.from_tensor(torch.randn(1, 2, 64, 64), f.key); v = KVStore.from_tensor(torch.randn(1, 2, 64, 64), f.value)
kvlab.fusion.tiled_decode(torch.randn(1, 4, 64), k, v)
try:
    import kvlab.kernels.decode_attention
except ImportError as e:
    assert "triton is not installed" in str(e)
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.strip() == "ok", r.stderr[-2000:]
