import pytest
import torch

from kvlab.formats import get_format

append = pytest.importorskip("kvlab.kernels.quantize_append", reason="triton is not installed")
from kvlab.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from kvlab.storage import KVStore  # noqa: E402

allocate = KVStore.allocate

pytestmark = pytest.mark.slow  # the kernels under Triton's interpreter on a CPU
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
        k.tokens = v.tokens = int(lens.max())  # the stores count rows written; lens says what each sequence uses
        qry = torch.randn(2, 8, 64, device=DEV)
        torch.testing.assert_close(decode_attention(qry, k, v, lens), decode_attention_reference(qry, k, v, lens),
                                   atol=2e-5 if DEV == "cpu" else 1e-2, rtol=1e-4 if DEV == "cpu" else 1e-2)


def test_overflow_is_an_error():
    k = allocate(get_format("int8").key, 1, 1, 4, 64, DEV)
    with pytest.raises(ValueError, match="overflows capacity"):
        append.quantize_append(k, torch.randn(1, 1, 2, 64, device=DEV), torch.tensor([3], device=DEV))


@pytest.mark.parametrize("fmt", ["int8", "int4", "lmdeploy-int4", "int8_tensor"])
def test_store_append_uses_the_kernel_path_and_matches_the_host(fmt, monkeypatch):
    """KVStore.append on CUDA goes through the kernel; forced here on the interpreter, it must equal the host."""
    q = get_format(fmt).key
    x = torch.randn(2, 2, 70, 64, device=DEV) * 2
    host, dev = KVStore(q), KVStore(q)
    monkeypatch.setattr(KVStore, "_append_on_device", lambda self, x: True)
    for s, a, b in ((dev, 0, 30), (dev, 30, 31), (dev, 31, 70)):
        s.append(x[:, :, a:b])
    monkeypatch.undo()
    for a, b in ((0, 30), (30, 31), (31, 70)):
        host.append(x[:, :, a:b])
    assert same(dev.codes[:, :, :70], host.codes[:, :, :70])
    if q.granularity != "tensor":
        assert same(dev.scale[:, :, :70], host.scale[:, :, :70]) and same(
            None if dev.zero is None else dev.zero[:, :, :70], None if host.zero is None else host.zero[:, :, :70])


def test_append_kernel_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="kernel does not read"):
        append.quantize_append(KVStore.from_tensor(torch.randn(1, 1, 32, 64), get_format("kivi-4").key),
                               torch.randn(1, 1, 1, 64), torch.tensor([0]))
    with pytest.raises(ValueError, match="full-range"):
        append.quantize_append(allocate(get_format("q4_0").key, 1, 1, 4, 64), torch.randn(1, 1, 1, 64),
                               torch.tensor([0]))
