import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kvlab.kernels  # noqa: E402,F401,I001  (first: sets TRITON_INTERPRET=1 on a CPU before anything imports triton)
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests are derandomized by default, so `make test` gives the same verdict on every run and
# machine (CI included); `pytest --hypothesis-profile=explore` searches with fresh random examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_llama():
    """A randomly initialised 2-layer Llama with GQA: fast, and the same code paths as the shipped model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def shipped():
    """kvlab-tiny, the small model the project trains and ships in data/model (model, tokenizer)."""
    from kvlab.models import load_model

    return load_model("kvlab-tiny")


@pytest.fixture(scope="session")
def smollm2():
    """The workbook's real pretrained model, SmolLM2-135M-Instruct (model, tokenizer)."""
    from kvlab.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """Every chapter executed and exported once per test session: ``(folder, report)`` (see kvlab.book)."""
    from kvlab import book

    out = tmp_path_factory.mktemp("book")
    return out, book.build(out, progress=False)


@pytest.fixture(scope="session")
def tiny_gemma3():
    """A randomly initialised 6-layer Gemma 3 (sliding windows of 8 tokens on 5 layers, one global): the
    hybrid-attention code paths of the long-context model, in milliseconds."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           max_position_embeddings=4096, query_pre_attn_scalar=32)
    model = Gemma3ForCausalLM(cfg).eval()
    from kvlab.cache import use_kvlab_attention

    use_kvlab_attention(model)
    return model
