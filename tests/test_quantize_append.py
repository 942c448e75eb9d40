import pytest
import torch

from kvlab.formats import get_format

append = pytest.importorskip("kvlab.kernels.quantize_append", reason="triton is not installed")
from kvlab.kernels.decode_attention import allocate, decode_attention, decode_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a CPU, Triton's interpreter rounds float -> fp8 casts differently from CUDA: FP8 is quantized
# on the host there, and the kernel's FP8 path is tested on a GPU only.
FORMATS = ["fp16", "int8", "int4", "int4_token", "lmdeploy-int8", "lmdeploy-int4"]
if DEV == "cuda":
    FORMATS += ["fp8_e4m3_token"]


def same(a, b):
    if a is None:
        return b is None
    return torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                       b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_append_matches_host_quantization_bit_for_bit(fmt, head_dim):
    q = get_format(fmt).key
    B, H, T = 3, 2, 40
    a, r = allocate(q, B, H, T, head_dim, DEV), allocate(q, B, H, T, head_dim, DEV)
    pos = torch.tensor([0, 5, 37], dtype=torch.int32, device=DEV)
    x = torch.randn(B, H, 3, head_dim, device=DEV) * 3
    append.quantize_append(a, x, pos)
    append.quantize_append_reference(r, x, pos)
    assert same(a.codes, r.codes) and same(a.scale, r.scale) and same(a.zero, r.zero)


def test_decode_after_appends():
    """Generation's loop: append one token, attend, repeat; the kernel reads what the kernel wrote."""
    q = get_format("int4").key
    k, v = allocate(q, 2, 2, 64, 64, DEV), allocate(q, 2, 2, 64, 64, DEV)
    lens = torch.tensor([0, 10], dtype=torch.int32, device=DEV)
    for _ in range(12):
        append.quantize_append(k, torch.randn(2, 2, 1, 64, device=DEV), lens)
        append.quantize_append(v, torch.randn(2, 2, 1, 64, device=DEV), lens)
        lens += 1
        qry = torch.randn(2, 8, 64, device=DEV)
        torch.testing.assert_close(decode_attention(qry, k, v, lens), decode_attention_reference(qry, k, v, lens),
                                   atol=2e-5 if DEV == "cpu" else 1e-2, rtol=1e-4 if DEV == "cpu" else 1e-2)


def test_overflow_is_an_error():
    k = allocate(get_format("int8").key, 1, 1, 4, 64, DEV)
    with pytest.raises(ValueError, match="overflows capacity"):
        append.quantize_append(k, torch.randn(1, 1, 2, 64, device=DEV), torch.tensor([3], device=DEV))
