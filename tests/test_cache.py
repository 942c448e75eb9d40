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
