"""kvlab.results: read without torch, the paired test against independent oracles, the sweep file's checks."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
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
    recs += [_rec("cached", 1024, 0.0, i, int4=False) for i in range(3)]  # reference from the filler stage
    s = R.LongSweep.load(_write(tmp_path, recs))
    pr = s.paired("filler", "int4", 1024)
    assert (pr.prompts, pr.correct, pr.ref_correct, pr.lost, pr.gained) == (11, 3, 10, 8, 1)
    assert pr.verdict == "worse" and pr.p == pytest.approx(20 / 512)
    c = s.paired("cached", "int4", 1024)
    assert (c.prompts, c.lost, c.gained) == (3, 3, 0) and c.verdict == "not distinguishable"
    assert s.fails_at("filler", "int4") == 1024 and s.fails_at("filler", "fp32") is None
    rows = s.table("filler")
    assert {(r["kv_format"], r["verdict"]) for r in rows} == {("fp32", "not distinguishable"), ("int4", "worse")}
    with pytest.raises(KeyError, match="no prompts"):
        s.paired("filler", "int4", 2048)


@pytest.mark.parametrize("line, msg", [
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
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="JSON Lines"):
        R.LongSweep.load(p)
    with pytest.raises(FileNotFoundError, match="sweep_long"):
        R.LongSweep.load(tmp_path / "missing.jsonl")


def test_the_shipped_long_sweep_loads_and_compares_on_identical_prompts():
    s = R.LongSweep.load()
    assert s.model == "gemma3-270m" and "fp32" in s.formats
    for r in s.table("filler"):
        assert r["prompts"] >= 1 and 0 <= r["lo"] <= r["rate"] <= r["hi"] <= 1
    assert s.figure("filler").data
