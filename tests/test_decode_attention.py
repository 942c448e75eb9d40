"""The fused decode kernel against its plain-torch reference, for every format it reads.

On a CPU this runs under Triton's interpreter (kvlab.kernels sets TRITON_INTERPRET=1
before importing triton); on CUDA the same tests run natively.
"""

import pytest
import torch

from kvlab.formats import get_format
from kvlab.quant import quantize
from kvlab.storage import KVStore

kernels = pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
pytestmark = pytest.mark.slow  # the kernels under Triton's interpreter on a CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token", "int8", "int8_tensor", "int4",
           "int4_token", "q4_0", "lmdeploy-int8", "lmdeploy-int4"]
# Tolerance: both sides compute in float32 from identical codes; only summation order differs.
ATOL = 2e-5 if DEV == "cpu" else 1e-2  # on a GPU tl.dot on float32 tiles uses TF32 (10-bit mantissa)


def make(fmt, B, Hkv, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    f = get_format(fmt)
    kq = KVStore.from_qtensor(quantize(k.to(DEV), f.key))
    vq = KVStore.from_qtensor(quantize(v.to(DEV), f.value))
    return kq, vq


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_mixed_lengths_match_reference(fmt, head_dim, gqa):
    lens = torch.tensor([1, 17, 1000], dtype=torch.int32, device=DEV)
    kq, vq = make(fmt, 3, 2, 1000, head_dim)
    q = torch.randn(3, 2 * gqa, head_dim, device=DEV)
    out = kernels.decode_attention(q, kq, vq, lens)
    ref = kernels.decode_attention_reference(q, kq, vq, lens)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4 if DEV == "cpu" else 1e-2)


@pytest.mark.parametrize("length", [1, 17, 1000])
def test_single_sequence_split_kv(length):
    kq, vq = make("int4", 1, 1, 1024, 128, seed=1)
    q = torch.randn(1, 8, 128, device=DEV)
    lens = torch.tensor([length], dtype=torch.int32, device=DEV)
    ref = kernels.decode_attention_reference(q, kq, vq, lens)
    for splits in (1, 3, 8):  # the log-sum-exp merge must not depend on how the sequence is cut
        out = kernels.decode_attention(q, kq, vq, lens, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4 if DEV == "cpu" else 1e-2)


def test_lse_matches_logsumexp():
    kq, vq = make("int8", 1, 1, 64, 64)
    q = torch.randn(1, 1, 64, device=DEV)
    lens = torch.tensor([64], device=DEV)
    _, lse = kernels.decode_attention(q, kq, vq, lens, return_lse=True)
    s = (q[0].float() @ kq.dequantize()[0, 0].T) * 64**-0.5
    torch.testing.assert_close(lse[0], torch.logsumexp(s, dim=-1), atol=ATOL * 5, rtol=1e-5 if DEV == "cpu" else 1e-2)


def test_reads_the_cache_layout():
    """The cache's own stores go to the kernel as they are, and give what SDPA gives over the dequantized cache."""
    from kvlab.cache import KVQuantCache

    cache = KVQuantCache("int4")
    k, v = torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    q = torch.randn(1, 4, 64)
    out = kernels.decode_attention(q.to(DEV), layer.k_store.to(DEV), layer.v_store.to(DEV),
                                   torch.tensor([50], device=DEV))
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], *layer.dequantized(), enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out.cpu(), want, atol=max(ATOL, 1e-4), rtol=1e-4 if DEV == "cpu" else 1e-2)


def test_clear_errors():
    kq, vq = make("int8", 1, 2, 8, 64)
    lens = torch.tensor([8], device=DEV)
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.decode_attention(torch.randn(1, 3, 64, device=DEV), kq, vq, lens)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        kernels.decode_attention(torch.randn(1, 2, 64, device=DEV), kq, vq, torch.tensor([9], device=DEV))
    with pytest.raises(ValueError, match="head_dim"):
        kernels.decode_attention(torch.randn(1, 2, 32, device=DEV), kq, vq, lens)
    kivi = KVStore.from_tensor(torch.randn(1, 2, 64, 64, device=DEV), get_format("kivi-4").key)
    with pytest.raises(ValueError, match="kernel does not read"):
        kernels.decode_attention(torch.randn(1, 2, 64, device=DEV), kivi, kivi, lens)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.decode_attention(torch.randn(1, 2, 64, device=DEV), kq, vq, lens, num_splits=0)
    short = KVStore.from_qtensor(quantize(torch.randn(1, 2, 8, 64, device=DEV), get_format("int8").key))
    short.scale = short.scale[:, :, :4]  # scales for 4 tokens over codes for 8: would read past the buffer
    with pytest.raises(ValueError, match="do not cover"):
        kernels.decode_attention(torch.randn(1, 2, 64, device=DEV), short, vq, lens)
    for bad in (float("nan"), float("inf"), 0.0, -1.0, True, "0.1"):
        with pytest.raises(ValueError, match="scaling"):
            kernels.decode_attention(torch.randn(1, 2, 64, device=DEV), kq, vq, lens, scaling=bad)


def test_strided_query_is_read_correctly():
    """A query that is a view with strides (e.g. a slice of a bigger projection) gives the same answer."""
    kq, vq = make("int8", 1, 2, 100, 64)
    lens = torch.tensor([100], device=DEV)
    big = torch.randn(1, 64, 8, device=DEV)
    q = big.transpose(1, 2)[:, :4]  # [1, 4, 64], last-axis stride 8
    torch.testing.assert_close(kernels.decode_attention(q, kq, vq, lens),
                               kernels.decode_attention_reference(q, kq, vq, lens),
                               atol=ATOL, rtol=1e-4 if DEV == "cpu" else 1e-2)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(["fp16", "fp8_e4m3", "int8", "int4", "q4_0", "lmdeploy-int4"]),
       B=st.integers(1, 3), Hkv=st.integers(1, 2), gqa=st.sampled_from([1, 3, 4]), T=st.integers(1, 150),
       D=st.sampled_from([32, 64]), strided=st.booleans(), seed=st.integers(0, 1000))
def test_generated_shapes_match_the_reference(fmt, B, Hkv, gqa, T, D, strided, seed):
    f = get_format(fmt)
    g = torch.Generator().manual_seed(seed)
    if any(q.granularity == "group" and D % q.group_size for q in (f.key, f.value)):
        return  # the group size does not divide head_dim: quantize() refuses (tested in test_quant)
    k = KVStore.from_tensor(torch.randn(B, Hkv, T, D, generator=g).to(DEV), f.key)
    v = KVStore.from_tensor(torch.randn(B, Hkv, T, D, generator=g).to(DEV), f.value)
    lens = torch.randint(1, T + 1, (B,), generator=g).to(torch.int32).to(DEV)
    q = torch.randn(B, D, Hkv * gqa, generator=g).to(DEV).transpose(1, 2) if strided else \
        torch.randn(B, Hkv * gqa, D, generator=g).to(DEV)
    out = kernels.decode_attention(q, k, v, lens)
    torch.testing.assert_close(out, kernels.decode_attention_reference(q, k, v, lens),
                               atol=max(ATOL, 5e-5), rtol=1e-4 if DEV == "cpu" else 1e-2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token"])
def test_fp8_read_as_bytes_matches_the_reference(fmt):
    """The sm_80 path: FP8 codes loaded as bytes and converted with integer operations."""
    kq, vq = make(fmt, 2, 2, 300, 64)
    q = torch.randn(2, 8, 64, device=DEV)
    lens = torch.tensor([300, 41], dtype=torch.int32, device=DEV)
    out = kernels.decode_attention(q, kq, vq, lens, fp8_bits=True)
    torch.testing.assert_close(out, kernels.decode_attention_reference(q, kq, vq, lens), atol=ATOL,
                               rtol=1e-4 if DEV == "cpu" else 1e-2)


def test_fp8_bit_conversion_is_exact_for_every_byte():
    """All 256 codes of both formats, NaN and the signed zeros included, against torch's own conversion."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(X, OUT, E4M3: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(OUT + offs, kernels._fp8_bits_to_f32(tl.load(X + offs), E4M3))

    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    for dt, e4m3 in ((torch.float8_e4m3fn, True), (torch.float8_e5m2, False)):
        out = torch.empty(256, device=DEV)
        convert[(1,)](codes, out, E4M3=e4m3)
        want = codes.view(dt).float()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(out), nan), f"{dt}: NaN codes differ"
        assert torch.equal(out[~nan], want[~nan]), f"{dt}: values differ"
        assert torch.equal(torch.signbit(out[~nan]), torch.signbit(want[~nan])), f"{dt}: signed zeros differ"


def test_interpreter_is_chosen_even_when_triton_is_imported_early():
    """Loading a transformers config imports triton (through torch ops) before kvlab.kernels: the kernels must still
    run under the interpreter on a CPU (chapter 3 computes a roofline from a config before it runs the kernel)."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("on CUDA the kernels run natively")
    code = (
        "import sys, torch\n"
        "from kvlab import roofline\n"
        "roofline.decode_step('llama-3.1-8b', 1, 1024, 'bf16', gpu='H200')\n"
        "from kvlab.kernels.decode_attention import decode_attention, decode_attention_reference\n"
        "from kvlab.storage import KVStore\n"
        "from kvlab.formats import get_format\n"
        "f = get_format('int8'); k, v, q = torch.randn(1, 1, 40, 64), torch.randn(1, 1, 40, 64), torch.randn(1, 2, 64)\n"
        "ks, vs = KVStore.from_tensor(k, f.key), KVStore.from_tensor(v, f.value); lens = torch.tensor([40], dtype=torch.int32)\n"
        "print(float((decode_attention(q, ks, vs, lens) - decode_attention_reference(q, ks, vs, lens)).abs().max()))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-3


def test_max_error_vs_reference_reports_the_kernels_own_error():
    errs = kernels.max_error_vs_reference(["bf16", "int4"], lengths=(40, 7), device=DEV)
    assert set(errs) == {"bf16", "int4"} and all(0 <= e < 1e-3 for e in errs.values())
    for bad in [{"lengths": ()}, {"lengths": (0, 3)}]:
        with pytest.raises(ValueError, match="lengths"):
            kernels.max_error_vs_reference(["bf16"], **bad)
    with pytest.raises(ValueError, match="formats"):
        kernels.max_error_vs_reference([])
