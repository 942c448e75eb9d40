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
            with pytest.raises(ValueError, match="not a regular file|is a folder"):
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


# ------------------------------------------------------------------ a second hostile pass (issue 45)


@pytest.mark.parametrize("call, why", [
    (lambda: power.power(10**7, 0.1), "prompts must be at most 50,000"),
    (lambda: power.prompts_needed(0.001), "loss must be in \\[0.005, 1\\]"),
    (lambda: power.prompts_needed(0.1, alpha=0), "alpha"),
    (lambda: power.prompts_needed(0.1, flips=-0.1), "flips"),
    (lambda: power.detectable_loss(25, step=1e-9), "step"),
    (lambda: power.detectable_loss(25, target=-1), "target"),
    (lambda: power.power(25, loss=10**400), "loss must be a finite number"),
    (lambda: results.fewest_prompts_to_detect(float("nan")), "alpha"),
    (lambda: results.mcnemar(10**8, 1), "at most 1,000,000"),
    (lambda: results.wilson(5, 10, z=10**400), "z must be"),
    (lambda: results.paired_nll([10**400], [1], [1]), "summed NLLs"),
])
def test_what_would_hang_or_overflow_is_refused_at_once_naming_the_argument(call, why):
    with pytest.raises(ValueError, match=why):
        call()


def test_large_counts_keep_their_exact_answers():
    # a balanced million pairs: p = 1; the bound on 10% of a million sits just above 10%
    assert results.mcnemar(10**6, 10**6) == 1.0
    assert 0.1 < results.exact_upper(10**5, 10**6) < 0.101
    assert power.table(losses=(0.1,), flips=(0.0,))[0]["prompts"] == power.prompts_needed(0.1)
    with pytest.raises(TypeError, match="sequence"):
        power.table(losses=0.1)


def test_quantize_helpers_refuse_what_they_cannot_use():
    import torch

    from kvlab.formats import Quantizer, get_format
    from kvlab.quant import dequantize, fake_quantize, hadamard, quantize

    with pytest.raises(ValueError, match="at most 8,192"):
        hadamard(1 << 16)
    with pytest.raises(TypeError, match="float type"):
        hadamard(4, dtype=torch.bool)
    q8 = get_format("int8").key
    x = torch.randn(2, 4, 8, 64)
    with pytest.raises(ValueError, match="must be positive"):  # 1e-300 is 0 in float32, the dtype quantize divides in
        quantize(x, q8, scale=torch.full(quantize(x, q8).scale.shape, 1e-300, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 dims"):
        fake_quantize(torch.randn(64), q8)
    with pytest.raises(TypeError, match="Quantizer"):
        fake_quantize(x, "int8")
    with pytest.raises(TypeError, match="QTensor"):
        dequantize("x")
    big = torch.full((2, 64), 1e6)
    assert torch.isfinite(fake_quantize(big, Quantizer())).all()  # float16 saturates at 65504, as int codes do


def test_with_options_names_read_back_to_the_same_format():
    from kvlab.formats import get_format

    f = get_format("int4_token")
    assert f.with_options(sinks=4).with_options(sinks=0).name == "int4_token"
    assert f.with_options(sinks=4).with_options(sinks=8).name == "int4_token+sinks8"
    g = f.with_options(sinks=4, rotate=True)
    assert get_format(g.name) == g
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        f.with_options(name="")


def test_simulator_and_budget_refuse_sizes_past_any_deployment():
    from kvlab import budget as B
    from kvlab.simulator import CostModel, pool_blocks

    with pytest.raises(ValueError, match="block_size must be at most"):
        B.budget("llama-3.1-8b", 1, 4096, block_size=10**400)
    with pytest.raises(ValueError, match="block_size must be a whole number"):
        pool_blocks("llama-3.1-8b", "L4", "bf16", block_size=0)
    cost = CostModel(1000, 2000, 1e15, 1e12)
    for args in (("a", 0, True), (-1000, 0, True), (0, float("inf"), True), (0, -1.0, True)):
        with pytest.raises(ValueError, match="prefill_tokens|decode_cache_bytes"):
            cost.step_seconds(*args)
    with pytest.raises(TypeError, match="keys must be field names"):
        B.load_shape({1: 2, "model_type": "llama"})


def test_quiz_objects_refuse_malformed_arguments_and_compare_dicts():
    import torch

    with pytest.raises(TypeError, match="mistakes must be a dict"):
        Numeric("q", 5, mistakes=[("a", 1)])
    with pytest.raises(TypeError, match="explanation must be text"):
        Numeric("q", 5, explanation=None)
    with pytest.raises(ValueError, match="atol"):
        Exercise("e", lambda x: x, [(1,)], atol=-1)

    def leaves():
        raise SystemExit(1)

    assert "called exit()" in Exercise("e", lambda: 1, [()]).check(leaves).message
    ex = Exercise("e", lambda: {"a": torch.ones(3)}, [()])
    assert ex.check(lambda: {"a": torch.ones(3)}).correct and not ex.check(lambda: {"a": torch.zeros(3)}).correct


def test_an_eval_grid_with_a_missing_cell_shows_none_and_strict_json_refuses_overflowing_floats(tmp_path):
    from kvlab.paths import load_json
    from kvlab.results import EvalResult

    r = EvalResult("p", "m", "f", [{"length": 512, "depth": 0.5, "trials": 4, "correct": 2},
                                  {"length": 1024, "depth": 0.0, "trials": 4, "correct": 4}])
    assert r.grid() == [[None, 1.0], [0.5, None]]
    with pytest.raises(TypeError, match="length must be a number"):
        r.accuracy(length="512")
    f = tmp_path / "x.json"
    f.write_text('{"a": 1e999}')
    with pytest.raises(ValueError, match="past a float's range"):
        load_json(f, "x")


def test_a_text_file_flag_refuses_process_streams_and_a_trailing_slash(tmp_path):
    from kvlab.paths import read_text
    from kvlab.tasks import key_lookalikes

    f = tmp_path / "hay.txt"
    f.write_text("Order 12345 shipped; order 123456 did not; 4321 waits. Then 99999.")
    assert read_text(f, "--haystack-file").startswith("Order")
    for bad, why in ((str(f) + "/", "ends in /"), ("/proc/self/environ", "under /proc or /dev")):
        with pytest.raises(ValueError, match=why):
            read_text(bad, "--haystack-file")
    assert key_lookalikes(f.read_text()) == 2  # 12345 and 99999: five digits exactly, not part of a longer number


def test_a_config_or_trace_saved_with_a_byte_order_mark_is_read(tmp_path):
    import json

    from kvlab import budget as B
    from kvlab.traces import load_trace

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
           "hidden_size": 256, "head_dim": 64, "vocab_size": 1000, "intermediate_size": 512}
    (tmp_path / "config.json").write_text("\ufeff" + json.dumps(cfg), encoding="utf-8")
    assert B.budget(str(tmp_path), 1, 16).cache_bytes == 2 * 2 * 64 * 2 * 16  # layers x (K, V) x head_dim x bytes x tokens
    (tmp_path / "t.jsonl").write_text('\ufeff{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": []}\n',
                                      encoding="utf-8")
    assert len(load_trace(tmp_path / "t.jsonl")) == 1
