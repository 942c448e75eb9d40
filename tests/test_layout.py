"""kvlab.layout: one description of a format's bytes, checked against the buffers a store really allocates,
against the budget, and against bit counts published for the engines' own formats."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import budget as B
from kvlab.formats import Quantizer, format_names, get_format
from kvlab.layout import Kind, Layout, ScaleMode, kernel_readable, kernel_unreadable
from kvlab.storage import KVStore

# Bits per value published for the engines' own block formats (scales included):
# ggml's block_q4_0 is 2 + 16 bytes per 32 values, block_q8_0 2 + 32 bytes (ggml-common.h);
# NVFP4 stores one FP8 E4M3 scale per 16 FP4 values (NVIDIA's NVFP4 post: "4.5 bits");
# KIVI-2 keeps an fp16 scale and zero per 32 tokens for each channel of the keys (2 + 32/32).
PUBLISHED_BITS = {"q4_0": 4.5, "q8_0": 8.5, "nvfp4": 4.5, "fp8_e4m3": 8.0, "bf16": 16.0}


@pytest.mark.parametrize("name", list(PUBLISHED_BITS))
def test_bits_per_value_match_the_published_block_sizes(name):
    f = get_format(name)
    assert Layout(f.key, 128).bits_per_element == PUBLISHED_BITS[name]
    assert Layout(f.value, 128).bits_per_element == PUBLISHED_BITS[name]


def test_kivi_key_groups_run_along_tokens():
    lay = Layout(get_format("kivi-2").key, 128)
    assert (lay.token_group, lay.n_groups, lay.bits_per_element) == (32, 128, 3.0)
    assert lay.kind is None and lay.scale_mode is None and "token" in kernel_unreadable(lay.quantizer)


def _stores(head_dim):
    for name in format_names():
        f = get_format(name)
        for part, q in (("key", f.key), ("value", f.value)):
            if q.granularity == "group" and q.group_axis == "channel" and head_dim % q.group_size:
                continue
            yield f"{name}.{part}", q


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_store_allocates_exactly_what_its_layout_declares(head_dim):
    """Every preset's K and V: the buffers an appending store holds have the layout's dtypes and widths,
    and the bytes it reports equal the layout's count (including a KIVI group still filling up)."""
    torch.manual_seed(0)
    checked = 0
    for label, q in _stores(head_dim):
        lay = Layout(q, head_dim)
        s = KVStore(q)
        g = lay.token_group
        for n in (2 * g, 3 * g):  # two appends, the second landing after a partly used capacity
            s.append(torch.randn(2, 3, n, head_dim))
        assert s.codes.dtype == getattr(torch, lay.code_dtype), label
        assert s.codes.shape[-1] == lay.code_width, label
        assert (s.zero is not None) == lay.has_zero, label
        if lay.grows:
            assert s.scale.shape[-1] == lay.n_groups and s.scale.dtype == getattr(torch, lay.scale_dtype), label
        elif not q.is_passthrough:
            assert tuple(s.scale.shape) == lay.frozen_shape(2, 3), label
        else:
            assert s.scale is None, label
        assert s.nbytes == lay.nbytes(2, 3, s.tokens), label
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("name", [n for n in format_names() if not get_format(n).residual])
def test_budget_counts_the_layout_bytes(name):
    """The budget of a real shape (every layer, K and V) is the layouts' bytes, at a ragged context."""
    shape = B.load_shape("llama-3.1-8b")
    f = get_format(name)
    layer = shape.layers[0]
    want = len(shape.layers) * sum(Layout(q, layer.head_dim).nbytes(2, layer.kv_heads, 1000)
                                   for q in (f.key, f.value))
    assert B.budget("llama-3.1-8b", 2, 1000, name).cache_bytes == want


def test_kernel_constants_name_the_enums():
    lay = Layout(get_format("int4").key, 128)
    assert lay.kernel_constants() == dict(kind=Kind.INT4, symmetric=False, scale_mode=ScaleMode.TOKEN, n_groups=2)
    fp8 = Layout(get_format("fp8_e4m3").key, 64)
    assert fp8.kernel_kind() is Kind.FP8 and fp8.kernel_kind(fp8_as_bytes=True) is Kind.FP8_E4M3_BYTES
    assert Layout(get_format("fp8_e5m2").key, 64).kernel_kind(True) is Kind.FP8_E5M2_BYTES
    assert fp8.kernel_constants()["scale_mode"] is ScaleMode.TENSOR
    with pytest.raises(ValueError, match="kernel does not read"):
        Layout(get_format("nvfp4").key, 64).kernel_constants()


def test_only_readable_layouts_have_a_kernel_kind():
    assert all((Layout(q, 128).kind is None) == (not kernel_readable(q)) for _, q in _stores(128))
    assert all((Layout(q, 128).scale_mode is None) == (not kernel_readable(q)) for _, q in _stores(128))


@given(st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=3)))
def test_a_bad_head_dim_is_named(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        Layout(get_format("int4").key, head_dim)


@given(st.integers(1, 512))
def test_groups_must_divide_head_dim_and_fill_bytes(head_dim):
    q = Quantizer("int4", "group", 32)
    if head_dim % 32:
        with pytest.raises(ValueError, match="does not divide"):
            Layout(q, head_dim)
    else:
        assert Layout(q, head_dim).code_width == head_dim // 2
    odd = Quantizer("int4", "token")
    if head_dim % 2:
        with pytest.raises(ValueError, match="whole bytes"):
            Layout(odd, head_dim)


def test_not_a_quantizer():
    with pytest.raises(TypeError, match="Quantizer"):
        Layout("int4", 128)
