import json

import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from kvlab import budget as B
from kvlab.cache import KVQuantCache
from kvlab.formats import get_format


@torch.no_grad()
def greedy(model, ids, cache, n=12):
    return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0)


def test_lossless_format_generates_like_dynamic_cache(shipped):
    model, tok = shipped
    ids = torch.tensor([tok.encode("Return the number of items in a container.")])
    ref = greedy(model, ids, DynamicCache())
    out = greedy(model, ids, KVQuantCache("fp32"))
    assert torch.equal(out, ref)


def test_fp8_per_tensor_matches_transformers_quantized_cache(shipped):
    model, tok = shipped
    ids = torch.tensor([tok.encode("The grass is green. The sky is blue. The pass key is 12345.")])
    try:
        hf = QuantizedCache(backend="fp8", config=model.config)
    except ValueError as e:  # transformers before its fp8 backend (5.17 on the bare GPU image): no engine to match
        pytest.skip(f"this transformers has no fp8 QuantizedCache ({e})")
    ours = KVQuantCache("fp8_e4m3", quantize_prefill=False)
    model.set_attn_implementation("sdpa")  # bit for bit: both dequantize, then SDPA (kvlab's tiles differ in the last bits)
    with torch.no_grad():
        a, b = model(ids, past_key_values=hf), model(ids, past_key_values=ours)
        assert torch.equal(a.logits, b.logits)
        nxt = a.logits[:, -1:].argmax(-1)
        for _ in range(3):
            a, b = model(nxt, past_key_values=hf), model(nxt, past_key_values=ours)
            assert torch.equal(a.logits, b.logits)
            nxt = a.logits[:, -1:].argmax(-1)
    model.set_attn_implementation("kvlab")
    for lh, lo in zip(hf.layers, ours.layers):
        assert torch.equal(lh._quantized_keys[0].view(torch.uint8), lo.k_store.view().data.view(torch.uint8))
        assert torch.equal(lh._quantized_keys[1].reshape(()), lo.k_store.scale.reshape(()))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3", "int8", "int4", "q4_0", "kivi-2", "lmdeploy-int4", "hf-int4"])
def test_bytes_held_match_the_budget(tiny_llama, fmt):
    cfg = tiny_llama.config
    ids = torch.randint(3, 300, (2, 200))
    cache = KVQuantCache(fmt)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
        for _ in range(5):  # a few decode steps through the residual
            tiny_llama(ids[:, :1], past_key_values=cache)
    want = B.budget(cfg, 2, 205, fmt, full_precision_bits=32)  # the model runs in fp32
    assert cache.nbytes == want.cache_bytes


def test_generate_with_every_preset(tiny_llama):
    ids = torch.randint(3, 300, (1, 40))
    for fmt in ["fp8_e5m2", "int8", "int4", "q8_0", "q4_0", "kivi-4", "kivi-2", "lmdeploy-int8"]:
        out = greedy(tiny_llama, ids, KVQuantCache(fmt), n=5)
        assert out.shape == (1, 45)


def test_sinks_and_rotation_options(tiny_llama):
    f = get_format("int4_token").with_options(sinks=4, rotate=True)
    cache = KVQuantCache(f)
    with torch.no_grad():
        tiny_llama(torch.randint(3, 300, (1, 30)), past_key_values=cache)
    layer = cache.layers[0]
    assert layer.sink_k.shape[-2] == 4 and layer.k_store.tokens == 26


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown KV format"):
        KVQuantCache("int5")
    with pytest.raises(ValueError, match="num_layers"):
        KVQuantCache("int8", num_layers=0)
    with pytest.raises(TypeError, match="quantize_prefill"):
        KVQuantCache("int8", quantize_prefill="yes")


@pytest.fixture
def kvlab_llama(tiny_llama):
    """tiny_llama with the "kvlab" attention implementation (as load_model sets it), restored afterwards."""
    from kvlab.cache import use_kvlab_attention

    use_kvlab_attention(tiny_llama)
    yield tiny_llama
    tiny_llama.set_attn_implementation("sdpa")


@pytest.mark.slow  # Triton's interpreter on a CPU
@pytest.mark.parametrize("fmt", ["int4", "fp8_e4m3", "hf-int4", "int8"])
def test_generation_through_the_fused_kernel(tiny_llama, fmt):
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    from kvlab.cache import fused_attention

    ids = torch.randint(3, 300, (2, 50))
    plain = greedy(tiny_llama, ids, KVQuantCache(fmt), n=6)
    cache = KVQuantCache(fmt)
    with fused_attention(tiny_llama, cache):
        fused = greedy(tiny_llama, ids, cache, n=6)
        assert tiny_llama.config._attn_implementation == "kvlab" and cache.kernel is True
        assert cache.layers[0].attends  # decode steps really went through attend()
    assert tiny_llama.config._attn_implementation == "sdpa" and cache.kernel is None
    assert torch.equal(plain, fused)


def test_fused_rejects_formats_the_kernel_cannot_read(tiny_llama):
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    from kvlab.cache import fused_attention

    with pytest.raises(ValueError, match="kernel does not read"):
        fused_attention(tiny_llama, KVQuantCache("kivi-4"))
    with pytest.raises(ValueError, match="kernel does not read"):
        KVQuantCache("kivi-2", kernel=True)


FORMATS = ["fp32", "fp8_e4m3", "int8", "int4", "q4_0", "kivi-2", "hf-int4", "int4_tensor", "int4_token", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_reads_the_stores_and_matches_sdpa_over_the_dequantized_cache(tiny_llama, fmt):
    """The "kvlab" path (tile by tile over the stores, merged with sinks and residual) = SDPA over the
    dequantized cache, step by step; and the layers never hold a full-precision copy."""
    from kvlab.cache import use_kvlab_attention

    f = get_format(fmt).with_options(sinks=3, rotate=fmt == "int8")
    ids = torch.randint(3, 300, (2, 150))
    logits = {}
    for attn in ("sdpa", "kvlab"):
        use_kvlab_attention(tiny_llama) if attn == "kvlab" else tiny_llama.set_attn_implementation("sdpa")
        cache, steps = KVQuantCache(f), []
        with torch.no_grad():
            tiny_llama(ids, past_key_values=cache)
            for t in range(40):  # decode steps flush the residual into the body
                steps.append(tiny_llama(ids[:, t : t + 1], past_key_values=cache).logits)
        logits[attn] = torch.cat(steps, 1)
        assert cache.layers[0].attends == (attn == "kvlab")
    tiny_llama.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits["kvlab"], logits["sdpa"], atol=1e-4, rtol=1e-4)
    full = 2 * 2 * 190 * 64 * 4  # one layer's K (or V) for the whole context, fp32
    for layer in cache.layers:
        held = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        assert all(t.numel() * t.element_size() < full for t in held), "a full-precision copy of the cache"


def test_padded_batch_decodes_like_sdpa(kvlab_llama):
    """Left padding: the mask reaches attend() as a bias over the cache's tokens."""
    ids = torch.randint(3, 300, (2, 60))
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    outs = {}
    for attn in ("kvlab", "sdpa"):
        kvlab_llama.set_attn_implementation(attn)
        cache = KVQuantCache("int4")
        outs[attn] = kvlab_llama.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                          past_key_values=cache, pad_token_id=0)
    assert torch.equal(outs["kvlab"], outs["sdpa"])


@pytest.mark.slow  # one cache goes through Triton's interpreter
def test_two_caches_in_one_process_do_not_interfere(kvlab_llama):
    """Interleaved decode steps through two caches (one through the kernel) = each cache alone."""
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    ids = torch.randint(3, 300, (1, 40))

    def run(cache, kernel=None):
        cache.kernel = kernel
        return [kvlab_llama(ids, past_key_values=cache).logits[:, -1]]

    alone = {}
    for fmt, kernel in (("int8", True), ("kivi-2", None)):
        cache = KVQuantCache(fmt)
        out = run(cache, kernel)
        with torch.no_grad():
            for t in range(4):
                out.append(kvlab_llama(ids[:, t : t + 1], past_key_values=cache).logits[:, -1])
        alone[fmt] = torch.cat(out)
    a, b = KVQuantCache("int8"), KVQuantCache("kivi-2")
    with torch.no_grad():
        outs = {"int8": run(a, True), "kivi-2": run(b)}
        for t in range(4):
            outs["int8"].append(kvlab_llama(ids[:, t : t + 1], past_key_values=a).logits[:, -1])
            outs["kivi-2"].append(kvlab_llama(ids[:, t : t + 1], past_key_values=b).logits[:, -1])
    for fmt in alone:
        assert torch.equal(torch.cat(outs[fmt]), alone[fmt]), fmt


def test_decode_memory_above_the_cache_is_one_tile():
    """attend() allocates a tile's worth, not the cache's: the peak does not grow with context."""
    from kvlab.fusion import peak_memory

    peaks = {}
    for T in (4096, 16384):  # one tile is 4096 tokens
        cache = KVQuantCache("int4")
        cache.update(torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64), 0)
        layer, q = cache.layers[0], torch.randn(1, 9, 64)
        peaks[T] = peak_memory(layer.attend, q)[1], peak_memory(layer.dequantized)[1]
    assert peaks[16384][0] < 1.25 * peaks[4096][0], peaks
    assert peaks[16384][0] < peaks[16384][1] / 4, peaks  # expanding the cache costs far more


def test_from_prefill_matches_storing_an_unquantized_prefill(tiny_llama):
    """Filling a format's cache from a shared full-precision prefill = prefilling straight into it."""
    ids = torch.randint(3, 300, (2, 90))
    with torch.no_grad():
        dyn = DynamicCache(config=tiny_llama.config)
        tiny_llama(ids, past_key_values=dyn)
        for fmt in ["int4", "kivi-2", "fp8_e4m3"]:
            a, b = KVQuantCache.from_prefill(fmt, dyn), KVQuantCache(fmt, quantize_prefill=False)
            tiny_llama(ids, past_key_values=b)
            nxt = ids[:, -1:]
            assert torch.equal(tiny_llama(nxt, past_key_values=a).logits, tiny_llama(nxt, past_key_values=b).logits)
            assert a.nbytes == b.nbytes
    with pytest.raises(ValueError, match="forward pass has filled"):
        KVQuantCache.from_prefill("int4", DynamicCache())


def test_dead_caches_are_freed_without_the_garbage_collector(tiny_llama):
    import gc
    import weakref

    gc.disable()
    try:
        cache = KVQuantCache("int4")
        with torch.no_grad():
            tiny_llama(torch.randint(3, 300, (1, 20)), past_key_values=cache)
        ref = weakref.ref(cache)
        del cache
        assert ref() is None, "a reference cycle keeps every cache of a sweep alive until gc runs"
    finally:
        gc.enable()


def test_update_checks_its_inputs():
    cache = KVQuantCache("int4")
    with pytest.raises(ValueError, match="same tokens"):
        cache.update(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 4, 64), 0)
    with pytest.raises(TypeError, match="kernel must be"):
        KVQuantCache("int8", kernel="yes")


@pytest.mark.parametrize("k, why", [
    (torch.randn(2, 2, 1, 64), "batch=1"),  # the batch changed mid-stream
    (torch.randn(1, 4, 1, 64), "kv_heads=2"),  # another model's heads
    (torch.randn(1, 2, 1, 32), "head_dim=64"),
    (torch.randn(1, 2, 1, 64, dtype=torch.float64), "float64"),  # the dtype changed mid-stream
])
def test_a_stream_that_changes_shape_or_dtype_is_refused(k, why):
    cache = KVQuantCache("int4_token", num_layers=2)
    cache.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), 0)
    with pytest.raises(ValueError, match=why):
        cache.update(k, k.clone(), 0)
    with pytest.raises(ValueError, match="past this cache's 2 layers"):
        cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), 2)
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), -1)


def test_frozen_scales_given_by_hand_are_checked():
    from kvlab.formats import get_format
    from kvlab.storage import KVStore

    q = get_format("int4_tensor").key
    with pytest.raises(ValueError, match="finite and positive"):
        KVStore.allocate(q, 1, 2, 8, 64, scale=torch.zeros(1))
    with pytest.raises(ValueError, match="needs 1"):
        KVStore.allocate(q, 1, 2, 8, 64, scale=torch.ones(3))
    assert KVStore.allocate(q, 1, 2, 8, 64, scale=0.5).scale.item() == 0.5


def test_after_fused_attention_the_cache_keeps_working_with_sdpa(tiny_llama):
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    from kvlab.cache import fused_attention

    ids = torch.randint(3, 300, (1, 40))
    ref = KVQuantCache("int8")
    cache = KVQuantCache("int8")
    with torch.no_grad():
        want = [tiny_llama(ids, past_key_values=ref).logits[:, -1]]
        want += [tiny_llama(ids[:, t : t + 1], past_key_values=ref).logits[:, -1] for t in range(3)]
        with fused_attention(tiny_llama, cache):
            got = [tiny_llama(ids, past_key_values=cache).logits[:, -1]]
            got.append(tiny_llama(ids[:, :1], past_key_values=cache).logits[:, -1])
        got += [tiny_llama(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in (1, 2)]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-4, rtol=1e-4)


def test_review_findings_stay_fixed(kvlab_llama):
    """K and V with different token groupings flush together; switching to SDPA by hand is handled at once."""
    from kvlab.formats import KVFormat, Quantizer

    mixed = KVFormat("mixed", Quantizer("int8", "token"), Quantizer("int4", "group", 32, "token", symmetric=False))
    cache = KVQuantCache(mixed)
    cache.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), 0)
    layer = cache.layers[0]
    assert layer.k_store.tokens == layer.v_store.tokens == 32 and layer.res_k.shape[-2] == 8

    ids = torch.randint(3, 300, (1, 30))
    a, b = KVQuantCache("int8"), KVQuantCache("int8")
    with torch.no_grad():
        kvlab_llama(ids, past_key_values=a)
        kvlab_llama(ids[:, :1], past_key_values=a)  # through attend()
        kvlab_llama.set_attn_implementation("sdpa")
        got = kvlab_llama(ids[:, 1:2], past_key_values=a).logits  # plain SDPA now: must see the whole cache
        kvlab_llama(ids, past_key_values=b)
        kvlab_llama(ids[:, :1], past_key_values=b)
        want = kvlab_llama(ids[:, 1:2], past_key_values=b).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="cannot drop tokens"):
        a.layers[0].crop(3)


# --------------------------------------------------------------------------- hybrid (sliding-window) models

@pytest.mark.parametrize("fmt", ["fp32", "int8", "kivi-2", "int4_token+sinks4"])
def test_sliding_layers_keep_their_window_and_attend_like_transformers(tiny_gemma3, fmt):
    """Gemma 3's windowed layers: a kvlab cache holds the window, not the context, and in fp32 its chunked
    prefill and decode give transformers' own DynamicCache logits."""
    from transformers import DynamicCache

    from kvlab.cache import layer_windows

    model = tiny_gemma3
    wins = layer_windows(model.config)
    assert wins.count(None) == 1 and set(wins) == {8, None}
    ids = torch.randint(3, 300, (1, 40))
    ref, ours = DynamicCache(config=model.config), KVQuantCache(fmt, config=model.config)
    with torch.no_grad():
        for s in range(0, 40, 16):  # chunked prefill, as engines do
            a = model(ids[:, s:s + 16], past_key_values=ref).logits
            b = model(ids[:, s:s + 16], past_key_values=ours).logits
            if fmt == "fp32":
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        for _ in range(4):
            nxt = a[:, -1:].argmax(-1)
            a = model(nxt, past_key_values=ref).logits
            b = model(nxt, past_key_values=ours).logits
            if fmt == "fp32":
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for w, layer in zip(wins, ours.layers):
        assert layer.get_seq_length() == 44
        if w is None:
            assert layer.held == 44
        else:  # a token-grouped format keeps whole groups: up to group - 1 tokens more
            assert w <= layer.held < w + max(layer.k_store.chunk, layer.v_store.chunk)


def test_from_prefill_keeps_windowed_positions(tiny_gemma3):
    """A windowed prefill layer holds only its last tokens; the kvlab copy must keep their true positions."""
    from kvlab import evals

    ids = torch.randint(3, 300, (1, 30))
    dyn, first = evals.prefill(tiny_gemma3, ids, chunk=7)
    want = evals.decode(tiny_gemma3, dyn, first, 5)
    dyn, first = evals.prefill(tiny_gemma3, ids, chunk=7)
    got = evals.decode(tiny_gemma3, KVQuantCache.from_prefill("fp32", dyn), first, 5)
    assert torch.equal(got, want)


def test_layer_formats_apply_per_layer_type(tiny_gemma3):
    ids = torch.randint(3, 300, (1, 24))
    cache = KVQuantCache("fp32", config=tiny_gemma3.config, layer_formats={"full_attention": "int4_token"})
    with torch.no_grad():
        tiny_gemma3(ids, past_key_values=cache)
    names = [layer.fmt.name for layer in cache.layers]
    assert names == ["fp32"] * 5 + ["int4_token"]
    with pytest.raises(ValueError, match="layer_formats"):
        KVQuantCache("fp32", layer_formats={"global": "int8"})


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int4_token", "q4_0"])
def test_gemma3_bytes_at_32k_match_the_budget(fmt):
    """The shipped Gemma 3 270M preset: a kvlab cache filled to 32,768 tokens holds what chapter 1's
    arithmetic says (windowed layers keep 512 tokens, the three global layers all of them)."""
    from transformers import Gemma3TextConfig

    from kvlab.budget import load_shape

    preset = json.loads((B.PRESETS / "models" / "gemma-3-270m.json").read_text())["config"]
    cfg = Gemma3TextConfig(**{k: v for k, v in preset.items() if k != "model_type"})
    cache = KVQuantCache(fmt, config=cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        for _ in range(4):  # 4 x 8192 tokens, as a chunked prefill delivers them
            k = torch.randn(1, 1, 8192, 256, generator=g, dtype=torch.bfloat16)
            cache.update(k, k, i)
    want = B.budget("gemma-3-270m", 1, 32768, fmt)
    assert cache.nbytes == want.cache_bytes
    assert sum(layer.window is not None for layer in cache.layers) == 15
    assert load_shape("gemma-3-270m").max_position_embeddings == 32768


def test_a_named_mix_needs_the_models_layer_types(tiny_gemma3):
    cache = KVQuantCache("int4_token@global", config=tiny_gemma3.config)
    assert [layer.fmt.name for layer in cache.layers] == ["fp32"] * 5 + ["int4_token"]
    with pytest.raises(ValueError, match="config=model.config"):
        KVQuantCache("int4_token@sliding")
    with pytest.raises(ValueError, match="itself a per-layer-type mix"):
        KVQuantCache("fp32", config=tiny_gemma3.config, layer_formats={"full_attention": "int4@global"})


def test_a_named_mix_from_a_prefill_takes_the_prefills_layer_types(tiny_gemma3):
    from kvlab import evals

    ids = torch.randint(3, 300, (1, 24))
    dyn, _ = evals.prefill(tiny_gemma3, ids)
    cache = KVQuantCache.from_prefill("int4_token@global", dyn)
    assert [layer.fmt.name for layer in cache.layers] == ["fp32"] * 5 + ["int4_token"]


def test_the_hand_off_to_attention_is_the_keys_themselves():
    """update() returns CacheKeys: the keys as a tensor (operations give plain tensors), naming the layer
    and whether they are complete; kvlab_attention reads those two fields and nothing else."""
    from kvlab.cache import CacheKeys, KVQuantLayer

    layer = KVQuantLayer("int8")
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    keys, values = layer.update(k, v)
    assert isinstance(keys, CacheKeys) and keys.layer is layer and keys.complete
    assert type(keys * 1) is torch.Tensor and type(values) is torch.Tensor
    assert keys.shape == (1, 2, 5, 16)
    torch.testing.assert_close(torch.Tensor(keys), layer.dequantized()[0])
    assert not layer.attends  # nobody has attended through kvlab yet: decode steps stay complete
    keys, _ = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    assert keys.complete and keys.shape[-2] == 6
