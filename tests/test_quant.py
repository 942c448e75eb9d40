import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.formats import Quantizer, format_names, get_format
from kvlab.quant import (
    _grouped,
    dequantize,
    fake_quantize,
    hadamard,
    pack_int,
    quantize,
    quantize_kv,
    unpack_int,
)

INT_QUANTIZERS = [
    Quantizer("int8", "token"), Quantizer("int8", "tensor"), Quantizer("int4", "token"),
    Quantizer("int4", "group", 32), Quantizer("int4", "group", 16, "token", symmetric=False),
    Quantizer("int8", "channel", symmetric=False), Quantizer("int2", "group", 32, symmetric=False),
    Quantizer("int4", "group", 32, full_range=True), Quantizer("int8", "head", scale_bits=32),
]


def shapes():
    return st.tuples(st.integers(1, 2), st.integers(1, 3), st.sampled_from([16, 32, 48]), st.sampled_from([32, 64]))


@settings(max_examples=40, deadline=None)
@given(shapes(), st.sampled_from(INT_QUANTIZERS), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_int_round_trip_error_is_at_most_half_a_step(shape, q, mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mag
    qt = quantize(x, q)
    err, _ = _grouped((dequantize(qt) - x).abs(), q)
    step = qt.scale.float().abs()
    # Half a step, plus the rounding of the stored fp16 scale (values at the edge may clamp).
    # Full-range formats (q4_0) map the largest magnitude to -8, so an opposite-sign value
    # of similar size clamps at +7: up to one whole step.
    half = 1.0 if q.full_range else 0.5
    assert (err <= half * step * 1.01 + 2**-10 * step * 2**q.bits).all()


@settings(max_examples=30, deadline=None)
@given(shapes(), st.sampled_from(["float8_e4m3fn", "float8_e5m2"]), st.sampled_from(["tensor", "token", "head"]),
       st.integers(0, 2**31 - 1))
def test_fp8_round_trip_relative_error(shape, element, gran, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    q = Quantizer(element, gran, scale_bits=32)
    qt = quantize(x, q)
    mant = 3 if element == "float8_e4m3fn" else 2
    view_scale = torch.broadcast_to(qt.scale.float(), _grouped(x, q)[0].shape).reshape(x.shape)
    tiny = view_scale * (2.0**-9 if mant == 3 else 2.0**-16)  # subnormal spacing / 2
    assert ((dequantize(qt) - x).abs() <= 2.0 ** -(mant + 1) * x.abs() + tiny + 1e-12).all()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_pack_unpack_inverts(bits, rows, n, seed):
    per = 8 // bits
    codes = torch.randint(0, 2**bits, (rows, n * per), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_int(codes, bits)
    assert packed.shape[-1] == n * per * bits // 8
    assert torch.equal(unpack_int(packed, bits), codes)


def test_nibble_order_low_first():
    assert pack_int(torch.tensor([[1, 2]], dtype=torch.uint8), 4).item() == 0x21


def test_packed_int4_takes_half_a_byte():
    x = torch.randn(1, 2, 8, 64)
    qt = quantize(x, Quantizer("int4", "token"))
    assert qt.data.dtype == torch.uint8 and qt.data.shape[-1] == 32
    assert qt.nbytes == 1 * 2 * 8 * 32 + 1 * 2 * 8 * 2  # codes + fp16 scale per token


@pytest.mark.parametrize("name", format_names())
@pytest.mark.parametrize("case", ["zeros", "nan", "inf", "huge", "tiny"])
def test_special_inputs_never_give_nan_or_zero_scale(name, case):
    x = torch.randn(1, 2, 32, 64)
    if case == "zeros":
        x.zero_()
    elif case == "nan":
        x[0, 0, 3, 5] = float("nan")
    elif case == "inf":
        x[0, 1, 7, 2] = float("inf")
        x[0, 1, 8, 2] = -float("inf")
    elif case == "huge":
        x = x * 1e30
    elif case == "tiny":
        x = x * 1e-30
    fmt = get_format(name)
    for q in (fmt.key, fmt.value):
        if q.is_passthrough:
            continue
        qt = quantize(x, q)
        assert torch.isfinite(qt.scale.float()).all() and (qt.scale.float() != 0).all()
        y = dequantize(qt)
        assert torch.isfinite(y).all(), f"{name}/{case} produced non-finite values"
        if case == "zeros":
            assert (y == 0).all()
        if case == "nan":
            assert y[0, 0, 3, 5].abs() <= qt.scale.float().abs().max()  # NaN is quantized as a 0
        if case == "inf":
            assert y[0, 1, 7, 2] > 0 and y[0, 1, 8, 2] < 0  # saturates, keeps its sign


def test_q4_0_uses_minus_8():
    x = torch.tensor([[-8.0, 1.0, 7.0, -3.0] * 8])
    qt = quantize(x, get_format("q4_0").key)
    codes = unpack_int(qt.data, 4).int() - 8
    assert codes.min() == -8 and torch.allclose(dequantize(qt), x)


@pytest.mark.parametrize("q,x,match", [
    (Quantizer("int4", "group", 48), torch.randn(2, 64), "group_size=48 does not divide head_dim"),
    (Quantizer("int4", "group", 5, "token"), torch.randn(12, 64), "does not divide tokens"),
    (Quantizer("int4", "token"), torch.randn(4, 63), "head_dim must be a multiple of 2"),
    (Quantizer("int8", "head"), torch.randn(4, 64), "per-head scales need"),
    (Quantizer("int8", "token"), torch.randn(64), "at least 2 dims"),
])
def test_clear_errors(q, x, match):
    with pytest.raises(ValueError, match=match):
        quantize(x, q)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown KV format 'int3'"):
        get_format("int3")
    with pytest.raises(ValueError, match="granularity must be one of"):
        Quantizer("int8", "row")
    with pytest.raises(ValueError, match="group_axis"):
        Quantizer("int8", "group", 32, "sideways")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, 4, dtype=torch.int32), Quantizer("int8", "token"))


@given(bits=st.sampled_from([2, 4, 8]), data=st.data())
def test_pack_int_refuses_codes_that_would_spill_into_a_neighbour(bits, data):
    bad = data.draw(st.one_of(st.integers(1 << bits, 1000), st.integers(-1000, -1)))
    codes = torch.zeros(1, 8, dtype=torch.int32)
    codes[0, data.draw(st.integers(0, 7))] = bad
    with pytest.raises(ValueError, match="must lie in"):
        pack_int(codes, bits)
    with pytest.raises(TypeError, match="integer tensor"):
        pack_int(torch.zeros(1, 8), bits)
    ok = torch.randint(0, 1 << bits, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_int(pack_int(ok, bits), bits), ok)


def test_hadamard_is_orthonormal_and_rotation_helps_outliers():
    H = hadamard(64)
    assert torch.allclose(H @ H.T, torch.eye(64), atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)
    x = torch.randn(1, 1, 256, 64)
    x[..., 3] *= 40  # one outlier channel, as keys often have
    q = Quantizer("int4", "token")
    plain = (fake_quantize(x, q) - x).pow(2).mean()
    rotated = (fake_quantize(x, q, rotate=True) - x).pow(2).mean()
    assert rotated < plain / 2


def test_sinks_and_residual_stay_exact():
    x = torch.randn(1, 2, 100, 64)
    y = fake_quantize(x, Quantizer("int4", "token"), sinks=4, residual=10)
    assert torch.equal(y[..., :4, :], x[..., :4, :]) and torch.equal(y[..., -10:, :], x[..., -10:, :])
    assert not torch.equal(y[..., 4:90, :], x[..., 4:90, :])


def test_kivi_keys_per_channel_values_per_token():
    k, v = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    kh, vh = quantize_kv(k, v, "kivi-4")
    # 300 - 128 residual = 172 -> 5 whole groups of 32 quantized, 12 left in full precision
    assert torch.equal(kh[..., 160:, :], k[..., 160:, :]) and not torch.equal(kh[..., :160, :], k[..., :160, :])
    assert torch.equal(vh[..., 172:, :], v[..., 172:, :])


def test_empty_input_is_a_clear_error():
    from kvlab.formats import format_names

    for name in format_names():
        with pytest.raises(ValueError, match="nothing to quantize"):
            quantize(torch.empty(1, 2, 0, 64), get_format(name).key)


# --------------------------------------------------------------------------- NVFP4

def test_fp4_rounds_to_the_nearest_e2m1_value_ties_to_even():
    from kvlab.quant import FP4_VALUES, fp4_decode, fp4_encode

    grid = torch.tensor(FP4_VALUES)
    xs = torch.linspace(-7, 7, 14001)
    got = fp4_decode(fp4_encode(xs))
    mag = xs.abs().clamp(max=6)
    dist = (mag[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.allclose((got.abs() - mag).abs(), best), "never farther than the nearest grid value"
    assert (torch.sign(got) == torch.sign(xs))[got != 0].all()
    # on a midpoint the even mantissa wins (0, 1, 2, 4 rather than 0.5, 1.5, 3, 6), as NVIDIA's conversion rounds
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp4_decode(fp4_encode(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4_decode(fp4_encode(torch.tensor([1e9, -1e9]))).tolist() == [6.0, -6.0]


@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
@settings(max_examples=40)
def test_nvfp4_error_is_within_half_a_step_of_its_block(seed, spread):
    """Each value lands within the largest half-step of its block (1 x the block scale, between 4 and 6),
    plus what saturation loses when the FP8 scale rounds down."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 64, generator=g) * spread
    q = get_format("nvfp4").key
    qt = quantize(x, q)
    err = (dequantize(qt) - x).abs().reshape(2, 3, 8, 4, 16)
    scale = qt.scale.float().reshape(2, 3, 8, 4, 1)
    amax = x.abs().reshape(2, 3, 8, 4, 16).amax(-1, keepdim=True)
    bound = scale + (amax - 6 * scale).clamp(min=0) + 1e-6 * amax
    assert (err <= bound).all()
    assert qt.scale.dtype == torch.float8_e4m3fn and get_format("nvfp4").bits_per_element(128) == 4.5


def test_fp4_needs_symmetric_channel_groups():
    with pytest.raises(ValueError, match="FP4"):
        Quantizer("float4_e2m1", "token")
    with pytest.raises(ValueError, match="scale_bits"):
        Quantizer("int4", "group", 16, scale_bits=12)
