"""Confidence intervals for the decisions a run makes: is the policy better than SFT?

Every comparison here is *paired*: the policy and the SFT model answer the same held-out prompts,
so the unit of resampling is the prompt, and the statistic is the mean of per-prompt values
(score deltas r(x, y_policy) − r(x, y_sft); a judge's verdicts as +1 win, 0 tie or invalid,
−1 lose, whose mean is the net win (win − lose) / n). The interval is the percentile bootstrap
(Efron & Tibshirani 1993, §13.3): resample the prompts with replacement, recompute the mean,
take the (1 − level)/2 and (1 + level)/2 quantiles. Proportions alone (a win rate) get Wilson's
score interval (Wilson 1927), which keeps its coverage at the small n a CPU run can afford.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

VERDICT_VALUE = {"win": 1.0, "tie": 0.0, "lose": -1.0, "invalid": 0.0}  # net win = mean of these


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval."""

    estimate: float
    low: float
    high: float
    level: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"

    def metrics(self, name: str) -> dict[str, float]:
        """`name`, `name_ci_low`, `name_ci_high`: one metric each, so MLflow charts and compares them."""
        return {name: self.estimate, f"{name}_ci_low": self.low, f"{name}_ci_high": self.high}


def bootstrap_mean(values, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """Percentile-bootstrap interval of the mean of paired per-prompt values."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError("bootstrap_mean needs a non-empty 1-D sequence of per-prompt values")
    if not np.isfinite(x).all():
        raise ValueError("bootstrap_mean: a per-prompt value is NaN or infinite")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(x.mean()), float(low), float(high), level, len(x))


def paired_delta(policy, sft, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """Mean of policy − sft over the same prompts, with its bootstrap interval."""
    policy, sft = np.asarray(policy, dtype=float), np.asarray(sft, dtype=float)
    if policy.shape != sft.shape:
        raise ValueError(f"paired_delta needs one value per prompt on both sides: {policy.shape} vs {sft.shape}")
    return bootstrap_mean(policy - sft, level, resamples, seed)


def across_runs(values, level: float = 0.95) -> Interval:
    """Student's t interval of the mean of one value per training run (a study's seeds): the
    spread between runs, which an interval over one run's prompts cannot show. With one run its
    interval is the point."""
    from scipy import stats as scipy_stats  # deferred: scipy loads in seconds, for intervals across seeds only

    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError("across_runs needs a non-empty 1-D sequence of finite per-run values")
    if len(x) == 1:
        return Interval(float(x[0]), float(x[0]), float(x[0]), level, 1)
    half = scipy_stats.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return Interval(float(x.mean()), float(x.mean() - half), float(x.mean() + half), level, len(x))


def net_win(verdicts, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """(win − lose) / n over judged pairs (invalid verdicts count as ties), with its bootstrap interval."""
    try:
        values = [VERDICT_VALUE[v] for v in verdicts]
    except KeyError as err:
        raise ValueError(f"unknown verdict {err.args[0]!r}: expected one of {sorted(VERDICT_VALUE)}") from None
    return bootstrap_mean(values, level, resamples, seed)


def wilson(successes: int, n: int, level: float = 0.95) -> Interval:
    """Wilson's score interval for a proportion successes / n."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 ≤ successes ≤ n and n > 0, got {successes} of {n}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), level, n)


def distinct_n(responses: list[list[int]], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams / all n-grams over the responses' tokens; low
    values mean repetition, one of the paper's pattern-collapse signs."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def correlation(x, y) -> float:
    """Pearson's r; 0 where either side is constant (no linear signal to report)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def length_controlled(values, length_diff, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """The per-prompt difference `values` (a score delta policy − SFT, or a verdict +1/0/−1)
    regressed on the per-prompt response-length difference (policy − SFT tokens): the intercept,
    the difference at equal lengths, with its percentile-bootstrap interval over the prompts.
    A judge that prefers shorter (or longer) answers scores a policy that only changed its length
    as better or worse; the intercept is what is left. Where a resample's length differences are
    constant the slope is not identified and counts as 0 (the intercept is that resample's mean)."""
    y, x = np.asarray(values, dtype=float), np.asarray(length_diff, dtype=float)
    if y.ndim != 1 or len(y) == 0 or y.shape != x.shape:
        raise ValueError(f"length_controlled needs one value and one length difference per prompt: {y.shape} vs {x.shape}")
    if not (np.isfinite(y).all() and np.isfinite(x).all()):
        raise ValueError("length_controlled: a per-prompt value or length difference is NaN or infinite")

    def intercepts(ys: np.ndarray, xs: np.ndarray) -> np.ndarray:  # rows: samples of the prompts
        x_mean, y_mean = xs.mean(axis=-1, keepdims=True), ys.mean(axis=-1, keepdims=True)
        var = ((xs - x_mean) ** 2).mean(axis=-1)
        cov = ((xs - x_mean) * (ys - y_mean)).mean(axis=-1)
        slope = np.divide(cov, var, out=np.zeros_like(cov), where=var > 1e-12 * (1 + x_mean[..., 0] ** 2))
        return y_mean[..., 0] - slope * x_mean[..., 0]

    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(y), size=(resamples, len(y)))
    boot = intercepts(y[picks], x[picks])
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(intercepts(y[None], x[None])[0]), float(low), float(high), level, len(y))
