import json
import math
import re
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab import evals, tasks
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
    back = evals.EvalResult.load(tmp_path / "r.json")
    assert back == res
    assert back.figure().data[0].z is not None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an EvalResult"):
        evals.EvalResult.load(tmp_path / "bad.json")


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


def test_teacher_comparison_against_itself_is_perfect(tiny_llama):
    out = evals.teacher_comparison(tiny_llama, CharTok(), "fp32", ["The sky looks blue."], max_new_tokens=8)
    assert out["kl"] == pytest.approx(0.0, abs=1e-9) and out["top1_agreement"] == 1.0
    assert out["first_divergence"] == [8]
    noisy = evals.teacher_comparison(tiny_llama, CharTok(), "kivi-2", ["The sky looks blue." * 12], max_new_tokens=8)
    assert noisy["kl"] >= 0


@pytest.mark.parametrize("kw,match", [
    (dict(lengths=[0]), "lengths"), (dict(depths=[1.5]), "depths"), (dict(trials=0), "trials"),
    (dict(fmt="int3"), "unknown KV format"),
])
def test_bad_arguments(tiny_llama, kw, match):
    args = dict(fmt="int8", lengths=[200], depths=[0.5], trials=1) | kw
    with pytest.raises(ValueError, match=match):
        evals.passkey_sweep(tiny_llama, CharTok(), progress=False, **args)


def _fake_sweep(tmp_path):
    def cells(short, long):
        return [{"length": 512, "depth": 0.0, "trials": 4, "correct": short},
                {"length": 2048, "depth": 0.0, "trials": 4, "correct": long},
                {"length": 4096, "depth": 0.0, "trials": 4, "correct": long}]

    teacher = {"kl": 0.01, "top1_agreement": 0.99, "mean_first_divergence": 20.0}
    doc = {"model": "m", "formats": {
        "fp32": {"bits_per_element": 32, "perplexity": 10.0, "passkey": cells(4, 4),
                 "chain2": [{"length": 512, "depth": 1.0, "trials": 4, "correct": 2}], "teacher": teacher},
        "int4": {"bits_per_element": 4.5, "perplexity": 10.5, "passkey": cells(4, 1), "chain2": [],
                 "teacher": dict(teacher, kl=0.2)}}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    return path


def test_load_sweep_and_ladder(tmp_path):
    sweep = evals.load_sweep(_fake_sweep(tmp_path))
    assert sweep["formats"]["int4"]["passkey_result"].accuracy(4096) == 0.25
    rows = {r["kv_format"]: r for r in evals.ladder(sweep, short=512, long_min=2048)}
    assert rows["int4"]["needle_short"] == 1.0 and rows["int4"]["needle_long"] == 0.25
    assert abs(rows["int4"]["ppl_increase"] - 0.05) < 1e-12 and rows["fp32"]["ppl_increase"] == 0
    assert rows["fp32"]["chain"] == 0.5 and rows["int4"]["chain"] is None and rows["int4"]["kl"] == 0.2
    with pytest.raises(KeyError, match="reference"):
        evals.ladder(sweep, reference="bf16")
    with pytest.raises(KeyError, match="no passkey cells"):
        evals.ladder(sweep, short=1024)


def test_load_sweep_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="sweep_evals"):
        evals.load_sweep(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="formats"):
        evals.load_sweep(tmp_path / "bad.json")


def test_trapped_formats_finds_the_trap(tmp_path):
    rows = evals.ladder(evals.load_sweep(_fake_sweep(tmp_path)), short=512, long_min=2048)
    assert evals.trapped_formats(rows, ppl_tol=0.06) == ["int4"]  # +5% perplexity, 100% at 512, 25% vs 100% long
    assert evals.trapped_formats(rows, ppl_tol=0.01) == []
    assert evals.trapped_formats(rows, long_drop=0.8) == []
    with pytest.raises(ValueError, match="ppl_tol"):
        evals.trapped_formats(rows, ppl_tol=2)
    with pytest.raises(KeyError, match="reference"):
        evals.trapped_formats(rows, reference="bf16")


def test_accuracy_pools_cells_from_a_minimum_length():
    res = evals.EvalResult("passkey", "m", "int4", [
        {"length": 512, "depth": 0.0, "trials": 10, "correct": 10},
        {"length": 4096, "depth": 0.0, "trials": 10, "correct": 3},
        {"length": 8192, "depth": 0.5, "trials": 10, "correct": 1}])
    assert res.accuracy(min_length=2048) == 0.2 and res.accuracy(min_length=8192, depth=0.5) == 0.1
    with pytest.raises(KeyError, match="min_length=16384"):
        res.accuracy(min_length=16384)


def test_ladder_markdown_and_cell_agreement(tmp_path):
    sweep = evals.load_sweep(_fake_sweep(tmp_path))
    md = evals.ladder_markdown(evals.ladder(sweep))
    lines = md.splitlines()
    assert lines[0].startswith("| format | bits | ppl_increase | needle_short | needle_long | chain") and len(lines) == 4
    assert "| int4 | 4.50 | +5.0% | 100% (51%–100%) | 25% (7%–59%) | — | 0.2000 |" in md, md
    # int4 differs from fp32 by 0.75 in both long cells: 4 of 6 cells agree within 0.25, all within 0.75
    assert evals.cell_agreement(sweep, tol=0.25) == 4 / 6 and evals.cell_agreement(sweep, tol=0.75) == 1.0
    with pytest.raises(KeyError, match="reference"):
        evals.cell_agreement(sweep, reference="bf16")


def test_shared_prefill_gives_each_format_what_its_own_run_gives(tiny_llama):
    ids = torch.randint(3, 300, (3, 120))
    fmts = [get_format(n) for n in ("fp32", "int4", "kivi-2", "int4_tensor")]
    shared = evals._generate(tiny_llama, ids, fmts, 6, "full")
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


@given(trials=st.integers(1, 500), data=st.data())
def test_wilson_interval_brackets_the_rate(trials, data):
    correct = data.draw(st.integers(0, trials))
    lo, hi = evals.wilson(correct, trials)
    assert 0 <= lo <= correct / trials <= hi <= 1
    lo2, hi2 = evals.wilson(trials - correct, trials)  # misses and hits are mirror images
    assert lo == pytest.approx(1 - hi2, abs=1e-9) and hi == pytest.approx(1 - lo2, abs=1e-9)
    if trials >= 100:
        assert hi - lo < 0.2
    with pytest.raises(ValueError):
        evals.wilson(trials + 1, trials)


def test_golden_prompts_are_long_slices_of_heldout_text(shipped):
    _, tok = shipped
    golden = evals.golden_prompts(tok, n=3, length=700)
    assert len(golden) == 3 and all(len(g) == 700 for g in golden) and golden[0] != golden[1]
    with pytest.raises(ValueError, match="positive"):
        evals.golden_prompts(tok, n=0)


def test_counts_and_where_a_format_falls():
    rows = [{"length": n, "depth": d, "trials": 5, "correct": c}
            for n, c in ((512, 5), (2048, 4), (8192, 1)) for d in (0.0, 1.0)]
    assert evals.counts(rows, length=2048) == (8, 10) and evals.counts(rows, min_length=2048) == (10, 20)
    res = evals.EvalResult("passkey", "m", "int4", rows)
    ref = evals.EvalResult("passkey", "m", "fp32", [dict(r, correct=5) for r in rows])
    assert evals.falls_at(res, ref, drop=0.2) == 2048 and evals.falls_at(res, ref, drop=0.5) == 8192
    assert evals.falls_at(ref, ref) is None
    with pytest.raises(ValueError, match="drop"):
        evals.falls_at(res, ref, drop=0)


def test_rates_with_intervals_draw_the_wilson_interval():
    rates, err = evals.rates_with_intervals([(5, 5), (1, 4)])
    assert rates == [1.0, 0.25] and err["array"][0] == 0.0
    lo, hi = evals.wilson(1, 4)
    assert err["arrayminus"][1] == pytest.approx(0.25 - lo) and err["array"][1] == pytest.approx(hi - 0.25)
