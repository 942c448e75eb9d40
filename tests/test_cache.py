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
    hf, ours = QuantizedCache(backend="fp8", config=model.config), KVQuantCache("fp8_e4m3", quantize_prefill=False)
    with torch.no_grad():
        a, b = model(ids, past_key_values=hf), model(ids, past_key_values=ours)
        assert torch.equal(a.logits, b.logits)
        nxt = a.logits[:, -1:].argmax(-1)
        for _ in range(3):
            a, b = model(nxt, past_key_values=hf), model(nxt, past_key_values=ours)
            assert torch.equal(a.logits, b.logits)
            nxt = a.logits[:, -1:].argmax(-1)
    for lh, lo in zip(hf.layers, ours.layers):
        assert torch.equal(lh._quantized_keys[0].view(torch.uint8), lo.k_store.qt.data.view(torch.uint8))
        assert torch.equal(lh._quantized_keys[1].reshape(()), lo.k_store.qt.scale.reshape(()))


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


@pytest.mark.parametrize("fmt", ["int4", "fp8_e4m3", "hf-int4", "int8"])
def test_generation_through_the_fused_kernel(tiny_llama, fmt):
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    from kvlab.cache import fused_attention

    ids = torch.randint(3, 300, (2, 50))
    plain = greedy(tiny_llama, ids, KVQuantCache(fmt), n=6)
    cache = KVQuantCache(fmt)
    with fused_attention(tiny_llama, cache):
        fused = greedy(tiny_llama, ids, cache, n=6)
        assert tiny_llama.config._attn_implementation == "kvlab_fused"
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert torch.equal(plain, fused)


def test_fused_rejects_formats_the_kernel_cannot_read(tiny_llama):
    pytest.importorskip("kvlab.kernels.decode_attention", reason="triton is not installed")
    from kvlab.cache import fused_attention

    with pytest.raises(ValueError, match="kernel does not read"):
        fused_attention(tiny_llama, KVQuantCache("kivi-4"))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "int4", "q4_0", "kivi-2", "hf-int4", "int4_tensor"])
def test_what_attention_reads_is_the_stored_cache(tiny_llama, fmt):
    """The incrementally updated full-precision view equals sinks + dequantized body + residual."""
    from kvlab.quant import dequantize

    f = get_format(fmt).with_options(sinks=3, rotate=fmt == "int8")
    cache = KVQuantCache(f)
    ids = torch.randint(3, 300, (2, 150))
    with torch.no_grad():
        tiny_llama(ids, past_key_values=cache)
        for t in range(40):  # decode steps flush the residual into the body
            tiny_llama(ids[:, t : t + 1], past_key_values=cache)
    for layer in cache.layers:
        body = dequantize(layer.k_store.qt)
        if f.rotate:
            from kvlab.quant import hadamard

            body = body @ hadamard(body.shape[-1]).T
        want = torch.cat([layer.sink_k, body, layer.res_k], dim=-2)
        got, _ = layer._gather()
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


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
