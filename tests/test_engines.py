import json

import pytest

from kvlab import engines
from kvlab.paths import RESULTS_DIR

pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")


@pytest.mark.slow
def test_quanto_side_by_side_on_the_real_model(smollm2):
    """The real transformers QuantizedCache (quanto) and kvlab's emulation, live, on one SmolLM2 prompt."""
    model, tok = smollm2
    r = engines.quanto_side_by_side(model, tok, lengths=(512,), trials=1, new_tokens=6)
    i4, i2 = r["hf-int4"], r["hf-int2"]
    assert i4["prompts"] == i2["prompts"] == 1
    assert i4["identical"] == 1, f"INT4 greedy tokens should match the engine's: first divergence {i4['first_divergence']}"
    assert i4["mean_kl"] < 0.05 and i4["mean_top1_agreement"] == 1.0, i4
    assert i2["mean_kl"] > 5 * i4["mean_kl"], "2-bit should move the distribution far more than 4-bit"
    assert i4["engine"][512] == i4["kvlab"][512] == [1, 1], "both retrieve the passkey at 512 tokens in INT4"


@pytest.mark.slow
def test_hqq_side_by_side_on_the_real_model(smollm2):
    """The real QuantizedCache with the HQQ backend, live, beside the same kvlab presets."""
    pytest.importorskip("hqq", reason="hqq is not installed")
    model, tok = smollm2
    r = engines.quanto_side_by_side(model, tok, lengths=(512,), trials=1, new_tokens=6, backend="hqq")
    i4, i2 = r["hqq-int4"], r["hqq-int2"]
    assert i4["kvlab_format"] == "hf-int4" and i2["kvlab_format"] == "hf-int2"
    assert i4["engine"][512] == [1, 1], "HQQ at 4 bits retrieves the 512-token passkey"
    assert 0 <= i4["mean_kl"] < i2["mean_kl"], "2-bit HQQ should sit further from kvlab's emulation than 4-bit"


def test_quanto_arguments(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="nbits must be one of"):
        engines.quanto_cache(model, 3)
    with pytest.raises(ValueError, match="backend must be one of"):
        engines.quanto_cache(model, 4, backend="bitsandbytes")
    with pytest.raises(ValueError, match="trials"):
        engines.quanto_side_by_side(model, tok, trials=0)
    with pytest.raises(ValueError, match="lengths"):
        engines.quanto_side_by_side(model, tok, lengths=(8,))


def test_shipped_quanto_comparison_has_its_schema():
    doc = json.loads((RESULTS_DIR / "engines_quanto.json").read_text())
    assert {"versions", "machine", "date", "seconds", "lengths", "trials", "formats"} <= set(doc)
    assert set(doc["versions"]) == {"transformers", "optimum-quanto", "torch"}
    for name in ("hf-int4", "hf-int2"):
        row = doc["formats"][name]
        assert row["prompts"] == len(doc["lengths"]) * doc["trials"] == len(row["kl"])
        for side in ("engine", "kvlab"):
            assert set(row[side]) == {str(n) for n in doc["lengths"]}
            assert all(0 <= c <= t == doc["trials"] for c, t in row[side].values())


@pytest.mark.slow
def test_llamacpp_script_runs_its_first_case():
    """When llama-cpp-python is installed (make peers), the comparison script runs its first case."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make peers builds it)")
    import subprocess
    import sys

    from kvlab.paths import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_engines.py"), "--llama-cpp", "--quick"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"f16": 1}, "f16 should retrieve the 512-token passkey"


def test_shipped_llamacpp_comparison_has_its_schema():
    path = RESULTS_DIR / "engines_llamacpp.json"
    if not path.exists():
        pytest.skip("no llama.cpp results shipped yet (make peers writes them)")
    doc = json.loads(path.read_text())
    assert {"versions", "machine", "date", "seconds", "lengths", "depths", "trials", "cache_types", "build"} <= set(doc)
    from kvlab.results import llamacpp_doc_problem

    assert llamacpp_doc_problem(doc) is None  # a file the script would resume
    assert set(doc["cache_types"]) == set(engines.LLAMA_CACHE_TYPES)
    for v in doc["cache_types"].values():
        cells = {(r["length"], r["depth"]) for r in v["rows"]}
        assert cells == {(n, d) for n in doc["lengths"] for d in doc["depths"]}
        assert all(0 <= r["correct"] <= r["trials"] == doc["trials"] for r in v["rows"]) and v["seconds"] > 0


def test_shipped_llamacpp_gemma_run_pairs_with_the_long_sweep_prompt_by_prompt():
    """llama.cpp on Gemma's GGUF ran the long sweep's own prompts: every row keeps each prompt's outcome and every
    cache type pairs with kvlab on all 25 prompts of each length it ran."""
    from kvlab.results import (
        LONG_SWEEPS,
        LongSweep,
        llamacpp_answered,
        llamacpp_paired,
        llamacpp_pending,
    )

    path = RESULTS_DIR / "engines_llamacpp_gemma3.json"
    if not path.exists():
        pytest.skip("llama.cpp on Gemma not shipped yet (make peers writes it)")
    doc = json.loads(path.read_text())
    assert doc["model"] == "gemma3-270m" and set(doc["cache_types"]) == set(engines.LLAMA_CACHE_TYPES)
    from kvlab.results import llamacpp_doc_problem

    assert llamacpp_doc_problem(doc) is None  # a file the script would resume
    pairs = llamacpp_paired(doc, LongSweep.load(LONG_SWEEPS["gemma3-270m"]))
    assert set(pairs) == set(engines.LLAMA_CACHE_TYPES)
    pending = llamacpp_pending(doc)  # a length still running (the run resumes) is not paired
    logged = {}  # every prompt in the file is logged with the machine and dates of the session that ran it
    for run in doc["runs"]:
        assert {"machine", "dates", "prompts", "seconds"} <= set(run) and run["dates"] == sorted(run["dates"])
        for ct, n in run["prompts"].items():
            logged[ct] = logged.get(ct, 0) + n
    assert logged == llamacpp_answered(doc["cache_types"])
    for ct, by_n in pairs.items():
        assert set(by_n) == set(doc["lengths"]) - set(pending.get(ct, {})) - set(pending.get("f16", {})) != set()
        for x in by_n.values():
            assert x["engine"].prompts == x["kvlab"].prompts == x["between"].prompts == len(doc["depths"]) * doc["trials"]


def test_shipped_llamacpp_server_comparison_has_its_schema():
    from kvlab import endpoint

    doc = endpoint.load(RESULTS_DIR / "engines_llamacpp_server.json")
    res = endpoint.results(doc)
    assert set(res) == {doc["teacher"], doc["student"]} == set(doc["labels"])
    assert {"versions", "machine", "date", "seconds", "settings"} <= set(doc)
    assert "journal" not in doc and not (RESULTS_DIR / "engines_llamacpp_server.requests.jsonl").exists()
    n = len(doc["settings"]["lengths"]) * len(doc["settings"]["depths"]) * doc["settings"]["trials"]
    for r in res.values():
        assert sum(x["trials"] for x in r.rows) == n, "every prompt answered"
    assert doc["agreement"]["prompts"] == n and "top-k" in doc["agreement"]["caveat"]


@pytest.mark.slow
@pytest.mark.parametrize("argv,needle", [
    (["--quanto", "--quick"], "--quick is for --llama-cpp"),
    (["--hqq", "--depths", "0.5"], "--depths is not for --quanto or --hqq"),
    (["--quanto", "--model", "gemma3-270m"], "--model gemma3-270m is for --llama-cpp"),
    (["--llama-cpp", "--trials", "0"], "--trials: must be >= 1, got 0"),
])
def test_compare_engines_refuses_flags_it_would_ignore_before_any_run(argv, needle):
    import subprocess
    import sys

    from kvlab.paths import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_engines.py"), *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


def test_llamacpp_run_resumes_and_reports_every_row(monkeypatch, shipped):
    """A long llama.cpp run writes after each (length, depth) cell and a rerun keeps those cells: a stand-in
    ``llama_cpp`` module counts the prompts the engine is given."""
    import sys
    import types

    _, tok = shipped
    seen = []

    class Llama:
        def __init__(self, **kw):
            self.kw = kw

        def generate(self, ids, **kw):
            seen.append(len(ids))
            yield from [7, 7, 7, 7, 7, 7, 7, 7]

        def reset(self):
            seen.append("reset")

    fake = types.SimpleNamespace(Llama=Llama, GGML_TYPE_F16=1, GGML_TYPE_Q8_0=8, GGML_TYPE_Q4_0=2)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    saved = []
    kw = dict(cache_types=("f16", "q4_0"), depths=(0.0, 1.0), trials=2)
    first = engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), on_row=lambda r: saved.append(json.dumps(r)), **kw)
    assert len(saved) == 8 and len(seen) == 8  # 2 cache types x 2 depths x 2 prompts, each written when answered
    assert all(len(v["rows"]) == 2 and v["rows"][0]["outcomes"] == [False, False] for v in first.values())
    assert all("partial" not in v for v in first.values())
    cut = json.loads(saved[2])  # stopped after f16's third prompt: its second cell holds one of two prompts
    assert cut["f16"]["partial"]["outcomes"] == [False] and len(cut["f16"]["rows"]) == 1
    from kvlab.results import llamacpp_pending

    assert llamacpp_pending({"lengths": [64], "depths": [0.0, 1.0], "cache_types": cut}) == {"f16": {64: 3}}
    seen.clear()
    resumed = engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done=cut, **kw)
    assert len(seen) == 5 and resumed == first | {ct: {**v, "seconds": resumed[ct]["seconds"]} for ct, v in first.items()}
    with pytest.raises(ValueError, match="'partial' cell must hold"):
        engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done={"f16": {"rows": [], "partial": [1]}}, **kw)
    seen.clear()
    again = engines.llamacpp_passkey("x.gguf", tok, lengths=(64, 96), done=json.loads(saved[-1]), **kw)
    assert seen == [96] * 8  # only the new length ran
    assert [(r["length"], r["depth"]) for r in again["q4_0"]["rows"]] == [(64, 0.0), (64, 1.0), (96, 0.0), (96, 1.0)]
    seen.clear()
    engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done=again, **{**kw, "trials": 3})
    assert len(seen) == 12  # rows of another trial count are run again
    seen.clear()  # a window-sized sliding-window cache: no prefix reuse between prompts, and the rows say so
    small = engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), swa_full=False, **{**kw, "cache_types": ("f16",)})
    assert seen == ["reset", 64] * 4 and all(r["swa_full"] is False for r in small["f16"]["rows"])
    assert all("swa_full" not in r for r in first["f16"]["rows"])
    with pytest.raises(ValueError, match="done is not an earlier result"):
        engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done={"f16": []}, **kw)
    with pytest.raises(ValueError, match="done must be an earlier result"):
        engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done=[], **kw)
    seen.clear()  # a cut-off cell this call would not resume (another length, another window setting) is refused
    with pytest.raises(ValueError, match="cut-off f16 cell .64 tokens, depth 1.0"):
        engines.llamacpp_passkey("x.gguf", tok, lengths=(96,), done=cut, **kw)
    with pytest.raises(ValueError, match="swa_full=None. that this call would not resume"):
        engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), done=cut, swa_full=False, **kw)
    assert seen == []
    for bad in ({"trials": True}, {"depths": (0.0, 0.0)}, {"cache_types": ("f16", "f16")}, {"depths": (float("nan"),)}):
        with pytest.raises(ValueError):
            engines.llamacpp_passkey("x.gguf", tok, lengths=(64,), **{**kw, **bad})
    for bad in ((-64,), (64, 64), ("64",)):
        with pytest.raises(ValueError, match="lengths must be distinct positive"):
            engines.llamacpp_passkey("x.gguf", tok, lengths=bad, **kw)
