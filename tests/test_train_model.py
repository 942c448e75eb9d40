"""The training script's pieces: the tokenizer's digit groups and the rows it trains on."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from kvlab import tasks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("train_model", ROOT / "scripts" / "train_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok(tm):
    return tm.build_tokenizer("Return the number of items in a container. " * 50, 1500)


def test_every_digit_group_is_one_token_and_keys_split_three_two(tok):
    for g in ["7", "07", "42", "000", "999", "123"]:
        assert len(tok.encode(g, add_special_tokens=False)) == 1, g
    ids = tok.encode(" The pass key is 88876.", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-4:] == ["Ġ", "888", "76", "."]


def test_tokenizer_too_small_for_the_digit_groups(tm):
    with pytest.raises(SystemExit, match="too small"):
        tm.build_tokenizer("some text " * 20, 1000)


def test_repeat_rows_weight_only_the_predictable_copy(tm):
    gen = torch.Generator().manual_seed(0)
    x, w = tm.fixed_repeat_batch(500, 64, 3, gen)
    assert torch.equal(x[:, :32], x[:, 32:]) and w[:, :33].sum() == 0 and (w[:, 33:] == 1).all()
    x, w = tm.repeat_batch(500, 64, 4, gen)
    for row, wt in zip(x, w):
        n = int(wt.sum()) + 1  # the first token of the copy is not predictable
        assert torch.equal(row[:n], row[n : 2 * n]) and wt[n + 1 : 2 * n].all()


def test_make_batch_shapes_and_answer_weights(tm, tok):
    corpus = tok.encode("Return the number of items in a container. " * 40, add_special_tokens=False)
    x, w = tm.make_batch(tok, corpus, 256, 16, random.Random(0))
    assert x.shape == w.shape == (16, 256) and x.dtype == torch.long
    assert w.max() <= 5.5 and (w >= 0).all()
    assert any((row[-3:] == 5.0).all() and row[-4] == 0.1 for row in w)  # a passkey row: the answer weighted
    ex = tasks.passkey(tok, 253, 0.5, random.Random(1))
    assert len(ex.answer_ids) == 3  # space + 3 digits + 2 digits: the rows assume it


@pytest.mark.slow
def test_quick_run_writes_a_loadable_model_and_its_record(tm, tmp_path):
    import json

    from kvlab.models import load_model

    tm.main(["--quick", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["warmup"] == {"seq_len": 128, "batch": 4, "steps": 10}
    assert [st["seq_len"] for st in record["stages"]] == [128, 256] and record["curve"]
    assert not (tmp_path / "checkpoint").exists()
    model, tok = load_model(tmp_path)
    assert model.config.vocab_size == len(tok) == 4096


@pytest.mark.slow  # a Python start-up with torch and transformers
def test_init_from_a_folder_with_a_broken_tokenizer_is_one_line(tmp_path):
    import shutil
    import subprocess
    import sys

    from kvlab.paths import DATA_DIR, ROOT

    shutil.copy(DATA_DIR / "model" / "config.json", tmp_path / "config.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_model.py"), "--init-from", str(tmp_path), "--quick",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "cannot load its tokenizer" in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]
    assert not (tmp_path / "out").exists()
