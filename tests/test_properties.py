"""Property tests over the functions a reader calls from a chapter (issue 45): given any input, each one returns a
finite, in-range answer or raises a named ``ValueError``/``TypeError``; never a NaN, an overflow, a hang or a
bare traceback from deep inside. Oracle values beside them (exact tails by integer arithmetic, closed forms)."""

import functools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import power, results
from kvlab.check import Exercise, Numeric, claims

ANY = st.one_of(st.none(), st.booleans(), st.integers(-10**400, 10**400), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=8), st.lists(st.integers(), max_size=2))
COUNTS = st.one_of(st.integers(-5, 5000), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3))


def answers_or_refuses(fn, *args, **kw):
    """Call ``fn``; return its answer, or None where it refused with a named error (the only refusals allowed)."""
    try:
        return fn(*args, **kw)
    except (ValueError, TypeError) as e:
        assert str(e), "a refusal must say why"
        return None


@given(COUNTS, COUNTS, st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans()))
def test_wilson_is_an_ordered_interval_inside_0_1_or_a_refusal(correct, trials, z):
    out = answers_or_refuses(results.wilson, correct, trials, z)
    if out is not None:
        lo, hi = out
        assert 0 <= lo <= correct / trials <= hi <= 1


@given(COUNTS, COUNTS)
def test_mcnemar_is_a_probability_or_a_refusal(lost, gained):
    p = answers_or_refuses(results.mcnemar, lost, gained)
    assert p is None or 0 <= p <= 1  # 0.0 where the tail is below the smallest float (2**-1074)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2500), st.integers(0, 2500))
def test_mcnemar_in_log_space_matches_the_exact_integer_tail(lost, gained):
    n, m = lost + gained, min(lost, gained)
    exact = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(m + 1)) / 2 ** n)
    assert results.mcnemar(lost, gained) == pytest.approx(exact, rel=1e-9, abs=1e-300)


def test_large_counts_answer_quickly():
    assert results.mcnemar(20000, 20000) == 1.0
    assert results.mcnemar(20000, 0) < 1e-300
    # Clopper-Pearson, closed form at k = 0: 1 - (1 - confidence)^(1/n)
    assert results.exact_upper(0, 10**5) == pytest.approx(1 - 0.05 ** (1 / 10**5), rel=1e-9)
    assert 0.05 < results.exact_upper(500, 10000) < 0.056  # 5% observed, one-sided 95% bound a little above


@settings(max_examples=60, deadline=None)
@given(COUNTS, COUNTS, st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans()))
def test_exact_upper_bounds_the_observed_rate_or_refuses(k, n, confidence):
    out = answers_or_refuses(results.exact_upper, k, n, confidence)
    assert out is None or k / n <= out <= 1


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=4), st.data())
def test_paired_nll_refuses_values_that_are_not_summed_nlls(nll, data):
    ref = data.draw(st.lists(st.floats(0, 1e4), min_size=len(nll), max_size=len(nll)))
    tokens = data.draw(st.lists(st.integers(-2, 600), min_size=len(nll), max_size=len(nll)))
    out = answers_or_refuses(results.paired_nll, nll, ref, tokens)
    if out is not None:
        assert all(math.isfinite(out[k]) for k in ("perplexity", "ref_perplexity", "increase", "p"))


@given(ANY, ANY)
def test_numeric_refuses_an_answer_or_tolerance_that_cannot_grade(answer, rel_tol):
    q = answers_or_refuses(Numeric, "how many?", answer, rel_tol=rel_tol)
    if q is not None:
        assert math.isfinite(q.answer) and 0 < q.rel_tol < 1


@given(ANY)
def test_numeric_check_answers_in_words_whatever_is_typed(value):
    fb = Numeric("how many?", 13).check(value)
    assert fb.message and "nan" not in fb.message.lower().replace("enter a finite number, got nan", "")
    assert fb.correct == (not isinstance(value, bool | list) and value is not None and _is_close(value, 13))


def _is_close(value, want):
    try:
        return math.isclose(float(value), want, rel_tol=0.02)
    except (TypeError, ValueError, OverflowError):
        return False


def test_numeric_oracles():
    q = Numeric("q", 13, rel_tol=0.01)
    assert not q.check(float("nan")).correct and "finite" in q.check("1e309").message
    assert "Enter a number" in q.check(10**400).message
    for bad in (float("inf"), 0, 1, True, -0.1):
        with pytest.raises(ValueError, match="rel_tol"):
            Numeric("q", 1, rel_tol=bad)
    with pytest.raises(ValueError, match="answer"):
        Numeric("q", float("nan"))


def test_exercise_names_a_partial_function_when_it_raises():
    def boom(x, y):
        raise RuntimeError("no")

    fb = Exercise("e", lambda x: x, [(1,)]).check(functools.partial(boom, y=2))
    assert not fb.correct and "partial" in fb.message and "RuntimeError: no" in fb.message


@given(ANY)
def test_a_claim_holds_only_for_a_real_true(value):
    try:
        claims({"c": value})
        held = True
    except (AssertionError, TypeError, ValueError):
        held = False
    assert held == (value is True or (isinstance(value, tuple) and value[:1] == (True,)))


@settings(max_examples=40, deadline=None)
@given(COUNTS, st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2)))
def test_power_functions_answer_in_range_or_refuse(prompts, loss):
    p = answers_or_refuses(power.power, prompts, loss) if isinstance(prompts, int) and prompts <= 400 else None
    assert p is None or 0 <= p <= 1
    d = answers_or_refuses(power.detectable_loss, prompts) if isinstance(prompts, int) and prompts <= 400 else None
    assert d is None or 0 < d <= 1


# ------------------------------------------------------------------ formats and quantize (issue 45)


def test_a_quantizer_takes_real_yes_no_and_integer_answers():
    from kvlab.formats import KVFormat, Quantizer, get_format

    for bad in (dict(granularity="group", group_size=True), dict(symmetric="no"), dict(full_range=1),
                dict(granularity="group", group_size=32.0)):
        with pytest.raises(TypeError, match="must be"):
            Quantizer("int4", **bad)
    with pytest.raises(ValueError, match="group_size is for granularity 'group'"):
        Quantizer("int4", "token", group_size=64)
    with pytest.raises(TypeError, match="key must be a Quantizer"):
        KVFormat("x", key="int4", value="int4")
    with pytest.raises(TypeError, match="rotate must be True or False"):
        get_format("int4").with_options(rotate="yes")
    assert get_format("int4").with_options(rotate=True).name == "int4+rotate"


def test_hadamard_takes_an_integer_size():
    from kvlab.quant import hadamard

    with pytest.raises(TypeError, match="integer"):
        hadamard(True)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)


def test_a_frozen_scale_must_be_one_quantize_could_have_made():
    import torch

    from kvlab.formats import get_format
    from kvlab.quant import dequantize, quantize

    x = torch.randn(2, 3, 8, 64)
    q8, q4 = get_format("int8_tensor").key, get_format("int4").key  # symmetric per tensor; asymmetric groups
    first = quantize(x, q8)
    assert torch.equal(quantize(x, q8, scale=first.scale).data, first.data)  # a previous scale is taken as is
    for bad, why in ((first.scale * 0, "positive"), (-first.scale, "positive"), (first.scale * float("nan"), "finite"),
                     (torch.ones(5, 7), "does not broadcast")):
        with pytest.raises(ValueError, match=why):
            quantize(x, q8, scale=bad)
    with pytest.raises(TypeError, match="tensor"):
        quantize(x, q8, scale=0.5)
    g = quantize(x, q4)
    with pytest.raises(ValueError, match="scale and zero together"):
        quantize(x, q4, scale=g.scale)
    assert torch.allclose(dequantize(quantize(x, q4, scale=g.scale, zero=g.zero)), dequantize(g))
    with pytest.raises(ValueError, match="stores no zero point"):
        quantize(x, q8, scale=first.scale, zero=first.scale)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans()),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans()))
def test_a_cost_model_times_a_step_finitely_or_refuses(bandwidth, peak):
    from kvlab.simulator import CostModel

    cost = answers_or_refuses(CostModel, 1000, 2000, peak, bandwidth)
    if cost is not None:
        t = cost.step_seconds(10, 100.0, True)
        assert math.isfinite(t) and t >= 0


# ------------------------------------------------------------------ loaders of shipped results (issue 45)

HOSTILE_JSON = {"a list": "[1, 2]", "a number": "3", "NaN": '{"x": NaN}', "deep nesting": "[" * 100_000 + "]" * 100_000,
                "a 5,000-digit integer": '{"x": ' + "9" * 5000 + "}", "not UTF-8": b"\xff\xfe{}", "empty": ""}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_every_json_loader_refuses_what_is_not_its_file_and_names_the_file(tmp_path, name):
    from kvlab.endpoint import load as load_side_by_side
    from kvlab.results import EvalResult, load_sweep

    f = tmp_path / "x.json"
    text = HOSTILE_JSON[name]
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    for load in (EvalResult.load, load_sweep, load_side_by_side):
        with pytest.raises(ValueError, match="x.json"):
            load(f)


def test_loaders_refuse_a_folder_and_a_device(tmp_path):
    from kvlab.results import EvalResult, LongSweep, load_sweep

    for load in (EvalResult.load, load_sweep, LongSweep.load):
        for path in (tmp_path, "/dev/zero"):
            with pytest.raises(ValueError, match="not a regular file"):
                load(path)


def test_an_eval_result_refuses_impossible_cells_naming_the_field(tmp_path):
    import json

    from kvlab.results import EvalResult

    cell = {"length": 512, "depth": 0.5, "trials": 5, "correct": 3}
    for bad, why in ((cell | {"correct": 6}, "correct 6 is more than its 5 trials"), (cell | {"trials": 0}, "positive"),
                     (cell | {"depth": float("nan")}, "depth must be a number in"), (cell | {"length": "512"}, "length"),
                     ([cell, cell], "appears twice")):
        with pytest.raises(ValueError, match=why):
            EvalResult("passkey", "m", "int4", bad if isinstance(bad, list) else [bad])
    f = tmp_path / "r.json"
    for doc, why in (({"task": "p", "model": "m", "kv_format": "f", "rows": [], "extra": 1}, "unknown fields extra"),
                     ({"task": "p", "model": "m", "kv_format": "f", "rows": {}}, "rows of the wrong type"),
                     ({"task": "p", "model": "m", "kv_format": "f", "rows": [cell | {"correct": 9}]}, "rows\\[0\\]")):
        f.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="r.json.*" + why):
            EvalResult.load(f)
    assert EvalResult.load(_saved(tmp_path, cell)).accuracy() == 0.6


def _saved(tmp_path, cell):
    from kvlab.results import EvalResult

    EvalResult("passkey", "m", "int4", [cell]).save(tmp_path / "ok.json")
    return tmp_path / "ok.json"


def test_a_long_sweep_with_one_prompt_written_twice_is_refused(tmp_path):
    from kvlab.results import LONG_SWEEPS, LongSweep

    lines = LONG_SWEEPS["smollm2-135m"].read_text().splitlines()
    record = next(x for x in lines[1:] if '"kind"' not in x)
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(lines + [record]) + "\n")
    with pytest.raises(ValueError, match="already recorded on an earlier line"):
        LongSweep.load(f)
