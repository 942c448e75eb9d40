"""The power of the paired test, against brute force over every outcome and the closed form without flips."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import power, results


def brute_power(n: int, loss: float, flips: float) -> float:
    """Every (lost, gained, agreed) split of n prompts, weighted by its multinomial chance, judged by verdict."""
    pl, pg = loss + flips, flips
    total = 0.0
    for b in range(n + 1):
        for c in range(n - b + 1):
            if results.verdict(b, c) == "worse":
                total += (math.factorial(n) / (math.factorial(b) * math.factorial(c) * math.factorial(n - b - c))
                          * pl ** b * pg ** c * (1 - pl - pg) ** (n - b - c))
    return total


@pytest.mark.parametrize("n,loss,flips", [(10, 0.3, 0.0), (25, 0.2, 0.0), (25, 0.1, 0.05), (30, 0.15, 0.1),
                                          (12, 0.0, 0.2), (20, 0.5, 0.25)])
def test_power_matches_brute_force(n, loss, flips):
    assert power.power(n, loss, flips) == pytest.approx(brute_power(n, loss, flips), abs=1e-12)


def test_without_flips_power_is_the_chance_of_enough_losses():
    k = results.fewest_prompts_to_detect()  # 6 at alpha 0.05: every discordant prompt a loss
    for n, loss in [(25, 0.2), (40, 0.1), (100, 0.05)]:
        closed = 1 - sum(math.comb(n, i) * loss ** i * (1 - loss) ** (n - i) for i in range(k))
        assert power.power(n, loss) == pytest.approx(closed, rel=1e-12)
    assert power.power(5, 1.0) == 0.0  # 5 losses out of 5 cannot reach p < 0.05 (p = 0.0625)


def test_prompts_needed_is_the_smallest_size_that_reaches_the_target():
    for loss, flips in [(0.2, 0.0), (0.1, 0.02), (0.3, 0.05)]:
        n = power.prompts_needed(loss, flips)
        assert power.power(n, loss, flips) >= power.POWER > max(power.power(m, loss, flips) for m in range(1, n))
    assert power.prompts_needed(0.01, limit=50) is None


def test_detectable_loss_is_the_smallest_step_with_the_power():
    d = power.detectable_loss(25)
    assert power.power(25, d) >= power.POWER > power.power(25, d - 0.005)
    assert power.detectable_loss(5) is None  # five prompts can never reach p < 0.05
    assert power.detectable_loss(250, flips=0.02) < power.detectable_loss(25, flips=0.02)


def test_flips_cost_prompts():
    rows = {(r["loss"], r["flips"]): r["prompts"] for r in power.table()}
    for d in (0.05, 0.10, 0.20):
        assert rows[d, 0.02] > rows[d, 0.0]
    assert rows[0.05, 0.0] > rows[0.10, 0.0] > rows[0.20, 0.0]


@pytest.mark.parametrize("call", [
    lambda: power.power(0, 0.1), lambda: power.power(True, 0.1), lambda: power.power(10, float("nan")),
    lambda: power.power(10, -0.1), lambda: power.power(10, 0.1, flips=0.5), lambda: power.power(10, 0.1, alpha=0),
    lambda: power.prompts_needed(0.0), lambda: power.prompts_needed(0.1, target=1.0),
    lambda: power.prompts_needed(0.1, limit=0), lambda: power.detectable_loss(10, step=float("inf")),
    lambda: power.power(10, "0.1"),
])
def test_bad_arguments_are_named(call):
    with pytest.raises(ValueError, match=r"^(prompts|loss|flips|alpha|target|limit|step)"):
        call()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), loss=st.floats(0, 0.6), flips=st.floats(0, 0.2))
def test_power_is_a_probability(n, loss, flips):
    p = power.power(n, loss, flips)
    assert 0.0 <= p <= 1.0 and math.isfinite(p)


def test_docstring_examples():
    import doctest

    assert doctest.testmod(power).failed == 0 and doctest.testmod(results).failed == 0
