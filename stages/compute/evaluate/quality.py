"""Whether a judge can judge: its pairwise accuracy on labelled held-out pairs (chosen vs
rejected), with its interval. A judge whose interval reaches 0.5 tells a better answer from a
worse one no better than a coin: its net win on the policy is noise, or its bias (a reward model
that prefers short answers scores a policy that only got shorter as better). Such a judge gives
no win or loss (`eval.judge_accuracy_gate`).

A reward model the reward stage registered carries its held-out accuracy (`rlhf.heldout_*` tags
on its version); every other judge judges `eval.judge_control_pairs` pairs of the rm_eval split
in both orders first, the chosen answer in the policy's place."""

from __future__ import annotations

from dataclasses import dataclass

from stages.compute.evaluate.judge import Pair, judge_pairs
from stages.leaves import stats
from stages.leaves.stats import Interval
from stages.leaves.tags import HELDOUT_ACCURACY_CI_HIGH_TAG, HELDOUT_ACCURACY_CI_LOW_TAG, HELDOUT_ACCURACY_TAG, HELDOUT_PAIRS_TAG

CONTROL_SPLIT = "rm_eval"


@dataclass(frozen=True)
class JudgeQuality:
    """A judge's accuracy on labelled held-out pairs (None: it has none) and where it comes from."""

    judge: str
    accuracy: Interval | None
    source: str  # "the reward stage's held-out pairs" or "control pairs"

    @property
    def can_judge(self) -> bool:
        """Its accuracy interval lies above chance."""
        return self.accuracy is not None and self.accuracy.low > 0.5

    def accuracy_text(self) -> str:
        """`0.594 [0.423, 0.745] on 32 held-out pairs`."""
        if self.accuracy is None:
            return "no held-out accuracy"
        a = self.accuracy
        return f"{a.estimate:.3f} [{a.low:.3f}, {a.high:.3f}] on {a.n} held-out pairs"

    def cannot_decide(self) -> str:
        """The verdict of a judge that cannot judge, and why."""
        if self.accuracy is None:
            return (f"cannot decide: {self.judge} has no held-out accuracy (a reward model without the reward "
                    f"stage's rlhf.heldout_* tags, and eval.judge_control_pairs is 0 or the run has no "
                    f"{CONTROL_SPLIT} split)")
        where = "lies below chance" if self.accuracy.high < 0.5 else "includes chance"
        return f"cannot decide: {self.judge}'s accuracy {self.accuracy_text()} {where}"

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>/accuracy` (+ `_ci_low`, `_ci_high`), `<prefix>/accuracy_pairs`, `<prefix>/can_judge` (1/0)."""
        out = {f"{prefix}/can_judge": float(self.can_judge)}
        if self.accuracy is not None:
            out.update(self.accuracy.metrics(f"{prefix}/accuracy"))
            out[f"{prefix}/accuracy_pairs"] = float(self.accuracy.n)
        return out


def recorded(judge: str, tags: dict[str, str], level: float) -> JudgeQuality | None:
    """The quality a reward model's registered version records (the reward stage's tags), or None
    where it records no accuracy with its pair count. Without its interval bounds the interval is
    Wilson's at `level`."""
    try:
        accuracy, pairs = float(tags[HELDOUT_ACCURACY_TAG]), int(tags[HELDOUT_PAIRS_TAG])
    except (KeyError, ValueError):
        return None
    if pairs <= 0:
        return None
    try:
        low, high = float(tags[HELDOUT_ACCURACY_CI_LOW_TAG]), float(tags[HELDOUT_ACCURACY_CI_HIGH_TAG])
        interval = Interval(accuracy, low, high, level, pairs)
    except (KeyError, ValueError):
        interval = stats.wilson(round(accuracy * pairs), pairs, level)
    return JudgeQuality(judge, interval, "the reward stage's held-out pairs")


def control_pairs(labelled: list[dict], n: int) -> list[Pair]:
    """The first `n` labelled pairs (rows of the `CONTROL_SPLIT` split), the chosen answer in the
    policy's place (a given answer is whole: it ended)."""
    return [Pair(r["row"], r["messages"], r["chosen"], r["rejected"]) for r in labelled[: max(n, 0)]]


def measured(judge, pairs: list[Pair], level: float) -> JudgeQuality:
    """A judge's accuracy on labelled pairs, each judged in both orders as the policy's are:
    (right + ½ · (tie or no verdict)) / n, so a judge that always ties, or always names the same
    position, is at 0.5; Wilson's interval at `level`."""
    if not pairs:
        return JudgeQuality(judge.name, None, "control pairs")
    verdicts = judge_pairs(judge, pairs)["verdict"]
    right = float((verdicts == "win").sum()) + 0.5 * float((verdicts != "win").sum() - (verdicts == "lose").sum())
    return JudgeQuality(judge.name, stats.wilson(right, len(pairs), level), "control pairs")
