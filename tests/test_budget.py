"""Cache-byte arithmetic, checked by hand for each architecture kind, plus properties."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import budget as B
from kvlab.formats import KVFormat, Quantizer, get_format


def cfg(**kw):
    base = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, vocab_size=1000)
    return base | kw


def test_mha_by_hand():
    # 4 layers x 2 (K,V) x 8 heads x 64 dims x 2 bytes = 8192 bytes per token
    b = B.budget(cfg(), batch=3, context=100, kv_format="fp16")
    assert b.bytes_per_token == 4 * 2 * 8 * 64 * 2 == 8192
    assert b.cache_bytes == 3 * 100 * 8192


def test_gqa_and_mqa_by_hand():
    assert B.budget(cfg(num_key_value_heads=2), 1, 1, "fp16").bytes_per_token == 4 * 2 * 2 * 64 * 2
    mqa = B.load_shape(cfg(num_key_value_heads=1))
    assert mqa.attention == "mqa"
    assert B.budget(mqa, 1, 1, "fp16").bytes_per_token == 4 * 2 * 1 * 64 * 2


def test_explicit_head_dim_overrides_hidden_over_heads():
    # Gemma-style: head_dim 256 although hidden/heads = 64
    b = B.budget(cfg(num_key_value_heads=2, head_dim=256), 1, 10, "fp16")
    assert b.bytes_per_token == 4 * 2 * 2 * 256 * 2


def test_presets_match_published_per_token_sizes():
    # Llama-3.1-8B: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    assert B.budget("llama-3.1-8b", 1, 1, "bf16").bytes_per_token == 131072
    assert B.budget("llama-3.1-70b", 1, 1, "bf16").bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert B.budget("qwen2.5-7b", 1, 1, "bf16").bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_mla_caches_latent_plus_rope_key():
    # DeepSeek-V3: 61 layers x (512 latent + 64 rope) x 2 bytes; no K/V pair, no heads.
    b = B.budget("deepseek-v3", 2, 1000, "bf16")
    assert b.bytes_per_token == 61 * 576 * 2 == 70272
    assert b.cache_bytes == 2 * 1000 * 70272
    # The latent is replicated on every TP rank.
    assert B.budget("deepseek-v3", 2, 1000, "bf16", tp=8).cache_bytes_per_gpu == b.cache_bytes


def test_sliding_window_layers_stop_growing():
    # Gemma 2 9B: 21 local layers (window 4096) + 21 global layers, 8 KV heads x 256 x 2 bytes x 2
    per_layer_token = 2 * 8 * 256 * 2
    b = B.budget("gemma-2-9b", 1, 32768, "bf16")
    assert b.cache_bytes == 21 * 4096 * per_layer_token + 21 * 32768 * per_layer_token
    # Mistral 7B v0.1: every layer windowed, so 32k costs what 4k does.
    assert B.budget("mistral-7b-v0.1", 1, 32768).cache_bytes == B.budget("mistral-7b-v0.1", 1, 4096).cache_bytes
    # Qwen2.5 has a sliding_window field but use_sliding_window=false: full attention.
    assert B.budget("qwen2.5-7b", 1, 200000).cache_bytes == 200000 * 57344


def test_tensor_parallel_split_and_replication():
    full = B.budget("llama-3.1-70b", 1, 1000, "bf16")
    assert B.budget("llama-3.1-70b", 1, 1000, "bf16", tp=4).cache_bytes_per_gpu == full.cache_bytes // 4
    # 16 ranks, 8 KV heads: each rank holds one head, so per-GPU bytes = total / 8
    assert B.budget("llama-3.1-70b", 1, 1000, "bf16", tp=16).cache_bytes_per_gpu == full.cache_bytes // 8
    with pytest.raises(ValueError, match="tp=3"):
        B.budget("llama-3.1-70b", 1, 1000, tp=3)


def test_paged_blocks_round_up():
    b = B.budget(cfg(), 1, 17, "fp16", block_size=16)
    assert b.cache_bytes == 32 * 8192


def test_quantized_bits_include_scales():
    assert get_format("int4").bits_per_element(128) == 4.5  # fp16 scale + zero per 64 values
    assert get_format("q4_0").bits_per_element(128) == 4.5  # 18 bytes per 32 values
    assert get_format("q8_0").bits_per_element(128) == 8.5  # 34 bytes per 32 values
    assert get_format("int8").bits_per_element(128) == 8 + 16 / 128
    assert get_format("fp8").bits_per_element(128) == 8
    # Llama-3.1-8B in int4: 32 x 2 x 8 x 128 x 4.5 / 8
    assert B.budget("llama-3.1-8b", 1, 1, "int4").bytes_per_token == 32 * 2 * 8 * 128 * 9 // 16


def test_residual_window_is_full_precision():
    fmt = get_format("kivi-4")
    assert fmt.residual == 128
    b = B.budget(cfg(), 1, 1000, fmt)
    # 128 residual tokens, plus the 8 that wait for a whole group of 32 along tokens (872 = 27*32 + 8)
    quant = 864 * 4 * 8 * 64 * 2 * 5 / 8
    full = 136 * 8192
    assert b.cache_bytes == quant + full


def test_config_json_path_and_pretrained_config(tmp_path):
    from transformers import LlamaConfig

    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg(num_key_value_heads=4)))
    assert B.budget(str(p), 1, 1).bytes_per_token == 4 * 2 * 4 * 64 * 2
    c = LlamaConfig(**{k: v for k, v in cfg(num_key_value_heads=4).items() if k != "model_type"})
    assert B.budget(c, 1, 1).bytes_per_token == 4 * 2 * 4 * 64 * 2


@pytest.mark.parametrize("bad,match", [
    (dict(model="no-such-model"), "neither a preset"),
    (dict(batch=0), "batch must be > 0"),
    (dict(context=-1), "context must be >= 0"),
    (dict(kv_format="int3"), "unknown KV format"),
    (dict(tp=0), "tp must be > 0"),
    (dict(block_size=1.5), "block_size must be an integer"),
])
def test_bad_input_names_the_argument(bad, match):
    args = dict(model="llama-3.1-8b", batch=1, context=10, kv_format="bf16") | bad
    with pytest.raises(ValueError, match=match):
        B.budget(args.pop("model"), args.pop("batch"), args.pop("context"), args.pop("kv_format"), **args)


def test_unreadable_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        B.load_shape(str(p))


def test_seed_headline_70b_fp8_fits_but_100_long_chats_do_not():
    f = B.fit("llama-3.1-70b", "H200", "fp8")
    assert f.weights_fit
    chats = B.budget("llama-3.1-70b", 100, 32768, "fp8")
    assert chats.cache_bytes > f.free_for_cache_per_gpu
    # halving the KV dtype roughly doubles concurrency
    c16 = B.max_concurrency("llama-3.1-70b", 32768, "bf16", "H200", "fp8")
    c8 = B.max_concurrency("llama-3.1-70b", 32768, "fp8", "H200", "fp8")
    assert c8 >= 2 * c16


def test_max_context_is_the_boundary():
    t = B.max_context("llama-3.1-8b", 8, "fp8", "L4", "bf16")
    free = B.fit("llama-3.1-8b", "L4", "bf16").free_for_cache_per_gpu
    assert B.budget("llama-3.1-8b", 8, t, "fp8").cache_bytes <= free < B.budget("llama-3.1-8b", 8, t + 1, "fp8").cache_bytes
    assert B.max_concurrency("llama-3.1-70b", 1000, gpu="L4") == 0  # the weights alone do not fit


def test_every_preset_has_a_source():
    for name in B.preset_names():
        shape = B.load_shape(name)
        assert shape.num_parameters and shape.num_layers
    for g in B.gpus().values():
        assert g.source and g.memory_bytes > 0
        assert g.usd_per_hour and g.usd_per_hour > 0, f"{g.name} has no price per GPU-hour"
        assert "https://" in g.price_source and "$" in g.price_source, f"{g.name}'s price names no page and rate"


def test_prices_follow_the_hardware():
    """Listed prices from one provider keep the order a reader expects: more memory bandwidth costs more."""
    p = {k: g.usd_per_hour for k, g in B.gpus().items()}
    assert p["L4"] < p["RTX-4090"] < p["A100-80GB"] < p["H100-80GB"] < p["H200"] < p["B200"]
    assert B.hourly_price("l4") == p["L4"] and B.hourly_price("L4", 1) == 1.0


def test_hourly_price_takes_any_real_number_type_and_names_what_it_refuses():
    from fractions import Fraction

    import numpy as np

    for usd in (np.float32(2.0), np.float16(2.0), np.int64(2), Fraction(2), 2):
        assert B.hourly_price("H100-80GB", usd) == 2.0
    for usd, why in ((10**400, "positive finite"), (2**1024, "positive finite"), (10**308, "at most"),
                     ("2", "real number"), (1j, "real number"), (np.float64("nan"), "finite")):
        with pytest.raises(ValueError, match=why) as e:
            B.hourly_price("H100-80GB", usd)
        assert len(str(e.value)) < 160


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans(), st.text(max_size=3)))
def test_hourly_price_refuses_what_is_not_a_price(usd):
    ok = isinstance(usd, (int, float)) and not isinstance(usd, bool) and 0 < usd < float("inf")
    if ok and B.MIN_HOURLY_USD <= usd <= B.MAX_HOURLY_USD:
        assert B.hourly_price("H100-80GB", usd) == usd
    else:
        with pytest.raises(ValueError, match="gpu_hour_usd must be"):
            B.hourly_price("H100-80GB", usd)


formats = st.sampled_from(["fp16", "fp8", "int8", "int4", "q4_0", "kivi-2", "lmdeploy-int4"])
models = st.sampled_from(["llama-3.1-8b", "gemma-2-9b", "deepseek-v3", "mistral-7b-v0.1"])


@settings(max_examples=60, deadline=None)
@given(models, formats, st.integers(1, 64), st.integers(0, 300_000), st.integers(1, 64), st.integers(0, 5000))
def test_monotonic_in_batch_and_context(model, fmt, batch, ctx, db, dt):
    """More sequences never cost fewer bytes. More context neither, except inside a token group: a KIVI
    key group leaves full precision the moment it fills (llama-3.1-8b, kivi-2: 17,694,720 B at 135 tokens,
    17,563,648 B at 160), so there the property holds across whole groups."""
    b = B.budget(model, batch, ctx, fmt).cache_bytes
    assert B.budget(model, batch + db, ctx, fmt).cache_bytes >= b
    k = get_format(fmt).key
    group = k.group_size if k.granularity == "group" and k.group_axis == "token" else 1
    assert B.budget(model, batch, ctx + dt * group, fmt).cache_bytes >= b


def test_a_token_group_filling_up_shrinks_the_cache():
    """The counter-example above, pinned: the budget is right to shrink there (the cache does too)."""
    assert B.budget("llama-3.1-8b", 1, 135, "kivi-2").cache_bytes == 17_694_720
    assert B.budget("llama-3.1-8b", 1, 160, "kivi-2").cache_bytes == 17_563_648


@settings(max_examples=40, deadline=None)
@given(models, st.integers(1, 8), st.integers(1, 200_000))
def test_monotonic_in_bits(model, batch, ctx):
    two_bit = KVFormat("int2", *[Quantizer("int2", "group", 32, symmetric=False)] * 2)
    sizes = [B.budget(model, batch, ctx, f).cache_bytes for f in (two_bit, "int4_tensor", "fp8", "fp16", "fp32")]
    assert sizes == sorted(sizes)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["llama-3.1-70b", "qwen2.5-7b", "deepseek-v3", "gemma-2-9b"]),
       st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 100_000), formats)
def test_tp_per_gpu_times_ranks_covers_total(model, tp, ctx, fmt):
    from hypothesis import assume

    assume(B.load_shape(model).q_heads % tp == 0)  # e.g. Qwen2.5-7B's 28 heads do not split over 8 ranks
    b = B.budget(model, 1, ctx, fmt, tp=tp)
    assert b.cache_bytes_per_gpu * tp >= b.cache_bytes


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(0, 100_000), st.integers(1, 20_000))
def test_windowed_never_exceeds_full(batch, ctx, window):
    windowed = cfg(model_type="mistral", sliding_window=window, num_key_value_heads=2)
    full = cfg(model_type="mistral", sliding_window=None, num_key_value_heads=2)
    assert B.budget(windowed, batch, ctx).cache_bytes <= B.budget(full, batch, ctx).cache_bytes


GOOD = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
        "intermediate_size": 1024, "vocab_size": 1000}


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": -2}, "num_key_value_heads must be > 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be > 0"),  # not silently replaced by a default
    ({"num_key_value_heads": 3}, "not a multiple of 3 KV heads"),
    ({"head_dim": -64}, "head_dim must be > 0"),
    ({"hidden_size": -512}, "hidden_size must be > 0"),
    ({"num_attention_heads": -8}, "num_attention_heads must be > 0"),
    ({"sliding_window": -4096}, "sliding_window must be > 0"),
    ({"kv_lora_rank": -512}, "kv_lora_rank must be > 0"),
    ({"hidden_size": "512"}, "hidden_size must be an integer"),
    ({"num_hidden_layers": 2.5}, "must be an integer"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"hidden_size": 500}, "not a multiple of 8 heads"),
])
def test_impossible_configs_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        B.budget(GOOD | change, 1, 1024, "int4")


def test_tensor_parallel_must_split_the_query_heads():
    with pytest.raises(ValueError, match="must divide the model's 32 attention heads"):
        B.fit("llama-3.1-8b", "H100-80GB", tp=1000)
    with pytest.raises(ValueError, match="must divide the model's 32 attention heads"):
        B.budget("llama-3.1-8b", 1, 1024, tp=1000)
    assert B.fit("llama-3.1-8b", "H100-80GB", tp=8).tp == 8


sizes = st.one_of(st.integers(-4, 4096), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                  st.none(), st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={k: sizes for k in (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "sliding_window", "kv_lora_rank", "intermediate_size", "vocab_size", "max_position_embeddings")}),
    st.integers(1, 8), st.integers(0, 100_000))
def test_any_config_gives_a_clear_error_or_sane_numbers(cfg, batch, context):
    try:
        b = B.budget(cfg, batch, context, "int4")
        c = B.max_concurrency(cfg, max(context, 1), "int4", "H100-80GB")
    except (ValueError, TypeError) as e:
        assert str(e), "errors must say what is wrong"
        return
    for v in (b.cache_bytes, b.cache_bytes_per_gpu, b.bytes_per_token, c):
        assert isinstance(v, int) and v >= 0


@pytest.mark.parametrize("model,match", [
    ("../gpus", "neither a preset"),  # preset names never walk out of data/presets/models
    ("/etc/hostname", "could not be read as JSON"),
    ("data/model/config", "neither a preset"),
])
def test_model_names_and_paths(model, match):
    with pytest.raises(ValueError, match=match):
        B.budget(model, 1, 10)


def test_binary_config_and_non_finite_sizes(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        B.budget(p, 1, 10)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="batch must be a finite integer"):
            B.budget("llama-3.1-8b", bad, 10)
        with pytest.raises(ValueError, match="context must be a finite integer"):
            B.max_concurrency("llama-3.1-8b", bad)


def test_absurd_sizes_are_refused_not_looped_over():
    """1e308 layers is an integer-valued float: it must be refused, not turned into a 1e308-entry layer table."""
    with pytest.raises(ValueError, match="larger than any model|num_hidden_layers must be at most"):
        B.budget({"num_hidden_layers": 1e308, "num_attention_heads": 1e308, "kv_lora_rank": 4096}, 1, 1, "int4")
    with pytest.raises(ValueError, match="larger than any model|head_dim must be at most"):
        B.budget(GOOD | {"head_dim": 2**60}, 1, 1)


@pytest.mark.parametrize("cfg, missing", [
    ({"model_type": "llama"}, "num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
])
def test_a_config_missing_its_sizes_is_refused_not_defaulted(cfg, missing):
    """transformers would fill in a default model's sizes (32 x 4096 for llama) and size a model nobody described."""
    with pytest.raises(ValueError, match=f"does not state.*{missing}"):
        B.budget(cfg, 1, 128)


@given(st.floats(min_value=1e6, allow_infinity=False, allow_nan=False).filter(lambda v: v > 1e6))
def test_an_hourly_price_past_any_real_one_is_refused(usd):
    with pytest.raises(ValueError, match="at most"):
        B.hourly_price("H100-80GB", usd)


def test_budget_cli_never_prints_a_negative_free_size(capsys):
    import json

    from kvlab.cli import main

    assert main(["budget", "--model", "llama-3.1-70b", "--batch", "1", "--context", "1000", "--gpu", "L4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    over = out["weights_and_reserve_over_by_bytes"]
    assert out["free_bytes_per_gpu"] == 0 and over > 100 * 2**30 and not out["fits"]
    assert over == out["weights_bytes_per_gpu"] + out["reserve_bytes_per_gpu"] - out["usable_bytes_per_gpu"]
    # with almost no memory usable, the overflow is the weights and the reserve, and it says both
    assert main(["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "1000", "--gpu", "H100-80GB",
                 "--memory-utilization", "1e-300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["usable_bytes_per_gpu"] == 0 and out["reserve_bytes_per_gpu"] > 0
    assert out["weights_and_reserve_over_by_bytes"] == out["weights_bytes_per_gpu"] + out["reserve_bytes_per_gpu"]


@pytest.mark.parametrize("name", [n for n in B.preset_names() if (B.PRESETS / "models" / f"{n}.json").exists()])
def test_a_preset_reads_the_same_without_transformers(name):
    """Presets are read as written (no transformers import); transformers must read each to the same shapes."""
    doc = json.loads((B.PRESETS / "models" / f"{name}.json").read_text())
    fast = B.shape_from_config(B._plain_config(doc["config"]), name)
    assert fast == B.shape_from_config(B._hf_config(doc["config"]), name)
    assert B.load_shape(name).layers == fast.layers


def test_a_config_file_that_states_its_shape_is_read_without_transformers():
    """kvlab-tiny's config.json states every size the shape reads, so `budget` reads it as written; transformers
    must agree. Configs that leave something to derive go through transformers (Gemma's head_dim default, Qwen 2's
    sliding layers)."""
    doc = json.loads((B.DATA / "model" / "config.json").read_text())
    assert B._states_its_shape(doc)
    assert B.shape_from_config(B._config_from_dict(doc)) == B.shape_from_config(B._hf_config(doc))
    gemma = {"model_type": "gemma", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1,
             "hidden_size": 2048}  # no head_dim: transformers' Gemma default is 256, not 2048 / 8
    assert not B._states_its_shape(gemma)
    assert B.shape_from_config(B._config_from_dict(gemma)).layers[0].head_dim == 256
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "hidden_size": 256, "sliding_window": 128, "use_sliding_window": False}
    assert not B._states_its_shape(qwen)  # transformers decides which layers slide (here: none)
    assert [s.window for s in B.shape_from_config(B._config_from_dict(qwen)).layers] == [None] * 4


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 6), kv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([32, 64, 128, 256]), window=st.one_of(st.none(), st.integers(16, 4096)),
       pattern=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_fully_stated_config_reads_as_transformers_reads_it(layers, kv, group, head_dim, window, pattern):
    d = {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": kv * group,
         "num_key_value_heads": kv, "head_dim": head_dim, "hidden_size": 64 * kv * group,
         "max_position_embeddings": 8192}
    if window is not None:
        d["sliding_window"] = window
        d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern[:layers]]
    assert B._states_its_shape(d)
    assert B.shape_from_config(B._config_from_dict(d)) == B.shape_from_config(B._hf_config(d))


def test_budget_and_serve_sim_on_presets_import_no_model_stack():
    import subprocess
    import sys

    code = ("import sys; from kvlab.cli import main; "
            "main(['budget', '--model', 'gemma-2-9b', '--batch', '2', '--context', '8192', '--gpu', 'L4', '--json']); "
            "main(['serve-sim', '--workload', 'rag', '--model', 'llama-3.1-8b', '--gpu', 'L4', '--json']); "
            "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "LOADED []"


@pytest.mark.slow  # 25 bisections over real presets: seconds, in make test only
@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["kivi-2", "kivi-4", "int4", "fp8"]), st.integers(1, 64), st.sampled_from(["L4", "A100-80GB"]))
def test_max_context_fits_at_every_length_on_the_way(fmt, batch, gpu):
    """A sequence passes through every length up to its context: each must fit, and one more token must not
    (for KIVI, whose bytes dip when a token group closes, the whole group that ends there)."""
    t = B.max_context("llama-3.1-8b", batch, fmt, gpu)
    free = B.fit("llama-3.1-8b", gpu).free_for_cache_per_gpu
    if t == 0:
        return
    assert all(B.budget("llama-3.1-8b", batch, s, fmt).cache_bytes <= free for s in range(max(0, t - 64), t + 1))
    k = get_format(fmt).key
    group = k.group_size if k.granularity == "group" and k.group_axis == "token" else 1
    assert any(B.budget("llama-3.1-8b", batch, s, fmt).cache_bytes > free for s in range(t + 1, t + 1 + group))


# --------------------------------------------------------------------------- published vLLM start-up logs

VLLM_LOGS = B.published_vllm_logs()
HALF_A_CENT_GIB = 0.005  # the logs print GiB to two decimals


def _oracle_tokens(log, gib: float) -> int:
    """vLLM's count by hand: 2 (K, V) x layers x KV heads on this rank x head_dim x bytes an element a token,
    whole 16-token blocks of the memory printed."""
    shape = B.load_shape(log["model"])
    heads = max(1, shape.layers[0].kv_heads // log["tp"])
    per_token = 2 * shape.num_layers * heads * shape.layers[0].head_dim * (1 if log["kv_cache_dtype"] == "fp8" else 2)
    assert log["bytes_per_token"] == per_token, (log["id"], log["bytes_per_token"], per_token)
    return int(gib * B.GIB) // (per_token * 16) * 16


@pytest.mark.parametrize("log", VLLM_LOGS, ids=[x["id"] for x in VLLM_LOGS])
def test_engine_cache_reads_a_published_vllm_log(log):
    """Memory printed -> tokens: vLLM's count lies inside what the printed (rounded) GiB allows, except
    the one tensor-parallel MoE log below; the printed breakdown gives the printed memory; the
    concurrency line is tokens / max_model_len."""
    r, tokens = log["numbers"], log["logged_tokens"]
    assert tokens == int(r.get("tokens") or r["blocks"] * 16) and tokens % 16 == 0  # whole blocks of 16 tokens
    assert log["kvlab_tokens"] == _oracle_tokens(log, r["available_gib"])
    lo = _oracle_tokens(log, r["available_gib"] - HALF_A_CENT_GIB)
    hi = _oracle_tokens(log, r["available_gib"] + HALF_A_CENT_GIB)
    assert log["within_rounding"] == (lo <= tokens <= hi)
    if log["id"] == "qwen3-235b-tp4":  # vLLM's count is 1.1% below: unexplained (see the chapter)
        assert 0.985 < tokens / log["kvlab_tokens"] < 0.992
    else:
        assert lo <= tokens <= hi, (lo, tokens, hi)
    if "weights_gib" in r:  # V0's breakdown: utilization x total - weights - non-torch - activation peak
        assert log["reserve_gib"] == r["non_torch_gib"] + r["activation_gib"]
        got = B.engine_available_bytes(r["total_gib"], r["utilization"], r["weights_gib"], log["reserve_gib"]) / B.GIB
        assert abs(got - r["available_gib"]) <= 2 * HALF_A_CENT_GIB
    if "peak_torch_gib" in r:  # late-2024 V0: the peak includes the weights
        got = B.engine_available_bytes(r["total_gib"], r["utilization"], 0, r["peak_torch_gib"] + r["non_torch_gib"]) / B.GIB
        assert abs(got - r["available_gib"]) <= 2 * HALF_A_CENT_GIB
    if "concurrency" in r:
        assert round(tokens / r["max_model_len"], 2) == r["concurrency"]


def test_the_published_logs_cover_models_gpus_and_kv_dtypes():
    assert len({x["model"] for x in VLLM_LOGS if x.get("model_stated", True)}) >= 4
    assert len({x["gpu"] for x in VLLM_LOGS}) >= 4
    assert {x["kv_cache_dtype"] for x in VLLM_LOGS} >= {"fp8", "auto (bf16)"}
    assert {x["tp"] for x in VLLM_LOGS} >= {1, 4}


def test_fp8_halves_the_bytes_per_token_the_fp8_log_shows():
    (log,) = [x for x in VLLM_LOGS if x["kv_cache_dtype"] == "fp8"]
    per_token = log["numbers"]["available_gib"] * B.GIB / log["logged_tokens"]
    assert abs(per_token - 48 * 1024) < 48 * 1024 * 0.001
    assert B.engine_cache(log["model"], "bf16", B.GIB).bytes_per_token == 2 * 48 * 1024


def test_tensor_parallel_splits_kv_heads_and_replicates_past_them():
    one = B.engine_cache("llama-3.1-70b", "bf16", 0).bytes_per_token
    assert B.engine_cache("llama-3.1-70b", "bf16", 0, tp=8).bytes_per_token == one // 8
    assert B.engine_cache("qwen3-235b-a22b", "bf16", 0, tp=8).bytes_per_token == \
        B.engine_cache("qwen3-235b-a22b", "bf16", 0, tp=4).bytes_per_token  # 4 KV heads: one per rank, then copies


@pytest.mark.parametrize("kw, match", [
    (dict(total_gib=0), "total_gib"), (dict(total_gib=float("nan")), "total_gib"),
    (dict(total_gib=80, gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(total_gib=80, weights_gib=-1), "weights_gib"), (dict(total_gib=80, reserve_gib=True), "reserve_gib")])
def test_engine_memory_refuses_what_is_not_memory(kw, match):
    with pytest.raises(ValueError, match=match):
        B.engine_available_bytes(**kw)


def test_engine_cache_refuses_what_vllm_does_not_page():
    with pytest.raises(ValueError, match="sliding-window"):
        B.engine_cache("gemma-2-9b", "bf16", B.GIB)
    with pytest.raises(ValueError, match="another precision"):
        B.engine_cache("llama-3.1-8b", "kivi-4", B.GIB)
    with pytest.raises(ValueError, match="available_bytes"):
        B.engine_cache("llama-3.1-8b", "bf16", -5)
    assert B.engine_available_bytes(24, 0.9, 30, 1) == 0  # weights past the share: no cache, never negative


def test_read_vllm_log_takes_text_or_lines():
    text = "GPU KV cache size: 1,024 tokens\nMaximum concurrency for 512 tokens per request: 2.00x"
    assert B.read_vllm_log(text) == {"tokens": 1024, "max_model_len": 512, "concurrency": 2.0}
    with pytest.raises(TypeError, match="lines"):
        B.read_vllm_log(5)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2), st.floats(-10, 1e7), st.floats(-10, 1e7))
@settings(max_examples=200)
def test_engine_memory_is_a_clear_error_or_a_non_negative_int(total, util, weights, reserve):
    try:
        got = B.engine_available_bytes(total, util, weights, reserve)
    except ValueError as e:
        assert any(n in str(e) for n in ("total_gib", "gpu_memory_utilization", "weights_gib", "reserve_gib"))
    else:
        assert isinstance(got, int) and got >= 0


def test_hostile_budget_inputs_get_named_errors():
    with pytest.raises(ValueError, match="weights_gib"):
        B.engine_available_bytes(80, 0.9, -0.5, 3)
    with pytest.raises(ValueError, match="line 1: total_gib"):
        B.read_vllm_log(["total_gpu_memory=1.2.3GiB"])
    with pytest.raises(ValueError, match="model_weights|weights_gib"):
        B.read_vllm_log(["model weights take " + "9" * 400 + " GiB"])
    with pytest.raises(ValueError, match="neither a preset"):
        B.load_shape("a" * 5000)
    with pytest.raises(ValueError, match="memory_utilization"):
        B.fit("llama-3.1-8b", "H100-80GB", memory_utilization=True)
    with pytest.raises(ValueError, match="weights dtype"):
        B.fit("llama-3.1-8b", "H100-80GB", ["bf16"])
    with pytest.raises(ValueError, match="context"):
        B.max_concurrency("llama-3.1-8b", 0)


@pytest.mark.parametrize("types, extra, match", [
    (["full_attention", "mamba"], {}, "are not attention layers kvlab can size"),
    (["sliding_attention", "full_attention"], {}, "sliding_window is not set"),
    (["chunked_attention", "full_attention"], {}, "attention_chunk_size is not set"),
])
def test_layer_types_kvlab_cannot_size_are_refused(types, extra, match):
    d = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "hidden_size": 256, "layer_types": types} | extra
    with pytest.raises(ValueError, match=match):
        B.load_shape(d)


def test_chunked_layers_keep_their_chunk():
    d = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "hidden_size": 256, "layer_types": ["chunked_attention", "full_attention"],
         "attention_chunk_size": 8192}
    assert [layer.window for layer in B.load_shape(d).layers] == [8192, None]


def test_a_config_whose_tie_word_embeddings_is_not_a_boolean_is_refused():
    d = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": "no"}
    with pytest.raises(ValueError, match="tie_word_embeddings must be true or false"):
        B.load_shape(d)


def test_bits_held_counts_scales_and_kivis_residual():
    from kvlab.formats import get_format

    assert B.bits_held("llama-3.1-8b", 4096, "bf16") == 16
    for fmt in ("int8", "int4", "q4_0"):  # a long context: only the scales on top of the codes
        assert B.bits_held("llama-3.1-8b", 1 << 16, fmt) == pytest.approx(get_format(fmt).bits_per_element(128), rel=0.01)
    # 512 tokens, 128 of them in KIVI's 16-bit residual: a quarter of the elements at 16 bits
    assert B.bits_held("llama-3.1-8b", 512, "kivi-4") > get_format("kivi-4").bits_per_element(128) + 2


def test_the_default_reserve_is_the_one_logged_at_that_tensor_parallel_size():
    assert B.default_reserve(1) == (3.05, B.RESERVE_SOURCE.format(tp=1))
    gib, source = B.default_reserve(8)  # no log at 8 ranks: the largest logged size below it, and it says which
    assert gib == pytest.approx(3.58 + 1.26) and "on 2 H100" in source and "#10511" in source


def test_blocks_are_whole_blocks_as_vllm_counts_them():
    # Llama-3.1-8B in BF16: 32 layers x (K and V) x 8 KV heads x 128 dims x 2 bytes = 131,072 bytes a token
    p = B.blocks("llama-3.1-8b", "bf16", 10 * 2**30 + 123, 1000, block_size=16)
    assert p["block_bytes"] == 16 * 131_072 and p["blocks"] == 5120 and p["tokens"] == 5120 * 16
    assert p["blocks_per_sequence"] == 63 and p["max_concurrency"] == 5120 // 63  # 1000 tokens take 63 blocks
    assert B.blocks("llama-3.1-8b", "bf16", 0, 1000)["max_concurrency"] == 0
    with pytest.raises(ValueError, match="block_size"):
        B.blocks("llama-3.1-8b", "bf16", 1, 1000, block_size=0)


def test_budget_cli_prints_the_reserve_it_took_and_the_blocks(capsys):
    import json

    from kvlab.cli import main

    argv = ["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "1000", "--gpu", "H100-80GB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reserve_gib"] == 3.05 and "#10511" in out["reserve_from"]
    assert out["predicted_ttft_ms"] > 0 and out["predicted_tpot_ms"] > 0  # the roofline's, as kvlab.decide.latency
    assert out["blocks_per_gpu"] == out["free_bytes_per_gpu"] // (16 * 131_072)
    assert out["tokens_in_blocks"] == 16 * out["blocks_per_gpu"] and out["max_concurrency"] == out["blocks_per_gpu"] // 63
    assert main(argv + ["--reserve-gib", "10"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert mine["reserve_from"] == "--reserve-gib" and mine["reserve_gib"] == 10
    assert out["free_bytes_per_gpu"] - mine["free_bytes_per_gpu"] == pytest.approx((10 - 3.05) * 2**30, abs=2)
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--reserve-gib", bad])
        assert e.value.code == 2 and "argument --reserve-gib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["budget", "--help"])
    assert "--reserve-gib" in capsys.readouterr().out


def test_quantized_weights_keep_the_embedding_and_lm_head_in_16_bit():
    # Llama-3.1-70B: 70,553,706,496 parameters, of which 2 x 128,256 x 8,192 are the (untied) embedding and LM head
    embed = 2 * 128_256 * 8_192
    assert B.load_shape("llama-3.1-70b").embedding_parameters == embed
    assert B.weights_bytes("llama-3.1-70b", "fp8") == (70_553_706_496 - embed) + 2 * embed  # ~67.7 GiB, as logged
    assert B.weights_bytes("llama-3.1-70b", "bf16") == 2 * 70_553_706_496
    tied = type("Config", (), {"vocab_size": 10, "hidden_size": 4, "tie_word_embeddings": True})
    assert B.embedding_parameters(tied) == 40 and B.embedding_parameters(object()) == 0
    f = B.fit("llama-3.1-70b", "H100-80GB", "fp8", weights_gib=67.7)
    assert f.weights_bytes_per_gpu == int(67.7 * 2**30)
    with pytest.raises(ValueError, match="weights_gib"):
        B.fit("llama-3.1-70b", "H100-80GB", "fp8", weights_gib=float("nan"))


def test_budget_cli_takes_the_engines_weights(capsys):
    import json

    from kvlab.cli import main

    argv = ["budget", "--model", "llama-3.1-70b", "--batch", "1", "--context", "2048", "--gpu", "H100-80GB",
            "--weights-dtype", "fp8", "--memory-utilization", "0.98", "--json"]
    assert main(argv + ["--weights-gib", "67.7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_bytes_per_gpu"] == int(67.7 * 2**30)
    assert main(["budget", "--model", "llama-3.1-8b", "--batch", "1", "--context", "8", "--weights-gib", "3"]) == 2
    assert "--weights-gib needs --gpu" in capsys.readouterr().err


def test_blocks_never_promise_more_sequences_than_they_hold():
    """A format with a full-precision window (hf-int4: the last 128 tokens in BF16) spreads the window's cost over
    its sequence's blocks: max_concurrency x blocks a sequence never exceeds the blocks (hostile-input finding)."""
    for fmt in ("hf-int4", "kivi-2", "kivi-4", "bf16", "int4"):
        p = B.blocks("llama-3.1-8b", fmt, 50 * 2**30, 8192, block_size=16)
        assert p["max_concurrency"] * p["blocks_per_sequence"] <= p["blocks"] and p["blocks_per_sequence"] == 512
        assert p["max_concurrency"] == 50 * 2**30 // (p["block_bytes"] * 512) or p["max_concurrency"] * p["block_bytes"] * 512 <= 50 * 2**30


def test_a_config_without_tie_word_embeddings_is_sized_one_way():
    """estimate_parameters and the 16-bit embedding count read a missing tie_word_embeddings the same (tied)."""
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 1000}
    shape = B.load_shape(cfg)
    assert shape.embedding_parameters == 1000 * 64  # one matrix: tied
    untied = B.load_shape(cfg | {"tie_word_embeddings": False})
    assert untied.embedding_parameters == 2 * 1000 * 64 and untied.num_parameters - shape.num_parameters == 1000 * 64


def test_a_tp_size_not_logged_takes_the_largest_logged_below_it():
    assert [B.logged_size({1: 3.0, 2: 4.8}, tp) for tp in (1, 2, 3, 8)] == [1, 2, 2, 2]


def _config_dir(tmp_path, **over):
    import json

    cfg = {"model_type": "llama", "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
           "hidden_size": 256, "head_dim": 64, "vocab_size": 32000, "intermediate_size": 512} | over
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_bad_config_field_is_named_with_its_file(tmp_path):
    d = _config_dir(tmp_path, num_key_value_heads=-1)
    with pytest.raises(ValueError, match=r"model config '.*config\.json': num_key_value_heads must be > 0"):
        B.budget(str(d), 1, 4096)
    (d / "config.json").write_text((d / "config.json").read_text().replace("12,", "9" * 5000 + ",", 1))
    with pytest.raises(ValueError, match=r"config\.json' holds a number too long"):
        B.budget(str(d), 1, 4096)


def test_a_deep_model_is_sized_per_kind_of_layer_not_per_layer(tmp_path):
    """20,000 identical layers: one kind of layer, worked out once (a bisection over every layer took minutes at
    10,000). Oracle: 1 KV head x 64 values x 2 (K, V) x 2 bytes = 256 bytes a token a layer."""
    d = str(_config_dir(tmp_path, num_hidden_layers=20_000))
    assert B.budget(d, 1, 1000).cache_bytes == 20_000 * 256 * 1000
    n = B.max_context(d, 1, "bf16", "H200", "bf16")
    assert B.budget(d, 1, n).cache_bytes_per_gpu <= B.fit(d, "H200", "bf16").free_for_cache_per_gpu \
        < B.budget(d, 1, n + 1).cache_bytes_per_gpu


def test_max_context_and_bits_held_refuse_what_has_no_answer():
    with pytest.raises(ValueError, match="limit must be > 0"):
        B.max_context("llama-3.1-8b", 1, limit=-5)
    with pytest.raises(ValueError, match="limit must be an integer"):
        B.max_context("llama-3.1-8b", 1, limit=True)
    with pytest.raises(ValueError, match="context must be > 0"):
        B.bits_held("llama-3.1-8b", 0, "int4")
