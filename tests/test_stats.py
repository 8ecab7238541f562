"""The intervals every "better than SFT" decision rests on, against hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from stages.leaves import stats


def test_wilson_matches_the_hand_computed_interval():
    # 8 of 10 at 95 %: z = 1.95996, centre (0.8 + z²/20) / (1 + z²/10) = 0.71674,
    # half-width z·√(0.016 + z²/400) / (1 + z²/10) = 0.22658 → [0.4902, 0.9433].
    interval = stats.wilson(8, 10)
    assert interval.estimate == 0.8
    assert interval.low == pytest.approx(0.4902, abs=1e-3) and interval.high == pytest.approx(0.9433, abs=1e-3)
    # 0 of 10: the interval starts at 0 and reaches z²/(n + z²) = 0.2775, not the Wald interval's 0.
    assert stats.wilson(0, 10).low == pytest.approx(0.0, abs=1e-12) and stats.wilson(0, 10).high == pytest.approx(0.2775, abs=1e-3)


def test_bootstrap_of_two_values_has_the_enumerated_distribution():
    # Resampling [0, 1] twice: mean 0 with p 1/4, 0.5 with p 1/2, 1 with p 1/4. The 2.5 % and 97.5 %
    # quantiles are 0 and 1; the 30 % and 70 % quantiles both 0.5.
    wide = stats.bootstrap_mean([0.0, 1.0], level=0.95)
    assert (wide.estimate, wide.low, wide.high) == (0.5, 0.0, 1.0)
    narrow = stats.bootstrap_mean([0.0, 1.0], level=0.4)
    assert (narrow.low, narrow.high) == (0.5, 0.5)


def test_bootstrap_of_many_values_agrees_with_the_normal_interval():
    x = np.random.default_rng(3).normal(0.3, 1.0, size=400)
    interval = stats.bootstrap_mean(x, resamples=8000)
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert interval.low == pytest.approx(x.mean() - half, abs=0.012)
    assert interval.high == pytest.approx(x.mean() + half, abs=0.012)
    assert interval.excludes_zero()


def test_net_win_counts_invalid_as_tie_and_its_interval_can_cross_zero():
    verdicts = ["win"] * 6 + ["lose"] * 4 + ["tie"] * 1 + ["invalid"] * 1
    interval = stats.net_win(verdicts)
    assert interval.estimate == pytest.approx(2 / 12)
    assert interval.low < 0 < interval.high and not interval.excludes_zero()  # 6 vs 4 of 12 is noise
    clear = stats.net_win(["win"] * 40 + ["lose"] * 5 + ["tie"] * 5)
    assert clear.low > 0
    with pytest.raises(ValueError, match="unknown verdict 'draw'"):
        stats.net_win(["win", "draw"])


def test_paired_delta_pairs_by_prompt_and_refuses_unpaired_input():
    interval = stats.paired_delta([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])
    assert (interval.estimate, interval.low, interval.high) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="one value per prompt"):
        stats.paired_delta([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="NaN or infinite"):
        stats.paired_delta([1.0, float("nan")], [1.0, 1.0])


def test_distinct_n_and_correlation():
    assert stats.distinct_n([[1, 2, 1, 2]], 1) == 0.5
    assert stats.distinct_n([[1, 2, 1, 2]], 2) == pytest.approx(2 / 3)
    assert stats.distinct_n([[7]], 2) == 0.0
    assert stats.correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert stats.correlation([1, 1, 1], [2, 4, 6]) == 0.0


def test_champion_needs_the_interval_not_the_point_estimate():
    from stages.pipeline.evaluate import champion_decision

    # 9 wins, 7 losses of 16: net win +0.125, but the interval reaches well below 0: no champion.
    noisy = stats.net_win(["win"] * 9 + ["lose"] * 7)
    won, text = champion_decision("reward_model", noisy, 0.0)
    assert noisy.estimate > 0 and noisy.low < 0 and not won
    assert text.startswith("no (judge reward_model: net win (win − lose)/n +0.125 [") and "lower bound not above 0" in text
    clear = stats.net_win(["win"] * 30 + ["lose"] * 4 + ["tie"] * 14)
    assert champion_decision("reward_model", clear, 0.0)[0] and not champion_decision("reward_model", clear, 0.9)[0]


def test_length_controlled_delta_is_the_intercept_at_equal_lengths():
    # Δ = 2 + 0.5 · Δlength exactly: the raw mean carries the length effect, the intercept is 2 in
    # every resample (a line through the points is the line whatever points are drawn).
    length_diff = np.array([-8.0, -4.0, 0.0, 2.0, 6.0, 10.0])
    exact = stats.length_controlled(2.0 + 0.5 * length_diff, length_diff)
    assert exact.estimate == pytest.approx(2.0) and (exact.low, exact.high) == pytest.approx((2.0, 2.0))
    assert stats.paired_delta(2.0 + 0.5 * length_diff, np.zeros(6)).estimate == pytest.approx(2.5)  # mean Δlength 1


def test_a_gain_that_is_only_a_length_effect_is_zero_once_length_controlled():
    # A judge that prefers short answers (−0.1 per token) and a policy that answers 16 tokens
    # shorter on average: a clear raw gain, nothing at equal lengths.
    rng = np.random.default_rng(0)
    length_diff = rng.normal(-16.0, 6.0, size=200)
    delta = -0.1 * length_diff + rng.normal(0.0, 0.2, size=200)
    raw, controlled = stats.paired_delta(delta, np.zeros(200)), stats.length_controlled(delta, length_diff)
    assert raw.low > 1.0
    assert controlled.low < 0 < controlled.high and abs(controlled.estimate) < 0.15


def test_length_controlled_without_length_differences_is_the_mean_and_refuses_unpaired_input():
    same_length = stats.length_controlled([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert same_length.estimate == pytest.approx(2.0) and same_length.low >= 1.0 and same_length.high <= 3.0
    with pytest.raises(ValueError, match="one value and one length difference per prompt"):
        stats.length_controlled([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="NaN or infinite"):
        stats.length_controlled([1.0, float("nan")], [1.0, 2.0])
