"""One Great Expectations suite per handoff, written as code; thresholds come from the config.

A suite is a function `(cfg) -> list of expectations` registered in `SUITES`. It judges a pandas
probe frame that the stage wrote (every frame carries a `row` column: the line number in the
source file, so a failure names rows a person can open). Row-wise rules GX has no built-in for
are expressed with built-ins over columns the stage writes (`rejected_prompt` beside `prompt`)
or with derived columns added in `derive()` before validation, never as Python checks beside GX.

Adding a suite for a new handoff is one function plus one entry in `SUITES` (and the stage
writing its probe frame, named in its `contract` in `stages/orchestration/registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import great_expectations.expectations as gxe
import pandas as pd

from stages.leaves.config import PipelineConfig
from stages.pipeline.data import RM_SPLITS, SPLITS, own_sources, pair_digest

RAW_PAIRS_COLUMNS = ["row", "prompt", "rejected_prompt", "chosen", "rejected"]
SPLITS_COLUMNS = ["row", "split", "prompt", "chosen", "rejected"]
SFT_COLUMNS = ["row", "response_tokens", "ended_with_eos", "perplexity_before", "perplexity_after",
               "final_train_loss"]
REWARD_COLUMNS = ["row", "r_chosen", "r_rejected", "margin"]
CRITIC_COLUMNS = ["row", "response_tokens", "score", "values_mean", "returns_mean", "value_loss",
                  "explained_variance"]
POLICY_COLUMNS = ["row", "response_tokens", "ended_with_eos", "kl", "perplexity", "score",
                  "sft_response_tokens_mean", "sft_perplexity_mean"]
EVALUATION_COLUMNS = ["row", "kind", "model", "shots", "subject", "predicted", "score", "judge", "judge_kind",
                      "verdict", "score_policy", "score_sft"]
FINITE = 1e12  # a bound that ±inf (and absurd magnitudes) break; NaN is null in pandas


def _schema(columns: list[str]) -> list:
    return [gxe.ExpectColumnToExist(column=c) for c in columns]


def _rows(condition: str | None) -> dict:
    """Arguments that limit a column rule to the rows a pandas query selects (None: all rows)."""
    return {"row_condition": condition, "condition_parser": "pandas"} if condition else {}


def _finite(column: str, min_value: float = -FINITE, max_value: float = FINITE, where: str | None = None) -> list:
    """Not NaN and within bounds (so not ±inf): GX has no 'finite' expectation."""
    return [gxe.ExpectColumnValuesToNotBeNull(column=column, **_rows(where)),
            gxe.ExpectColumnValuesToBeBetween(column=column, min_value=min_value, max_value=max_value, **_rows(where))]


def _eos_rate(min_rate: float) -> list:
    """At least `min_rate` of the responses end with EOS; no rule at 0 (models that never stop)."""
    if min_rate <= 0:
        return []
    return [gxe.ExpectColumnValuesToBeInSet(column="ended_with_eos", value_set=[True], mostly=min_rate)]


def raw_pairs(cfg: PipelineConfig) -> list:
    """Raw pairs as read from the source file, before dirty rows are dropped."""
    rules = cfg.contracts.raw_pairs
    # drop_invalid: false says "this data is clean": then any dirty row fails the gate.
    mostly = 1.0 - rules.max_invalid_fraction if cfg.data.drop_invalid else 1.0
    # Duplicated prompts are always reduced to their first row by the splits, whatever drop_invalid.
    dup_mostly = 1.0 - rules.max_duplicate_fraction
    return [
        *_schema(RAW_PAIRS_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=rules.min_rows),
        gxe.ExpectColumnValuesToNotBeNull(column="chosen"),
        gxe.ExpectColumnValuesToNotBeNull(column="rejected"),
        gxe.ExpectColumnValueLengthsToBeBetween(column="chosen", min_value=1, max_value=rules.max_answer_chars,
                                                mostly=mostly),
        gxe.ExpectColumnValueLengthsToBeBetween(column="rejected", min_value=1, max_value=rules.max_answer_chars,
                                                mostly=mostly),
        gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=["chosen", "rejected"], mostly=mostly),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="prompt", column_B="rejected_prompt", mostly=mostly),
        gxe.ExpectColumnValuesToBeUnique(column="prompt", mostly=dup_mostly),
    ]


def splits(cfg: PipelineConfig) -> list:
    """The seeded splits: sizes as configured, no prompt in two splits, every row clean. A split
    from a source of its own (data.*_source) has the answers its source has: an SFT set the
    chosen one, a prompt set none."""
    sizes = cfg.data.splits.model_dump()
    own = own_sources(cfg.data)
    present = [name for name in SPLITS if sizes[name] > 0]
    pair_splits = [name for name in present if name not in own]
    answered = pair_splits + [name for name in own if name == "sft"]
    reward_splits = [name for pair in RM_SPLITS.values() for name in pair if sizes[name] > 0]
    return [
        *_schema(SPLITS_COLUMNS),
        gxe.ExpectTableRowCountToEqual(value=sum(sizes.values())),
        gxe.ExpectColumnDistinctValuesToEqualSet(column="split", value_set=present),
        # The gold RM judges the proxy only on pairs the proxy never saw: no pair (its row digest)
        # in two of the reward models' splits.
        *([gxe.ExpectColumnValuesToBeUnique(column="pair_digest", **_rows(_split_in(reward_splits)))]
          if any(sizes[name] for name in RM_SPLITS["gold"]) else []),
        # No prompt twice across the union of the splits: leakage between splits (and
        # duplicates inside one) both show up here, with the rows that share a prompt.
        gxe.ExpectColumnValuesToBeUnique(column="prompt"),
        gxe.ExpectColumnValueLengthsToBeBetween(column="chosen", min_value=1, **_rows(_split_in(answered))),
        gxe.ExpectColumnValueLengthsToBeBetween(column="rejected", min_value=1, **_rows(_split_in(pair_splits))),
        gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=["chosen", "rejected"],
                                                           **_rows(_split_in(pair_splits))),
    ]


def _split_in(names: list[str]) -> str | None:
    """A row condition for the rows of these splits (None: every split)."""
    return None if set(names) >= set(SPLITS) else f"split in {names!r}"


def sft(cfg: PipelineConfig) -> list:
    """The SFT model, judged on its held-out probe (one row per greedy response)."""
    rules = cfg.contracts.sft
    out = [
        *_schema(SFT_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *_finite("final_train_loss", 0.0, rules.max_final_train_loss),
        *_finite("perplexity_after", 1.0),
        *_eos_rate(rules.min_eos_rate),
        gxe.ExpectColumnMeanToBeBetween(column="response_tokens", min_value=rules.min_mean_response_tokens,
                                        max_value=rules.max_mean_response_tokens),
    ]
    if rules.require_perplexity_drop:
        out.append(gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="perplexity_before",
                                                               column_B="perplexity_after"))
    return out


def reward(cfg: PipelineConfig) -> list:
    """The reward model, judged on the held-out pairs it scored (one row per rm_eval pair)."""
    rules = cfg.contracts.reward
    return [
        *_schema(REWARD_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *_finite("r_chosen"),
        *_finite("r_rejected"),
        # Held-out accuracy: the mean of `correct` (derived: margin > 0).
        gxe.ExpectColumnMeanToBeBetween(column="correct", min_value=rules.min_accuracy),
        gxe.ExpectColumnStdevToBeBetween(column="r_chosen", min_value=rules.min_score_std),
        gxe.ExpectColumnStdevToBeBetween(column="r_rejected", min_value=rules.min_score_std),
    ]


def critic(cfg: PipelineConfig) -> list:
    """The critic, judged on rollouts of the frozen SFT policy for held-out prompts (one row per
    rollout; explained variance is the batch's, repeated on every row)."""
    rules = cfg.contracts.critic
    return [
        *_schema(CRITIC_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *_finite("values_mean"),
        *_finite("returns_mean"),
        *_finite("value_loss", 0.0),
        gxe.ExpectColumnMeanToBeBetween(column="value_loss", max_value=rules.max_value_loss),
        *_finite("explained_variance", rules.min_explained_variance, 1.0),
    ]


def policy(cfg: PipelineConfig) -> list:
    """The PPO policy against the SFT policy, the paper's pattern-collapse guard: one row per
    response of the final held-out evaluation, with the SFT policy's means as baseline columns."""
    rules = cfg.contracts.policy
    return [
        *_schema(POLICY_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *_finite("score"),
        *_finite("kl"),
        *_finite("perplexity", 1.0),
        *_finite("sft_response_tokens_mean", 1.0),
        *_finite("sft_perplexity_mean", 1.0),
        gxe.ExpectColumnMeanToBeBetween(column="kl", max_value=rules.max_kl),
        # Bands around the SFT policy: means of the derived per-response ratios to its means.
        gxe.ExpectColumnMeanToBeBetween(column="length_ratio", min_value=rules.min_length_ratio,
                                        max_value=rules.max_length_ratio),
        gxe.ExpectColumnMeanToBeBetween(column="perplexity_ratio", min_value=rules.min_perplexity_ratio,
                                        max_value=rules.max_perplexity_ratio),
        *_eos_rate(rules.min_eos_rate),
    ]


def evaluation(cfg: PipelineConfig) -> list:
    """The eval stage's probe: one row per C-Eval answer (kind `ceval`) and per judged pair
    (kind `judge`; `invalid`: no parseable verdict after a retry; how many a judge may have is the
    `judge` suite's rule, per judge)."""
    ceval_rows, judge_rows = 'kind == "ceval"', 'kind == "judge"'
    scored_rows = 'judge_kind in ["reward_model", "reward_source"]'  # score judges: both scores finite
    return [
        *_schema(EVALUATION_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        gxe.ExpectColumnValuesToBeInSet(column="kind", value_set=["ceval", "judge"]),
        gxe.ExpectColumnValuesToNotBeNull(column="predicted", **_rows(ceval_rows)),
        gxe.ExpectColumnValuesToBeInSet(column="predicted", value_set=list("ABCD"), **_rows(ceval_rows)),
        *_finite("score", where=ceval_rows),  # the chosen letter's log-probability
        gxe.ExpectColumnValuesToNotBeNull(column="verdict", **_rows(judge_rows)),
        gxe.ExpectColumnValuesToBeInSet(column="verdict", value_set=["win", "tie", "lose", "invalid"],
                                        **_rows(judge_rows)),
        *_finite("score_policy", where=scored_rows),
        *_finite("score_sft", where=scored_rows),
    ]


def judge(cfg: PipelineConfig) -> list:
    """One judge's verdicts on the eval stage's pairs (the gate runs it once per judge, `GROUPED`):
    `invalid` (no parseable verdict after a retry) tolerated up to a fraction. A judge that breaks
    it cannot judge; the gate names it and the other judges' results stand."""
    rules = cfg.contracts.eval
    return [
        *_schema(["row", "judge", "verdict"]),
        gxe.ExpectColumnValuesToBeInSet(column="verdict", value_set=["win", "tie", "lose"],
                                        mostly=1.0 - rules.max_invalid_fraction),
    ]


SUITES: dict[str, Callable[[PipelineConfig], list]] = {
    "raw_pairs": raw_pairs,
    "splits": splits,
    "sft": sft,
    "reward": reward,
    "critic": critic,
    "policy": policy,
    "evaluation": evaluation,
    "judge": judge,
}

# Suites the gate runs once per value of a column, each value's rows apart (`<suite>.<value>`): the
# handoff passes when every other suite passes and at least one group does.
GROUPED: dict[str, str] = {"judge": "judge"}

# Per-row columns computed from the stage's columns, for batch rules GX states as a column mean.
DERIVED: dict[str, dict[str, Callable[[pd.DataFrame], pd.Series]]] = {
    "reward": {"correct": lambda f: (f["margin"] > 0).astype(float)},  # mean = held-out accuracy
    "splits": {"pair_digest": lambda f: pd.Series([pair_digest(p, c, r) for p, c, r in
                                                   zip(f["prompt"], f["chosen"], f["rejected"])], index=f.index,
                                                  dtype=object)},
    "policy": {"length_ratio": lambda f: f["response_tokens"] / f["sft_response_tokens_mean"],
               "perplexity_ratio": lambda f: f["perplexity"] / f["sft_perplexity_mean"]},
}


def derive(suite: str, frame: pd.DataFrame) -> pd.DataFrame:
    """The frame plus the derived columns its suite reads. One whose source column is missing is
    left out: the suite's schema rules name the missing column."""
    out = frame.copy()
    for name, compute in DERIVED.get(suite, {}).items():
        try:
            out[name] = compute(frame)
        except KeyError:
            pass
    return out
