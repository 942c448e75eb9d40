import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import budget as B
from kvlab import decide


def test_step_time_is_a_roofline():
    a = decide.step_time("llama-3.1-8b", 1, 1024, "bf16", "H100-80GB")
    b = decide.step_time("llama-3.1-8b", 1, 1024, "int4", "H100-80GB")
    assert a.bound == "memory" and a.weights_bytes == b.weights_bytes and b.cache_bytes < a.cache_bytes / 3
    assert a.seconds == pytest.approx((a.weights_bytes + a.cache_bytes) / (3.35e12 * 0.7))  # at roofline.MBU
    assert decide.step_time("llama-3.1-8b", 1, 1024, "bf16", "H100-80GB", mbu=1.0).seconds == \
        pytest.approx((a.weights_bytes + a.cache_bytes) / 3.35e12)
    big = decide.step_time("llama-3.1-8b", 4096, 16, "bf16", "H100-80GB")
    assert big.bound == "compute", "thousands of short sequences at once turn the step compute-bound"
    with pytest.raises(ValueError, match="mbu"):
        decide.step_time("llama-3.1-8b", 1, 1024, mbu=0)


def test_options_rows_and_shortlist():
    risk = {"A": {"held": ["fp8_e4m3", "q4_0"], "needle": {"fp8_e4m3": "held", "q4_0": "held", "int4_tensor": "worse at 1k"},
                  "ppl": {"fp8_e4m3": 0.01, "q4_0": 0.04, "int4_tensor": 1.2}},
            "B": {"held": ["fp8_e4m3", "q4_0"], "needle": {"fp8_e4m3": "held", "q4_0": "held", "int4_tensor": "held"},
                  "ppl": {"fp8_e4m3": 0.01, "q4_0": 0.07, "int4_tensor": 0.01}}}
    rows = decide.options("llama-3.1-8b", "H100-80GB", 32768, 64, risk=risk,
                          formats=["bf16", "fp8_e4m3", "q4_0", "int4_tensor", "int8_tensor"])
    by = {r["kv_format"]: r for r in rows}
    assert by["bf16"]["speedup"] == 1.0 and by["fp8_e4m3"]["max_concurrency"] >= 2 * by["bf16"]["max_concurrency"] - 1
    assert "vLLM" in by["fp8_e4m3"]["engines"] and by["int4_tensor"]["engines"] == {}
    assert by["int8_tensor"]["quality"]["measured"] is False  # in neither sweep
    # q4_0 held on both but costs 7% perplexity on B (over the 5% bar); int4_tensor no engine offers
    assert decide.shortlist(rows) == ["bf16", "fp8_e4m3"]
    assert decide.shortlist(rows, max_ppl=0.08) == ["bf16", "fp8_e4m3", "q4_0"]
    risk["B"]["held"].remove("fp8_e4m3")  # worse on one model: off the list
    assert decide.shortlist(decide.options("llama-3.1-8b", "H100-80GB", 32768, 64, risk=risk,
                                           formats=["bf16", "fp8_e4m3"])) == ["bf16"]
    md = decide.markdown(rows)
    assert "needle held (A · B)" in md and "| `q4_0` |" in md and "yes · yes | +4.0% · +7.0% |" in md
    assert "not measured" in md and "needle" not in decide.markdown(rows, quality=False)
    plain = decide.options("llama-3.1-8b", "H100-80GB", 1024, 1, formats=["bf16"])
    assert plain[0]["quality"] == {"measured": False} and "needle" not in decide.markdown(plain)
    # added to the sweeps later: held on A's needles, only perplexity on B so far: shown, not yet on the list
    risk["A"]["held"].append("fp8_e5m2")
    risk["A"]["needle"]["fp8_e5m2"], risk["A"]["ppl"]["fp8_e5m2"], risk["B"]["ppl"]["fp8_e5m2"] = "held", 0.02, 0.03
    rows = decide.options("llama-3.1-8b", "H100-80GB", 32768, 64, risk=risk, formats=["bf16", "fp8_e5m2"])
    q = rows[1]["quality"]
    assert q["measured"] is False and q["models"]["B"] == {"held": False, "needle": None, "ppl_increase": 0.03}
    assert decide.shortlist(rows) == ["bf16"] and "| yes · not run yet | +2.0% · +3.0% |" in decide.markdown(rows)


SIX = ["bf16", "fp8_e4m3", "int8", "int8_tensor", "q8_0", "q4_0"]
HELD = {"held": SIX, "needle": {f: "held" for f in SIX}, "ppl": {f: 0.01 for f in SIX}}  # every format passed


def _six(risk_b=HELD):
    """Rows and plans of chapter 6's deployment for :data:`SIX`, model A held everywhere, model B as given."""
    rows = decide.options("llama-3.1-8b", "H100-80GB", 32768, 64, risk={"A": HELD, "B": risk_b}, formats=SIX)
    return rows, {f: decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, f) for f in SIX}


def test_choose_takes_the_fewest_gpus_and_gives_a_throughput_tie_to_the_most_offered_format():
    rows, plans = _six()
    c = decide.choose(plans, rows)
    assert c["call"] == "q4_0" and c["tied"] == []  # fewest GPUs first, whatever the engines
    del plans["q4_0"]
    c = decide.choose(plans, rows)
    by = {r["kv_format"]: r for r in rows}
    assert plans["int8_tensor"]["tokens_per_s"] == pytest.approx(plans["fp8_e4m3"]["tokens_per_s"], rel=1e-3)
    assert len(by["fp8_e4m3"]["engines"]) > len(by["int8_tensor"]["engines"])  # the tie goes to FP8
    assert c["call"] == "fp8_e4m3" and c["tied"] == ["int8_tensor", "int8"]  # then by throughput: int8's scales cost 1%
    assert "q8_0" in decide.shortlist(rows) and "q8_0" not in c["tied"]  # on the list, 4% slower: not a tie at 2%
    assert decide.choose(plans, rows, tie=0.0)["tied"] in ([], ["int8_tensor"])  # only an exact tie
    assert "q8_0" in decide.choose(plans, rows, tie=0.1)["tied"]
    assert decide.choose({f: None for f in SIX}, rows) == {"call": None, "tied": []}
    for bad in (-0.1, 1, True, float("nan")):
        with pytest.raises(ValueError, match="tie must be a fraction"):
            decide.choose(plans, rows, tie=bad)


def test_by_engine_applies_the_call_rule_to_each_engine_s_own_formats():
    rows, plans = _six()
    picks = decide.by_engine(plans, rows)
    assert picks["llama.cpp"][0] == "q4_0" and picks["SGLang"] == ["fp8_e4m3"]  # fewest GPUs first, per engine
    assert picks["vLLM"] == ["fp8_e4m3", "int8"]  # the FP8/INT8 tie goes as in choose()
    assert picks["TensorRT-LLM"] == ["fp8_e4m3", "int8_tensor"]
    assert all("bf16" not in fs for fs in picks.values())  # the reference is no answer
    rows, plans = _six(dict(HELD, held=[f for f in SIX if f != "q4_0"]))  # q4_0 worse on one model: llama.cpp falls back
    picks = decide.by_engine(plans, rows)
    assert picks["llama.cpp"] == ["q8_0"]
    md = decide.by_engine_md(picks, plans, rows).splitlines()
    assert md[0].startswith("| engine |") and len(md) == 2 + len(picks)
    assert any(line.startswith("| vLLM | `fp8_e4m3` | `--kv-cache-dtype fp8` | 3 | `int8` (3 GPUs, a tie) |")
               for line in md), md
    slower = dict(plans, int8=dict(plans["int8"], tokens_per_s=plans["fp8_e4m3"]["tokens_per_s"] * 0.9))
    md = decide.by_engine_md({"vLLM": ["fp8_e4m3", "int8"]}, slower, rows)
    assert "`int8` (3 GPUs, 10.0% less throughput)" in md


def test_paired_risk_reads_both_shipped_sweeps():
    """Chapter 6's risk is chapter 4's paired verdicts: held on a model means never worse at any length in either
    haystack nor pooled, so a format worse only pooled is not held."""
    from kvlab import facts

    risk = facts.paired_risk()
    assert list(risk) == ["SmolLM2-135M-Instruct", "Gemma 3 270M"]
    for r in risk.values():
        assert set(r["held"]) == {f for f, v in r["needle"].items() if v == "held"} and "fp8_e4m3" in r["held"]
        assert all(v == "held" or v.startswith("worse") for v in r["needle"].values())
    assert risk["SmolLM2-135M-Instruct"]["needle"]["q4_0"].startswith("worse pooled")


def test_options_refuse_bad_input():
    with pytest.raises(ValueError, match="does not fit"):
        decide.options("llama-3.1-70b", "L4", 1024, 1)
    with pytest.raises(ValueError, match="concurrency"):
        decide.options("llama-3.1-8b", "H100-80GB", 1024, 0)
    with pytest.raises(ValueError, match="unknown GPU"):
        decide.options("llama-3.1-8b", "H9000", 1024, 1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(1, 512), st.sampled_from(["bf16", "fp8_e4m3", "int4", "kivi-2"]))
def test_any_load_gives_finite_non_negative_rows(context, concurrency, fmt):
    for r in decide.options("llama-3.1-8b", "H200", context, concurrency, formats=["bf16", fmt]):
        assert r["max_concurrency"] >= 0 and r["cache_gib_per_gpu"] >= 0 and r["tokens_per_s"] >= 0
        assert r["running"] <= concurrency and (r["step_ms"] is None or math.isfinite(r["step_ms"]))
        assert r["fits"] == (r["max_concurrency"] >= concurrency)


def test_throughput_curves_end_where_the_pool_is_full():
    curves = decide.throughput_curves("llama-3.1-8b", "H100-80GB", 32768, ["bf16", "int4"])
    for f, (xs, ys) in curves.items():
        most = decide.B.max_concurrency("llama-3.1-8b", 32768, f, "H100-80GB")
        assert xs[-1] == most and len(xs) == len(ys) and ys == sorted(ys)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int4"])
def test_plan_holds_the_load_on_the_fewest_gpus(fmt):
    p = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, fmt)
    assert p["replicas"] * p["per_replica"] >= 64 and p["gpus"] == p["tp"] * p["replicas"]
    for tp in decide.TP_SIZES:  # no layout on fewer GPUs holds it
        room = B.max_concurrency("llama-3.1-8b", 32768, fmt, "H100-80GB", tp=tp, reserve_gib=decide.reserve_at(tp))
        for replicas in range(1, 64):
            if tp * replicas < p["gpus"]:
                assert replicas * room < 64, (tp, replicas, room)
    assert p["tokens_per_s"] > 0 and p["usd_per_million_tokens"] > 0


def test_the_reserve_grows_with_tensor_parallelism_as_vllm_logged_it():
    assert decide.reserve_at(1) == B.DEFAULT_RESERVE_GIB and decide.reserve_at(2) > decide.reserve_at(1)
    assert decide.reserve_at(8) == decide.reserve_at(2)  # a size not logged takes the largest logged below it
    assert decide.reserve_at(4, 7.5) == 7.5 and decide.reserve_at(3, {1: 1.0, 2: 2.0, 4: 4.0}) == 2.0
    for bad, match in [(0, "tp"), (True, "tp")]:
        with pytest.raises(ValueError, match=match):
            decide.reserve_at(bad)
    with pytest.raises(ValueError, match="reserve_gib"):
        decide.reserve_at(1, -1.0)
    # the default plan uses it: the same plan as when the reserves are passed explicitly, and never more room
    grown = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "bf16")
    assert grown == decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "bf16", reserve_gib=dict(B.TP_RESERVE_GIB))
    flat = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "bf16", reserve_gib=B.DEFAULT_RESERVE_GIB)
    assert grown["gpus"] >= flat["gpus"]


def test_plan_cost_follows_the_price_and_gives_up_past_max_gpus():
    a = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "fp8", gpu_hour_usd=2.0)
    b = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "fp8", gpu_hour_usd=4.0)
    assert b["usd_per_million_tokens"] == pytest.approx(2 * a["usd_per_million_tokens"])
    assert decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "bf16", max_gpus=2) is None
    with pytest.raises(ValueError, match="concurrency"):
        decide.plan("llama-3.1-8b", "H100-80GB", 32768, 0)
    with pytest.raises(ValueError, match="max_gpus"):
        decide.plan("llama-3.1-8b", "H100-80GB", 32768, 4, max_gpus=-1)


@pytest.mark.parametrize("kw, match", [(dict(reserve_gib={}), "tp=1"), (dict(reserve_gib={1: 3, 2: "x"}), r"reserve_gib\[2\]"),
                                       (dict(reserve_gib={"2": 100}), "tp=1"), (dict(context=200_000), "window")])
def test_plan_refuses_what_it_cannot_plan(kw, match):
    args = dict(model="llama-3.1-8b", gpu="H100-80GB", context=32768, concurrency=8) | kw
    with pytest.raises(ValueError, match=match):
        decide.plan(**args)


def test_plan_reports_a_format_error_instead_of_nothing_fits():
    cfg = dict(model_type="llama", hidden_size=640, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2,
               intermediate_size=100, vocab_size=100, head_dim=80, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        decide.plan(cfg, "H100-80GB", 4096, 1, "int4")


def test_the_vllm_command_runs_one_replica_of_the_plan():
    p = decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "fp8_e4m3")
    line = decide.vllm_command(p, 32768, "meta-llama/Llama-3.1-8B-Instruct")
    assert line.startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8 --max-model-len 32768 ")
    assert f"--tensor-parallel-size {p['tp']} --max-num-seqs {p['per_replica']}" in line
    assert (f"on each of {p['replicas']} replicas" in line) == (p["replicas"] > 1)
    assert decide.vllm_command(decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "kivi-4"), 32768) == ""
    assert "--calculate-kv-scales" not in line and "llm-compressor" in line  # removed from vLLM (PR #49389)
    assert "scales" not in decide.vllm_command(decide.plan("llama-3.1-8b", "H100-80GB", 32768, 64, "bf16"),
                                                              32768)


def test_the_comparison_reads_perplexity_and_needles_at_several_lengths_up_to_the_context():
    row = decide.options("llama-3.1-8b", "H100-80GB", 32768, 8, formats=["bf16", "fp8_e4m3"])[1]
    assert "--lengths 4096,16384,32756 " in row["eval"] and "--ppl-windows 16" in row["eval"]
    assert "--lengths 512,2048,4084 " in decide.options("llama-3.1-8b", "H100-80GB", 4096, 8, formats=["bf16"])[0]["eval"]
    # a server started with --max-model-len = the context accepts the longest prompt plus its answer
    import re
    lengths = [int(x) for x in re.search(r"--lengths ([\d,]+)", row["eval"])[1].split(",")]
    answer = int(re.search(r"--max-tokens (\d+)", row["eval"])[1])
    assert max(lengths) + answer <= 32768 < max(lengths) + answer + 64


def test_latency_is_prefill_compute_and_decode_bandwidth():
    """Llama-3.1-8B on an H100, oracle arithmetic written out: prefill FLOPs 2 x params x n + 2 x n^2 x 128 x 32 heads
    x 32 layers at 50% of 989 TFLOP/s; decode reads the weights and the cache at 70% of 3.35 TB/s."""
    import kvlab.budget as B
    from kvlab.decide import latency

    n, p = 4096, B.load_shape("llama-3.1-8b").num_parameters
    lat = latency("llama-3.1-8b", n, "bf16", "H100-80GB", batch=1)
    flops = 2 * p * n + 2 * n * n * 128 * 32 * 32
    assert lat["ttft_bound"] == "compute" and lat["ttft_s"] == pytest.approx(flops / (B.get_gpu("H100-80GB").peak_bf16_flops * 0.5))
    read = 2 * p + n * 32 * 2 * 8 * 128 * 2  # BF16 weights, then the cache: 32 layers x K,V x 8 heads x 128 x 2 B
    assert lat["tpot_bound"] == "memory" and lat["tpot_s"] == pytest.approx(read / (B.get_gpu("H100-80GB").bandwidth_bytes_per_s * 0.7))
    fp8 = latency("llama-3.1-8b", n, "fp8_e4m3", "H100-80GB", batch=8)
    assert fp8["ttft_s"] == pytest.approx(lat["ttft_s"]) and fp8["tpot_s"] < latency("llama-3.1-8b", n, "bf16", "H100-80GB", batch=8)["tpot_s"]
    with pytest.raises(ValueError, match="batch"):
        latency("llama-3.1-8b", n, batch=0)
    given = latency("llama-3.1-8b", n, "bf16", "H100-80GB", batch=1, weights_gib=30)  # the engine's logged weights
    assert given["tpot_s"] == pytest.approx((30 * 2**30 + n * 32 * 2 * 8 * 128 * 2) / (B.get_gpu("H100-80GB").bandwidth_bytes_per_s * 0.7))
