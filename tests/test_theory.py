import math

import pytest

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
