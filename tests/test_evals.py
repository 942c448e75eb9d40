import math
import re
import weakref

import pytest
import torch

from kvlab import evals, tasks
from kvlab import results as R
from kvlab.cache import KVQuantCache
from kvlab.formats import get_format


class CharTok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class Oracle(torch.nn.Module):
    """Reads the prompt like a perfect retriever and answers with the key (``wrong`` flips a digit).

    A prefill (several tokens) plans the answer; a decode step (one token) answers the next
    character of the plan of the last prefill, counting steps per cache object, so that
    caches filled from one shared prefill each replay the answer from its second character.
    """

    def __init__(self, wrong=False):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"_name_or_path": "oracle", "model_type": "oracle"})()
        self.wrong = wrong
        self.steps = weakref.WeakKeyDictionary()  # ids of freed caches get reused

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        B = input_ids.shape[0]
        kv = torch.zeros(B, 1, input_ids.shape[1], 2)
        past_key_values.update(kv, kv, 0)  # a one-layer cache, so shared prefills have something to copy
        if input_ids.shape[1] > 1:
            self.plan = []
            for row in input_ids.tolist():
                key = re.search(r"pass key is (\d{5})", "".join(map(chr, row))).group(1)
                if self.wrong:
                    key = key[:-1] + str((int(key[-1]) + 1) % 10)
                self.plan.append([ord(c) for c in " " + key])
            step = 0
        else:
            step = self.steps.get(past_key_values, 1)
        self.steps[past_key_values] = step + 1
        logits = torch.zeros(B, input_ids.shape[1], 300)
        for b in range(B):
            logits[b, -1, self.plan[b][step]] = 1
        return type("O", (), {"logits": logits})()


def test_exact_match_scoring_with_an_oracle():
    res = evals.passkey_sweep(Oracle(), CharTok(), "fp16", lengths=[300, 400], depths=[0.0, 1.0], trials=3,
                              progress=False)
    assert res.accuracy() == 1.0 and len(res.rows) == 4
    bad = evals.passkey_sweep(Oracle(wrong=True), CharTok(), "fp16", lengths=[300], depths=[0.5], trials=3,
                              progress=False)
    assert bad.accuracy() == 0.0


def test_sweep_runs_a_real_model_and_round_trips(tiny_llama, tmp_path):
    res = evals.passkey_sweep(tiny_llama, CharTok(), "int4", lengths=[200], depths=[0.0, 1.0], trials=2,
                              progress=False)
    assert len(res.rows) == 2 and all(r["trials"] == 2 for r in res.rows)
    assert 0.0 <= res.accuracy() <= 1.0
    res.save(tmp_path / "r.json")
    back = R.EvalResult.load(tmp_path / "r.json")
    assert back == res
    assert back.figure().data[0].z is not None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an EvalResult"):
        R.EvalResult.load(tmp_path / "bad.json")


def test_chain_sweep_runs(tiny_llama):
    res = evals.chain_sweep(tiny_llama, CharTok(), "int8", lengths=[300], depths=[1.0], hops=2, trials=2,
                            progress=False)
    assert res.task == "chain2" and res.rows[0]["trials"] == 2


def test_perplexity_fp32_cache_equals_plain_forward(tiny_llama):
    text = "".join(tasks.FILLER) * 20
    ppl = evals.perplexity(tiny_llama, CharTok(), "fp32", text=text, window=64, max_windows=2)
    ids = torch.tensor([CharTok().encode(text)[:64]])
    with torch.no_grad():
        loss = tiny_llama(ids, labels=ids).loss.item()
    ids2 = torch.tensor([CharTok().encode(text)[64:128]])
    with torch.no_grad():
        loss2 = tiny_llama(ids2, labels=ids2).loss.item()
    assert ppl == pytest.approx(math.exp((loss + loss2) / 2), rel=1e-4)


def test_window_nll_on_a_hybrid_model_reads_each_layer_types_format(tiny_gemma3):
    x = torch.randint(0, 300, (1, 40))  # longer than the 8-token windows
    with torch.no_grad():
        plain = tiny_gemma3(x, labels=x).loss.item() * 39
    assert evals.window_nll(tiny_gemma3, x, "fp32") == pytest.approx(plain, rel=1e-4)
    only_global = evals.window_nll(tiny_gemma3, x, "int4_tensor@global")
    only_windows = evals.window_nll(tiny_gemma3, x, "int4_tensor@sliding")
    everywhere = evals.window_nll(tiny_gemma3, x, "int4_tensor")
    assert len({round(v, 6) for v in (plain, only_global, only_windows, everywhere)}) == 4


def test_teacher_comparison_against_itself_is_perfect(tiny_llama):
    out = evals.teacher_comparison(tiny_llama, CharTok(), "fp32", ["The sky looks blue."], max_new_tokens=8)
    assert out["kl"] == pytest.approx(0.0, abs=1e-9) and out["top1_agreement"] == 1.0
    assert out["first_divergence"] == [8]
    noisy = evals.teacher_comparison(tiny_llama, CharTok(), "kivi-2", ["The sky looks blue." * 12], max_new_tokens=8)
    assert noisy["kl"] >= 0


def test_prompts_are_checked_with_the_tokenizer_alone():
    evals.check_prompts(CharTok(), "passkey", [300, 600], [0.0, 1.0])
    evals.check_prompts(CharTok(), "chain", [600], [1.0], hops=2)
    for task, kw, match in (("passkey", dict(lengths=[8]), "too short for a passkey prompt"),
                            ("chain", dict(lengths=[100], hops=40), "too short for a 40-hop chain"),
                            ("passkey", dict(lengths=[0]), "lengths must be positive"),
                            ("passkey", dict(depths=[2.0]), "depths must be numbers in"),
                            ("passkey", dict(haystack="soup"), "haystack must be one of"),
                            ("haystack", {}, "task must be 'passkey' or 'chain'")):
        with pytest.raises(ValueError, match=match):
            evals.check_prompts(CharTok(), task, **(dict(lengths=[300], depths=[0.5]) | kw))


@pytest.mark.parametrize("kw,match", [
    (dict(lengths=[0]), "lengths"), (dict(depths=[1.5]), "depths"), (dict(trials=0), "trials"),
    (dict(fmt="int3"), "unknown KV format"),
])
def test_bad_arguments(tiny_llama, kw, match):
    args = dict(fmt="int8", lengths=[200], depths=[0.5], trials=1) | kw
    with pytest.raises(ValueError, match=match):
        evals.passkey_sweep(tiny_llama, CharTok(), progress=False, **args)


def test_shared_prefill_gives_each_format_what_its_own_run_gives(tiny_llama):
    ids = torch.randint(3, 300, (3, 120))
    fmts = [get_format(n) for n in ("fp32", "int4", "kivi-2", "int4_tensor")]
    shared = evals.answers(tiny_llama, ids, fmts, 6, "full")
    for f in fmts:
        assert torch.equal(shared[f.name], evals.greedy_through_cache(tiny_llama, ids, f, 6)), f.name
    cached = evals.greedy_through_cache(tiny_llama, ids, "fp32", 6, prefill_mode="cached")
    assert torch.equal(cached, shared["fp32"]), "a lossless cache cannot tell the two prefill modes apart"
    with pytest.raises(ValueError, match="prefill"):
        evals.greedy_through_cache(tiny_llama, ids, "int4", 6, prefill_mode="chunky")


def test_decode_stops_once_every_row_has_missed(tiny_llama):
    ids = torch.randint(3, 300, (2, 30))
    dyn, first = evals.prefill(tiny_llama, ids)
    free = evals.decode(tiny_llama, KVQuantCache.from_prefill("fp32", dyn), first, 6)
    wrong = (free + 1) % 300
    stopped = evals.decode(tiny_llama, KVQuantCache.from_prefill("fp32", dyn), first, 6, targets=wrong)
    assert stopped.shape == (2, 6) and (stopped[:, 1:] == -1).all() and torch.equal(stopped[:, 0], free[:, 0])
    kept = evals.decode(tiny_llama, KVQuantCache.from_prefill("fp32", dyn), first, 6, targets=free)
    assert torch.equal(kept, free)


def test_golden_prompts_are_long_slices_of_heldout_text(shipped):
    _, tok = shipped
    golden = evals.golden_prompts(tok, n=3, length=700)
    assert len(golden) == 3 and all(len(g) == 700 for g in golden) and golden[0] != golden[1]
    with pytest.raises(ValueError, match="positive"):
        evals.golden_prompts(tok, n=0)


@pytest.mark.slow
def test_the_long_sweep_script_runs_and_resumes(tmp_path, capsys):
    """scripts/sweep_long.py --quick on kvlab-tiny: a header and one line per prompt; a second run adds nothing."""
    import json
    import subprocess
    import sys

    from kvlab.paths import ROOT
    from kvlab.results import LongSweep

    out = tmp_path / "q.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "sweep_long.py"), "--quick", "--model", "kvlab-tiny", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and len(lines) > 5
    assert all(set(x["correct"]) <= set(lines[0]["formats"]) for x in lines[1:] if "correct" in x)
    stages = {x["stage"] for x in lines[1:]}
    assert stages == {"filler", "perplexity", "prose", "cached", "multikey", "orders"}, stages
    assert all(x["records"] == 3 and x["haystack"] == "prose" for x in lines[1:] if x["stage"] == "orders")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming" in again.stdout and len(out.read_text().splitlines()) == len(lines)
    whole = out.read_text()
    out.write_text(whole + '{"stage": "filler", "length": 10')  # killed mid-write: the cut-off record is dropped
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "cut off mid-write" in again.stdout and out.read_text() == whole
    # the refusals run the script's main() in this process: each subprocess would spend seconds importing torch
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_long_script", ROOT / "scripts" / "sweep_long.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def refused(path) -> str:
        with pytest.raises(SystemExit) as e:
            script.main(cmd[2:-1] + [str(path)])
        assert e.value.code == 2
        return capsys.readouterr().err

    other = tmp_path / "other.jsonl"  # another sweep's file with a cut-off last line: refused, and left as it was
    cut = whole.splitlines()[0].replace('"kvlab-tiny"', '"another-model"') + '\n{"stage": "filler", "len'
    other.write_text(cut)
    err = refused(other)
    assert "different sweep" in err and other.read_text() == cut, (err[-500:], other.read_text())
    bad = tmp_path / "bad.jsonl"
    for damaged in ("hello\n", "[1, 2]\n", whole.splitlines()[0] + '\n{"stage": "filler"}\n'):
        bad.write_text(damaged)
        err = refused(bad)
        assert "move the file away" in err and "Traceback" not in err, err[-500:]
        assert bad.read_text() == damaged
    add = cmd + ["--add-formats", "fp8_e5m2", "--stages", "perplexity", "filler"]  # one more format, same prompts
    r = subprocess.run(add, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "adding ['fp8_e5m2']" in r.stdout, r.stderr[-2000:]
    sweep = LongSweep.load(out)
    assert sweep.added_formats == ["fp8_e5m2"] and sweep.header["added"][0]["formats"] == ["fp8_e5m2"]
    assert len(sweep.records) == len(lines) - 1  # merged into their prompts' records
    assert all(("fp8_e5m2" in (x.get("correct") or x["nll"])) == (x["stage"] in ("perplexity", "filler"))
               for x in sweep.records)
    assert sweep.paired("filler", "fp8_e5m2", 1024).prompts == 2 and sweep.paired_perplexity("fp8_e5m2")["windows"] == 2
    again = subprocess.run(add, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 prompts to measure" in again.stdout
    for argv, msg in ((["--add-formats", "int8"], "in the sweep already"), (["--add-formats", "nope"], "unknown KV format"),
                      (["--add-formats", "q4_0", "--chunk", "7"], "was swept with chunk 1024")):
        r = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=600)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    changed = whole.replace('"key": "', '"key": "9', 1)  # a prompt the code no longer builds
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(changed)
    r = subprocess.run(cmd[:-1] + [str(tampered), "--add-formats", "q4_0", "--stages", "filler"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "the prompts changed" in r.stderr, r.stderr[-500:]
    assert tampered.read_text() == changed  # refused before a line is written
    out.write_text(out.read_text().replace('"key": "', '"key": "9', 1))  # the sweep's record no longer its added one's
    r = subprocess.run(add, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "a different prompt" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    recs = [json.loads(x) for x in whole.splitlines()]
    ppl = next(x for x in recs if x.get("stage") == "perplexity")
    ppl["nll"]["fp32"] = round(ppl["nll"]["fp32"] * 1.1, 4)  # full precision no longer reads the window it read
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(json.dumps(x) + "\n" for x in recs))
    r = subprocess.run(cmd[:-1] + [str(moved), "--add-formats", "q4_0", "--stages", "perplexity"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "not the same window" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    assert moved.read_text() == "".join(json.dumps(x) + "\n" for x in recs)  # refused at once: not even a formats line
    short = tmp_path / "short.jsonl"  # a stage whose prompt cannot fit: refused before a header is written
    r = subprocess.run(cmd[:-1] + [str(short), "--stages", "orders", "--lengths", "64"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "the orders stage cannot use 64 tokens" in r.stderr and not short.exists(), r.stderr[-500:]
