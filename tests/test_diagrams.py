"""The scale diagram against counts written out by hand (the oracle: how many scales each layout stores)."""

import pytest

from kvlab import diagrams
from kvlab.formats import get_format


@pytest.mark.parametrize("fmt,scales", [
    ("int4_tensor", 1), ("int4_token", 8), ("int4", 8 * 1), ("q4_0", 8 * 2), ("int4_g16", 8 * 4), ("kivi-4", 64)])
def test_each_layout_has_as_many_patches_as_it_stores_scales(fmt, scales):
    """8 tokens x 64 channels of a key: per token 8 scales, groups of 32 along head_dim 16, KIVI's per-channel keys
    over 32 tokens: 64 (one token block here)."""
    ids = diagrams.scale_ids(get_format(fmt).key, 8, 64)
    assert len({i for row in ids for i in row}) == scales


def test_neighbouring_patches_differ_and_full_precision_tokens_are_grey():
    z = diagrams.tile_colours("q4_0", tokens=4, head_dim=64)
    assert z[0][31] != z[0][32] and z[0][0] != z[1][0]  # across a group boundary, and across tokens
    s = diagrams.tile_colours("int4_token+sinks4", tokens=8, head_dim=4)
    assert [row[0] for row in s[:4]] == [diagrams.FULL] * 4 and diagrams.FULL not in s[4]
    k = diagrams.tile_colours("kivi-4", tokens=64, head_dim=4, context=160)  # residual 128: tokens 32.. of 160
    assert diagrams.FULL not in k[31] and k[32] == [diagrams.FULL] * 4


@pytest.mark.parametrize("call,match", [
    (lambda: diagrams.scale_ids(get_format("int4").key, 0, 4), "tokens"),
    (lambda: diagrams.tile_colours("int4", which="query"), "which"),
    (lambda: diagrams.tile_colours("int4", tokens=64, context=10), "context"),
    (lambda: diagrams.scale_tile([]), "formats")])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_figure_has_a_panel_per_format():
    fig = diagrams.scale_tile(["int4_tensor", "int4_token", "q4_0"], tokens=8, head_dim=8)
    assert len(fig.data) == 3 and [a.text for a in fig.layout.annotations] == ["int4_tensor", "int4_token", "q4_0"]


def test_what_a_cache_stores_by_hand():
    """One head, 4,096 tokens, head_dim 128, K and V: BF16 is 4096 x 128 x 2 bytes x 2 = 2,048 KiB of codes; INT4 with a
    scale and zero per 64 values holds 512 KiB of codes and 32 KiB each of scales and zeros (2 groups x 2 bytes x 4096
    x 2); KIVI-4 keeps its newest 128 tokens whole (128 x 128 x 2 x 2 = 64 KiB)."""
    c = diagrams.cache_contents(["bf16", "int4", "kivi-4"], context=4096, head_dim=128)
    assert c["bf16"] == {"codes": 2048, "scales": 0, "zero points": 0, "full-precision tokens": 0}
    assert c["int4"] == {"codes": 512, "scales": 32, "zero points": 32, "full-precision tokens": 0}
    assert c["kivi-4"]["full-precision tokens"] == 64 and c["kivi-4"]["codes"] == (4096 - 128) * 64 * 2 / 1024


def test_what_a_cache_stores_agrees_with_the_budget_for_formats_whose_scales_grow():
    from kvlab import budget as B

    for fmt in ("int8", "int4", "q4_0", "kivi-4", "int4_token+sinks4"):
        per_head = sum(diagrams.cache_contents([fmt], 4096, 128)[get_format(fmt).name].values()) * 1024
        b = B.budget("llama-3.1-8b", 1, 4096, fmt)
        assert per_head == pytest.approx(b.per_layer_bytes[0] / 8, abs=1), fmt  # 8 KV heads a layer


def test_the_split_kv_picture_is_the_kernels_plan():
    from kvlab.kernels.reference import split_plan

    assert split_plan(4096, 1, 8, 32) == (16, 256)  # about 128 programs: 8 heads x 16 splits of 8 tiles
    fig = diagrams.split_kv(4096, 32, 8, 32)
    assert len(fig.data[0].z) == 8 and len(fig.data[0].z[0]) == 128 and len(fig.layout.annotations) == 16
    with pytest.raises(ValueError, match="q_heads"):
        diagrams.split_kv(4096, 30, 8)
