import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import budget as B
from kvlab import serving as S
from kvlab.traces import MAX_LINE


def seq(*prompts, gap=100.0, out=1, block=4):
    return [S.request_from_tokens(i * gap, list(p), [900 + i] * out, block, i) for i, p in enumerate(prompts)]


def test_hand_worked_trace():
    """Block size 4, a pool of 4 blocks, requests far apart (see the derivation in the docstring)."""
    a, c, d = list(range(1, 9)), list(range(9, 13)), list(range(20, 28))
    reqs = seq(a, a + c, d, a)
    res = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=4, num_blocks=4)
    # R0 fills A,B. R1 reuses A,B (8 tokens) and adds C. R2's two prompt blocks and its decode
    # block need three blocks: one free, then A and B are evicted (least recently used first).
    # R3 asks for A,B again: gone.
    assert [r["cached_tokens"] for r in res.requests] == [0, 8, 0, 0]
    assert res.hit_rate == pytest.approx(8 / 36)
    assert res.peak_concurrency == 1


def test_unbounded_pool_hit_rate_is_fraction_of_blocks_seen_before():
    reqs = S.rag(n=120, docs=30, doc_len=64, block_size=16, output_len=8, seed=3)
    res = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=16, num_blocks=10**7)
    seen, hits, total = set(), 0, 0
    for r in sorted(reqs, key=lambda r: r.arrival):
        hits += sum(h in seen for h in r.prompt_hashes)
        total += len(r.prompt_hashes)
        seen.update(r.prompt_hashes)
        seen.update(r.output_hashes or [])
    assert res.block_hit_rate == pytest.approx(hits / total)


def test_working_set_counts_reused_and_distinct_blocks_and_an_lru_pool_needs_the_distinct_ones():
    a, b, c = list(range(1, 9)), list(range(9, 17)), list(range(30, 38))
    reqs = seq(a, a + b, c, a + b, block=4)  # blocks A,B reused; A,B,C,D,E,F distinct
    ws = S.working_set(reqs, "llama-3.1-8b", "bf16", block_size=4)
    assert ws["block_bytes"] == B.budget("llama-3.1-8b", 1, 4, "bf16").bytes_per_token * 4
    assert ws["reused"] == 4 * ws["block_bytes"] and ws["distinct"] == 6 * ws["block_bytes"]
    assert S.working_set(reqs, "llama-3.1-8b", "int4", block_size=4)["distinct"] < ws["distinct"] / 3
    # with a pool of every distinct block (and room to decode) nothing useful is evicted: every repeat hits
    big = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=4, num_blocks=12)
    assert [r["cached_tokens"] for r in big.requests] == [0, 8, 0, 16]
    with pytest.raises(ValueError, match="block_size"):
        S.working_set(reqs, "llama-3.1-8b", "bf16", block_size=0)
    with pytest.raises(ValueError, match="no requests"):
        S.working_set([], "llama-3.1-8b", "bf16")


def test_lru_hit_rate_never_drops_as_the_pool_grows():
    reqs = S.rag(n=150, docs=40, doc_len=64, block_size=16, output_len=4, rate=0.001, seed=1)  # one at a time
    rates = [S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=16, num_blocks=n).hit_rate
             for n in (40, 60, 100, 200, 400, 1000)]
    assert rates == sorted(rates) and rates[-1] > rates[0]


@pytest.mark.slow  # seconds: in make test, not make quick
@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["system-prompt", "chat", "rag", "few-shot"]), st.integers(30, 400), st.integers(0, 50))
def test_bytes_held_never_exceed_the_pool(workload, blocks, seed):
    kw = {"conversations": 8} if workload == "chat" else {"n": 40}
    reqs = S.WORKLOADS[workload](block_size=16, seed=seed, **kw)
    need = max(-(-(r.prompt_len + r.output_len) // 16) for r in reqs)
    res = S.simulate(reqs, "llama-3.1-8b", "L4", "int4", block_size=16, num_blocks=max(blocks, need))
    assert res.max_bytes_held <= res.pool_bytes
    assert len(res.requests) == len(reqs)  # everyone is served eventually


def test_smaller_format_more_blocks_same_bytes():
    n16, b16, p16 = S.pool_blocks("llama-3.1-8b", "H100-80GB", "bf16")
    n8, b8, _ = S.pool_blocks("llama-3.1-8b", "H100-80GB", "fp8")
    n4, _, _ = S.pool_blocks("llama-3.1-8b", "H100-80GB", "int4")
    assert b16 == 2 * b8 and n8 == pytest.approx(2 * n16, rel=1e-3)
    assert n4 / n16 == pytest.approx(16 / 4.5, rel=1e-3)


def test_trace_loader(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}\n'
                    '{"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [7, 10]}\n')
    reqs = S.load_trace(good)
    assert [len(r.prompt_hashes) for r in reqs] == [2, 1] and reqs[1].arrival == 2.0
    far = tmp_path / "far.jsonl"  # epoch milliseconds are fine; a span of more than a year is a unit mistake
    far.write_text('{"timestamp": 1700000000000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}\n'
                   '{"timestamp": 1e308, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}\n')
    with pytest.raises(ValueError, match="more than a year"):
        S.simulate(S.load_trace(far), "llama-3.1-8b", "H100-80GB", "bf16", block_size=512)
    res = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=512)
    assert res.requests[1]["cached_tokens"] == 512
    for body, msg in [('{"timestamp": 0}', ":1: missing field 'input_length'"),
                      ("not json", ":1: not valid JSON"),
                      ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
                      ('[1, 2]', "expected a JSON object"),
                      ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}',
                       "more than its 1 blocks")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\n' + body + "\n")
        with pytest.raises(ValueError, match=msg.replace(":1:", ":2:")):
            S.load_trace(bad)


def test_request_larger_than_pool_is_a_clear_error():
    reqs = seq(list(range(64)))
    with pytest.raises(ValueError, match="needs 17 blocks but the pool has 4"):
        S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=4, num_blocks=4)


def test_cli(capsys):
    import json

    from kvlab.cli import main

    assert main(["serve-sim", "--workload", "few-shot", "--requests", "50", "--kv-dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 50 and 0 <= out["hit_rate"] <= 1 and out["cost_per_million_output_tokens"] > 0
    assert out["gpu_hour_usd"] == B.gpus()["H100-80GB"].usd_per_hour, "the default price is the GPU's listed one"
    assert main(["serve-sim", "--workload", "few-shot", "--requests", "50", "--gpu-hour-usd", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_hour_usd"] == 6.0
    for bad in ("inf", "0", "-1", "x"):
        with pytest.raises(SystemExit):
            main(["serve-sim", "--gpu-hour-usd", bad])
        assert "--gpu-hour-usd" in capsys.readouterr().err


def test_cost_per_million_prices_and_tokens():
    r = S.simulate(S.few_shot(n=20), "llama-3.1-8b", "L4", "bf16")
    assert r.cost_per_million() == pytest.approx(r.cost_per_million(B.gpus()["L4"].usd_per_hour))
    assert r.cost_per_million(2.0) == pytest.approx(2 * r.cost_per_million(1.0))
    assert r.cost_per_million(1.0, "total") < r.cost_per_million(1.0, "output")
    with pytest.raises(ValueError, match="tokens must be 'output' or 'total'"):
        r.cost_per_million(1.0, "input")
    with pytest.raises(ValueError, match="gpu_hour_usd must be a positive finite"):
        r.cost_per_million(float("nan"))


def test_cost_table_flags_one_score_per_format():
    q = {"bf16": 1.0, "int4": 0.2, "fp8_e4m3": None}  # one score per format: the pooled long-context quality
    reqs = S.few_shot(n=30)
    rows = S.cost_table(reqs, "llama-3.1-8b", "L4", ["bf16", "int4"], quality=q, threshold=0.9)
    assert [r["ok"] for r in rows] == [True, False]
    html = S.cost_table_html(rows)
    assert html.count("<tr>") == 3 and "below threshold" in html and "20%" in html


def test_quality_per_context_length_join():
    sweep = {"formats": {"int4": {"passkey": [{"length": 512, "depth": 0.0, "trials": 10, "correct": 10},
                                             {"length": 512, "depth": 1.0, "trials": 10, "correct": 8},
                                             {"length": 4096, "depth": 0.0, "trials": 10, "correct": 3}]},
                         "bf16": {"passkey": [{"length": 4096, "depth": 0.0, "trials": 5, "correct": 5}]}}}
    q = S.quality_by_length(sweep, ["bf16", "int4", "fp8_e4m3"])
    assert q == {"bf16": {512: None, 4096: 1.0}, "int4": {512: 0.9, 4096: 0.3},
                 "fp8_e4m3": {512: None, 4096: None}}
    rows = S.cost_table(S.few_shot(n=30), "llama-3.1-8b", "L4", ["bf16", "int4"], quality=q, threshold=0.5)
    assert rows[1]["ok"] == {512: True, 4096: False} and rows[0]["ok"] == {512: None, 4096: True}
    html = S.cost_table_html(rows)
    assert "<th>512</th><th>4096</th>" in html and html.count("color:#b00") == 1 and "30%" in html


LINE = '{{"timestamp": {ts}, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}}\n'


@pytest.mark.parametrize("body,msg", [
    (LINE.format(ts="NaN"), ":1: NaN is not a number JSON allows"),
    (LINE.format(ts="Infinity"), ":1: Infinity is not a number JSON allows"),
    (LINE.format(ts="-5"), ":1: timestamp must be a finite number of ms >= 0"),
    ("\n\n", "holds no requests"),
    (b"\xff\xfe\x00binary", ":1: not UTF-8 text"),
    ("[" * 100_000 + "]" * 100_000 + "\n", ":1: JSON nested too deeply"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 50000000, "hash_ids": []}\n', ":1: .* at most 1048576"),
    ("x" * (MAX_LINE + 10), ":1: a line over"),
])
def test_bad_traces_name_the_file_and_line(tmp_path, body, msg):
    p = tmp_path / "t.jsonl"
    p.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(ValueError, match=msg):
        S.load_trace(p)


def test_trace_paths_and_block_sizes(tmp_path):
    with pytest.raises(ValueError, match="trace path is empty"):
        S.load_trace("")
    with pytest.raises(ValueError, match="is a directory"):
        S.load_trace(tmp_path)
    with pytest.raises(ValueError, match="cannot read trace"):
        S.load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        S.load_trace("/dev/zero")
    p = tmp_path / "t.jsonl"
    p.write_text(LINE.format(ts=0))
    with pytest.raises(ValueError, match="is block_size right"):  # 512-token hash ids read as 16-token blocks
        S.load_trace(p, block_size=16)
    reqs = S.load_trace(p)
    with pytest.raises(ValueError, match="simulate it with block_size=512"):
        S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16", block_size=16)


def test_simulator_inputs():
    with pytest.raises(ValueError, match="no requests"):
        S.simulate([], "llama-3.1-8b", "H100-80GB", "bf16")
    with pytest.raises(ValueError, match="arrival must be a finite number"):
        S.request_from_tokens(float("nan"), list(range(40)), [1], 16)


@given(st.one_of(st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: not v.is_integer()),
                 st.booleans(), st.integers(max_value=-1), st.text(max_size=3)))
def test_a_request_refuses_token_counts_that_are_not_whole(bad):
    with pytest.raises(ValueError, match="prompt_len must be a whole number"):
        S.Request(0.0, bad, 4, [])
    with pytest.raises(ValueError, match="output_len must be a whole number"):
        S.Request(0.0, 64, bad, [])


def test_a_request_refuses_more_block_hashes_than_blocks():
    with pytest.raises(ValueError, match="at most 4"):
        S.Request(0.0, 64, 4, list(range(5)), block_size=16)


def test_the_clock_starts_at_the_first_arrival():
    """Shifting every arrival by the same amount changes nothing."""
    prompts = [list(range(i, i + 64)) for i in range(0, 400, 40)]
    a = S.simulate(seq(*prompts, gap=0.5), "llama-3.1-8b", "L4", "bf16", block_size=4)
    shifted = [S.Request(r.arrival - 1000.0, r.prompt_len, r.output_len, r.prompt_hashes, r.output_hashes, r.rid,
                         r.block_size) for r in seq(*prompts, gap=0.5)]
    b = S.simulate(shifted, "llama-3.1-8b", "L4", "bf16", block_size=4)
    sa, sb = a.summary(), b.summary()
    assert sa.keys() == sb.keys()
    for k in sa:  # equal up to the float rounding of the shifted clock
        assert sa[k] == (pytest.approx(sb[k], rel=1e-9) if isinstance(sa[k], float) else sb[k]), k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.fixed_dictionaries({
    "timestamp": st.one_of(st.integers(-10, 10**7), st.floats(allow_nan=True, allow_infinity=True)),
    "input_length": st.integers(-2, 5000), "output_length": st.integers(-2, 300),
    "hash_ids": st.lists(st.integers(0, 20), max_size=12)}), max_size=12))
def test_any_trace_gives_a_clear_error_or_strict_json(tmp_path_factory, rows):
    """Generated traces: the CLI exits 0 with JSON that parses strictly, or 2 with one line; never hangs."""
    import contextlib
    import io
    import json
    import signal

    from kvlab.cli import main

    p = tmp_path_factory.mktemp("t") / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes NaN / Infinity as Python does
    out, err = io.StringIO(), io.StringIO()

    def hang(*_):
        raise TimeoutError("serve-sim did not finish in 30 s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["serve-sim", "--trace", str(p), "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--json"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if code == 0:
        doc = json.loads(out.getvalue(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
        assert all(v >= 0 for v in doc.values() if isinstance(v, int | float))
    else:
        e = err.getvalue()
        assert code == 2 and e.startswith("kvlab: error:") and len(e.splitlines()) == 1, e


def test_a_timestamp_too_large_for_a_float_is_a_clear_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1' + "0" * 400 + ', "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match=":1: timestamp must be a finite number"):
        S.load_trace(p)


def test_without_sharing_removes_every_hit_and_keeps_the_rest():
    reqs = S.rag(n=60, docs=5, doc_len=200, seed=1)
    alone = S.without_sharing(reqs)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in alone] == [(r.arrival, r.prompt_len, r.output_len) for r in reqs]
    shared = S.simulate(reqs, "llama-3.1-8b", "H100-80GB", "bf16")
    unshared = S.simulate(alone, "llama-3.1-8b", "H100-80GB", "bf16")
    assert shared.hit_rate > 0.3 and unshared.hit_rate == 0.0


def test_cost_split_separates_concurrency_from_hits():
    reqs = S.rag(n=120, docs=20, doc_len=400, seed=2)
    rows = {r["kv_format"]: r for r in S.cost_split(reqs, "llama-3.1-8b", "L4", ["fp8_e4m3", "int4"])}
    assert rows["bf16"]["saving_shared"] == rows["bf16"]["saving_unshared"] == 0
    for f in ("fp8_e4m3", "int4"):
        assert 0 < rows[f]["saving_unshared"] < 1 and rows[f]["usd_shared"] < rows[f]["usd_unshared"]
    # the price scales every cost and no saving
    again = {r["kv_format"]: r for r in S.cost_split(reqs, "llama-3.1-8b", "L4", ["int4"], gpu_hour_usd=1.0)}
    assert again["int4"]["saving_shared"] == pytest.approx(rows["int4"]["saving_shared"])
    assert again["int4"]["usd_shared"] == pytest.approx(rows["int4"]["usd_shared"] / B.hourly_price("L4"))


def test_quality_bar_relative_to_full_precision():
    reqs = S.rag(n=20, docs=5, doc_len=200, seed=3)
    q = {"bf16": {512: 1.0, 8192: 0.8}, "int4_tensor": {512: 0.6, 8192: 0.36}}
    ref = {512: 1.0, 8192: 0.8}
    rows = {r["kv_format"]: r for r in S.cost_table(reqs, "llama-3.1-8b", "L4", ["bf16", "int4_tensor"], quality=q,
                                                      threshold=0.9, reference=ref)}
    assert rows["bf16"]["ok"] == {512: True, 8192: True}, "the model's own misses are not the format's"
    assert rows["int4_tensor"]["ok"] == {512: False, 8192: False}
    absolute = {r["kv_format"]: r for r in S.cost_table(reqs, "llama-3.1-8b", "L4", ["bf16"], quality=q, threshold=0.9)}
    assert absolute["bf16"]["ok"][8192] is False
    with pytest.raises(ValueError, match="threshold"):
        S.cost_table(reqs, "llama-3.1-8b", "L4", ["bf16"], threshold=1.5)


def test_cost_table_perplexity_column():
    reqs = S.few_shot(n=30)
    ppl = {"bf16": 0.0, "int4": 0.12}
    rows = {r["kv_format"]: r for r in S.cost_table(reqs, "llama-3.1-8b", "L4", ["bf16", "int4", "fp8_e4m3"],
                                                      perplexity=ppl, max_ppl_increase=0.05)}
    assert (rows["bf16"]["ppl_ok"], rows["int4"]["ppl_ok"], rows["fp8_e4m3"]["ppl_ok"]) == (True, False, None)
    html = S.cost_table_html(list(rows.values()))
    assert "<th>perplexity</th>" in html and "+12%" in html and html.count("color:#b00") == 1
    looser = S.cost_table(reqs, "llama-3.1-8b", "L4", ["int4"], perplexity=ppl, max_ppl_increase=0.2)
    assert looser[0]["ppl_ok"] is True
    assert "perplexity" not in S.cost_table_html(S.cost_table(reqs, "llama-3.1-8b", "L4", ["int4"]))
    for bad, match in [({"max_ppl_increase": -0.1}, "max_ppl_increase"), ({"max_ppl_increase": float("inf")}, "max_ppl"),
                       ({"perplexity": {"int4": float("nan")}}, "perplexity increases must be finite"),
                       ({"quality": {"int4": float("nan")}}, r"quality\['int4'\]"),
                       ({"quality": {"int4": {512: 1.5}}}, "in \\[0, 1\\]"),
                       ({"quality": {"int4": 0.9}, "reference": float("nan")}, "reference")]:
        with pytest.raises(ValueError, match=match):
            S.cost_table(reqs, "llama-3.1-8b", "L4", ["int4"], **bad)


def test_cost_table_with_paired_needle_verdicts_per_model():
    """Chapter 5's quality columns: each model's paired needle verdict (held or the test failed) and perplexity
    change; a row passes the needle only if every model held, and perplexity only if every model is under the limit."""
    reqs = S.few_shot(n=20)
    needle = {"bf16": {"A": "reference", "B": "reference"}, "fp8_e4m3": {"A": "held", "B": "held"},
              "int4": {"A": "held", "B": "worse at 4k"}}
    ppl = {"fp8_e4m3": {"A": 0.01, "B": 0.02}, "int4": {"A": 0.03, "B": 0.2}}
    rows = {r["kv_format"]: r for r in S.cost_table(reqs, "llama-3.1-8b", "L4", list(needle), needle=needle,
                                                      perplexity=ppl, max_ppl_increase=0.05)}
    assert [rows[f]["needle_ok"] for f in needle] == [True, True, False]
    assert [rows[f]["ppl_ok"] for f in needle] == [None, True, False]  # int4 is over the limit on B only
    html = S.cost_table_html(list(rows.values()))
    assert "<th>needle, A</th><th>perplexity, A</th><th>needle, B</th>" in html
    assert html.count("color:#b00") == 2 and "worse at 4k</td>" in html and "+20.0%" in html  # B's needle and ppl
    for bad in [{"int4": "held"}, {"int4": {}}, {"int4": {"A": 1}}, ["held"]]:
        with pytest.raises(ValueError, match="needle must map each format"):
            S.cost_table(reqs, "llama-3.1-8b", "L4", ["int4"], needle=bad)
    with pytest.raises(ValueError, match="perplexity increases must be finite"):
        S.cost_table(reqs, "llama-3.1-8b", "L4", ["int4"], perplexity={"int4": {"A": float("inf")}})


def test_a_request_longer_than_the_models_context_is_refused_not_replayed():
    from kvlab.simulator import Request, simulate

    reqs = [Request(0.0, 1000, 10, [], rid=1), Request(0.1, 8190, 10, [], rid=7)]  # 8,200 tokens > SmolLM2's 8,192
    with pytest.raises(ValueError, match=r"1 of 2 requests are longer than .*8,192 tokens.*request 7.*8,190 \+ 10"):
        simulate(reqs, "smollm2-135m", "H100-80GB", "int4")
    assert simulate(reqs[:1], "smollm2-135m", "H100-80GB", "int4").summary()["requests"] == 1
