"""kvlab.results: read without torch, the paired test against independent oracles, the sweep file's checks."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import results as R


def test_reading_results_imports_no_model_stack():
    code = ("import sys, kvlab.results, kvlab.serving, kvlab.decide, kvlab.budget, kvlab.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("lost, gained, p", [
    (0, 0, 1.0), (0, 6, 0.03125), (6, 0, 0.03125), (5, 0, 0.0625), (3, 3, 1.0),
    # oracle: R's mcnemar.exact / binom.test(1, 10): 2 * P(X <= 1 | n=10, 1/2) = 22/1024
    (1, 9, 22 / 1024), (14, 0, 2 / 2 ** 14),
])
def test_mcnemar_matches_the_binomial_test(lost, gained, p):
    assert R.mcnemar(lost, gained) == pytest.approx(p, rel=1e-12)


@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_is_a_symmetric_probability(lost, gained):
    p = R.mcnemar(lost, gained)
    assert 0 < p <= 1 and p == R.mcnemar(gained, lost)
    # the exact tail, summed the other way round (an independent formula)
    n = lost + gained
    if n:
        k = min(lost, gained)
        upper = sum(math.comb(n, i) for i in range(n - k, n + 1)) / 2 ** n
        assert p == pytest.approx(min(1.0, 2 * upper))


@given(st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), st.text()))
def test_mcnemar_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="lost"):
        R.mcnemar(bad, 1)


def test_the_decision_rule_needs_six_one_sided_pairs():
    assert R.fewest_prompts_to_detect() == 6
    assert R.verdict(5, 0) == "not distinguishable" and R.verdict(6, 0) == "worse" and R.verdict(0, 6) == "better"
    with pytest.raises(ValueError, match="alpha"):
        R.verdict(1, 1, alpha=1.5)


def _write(tmp_path, recs, header=None):
    header = header or {"kind": "header", "model": "m", "formats": {"fp32": {}, "int4": {}}}
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [header, *recs]) + "\n")
    return p


def _rec(stage, length, depth, i, **correct):
    return {"stage": stage, "length": length, "depth": depth, "index": i, "correct": correct}


def test_paired_counts_discordant_prompts(tmp_path):
    recs = [_rec("filler", 1024, 0.0, i, fp32=True, int4=i >= 8) for i in range(10)]
    recs += [_rec("filler", 1024, 0.5, 0, fp32=False, int4=True)]
    recs += [_rec("cached", 1024, 0.0, i, int4=i == 9) for i in (0, 1, 2, 8, 9)]  # reference from the filler stage
    s = R.LongSweep.load(_write(tmp_path, recs))
    pr = s.paired("filler", "int4", 1024)
    assert (pr.prompts, pr.correct, pr.ref_correct, pr.lost, pr.gained) == (11, 3, 10, 8, 1)
    assert pr.verdict == "worse" and pr.p == pytest.approx(20 / 512)
    c = s.paired("cached", "int4", 1024)
    assert (c.prompts, c.lost, c.gained) == (5, 4, 0) and c.verdict == "not distinguishable"
    # one format's two prefill modes on the same prompts: reading its own cache, int4 loses prompt 8
    m = s.paired("cached", "int4", 1024, "int4", "filler")
    assert (m.prompts, m.correct, m.ref_correct, m.lost, m.gained) == (5, 1, 2, 1, 0)
    with pytest.raises(ValueError, match="do not share prompts"):
        s.paired("multikey", "int4", 1024, "int4", "filler")
    assert s.fails_at("filler", "int4") == 1024 and s.fails_at("filler", "fp32") is None
    rows = s.table("filler")
    assert {(r["kv_format"], r["verdict"]) for r in rows} == {("fp32", "not distinguishable"), ("int4", "worse")}
    with pytest.raises(KeyError, match="no prompts"):
        s.paired("filler", "int4", 2048)


def test_the_multikey_rung_is_paired_within_its_own_prompts(tmp_path):
    """Its prompts differ from the filler stage's (two named keys): full precision's answers come from the same
    multikey prompts, never from another stage."""
    recs = [_rec("filler", 1024, 0.0, i, fp32=True, int4=True) for i in range(6)]
    recs += [_rec("multikey", 1024, 0.0, i, fp32=i < 5, int4=i == 5) for i in range(6)]
    s = R.LongSweep.load(_write(tmp_path, recs))
    m = s.paired("multikey", "int4", 1024)
    assert (m.prompts, m.ref_correct, m.lost, m.gained, m.verdict) == (6, 5, 5, 1, "not distinguishable")
    assert s.lengths("multikey", complete=False) == [1024]
    # each prompt's outcome, keyed by (depth, index): the same keys name different prompts in another stage
    assert s.outcomes("multikey", 1024)[(0.0, 5)] == {"fp32": False, "int4": True}
    assert s.outcomes("filler", 1024)[(0.0, 5)] == {"fp32": True, "int4": True}
    assert s.outcomes("multikey", 2048) == {}
    with pytest.raises(ValueError, match="stage must be one of"):
        s.outcomes("haystack", 1024)


@given(st.integers(1, 300), st.data())
def test_the_exact_upper_bound_leaves_five_percent_below_it(n, data):
    k = data.draw(st.integers(0, n))
    up = R.exact_upper(k, n)
    assert k / n <= up <= 1.0
    if k < n:  # at the bound, seeing k or fewer has probability 5% (the definition of Clopper-Pearson's bound)
        tail = sum(math.comb(n, i) * up ** i * (1 - up) ** (n - i) for i in range(k + 1))
        assert tail == pytest.approx(0.05, abs=1e-9)


def test_the_exact_upper_bound_has_a_closed_form_at_zero_and_refuses_nonsense():
    assert R.exact_upper(0, 150) == pytest.approx(1 - 0.05 ** (1 / 150))  # (1 - p)^n = 0.05
    assert R.exact_upper(3, 3) == 1.0
    for k, n in ((4, 3), (-1, 5), (0, 0)):
        with pytest.raises(ValueError, match="need 0 <= k <= n|k must be a non-negative integer"):
            R.exact_upper(k, n)


def test_pooling_lengths_is_the_same_paired_test_on_more_prompts(tmp_path):
    """-4 +0 at each of two lengths: not distinguishable at either (p = 0.125), worse pooled (-8 +0, p = 0.008)."""
    header = {"kind": "header", "model": "m", "formats": {"fp32": {}, "int4": {}}, "depths": [0.0], "per_depth": 6}
    recs = [_rec("orders", n, 0.0, i, fp32=True, int4=i >= 4) for n in (1024, 2048) for i in range(6)]
    recs += [_rec("orders", 4096, 0.0, 0, fp32=True, int4=False)]  # an incomplete length is left out
    s = R.LongSweep.load(_write(tmp_path, recs, header))
    assert [s.paired("orders", "int4", n).verdict for n in (1024, 2048)] == ["not distinguishable"] * 2
    pooled = s.paired_pooled("orders", "int4")
    assert (pooled.prompts, pooled.correct, pooled.ref_correct, pooled.lost, pooled.gained) == (12, 4, 12, 8, 0)
    assert pooled.verdict == "worse" and pooled.p == pytest.approx(2 / 256)
    with pytest.raises(KeyError, match="no prompts"):
        s.paired_pooled("prose", "int4")


def _ppl(i, tokens=10, **nll):
    return {"stage": "perplexity", "length": tokens + 1, "depth": 0.0, "index": i, "tokens": tokens, "nll": nll}


def test_a_length_still_being_swept_is_left_out_until_whole(tmp_path):
    header = {"kind": "header", "model": "m", "formats": {"fp32": {}, "int4": {}}, "depths": [0.0, 1.0], "per_depth": 2}
    recs = [_rec("filler", 1024, d, i, fp32=True, int4=True) for d in (0.0, 1.0) for i in range(2)]
    recs += [_rec("filler", 4096, 0.0, i, fp32=True, int4=False) for i in range(2)]  # half of 4096 so far
    s = R.LongSweep.load(_write(tmp_path, recs, header))
    assert s.lengths("filler") == [1024] and s.lengths("filler", complete=False) == [1024, 4096]
    assert [r["length"] for r in s.table("filler")] == [1024, 1024]


def test_perplexity_windows_are_paired_by_the_same_rule(tmp_path):
    recs = [_ppl(i, fp32=20.0, int4=21.0 + (i == 0) * -2) for i in range(8)]  # worse on 7 windows, better on 1
    s = R.LongSweep.load(_write(tmp_path, recs))
    assert s.perplexity("fp32") == pytest.approx(math.exp(2.0))
    row = s.paired_perplexity("int4")
    assert (row["windows"], row["worse_windows"], row["better_windows"]) == (8, 7, 1)
    assert row["p"] == pytest.approx(R.mcnemar(7, 1)) and row["verdict"] == "not distinguishable"
    assert row["increase"] == pytest.approx(math.exp((7 * 21 + 19) / 80) / math.exp(2.0) - 1)
    s8 = R.LongSweep.load(_write(tmp_path, [_ppl(i, fp32=20.0, int4=20.5) for i in range(8)]))
    assert s8.paired_perplexity("int4")["verdict"] == "worse"  # 8 of 8 windows worse: p < 0.05
    assert s8.table("filler") == [] and s8.lengths("filler") == []  # perplexity windows are no passkey prompts
    with pytest.raises(KeyError, match="no perplexity"):
        s8.paired_perplexity("int8")


def test_rungs_find_the_trap_only_past_the_short_needle(tmp_path):
    fmts = {"fp32": {}, "trapped": {}, "caught": {}, "costly": {}, "fine": {}}
    recs = [_ppl(i, fp32=20.0, trapped=20.2, caught=20.2, costly=25.0, fine=20.0) for i in range(4)]
    for n in (1024, 8192):
        for i in range(10):  # "trapped" and "costly" lose 8 of 10 at 8k only; "caught" already at 1k
            late = n == 8192 and i < 8
            recs.append(_rec("filler", n, 0.0, i, fp32=True, trapped=not late, caught=i >= 8, costly=not late, fine=True))
    s = R.LongSweep.load(_write(tmp_path, recs, {"kind": "header", "model": "m", "formats": fmts}))
    rows = {r["kv_format"]: r for r in R.rungs(s)}
    assert [n for n, r in rows.items() if r["trap"]] == ["trapped"]
    assert rows["caught"]["short_verdict"] == "worse" and rows["caught"]["worse_at"] == [1024, 8192]
    assert rows["costly"]["falls_at"] == 8192 and not rows["costly"]["ppl_ok"]  # perplexity already flags it
    assert rows["fine"]["falls_at"] is None and rows["fine"]["worse_at"] == []
    assert R.rungs(s, ppl_tolerance=0.7)[2]["trap"]  # "costly" (+65%) is trapped once that counts as fine
    with pytest.raises(ValueError, match="ppl_tolerance"):
        R.rungs(s, ppl_tolerance=-0.1)
    with pytest.raises(ValueError, match="no 'prose' prompts"):
        R.rungs(s, "prose")
    md = R.verdict_markdown({"m": s}, ["fp32", "trapped"])
    assert "| `trapped` | 10/10 | **2/10 −8 +0 ✗** |" in md and "| `fp32` | 10/10 | 10/10 |" in md
    assert md.startswith("*Passkey in the filler haystack: needles found / prompts, then −lost +gained against `fp32`")
    fig = R.figure_by_model({"m": s, "m2": s}, ["fp32", "trapped"])
    assert len(fig.data) == 4 and [t.showlegend for t in fig.data] == [True, True, False, False]
    assert list(fig.data[1].marker.symbol) == ["circle", "circle-open"]


def test_formats_added_later_join_their_prompts_and_count_only_once_whole(tmp_path):
    """sweep_long --add-formats appends a formats line and records marked "added": each merges into the record of
    the same prompt; a format that has reached only some prompts of a length (or windows) is not reported there."""
    header = {"kind": "header", "model": "m", "formats": {"fp32": {}, "int4": {}}, "depths": [0.0], "per_depth": 6}
    recs = [_rec("filler", n, 0.0, i, fp32=True, int4=i >= 4) | {"key": f"k{i}"} for n in (1024, 2048) for i in range(6)]
    recs += [_ppl(i, fp32=20.0, int4=21.0) for i in range(3)]
    added = {"kind": "formats", "formats": {"fp8_e5m2": {"bits_per_element": 8.0}}, "date": "2026-12-03"}
    more = [_rec("filler", 1024, 0.0, i, fp8_e5m2=i > 0) | {"key": f"k{i}", "added": True} for i in range(6)]
    more += [_rec("filler", 2048, 0.0, i, fp8_e5m2=True) | {"key": f"k{i}", "added": True} for i in range(3)]
    more += [_ppl(i, fp8_e5m2=20.5) | {"added": True} for i in range(2)]
    s = R.LongSweep.load(_write(tmp_path, recs + [added] + more, header))
    assert s.header["added"][0]["date"] == "2026-12-03"
    assert len(s.records) == 15  # merged, not appended
    pr = s.paired("filler", "fp8_e5m2", 1024)
    assert (pr.prompts, pr.lost, pr.gained) == (6, 1, 0) and s.paired("filler", "int4", 2048).lost == 4
    with pytest.raises(KeyError, match="3 of the 6 prompts at 2048 tokens in .filler. so far"):
        s.paired("filler", "fp8_e5m2", 2048)
    assert s.counts("filler", "fp8_e5m2", 2048) == (0, 0) and s.counts("filler", "fp8_e5m2", 1024) == (5, 6)
    assert s.formats == ["fp32", "int4"] and s.added_formats == ["fp8_e5m2"] and s.all_formats[-1] == "fp8_e5m2"
    assert s.format_entry("fp8_e5m2") == {"bits_per_element": 8.0}
    assert [r["kv_format"] for r in R.rungs(s)] == ["int4"]  # the sweep's own formats by default
    assert [r["kv_format"] for r in R.rungs(s, formats=s.all_formats)] == ["int4"]  # not at 2048 yet: left out
    done = [_rec("filler", 2048, 0.0, i, fp8_e5m2=True) | {"key": f"k{i}", "added": True} for i in range(3, 6)]
    whole = R.LongSweep.load(_write(tmp_path, recs + [added] + more + done, header))
    assert [r["kv_format"] for r in R.rungs(whole, formats=whole.all_formats)] == ["int4", "fp8_e5m2"]
    assert {r["kv_format"] for r in whole.table()} == {"fp32", "int4", "fp8_e5m2"}  # figures reach an added format once whole
    assert whole.paired_pooled("filler", "fp8_e5m2").prompts == 12
    with pytest.raises(KeyError, match="2 of the 3 prompts at the perplexity windows"):
        s.paired_perplexity("fp8_e5m2")
    with pytest.raises(R.Incomplete, match="3 of the 6 prompts at 2048"):  # not pooled over the length it finished
        s.paired_pooled("filler", "fp8_e5m2")
    with pytest.raises(R.Incomplete):
        s.needle_tests("fp8_e5m2", ("filler",))
    with pytest.raises(R.Incomplete, match="fp8_e5m2"):  # a partial format as the reference is refused too
        s.paired("filler", "int4", 2048, reference="fp8_e5m2")
    s2 = R.LongSweep.load(_write(tmp_path, recs + [added] + more + [_ppl(2, fp8_e5m2=20.5) | {"added": True}], header))
    assert s2.paired_perplexity("fp8_e5m2")["windows"] == 3 and s2.perplexity("int4") == pytest.approx(math.exp(2.1))
    for bad, msg in (([added, _rec("filler", 4096, 0.0, 0, fp8_e5m2=True) | {"added": True}], "never measured"),
                     ([added, _rec("filler", 1024, 0.0, 0, int4=True) | {"key": "k0", "added": True}], "measured twice"),
                     ([added, _rec("filler", 1024, 0.0, 0, fp8_e5m2=True) | {"key": "k9", "added": True}],
                      "a different prompt"),
                     ([_rec("filler", 1024, 0.0, 0, fp8_e5m2=True) | {"key": "k0", "added": True}], "not in the header"),
                     ([added, added], "already in the sweep"),
                     ([{"kind": "formats", "formats": {}}], "must name formats")):
        with pytest.raises(ValueError, match=msg):
            R.LongSweep.load(_write(tmp_path, recs + bad, header))


@pytest.mark.parametrize("line, msg", [
    (_ppl(0, fp32=-1.0), "nll"),
    (_ppl(0, fp32=float("inf")), "nll"),
    (_ppl(0, fp32=True), "nll"),
    ({**_ppl(0, fp32=1.0), "tokens": 0}, "tokens"),
    ({"stage": "x", "length": 1, "depth": 0, "index": 0, "correct": {"fp32": True}}, "stage"),
    ({"stage": "filler", "length": -1, "depth": 0, "index": 0, "correct": {"fp32": True}}, "length"),
    ({"stage": "filler", "length": 1, "depth": 2, "index": 0, "correct": {"fp32": True}}, "depth"),
    ({"stage": "filler", "length": 1, "depth": 0, "index": 0, "correct": {"fp32": 1}}, "correct"),
    ({"stage": "filler", "length": 1, "depth": 0, "index": 0, "correct": {"fp64": True}}, "not in the header"),
    ([1, 2], "JSON object"),
])
def test_a_malformed_sweep_names_its_line(tmp_path, line, msg):
    with pytest.raises(ValueError, match=msg) as e:
        R.LongSweep.load(_write(tmp_path, [line]))
    assert "s.jsonl:2" in str(e.value)


def test_a_sweep_without_header_or_file_is_refused(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"stage": "filler"}\n')
    with pytest.raises(ValueError, match="header"):
        R.LongSweep.load(p)
    head = '{"kind": "header", "model": "m", "formats": {"fp32": {}}}\n'
    for bad, msg in (("not json\n", "s.jsonl:2 is not a JSON sweep line"), ("[" * 100_000 + "]" * 100_000 + "\n",
                     "s.jsonl:2 nests too deeply"), ('{"index": ' + "9" * 5000 + "}\n", "s.jsonl:2 is not a JSON sweep line")):
        p.write_text(head + bad)
        with pytest.raises(ValueError, match=msg):
            R.LongSweep.load(p)
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="cannot read it as UTF-8"):
        R.LongSweep.load(p)
    with pytest.raises(FileNotFoundError, match="sweep_long"):
        R.LongSweep.load(tmp_path / "missing.jsonl")


def test_the_shipped_long_sweep_loads_and_compares_on_identical_prompts():
    s = R.LongSweep.load()
    assert s.model == "gemma3-270m" and "fp32" in s.formats
    for r in s.table("filler"):
        assert r["prompts"] >= 1 and 0 <= r["lo"] <= r["rate"] <= r["hi"] <= 1
    assert s.figure("filler").data


# --------------------------------------------------------------------------- chapter 4's SmolLM2 sweep (moved from test_evals)

def _fake_sweep(tmp_path):
    def cells(short, long):
        return [{"length": 512, "depth": 0.0, "trials": 4, "correct": short},
                {"length": 2048, "depth": 0.0, "trials": 4, "correct": long},
                {"length": 4096, "depth": 0.0, "trials": 4, "correct": long}]

    teacher = {"kl": 0.01, "top1_agreement": 0.99, "mean_first_divergence": 20.0, "first_divergence": [18, 22],
               "max_new_tokens": 32}
    doc = {"model": "m", "formats": {
        "fp32": {"bits_per_element": 32, "perplexity": 10.0, "passkey": cells(4, 4),
                 "chain2": [{"length": 512, "depth": 1.0, "trials": 4, "correct": 2}], "teacher": teacher},
        "int4": {"bits_per_element": 4.5, "perplexity": 10.5, "passkey": cells(4, 1), "chain2": [],
                 "teacher": dict(teacher, kl=0.2)}}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    return path


def test_load_sweep_and_ladder(tmp_path):
    sweep = R.load_sweep(_fake_sweep(tmp_path))
    assert sweep["formats"]["int4"]["passkey_result"].accuracy(4096) == 0.25
    rows = {r["kv_format"]: r for r in R.ladder(sweep, short=512, long_min=2048)}
    assert rows["int4"]["needle_short"] == 1.0 and rows["int4"]["needle_long"] == 0.25
    assert abs(rows["int4"]["ppl_increase"] - 0.05) < 1e-12 and rows["fp32"]["ppl_increase"] == 0
    assert rows["fp32"]["chain"] == 0.5 and rows["int4"]["chain"] is None and rows["int4"]["kl"] == 0.2
    with pytest.raises(KeyError, match="reference"):
        R.ladder(sweep, reference="bf16")
    with pytest.raises(KeyError, match="no passkey cells"):
        R.ladder(sweep, short=1024)


def test_load_sweep_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="sweep_evals"):
        R.load_sweep(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="formats"):
        R.load_sweep(tmp_path / "bad.json")


def test_accuracy_pools_cells_from_a_minimum_length():
    res = R.EvalResult("passkey", "m", "int4", [
        {"length": 512, "depth": 0.0, "trials": 10, "correct": 10},
        {"length": 4096, "depth": 0.0, "trials": 10, "correct": 3},
        {"length": 8192, "depth": 0.5, "trials": 10, "correct": 1}])
    assert res.accuracy(min_length=2048) == 0.2 and res.accuracy(min_length=8192, depth=0.5) == 0.1
    with pytest.raises(KeyError, match="min_length=16384"):
        res.accuracy(min_length=16384)


def test_ladder_markdown_and_cell_agreement(tmp_path):
    sweep = R.load_sweep(_fake_sweep(tmp_path))
    md = R.ladder_markdown(R.ladder(sweep))
    lines = md.splitlines()
    assert lines[0].startswith("| format | bits / value | perplexity vs fp32 | needle at 512 (95% CI) | "
                               "needle at ≥2k, all depths (95% CI) | 2-hop chain | KL to teacher (nats / token) |"), lines[0]
    assert lines[0].endswith("| first divergent token (mean of 2 prompts; 32 = none) |") and len(lines) == 4
    assert "| int4 | 4.50 | +5.0% | 100% (51%–100%) | 25% (7%–59%) | — | 0.2000 |" in md, md
    # int4 differs from fp32 by 0.75 in both long cells: 4 of 6 cells agree within 0.25, all within 0.75
    assert R.cell_agreement(sweep, tol=0.25) == 4 / 6 and R.cell_agreement(sweep, tol=0.75) == 1.0
    with pytest.raises(KeyError, match="reference"):
        R.cell_agreement(sweep, reference="bf16")


@given(trials=st.integers(1, 500), data=st.data())
def test_wilson_interval_brackets_the_rate(trials, data):
    correct = data.draw(st.integers(0, trials))
    lo, hi = R.wilson(correct, trials)
    assert 0 <= lo <= correct / trials <= hi <= 1
    lo2, hi2 = R.wilson(trials - correct, trials)  # misses and hits are mirror images
    assert lo == pytest.approx(1 - hi2, abs=1e-9) and hi == pytest.approx(1 - lo2, abs=1e-9)
    if trials >= 100:
        assert hi - lo < 0.2
    with pytest.raises(ValueError):
        R.wilson(trials + 1, trials)


def test_counts_and_where_a_format_falls():
    rows = [{"length": n, "depth": d, "trials": 5, "correct": c}
            for n, c in ((512, 5), (2048, 4), (8192, 1)) for d in (0.0, 1.0)]
    assert R.counts(rows, length=2048) == (8, 10) and R.counts(rows, min_length=2048) == (10, 20)
    res = R.EvalResult("passkey", "m", "int4", rows)
    ref = R.EvalResult("passkey", "m", "fp32", [dict(r, correct=5) for r in rows])
    assert R.falls_at(res, ref, drop=0.2) == 2048 and R.falls_at(res, ref, drop=0.5) == 8192
    assert R.falls_at(ref, ref) is None
    with pytest.raises(ValueError, match="drop"):
        R.falls_at(res, ref, drop=0)


def test_rates_with_intervals_draw_the_wilson_interval():
    rates, err = R.rates_with_intervals([(5, 5), (1, 4)])
    assert rates == [1.0, 0.25] and err["array"][0] == 0.0
    lo, hi = R.wilson(1, 4)
    assert err["arrayminus"][1] == pytest.approx(0.25 - lo) and err["array"][1] == pytest.approx(hi - 0.25)


def test_llamacpp_beside_kvlab_joins_the_same_cells():
    llama = {"cache_types": {"q4_0": {"seconds": 3.0, "rows": [
        {"length": 512, "depth": 0.0, "trials": 5, "correct": 4}, {"length": 512, "depth": 1.0, "trials": 5, "correct": 5},
        {"length": 2048, "depth": 0.0, "trials": 5, "correct": 1}]}}}
    sweep = {"formats": {"q4_0": {"passkey": [
        {"length": 512, "depth": 0.0, "trials": 5, "correct": 5}, {"length": 512, "depth": 1.0, "trials": 5, "correct": 3},
        {"length": 8192, "depth": 0.0, "trials": 5, "correct": 2}]}}}
    t = R.llamacpp_vs_kvlab(llama, sweep)["q4_0"]
    assert t["preset"] == "q4_0" and set(t["lengths"]) == {512}  # 2048 and 8192 were measured by one side only
    assert t["lengths"][512] == {"llama.cpp": (9, 10), "kvlab": (8, 10)}
    sweep["formats"]["q4_0"]["passkey"] = sweep["formats"]["q4_0"]["passkey"][2:]
    with pytest.raises(ValueError, match="share no"):
        R.llamacpp_vs_kvlab(llama, sweep)


def test_llamacpp_is_paired_with_the_long_sweep_prompt_by_prompt(tmp_path):
    """llama.cpp's quantized caches sit beside kvlab's "cached" stage where it has the format (the prompt reads
    the cache in both), beside the "filler" stage otherwise; f16 beside the sweep's fp32."""
    header = {"kind": "header", "model": "m", "formats": {"fp32": {}, "q4_0": {}, "q8_0": {}}}
    recs = [_rec("filler", 64, 0.0, i, fp32=True, q4_0=True, q8_0=i != 0) for i in range(4)]
    recs += [_rec("cached", 64, 0.0, i, q4_0=i >= 2) for i in range(4)]  # the prompt reading q4_0 loses two
    s = R.LongSweep.load(_write(tmp_path, recs, header))

    def row(*outcomes):
        return {"length": 64, "depth": 0.0, "trials": len(outcomes), "correct": sum(outcomes), "outcomes": list(outcomes)}

    llama = {"cache_types": {"f16": {"rows": [row(True, True, True, False)]},
                             "q8_0": {"rows": [row(True, True, True, True)]},
                             "q4_0": {"rows": [row(False, True, False, False)]}}}
    t = R.llamacpp_paired(llama, s)
    q4 = t["q4_0"][64]
    assert q4["preset"] == "q4_0" and q4["kvlab_stage"] == "cached"
    assert (q4["engine"].lost, q4["engine"].gained) == (2, 0)  # vs llama.cpp's own f16 on the same prompts
    assert (q4["kvlab"].lost, q4["kvlab"].gained, q4["kvlab"].prompts) == (2, 0, 4)  # kvlab's cached q4_0 vs fp32
    assert (q4["between"].lost, q4["between"].gained) == (2, 1)  # prompt by prompt, llama.cpp vs kvlab
    q8 = t["q8_0"][64]
    assert q8["kvlab_stage"] == "filler" and (q8["engine"].gained, q8["kvlab"].lost) == (1, 1)
    assert t["f16"][64]["kvlab_stage"] == "filler" and t["f16"][64]["between"].lost == 1
    # a resumed run writes after each depth: a length not finished by a cache type (or by f16) is not paired
    part = {"lengths": [64, 128], "depths": [0.0, 0.5], **llama}
    part["cache_types"] = {ct: {"rows": [v["rows"][0], {**v["rows"][0], "depth": 0.5}]} for ct, v in llama["cache_types"].items()}
    part["cache_types"]["q4_0"]["rows"].append({**llama["cache_types"]["q4_0"]["rows"][0], "length": 128})
    assert R.llamacpp_pending(part) == {ct: {128: 4 if ct == "q4_0" else 0} for ct in ("f16", "q8_0", "q4_0")}
    assert all(set(by_n) == {64} for by_n in R.llamacpp_paired(part, s).values())
    part["cache_types"]["f16"]["rows"].pop()  # f16 without depth 0.5 at 64: nothing pairs at 64 either
    assert R.llamacpp_pending(part)["f16"] == {64: 4, 128: 0} and R.llamacpp_paired(part, s) == {}
    llama["cache_types"]["q4_0"]["rows"][0].pop("outcomes")
    with pytest.raises(ValueError, match="no per-prompt outcomes"):
        R.llamacpp_paired(llama, s)
    with pytest.raises(ValueError, match="f16 cache as the reference"):
        R.llamacpp_paired({"cache_types": {"q8_0": llama["cache_types"]["q8_0"]}}, s)


def test_the_perplexity_interval_shows_how_much_the_passages_decide(tmp_path):
    same = R.LongSweep.load(_write(tmp_path, [_ppl(i, fp32=20.0, int4=20.5) for i in range(8)]))
    lo, hi = same.perplexity_interval("int4")  # every passage says the same: no spread
    assert lo == pytest.approx(hi) == pytest.approx(math.exp(0.05) - 1)
    mixed = R.LongSweep.load(_write(tmp_path, [_ppl(i, fp32=20.0, int4=20.0 + i / 4) for i in range(8)]))
    lo, hi = mixed.perplexity_interval("int4")
    whole = mixed.paired_perplexity("int4")["increase"]
    assert lo < whole < hi and mixed.perplexity_interval("int4") == (lo, hi)  # seeded: the same data, the same answer
    with pytest.raises(ValueError, match="level"):
        mixed.perplexity_interval("int4", level=1.5)
    with pytest.raises(KeyError, match="no perplexity windows"):
        mixed.perplexity_interval("q4_0")


def test_paired_perplexity_can_read_only_the_first_windows(tmp_path):
    recs = [_ppl(i, fp32=10.0, int4=10.0 + (5.0 if i >= 2 else 0.0)) for i in range(4)]
    s = R.LongSweep.load(_write(tmp_path, recs))
    assert s.paired_perplexity("int4", windows=2)["increase"] == 0.0 and s.paired_perplexity("int4", windows=2)["windows"] == 2
    assert s.paired_perplexity("int4")["increase"] > 0 and s.paired_perplexity("int4")["worse_windows"] == 2


def test_holm_steps_down_and_is_never_looser_than_the_single_test():
    from kvlab.results import holm

    assert holm([0.01, 0.04, 0.03]) == [True, False, False]  # 0.01 < 0.05/3; 0.03 >= 0.05/2: stop
    assert holm([0.001, 0.02, 0.04]) == [True, True, True]  # 0.001 < .0167, 0.02 < .025, 0.04 < .05
    assert holm([]) == [] and holm([0.049]) == [True] and holm([0.05]) == [False]
    for bad in ([1.5], [-0.1], [float("nan")], ["0.1"], [True]):
        with pytest.raises(ValueError, match="p-values"):
            holm(bad)
    with pytest.raises(ValueError, match="alpha"):
        holm([0.1], alpha=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), max_size=12))
def test_holm_rejects_a_subset_of_what_each_test_alone_rejects_and_smaller_ps_first(ps):
    from kvlab.results import ALPHA, holm

    keep = holm(ps)
    assert all(p < ALPHA for p, k in zip(ps, keep) if k)
    assert all(not k2 or k1 for p1, k1 in zip(ps, keep) for p2, k2 in zip(ps, keep) if p1 < p2)


def test_a_sweeps_needle_tests_are_each_length_of_each_haystack_and_pooled(tmp_path):
    """-4 +0 at two lengths (p = 0.125 each), -8 +0 pooled (p = 0.008): three tests, and Holm keeps the pooled one
    (0.008 < 0.05 / 3); at -3 +0 a length (pooled -6 +0, p = 0.031 > 0.05 / 3) it keeps none."""
    header = {"kind": "header", "model": "m", "formats": {"fp32": {}, "int4": {}}, "depths": [0.0], "per_depth": 6}
    for miss, kept in ((4, ["pooled"]), (3, [])):
        recs = [_rec("filler", n, 0.0, i, fp32=True, int4=i >= miss) for n in (1024, 2048) for i in range(6)]
        s = R.LongSweep.load(_write(tmp_path, recs, header))
        tests = s.needle_tests("int4")
        assert list(tests) == ["filler 1024", "filler 2048", "pooled"] and tests["pooled"].lost == 2 * miss
        assert tests["pooled"].verdict == "worse" and s.worse_after_holm("int4") == kept
    with pytest.raises(KeyError, match="no prompts"):
        s.needle_tests("int4", stages=("prose",))


def test_paired_nll_pairs_windows_and_refuses_unequal_lists():
    import math

    from kvlab.results import paired_nll

    r = paired_nll([11.0, 12.0, 9.0], [10.0, 10.0, 10.0], [10, 10, 10])
    assert (r["worse_windows"], r["better_windows"], r["windows"], r["tokens"]) == (2, 1, 3, 30)
    assert r["increase"] == pytest.approx(math.exp(32 / 30) / math.exp(1) - 1)
    with pytest.raises(ValueError, match="one NLL per window"):
        paired_nll([1.0], [1.0, 2.0], [5])


def test_one_formats_two_prefill_modes_pool_over_the_cached_lengths_only(tmp_path):
    """At each of two cached lengths reading the cache loses 3 prompts of 4 that the full prefill answered;
    the filler stage also has a third length the cached stage never ran, which the pooled test must skip."""
    recs = [_rec("filler", n, 0.0, i, fp32=True, int4=True) for n in (1024, 2048, 4096) for i in range(4)]
    recs += [_rec("cached", n, 0.0, i, int4=i == 0) for n in (1024, 2048) for i in range(4)]
    s = R.LongSweep.load(_write(tmp_path, recs))
    pooled = s.paired_pooled("cached", "int4", "int4", reference_stage="filler")
    each = [s.paired("cached", "int4", n, "int4", "filler") for n in (1024, 2048)]
    assert (pooled.prompts, pooled.lost, pooled.gained) == (8, 6, 0) == (sum(p.prompts for p in each),
                                                                         sum(p.lost for p in each), 0)
    assert pooled.verdict == "worse" and all(p.verdict == "not distinguishable" for p in each)


def test_a_resumed_llamacpp_run_logs_each_sessions_machine_and_prompts():
    """A llama.cpp file resumed on another machine lists where each session's prompts ran, not one machine for all."""
    from kvlab.results import llamacpp_answered, llamacpp_log_run, llamacpp_machines_md

    row = {"length": 64, "depth": 0.0, "trials": 5, "correct": 5, "outcomes": [True] * 5}
    start = {"f16": {"rows": [row], "seconds": 10.0}, "q4_0": {"rows": [], "seconds": 4.0,
                                                               "partial": {"outcomes": [True, False]}}}
    assert llamacpp_answered(start) == {"f16": 5, "q4_0": 2}
    first = [{"machine": "A", "dates": ["2026-12-02", "2026-12-03"], "prompts": {"f16": 5, "q4_0": 2}}]
    later = {"f16": start["f16"], "q4_0": {"rows": [{**row, "correct": 4}], "seconds": 30.5}}
    runs = llamacpp_log_run(first, llamacpp_answered(start), later, {"f16": 10.0, "q4_0": 4.0}, machine="B",
                            dates=["2026-12-07", "2026-12-07"])
    assert runs[1] == {"machine": "B", "dates": ["2026-12-07", "2026-12-07"], "prompts": {"q4_0": 3},
                       "seconds": {"q4_0": 26.5}}
    assert llamacpp_log_run(first, llamacpp_answered(start), start, {}, machine="B", dates=["x", "x"]) == first
    md = llamacpp_machines_md({"runs": runs})
    assert md == "A, 2026-12-02 to 2026-12-03 (5 f16, 2 q4_0 prompts); and B, 2026-12-07 (3 q4_0 prompts)"
    assert llamacpp_machines_md({"machine": "C", "date": "2026-12-01"}) == "C, 2026-12-01"
    assert llamacpp_machines_md({"runs": [{**first[0], "prompts": {"q4_0": 1}}]}).endswith("(1 q4_0 prompt)")
    again = runs + [{"machine": "B", "dates": ["2026-12-08", "2026-12-09"], "prompts": {"q4_0": 4, "q8_0": 1}}]
    assert llamacpp_machines_md({"runs": again}).endswith("; and B, 2026-12-07 to 2026-12-09 (7 q4_0, 1 q8_0 prompts)")


def test_a_machine_name_goes_into_a_chapter_as_literal_text():
    """A CPU name with Markdown in it (``_``, ``*``, ``|``) reads as written, not as emphasis or a table border."""
    from kvlab.results import llamacpp_machines_md

    run = {"machine": "Xeon_*v4* | AMX", "dates": ["2026-12-07", "2026-12-07"], "prompts": {"q4_0": 2}}
    assert llamacpp_machines_md({"runs": [run]}) == r"Xeon\_\*v4\* \| AMX, 2026-12-07 (2 q4_0 prompts)"
    assert llamacpp_machines_md({"machine": "a_b", "date": "2026-12-01"}) == r"a\_b, 2026-12-01"
    assert llamacpp_machines_md({"runs": [{**run, "machine": "Intel(R) Xeon(R)"}]}).startswith("Intel(R) Xeon(R),")
