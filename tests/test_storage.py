import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.formats import KVFormat, Quantizer, format_names, get_format
from kvlab.kernels.reference import (
    attend_dense,
    attend_tiles,
    decode_attention_reference,
    merge_partials,
)
from kvlab.quant import dequantize, quantize
from kvlab.storage import KVStore, kernel_readable, kernel_unreadable

# per-channel and per-head scales, which no preset uses for both K and V
CHANNEL = KVFormat("int4_channel", Quantizer("int4", "channel", symmetric=False), Quantizer("int4", "channel", symmetric=False))
HEAD = KVFormat("int4_head", Quantizer("int4", "head"), Quantizer("int4", "head"))
GROWING = ["fp16", "int8", "int4", "int4_token", "q4_0", "q8_0", "lmdeploy-int4", "fp8_e4m3_token"]


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


@pytest.mark.parametrize("fmt", GROWING + ["kivi-2"])
@pytest.mark.parametrize("side", ["key", "value"])
def test_appends_across_capacity_growth_are_bit_exact(fmt, side):
    """Many small appends (through several doublings) hold exactly what one quantize() of the whole gives."""
    q = getattr(get_format(fmt), side)
    x = torch.randn(2, 3, 320, 64) * 3
    store, t, steps = KVStore(q), 0, [q.group_size if store_chunk(q) > 1 else s for s in (1, 5, 64, 7, 100, 1)]
    capacities = []
    while t < 320:
        n = min(steps[len(capacities) % len(steps)], 320 - t)
        store.append(x[:, :, t : t + n])
        t += n
        capacities.append(store.capacity)
    assert len(set(capacities)) > 2, "capacity should have grown several times"
    whole = quantize(x, q)
    got = store.view()
    assert torch.equal(bits(got.data), bits(whole.data))
    for a, b in ((got.scale, whole.scale), (got.zero, whole.zero)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a.reshape(b.shape), b))
    assert torch.equal(store.dequantize(), dequantize(whole).float())


def store_chunk(q):
    return q.group_size if q.granularity == "group" and q.group_axis == "token" else 1


@pytest.mark.parametrize("fmt", ["int4_tensor", "fp8_e4m3", "int8_tensor", CHANNEL, HEAD])
def test_frozen_scales_are_calibrated_once(fmt):
    q = get_format(fmt).key
    first, later = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 30, 64) * 10  # later values saturate
    store = KVStore(q)
    store.append(first)
    scale = store.scale.clone()
    store.append(later)
    assert torch.equal(store.scale, scale)
    want = quantize(later, q, scale=scale, zero=store.zero)
    assert torch.equal(bits(store.view(40, 70).data), bits(want.data))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3", "int8", "int4", "q4_0", "kivi-2", CHANNEL, HEAD])
def test_bytes_held_are_codes_and_scales_of_the_tokens_not_the_capacity(fmt):
    f = get_format(fmt)
    for q in (f.key, f.value):
        store = KVStore.from_tensor(torch.randn(2, 2, 96, 64), q)
        store.append(torch.randn(2, 2, 32, 64))  # grows capacity to 192
        assert store.reserved_bytes > store.nbytes
        per_elem = q.bits_per_element(64)
        static = 0 if q.granularity in ("token", "group") or q.is_passthrough else None
        if static == 0:
            assert store.nbytes * 8 == pytest.approx(2 * 2 * 128 * 64 * per_elem)
        else:  # frozen statistics counted once
            assert store.nbytes > 2 * 2 * 128 * 64 * q.bits / 8


def test_views_and_bad_input():
    q = get_format("kivi-2").key  # token groups of 32
    store = KVStore.from_tensor(torch.randn(1, 2, 64, 64), q)
    assert store.dequantize(32, 64).shape == (1, 2, 32, 64)
    with pytest.raises(ValueError, match="cuts a group"):
        store.view(5, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        store.append(torch.randn(1, 2, 7, 64))
    with pytest.raises(ValueError, match="does not match"):
        store.append(torch.randn(1, 3, 32, 64))
    with pytest.raises(ValueError, match=r"\[batch, kv_heads"):
        KVStore(q).append(torch.randn(2, 64))
    with pytest.raises(ValueError, match="empty"):
        KVStore(q).dequantize()
    with pytest.raises(TypeError, match="Quantizer"):
        KVStore("int4")
    with pytest.raises(ValueError, match="capacity must be a positive"):
        KVStore.allocate(q, 1, 1, 0, 64)


def test_kernel_readable_is_one_table():
    readable = {n for n in format_names() if all(kernel_readable(q) for q in (get_format(n).key, get_format(n).value))}
    assert {"fp16", "fp8_e4m3", "int8", "int4", "q4_0", "lmdeploy-int4"} <= readable
    assert not readable & {"kivi-2", "kivi-4"}
    assert "token" in kernel_unreadable(get_format("kivi-2").key)
    assert "INT2" in kernel_unreadable(get_format("kivi-2").value)
    assert "channel" in kernel_unreadable(CHANNEL.key) and "head" in kernel_unreadable(HEAD.key)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(["fp16", "int8", "int4", "fp8_e4m3", "kivi-2", "q4_0", CHANNEL]),
       T=st.integers(1, 300), block=st.sampled_from([16, 64, 1024]), gqa=st.sampled_from([1, 3]),
       masked=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_tiles_equal_the_reference_for_any_length_block_and_mask(fmt, T, block, gqa, masked, seed):
    f = get_format(fmt)
    g = torch.Generator().manual_seed(seed)
    chunk = max(store_chunk(f.key), store_chunk(f.value))
    T = max(chunk, T // chunk * chunk)
    k = KVStore.from_tensor(torch.randn(2, 2, T, 64, generator=g), f.key)
    v = KVStore.from_tensor(torch.randn(2, 2, T, 64, generator=g), f.value)
    q = torch.randn(2, 2 * gqa, 64, generator=g)
    masked = min(masked, T - 1)
    bias = torch.zeros(2, T)
    bias[0, :masked] = float("-inf")  # left padding in row 0
    out, lse = attend_tiles(q, k, v, bias=bias, block=block)
    kf, vf = k.dequantize(), v.dequantize()
    for b, start in ((0, masked), (1, 0)):
        kb, vb = kf[b : b + 1, :, start:], vf[b : b + 1, :, start:]
        want = decode_attention_reference(q[b : b + 1], KVStore.from_tensor(kb, get_format("fp32").key),
                                          KVStore.from_tensor(vb, get_format("fp32").key),
                                          torch.tensor([T - start]))
        torch.testing.assert_close(out[b : b + 1], want, atol=2e-5, rtol=1e-4)
        s = torch.einsum("hd,hnd->hn", q[b], kb[0].repeat_interleave(gqa, 0)) * 64**-0.5
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1), atol=1e-4, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_merge_of_pieces_is_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 64, generator=g), torch.randn(1, 2, 50, 64, generator=g), torch.randn(1, 2, 50, 64, generator=g)
    whole, _ = attend_dense(q, k, v)
    parts = [attend_dense(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 3), (3, 40), (40, 50))]
    torch.testing.assert_close(merge_partials(parts), whole, atol=1e-6, rtol=1e-5)
    empty = attend_dense(q, k[:, :, :1], v[:, :, :1], bias=torch.full((1, 1), float("-inf")))
    torch.testing.assert_close(merge_partials(parts + [empty]), whole, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


@pytest.mark.parametrize("fmt", [n for n in format_names() if n not in ("kivi-2", "kivi-4")])
def test_folded_scales_equal_dequantize_then_attend(fmt):
    """The CPU path's arithmetic (scales pulled out of the products, FP8 read through its bits) = the reference."""
    f = get_format(fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 200, 64, generator=g) * 4
    x[:, :, :, 5] *= 30  # an outlier channel, as real keys have
    k, v = KVStore.from_tensor(x, f.key), KVStore.from_tensor(torch.randn(2, 2, 200, 64, generator=g), f.value)
    q = torch.randn(2, 6, 64, generator=g)
    out, _ = attend_tiles(q, k, v, block=64)
    # the offset comes off after the product (c . q - 128 * sum(q)): float32 cancellation, ~1e-4 here
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, torch.tensor([200, 200])), atol=2e-4, rtol=1e-4)


def test_fp8_bits_to_float_is_exact():
    from kvlab.kernels.reference import _fp8_planes

    every = torch.stack(torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij"), -1).reshape(-1, 2)
    for dt, factor in ((torch.float8_e4m3fn, 256.0), (torch.float8_e5m2, 1.0)):
        codes = every.to(torch.uint8).view(dt)  # every pair of codes, as adjacent channels
        ref = codes.float()
        even, odd = _fp8_planes(codes).float().unbind(-1)  # one pair: plane order is (even, odd)
        for got, want in ((even * factor, ref[:, 0]), (odd * factor, ref[:, 1])):
            ok = torch.isfinite(want)  # NaN/Inf codes are never written (the quantizer saturates)
            assert torch.equal(got[ok], want[ok])


def test_allocate_with_a_given_frozen_scale_keeps_it():
    q = Quantizer("int8")  # one scale per tensor
    s = KVStore.allocate(q, 1, 2, 128, 64, scale=torch.tensor(0.05))
    s.append(torch.randn(1, 2, 10, 64))
    assert float(s.scale.reshape(())) == pytest.approx(0.05, rel=1e-3)
    with pytest.raises(ValueError, match="only be given"):
        KVStore.allocate(get_format("int8").key, 1, 2, 16, 64, scale=torch.tensor(0.05))
    with pytest.raises(ValueError, match="empty"):
        KVStore(q).view()


def test_kernel_shape_rule():
    from kvlab.storage import kernel_head_dim_ok

    assert kernel_head_dim_ok(64) and kernel_head_dim_ok(128) and not kernel_head_dim_ok(96) and not kernel_head_dim_ok(8)
