import math

import pytest
import torch

from kvlab import theory


def test_expected_max_matches_closed_forms():
    assert theory.expected_max_normal(1) == pytest.approx(0.0, abs=1e-6)
    assert theory.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-5)
    assert theory.expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-5)
    # grows like sqrt(2 ln n), slowly approaching it from below
    big = theory.expected_max_normal(100_000)
    assert 0.85 * math.sqrt(2 * math.log(100_000)) < big < math.sqrt(2 * math.log(100_000))


def test_p_argmax_limits_and_monotonicity():
    assert theory.p_argmax(1.0, 0.0, 100) == 1.0
    assert theory.p_argmax(0.0, 1.0, 1) == pytest.approx(0.5, abs=1e-6)  # two symmetric normals
    assert theory.p_argmax(0.0, 1.0, 9) == pytest.approx(0.1, abs=1e-6)  # any of 10 equally likely
    ps = [theory.p_argmax(4.0, 1.0, n) for n in (10, 100, 1000, 10000)]
    assert ps == sorted(ps, reverse=True) and ps[0] > 0.95 and ps[-1] < 0.6


@pytest.mark.parametrize("margin,sigma,n", [(4.0, 1.0, 100), (7.0, 1.0, 500), (3.0, 0.5, 50)])
def test_simulation_agrees_with_formulas(margin, sigma, n):
    sim = theory.simulate(margin, sigma, n, trials=4000, seed=1)
    assert sim["p_argmax"] == pytest.approx(theory.p_argmax(margin, sigma, n), abs=0.03)
    assert sim["needle_mass"] == pytest.approx(theory.needle_mass(margin, sigma, n), abs=0.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n"):
        theory.p_argmax(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="sigma"):
        theory.needle_mass(1.0, -1.0, 5)


def test_effective_margin_reproduces_the_softmax_share():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(300, generator=g) * 2
    s[17] += 6
    margin, n = theory.effective_margin(s, 17)
    assert n == 299
    share = torch.softmax(s.double(), 0)[17].item()
    assert abs(theory.needle_mass(margin, 0.0, n) - share) < 1e-9


def test_effective_margin_rejects_bad_index():
    with pytest.raises(ValueError, match="needle index"):
        theory.effective_margin(torch.zeros(4), 9)
    with pytest.raises(ValueError, match="distractor"):
        theory.effective_margin(torch.zeros(1), 0)


class DigitTok:
    """One token per character; enough for the passkey prompt's structure."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 300 for c in text]


def test_retrieval_head_stats_on_a_tiny_llama(tiny_llama):
    clean = theory.retrieval_head_stats(tiny_llama, DigitTok(), "fp32", 200, 0.5)
    assert clean["sigma"] < 1e-5 and abs(clean["mass_measured"] - clean["mass_clean"]) < 1e-6
    # Without noise the theory is exact by construction of the effective margin.
    assert abs(clean["mass_predicted"] - clean["mass_clean"]) < 1e-6
    assert abs(clean["log_leak_predicted"] - clean["log_leak_measured"]) < 1e-4
    assert abs(clean["log_leak_clean"] - clean["log_leak_measured"]) < 1e-4
    lh = (clean["layer"], clean["head"])
    int4 = theory.retrieval_head_stats(tiny_llama, DigitTok(), "int4_tensor", 200, 0.5, layer_head=lh)
    int8 = theory.retrieval_head_stats(tiny_llama, DigitTok(), "int8", 200, 0.5, layer_head=lh)
    assert int4["sigma"] > int8["sigma"] > 0
    assert int4["n"] == 200  # 200 prompt tokens + 1 answer token, minus the needle and int4["margin"] == clean["margin"]
    with pytest.raises(ValueError, match="step"):
        theory.retrieval_head_stats(tiny_llama, DigitTok(), "fp32", 200, 0.5, step=9)


def test_retrieval_head_table_follows_one_head(tiny_llama):
    t = theory.retrieval_head_table(tiny_llama, DigitTok(), ["fp32", "int4_tensor"], [300, 200], step=1)
    assert t["lengths"] == [200, 300] and set(t["stats"]) == {(n, f) for n in (200, 300) for f in ("fp32", "int4_tensor")}
    assert all((s["layer"], s["head"]) == t["head"] for s in t["stats"].values())
    for i, n in enumerate(t["lengths"]):
        s = t["stats"][n, "fp32"]
        assert t["margin"][i] == s["margin"] and t["clean_leak"][i] == s["log_leak_clean"]
        assert t["gap"][n, "int4_tensor"] == pytest.approx(
            t["stats"][n, "int4_tensor"]["log_leak_measured"] - t["stats"][n, "int4_tensor"]["log_leak_predicted"])
    assert t["sigma"]["int4_tensor"] > 1e-3 > t["sigma"]["fp32"] and t["drift"]["int4_tensor"] > 0
    with pytest.raises(ValueError, match="at least one"):
        theory.retrieval_head_table(tiny_llama, DigitTok(), [], [200])


def test_the_retrieval_head_reads_the_sweeps_own_prompt_whatever_the_depth_type(shipped):
    """depth 0 and 0.0 must give the same prompt (the sweeps seed on float(depth)): the stats agree exactly."""
    from kvlab import theory

    model, tok = shipped
    a = theory.retrieval_head_stats(model, tok, "int8", length=128, depth=0)
    b = theory.retrieval_head_stats(model, tok, "int8", length=128, depth=0.0)
    assert a == b
