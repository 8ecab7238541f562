"""One Great Expectations suite per handoff, written as code; thresholds come from the config.

A suite is a function `(cfg) -> list of expectations` registered in `SUITES`. It judges a pandas
probe frame that the stage wrote (every frame carries a `row` column: the line number in the
source file, so a failure names rows a person can open). Row-wise rules GX has no built-in for
are expressed with built-ins over columns the stage writes (`rejected_prompt` beside `prompt`)
or with derived columns added in `derive()` before validation, never as Python checks beside GX.

Adding a suite for a new handoff is one function plus one entry in `SUITES` (and the stage
writing its probe frame; see `gate.HANDOFFS`).
"""

from __future__ import annotations

from collections.abc import Callable

import great_expectations.expectations as gxe
import pandas as pd

from stages.config import PipelineConfig
from stages.data import SPLITS

RAW_PAIRS_COLUMNS = ["row", "prompt", "rejected_prompt", "chosen", "rejected"]
SPLITS_COLUMNS = ["row", "split", "prompt", "chosen", "rejected"]
SFT_COLUMNS = ["row", "response_tokens", "ended_with_eos", "perplexity_before", "perplexity_after",
               "final_train_loss"]


def _schema(columns: list[str]) -> list:
    return [gxe.ExpectColumnToExist(column=c) for c in columns]


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
    """The seeded splits: sizes as configured, no prompt in two splits, every row clean."""
    sizes = cfg.data.splits.model_dump()
    return [
        *_schema(SPLITS_COLUMNS),
        gxe.ExpectTableRowCountToEqual(value=sum(sizes.values())),
        gxe.ExpectColumnDistinctValuesToEqualSet(column="split", value_set=list(SPLITS)),
        # No prompt twice across the union of the splits: leakage between splits (and
        # duplicates inside one) both show up here, with the rows that share a prompt.
        gxe.ExpectColumnValuesToBeUnique(column="prompt"),
        gxe.ExpectColumnValueLengthsToBeBetween(column="chosen", min_value=1),
        gxe.ExpectColumnValueLengthsToBeBetween(column="rejected", min_value=1),
        gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=["chosen", "rejected"]),
    ]


def sft(cfg: PipelineConfig) -> list:
    """The SFT model, judged on its held-out probe (one row per greedy response)."""
    rules = cfg.contracts.sft
    out = [
        *_schema(SFT_COLUMNS),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        # NaN counts as null in pandas: finite loss and perplexities = not null and bounded.
        gxe.ExpectColumnValuesToNotBeNull(column="final_train_loss"),
        gxe.ExpectColumnValuesToBeBetween(column="final_train_loss", min_value=0.0,
                                          max_value=rules.max_final_train_loss),
        gxe.ExpectColumnValuesToNotBeNull(column="perplexity_after"),
        gxe.ExpectColumnValuesToBeBetween(column="perplexity_after", min_value=1.0, max_value=1e12),
        gxe.ExpectColumnValuesToBeInSet(column="ended_with_eos", value_set=[True], mostly=rules.min_eos_rate)
        if rules.min_eos_rate > 0 else None,
        gxe.ExpectColumnMeanToBeBetween(column="response_tokens", min_value=rules.min_mean_response_tokens,
                                        max_value=rules.max_mean_response_tokens),
    ]
    if rules.require_perplexity_drop:
        out.append(gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="perplexity_before",
                                                               column_B="perplexity_after"))
    return [e for e in out if e is not None]


SUITES: dict[str, Callable[[PipelineConfig], list]] = {
    "raw_pairs": raw_pairs,
    "splits": splits,
    "sft": sft,
}


def derive(suite: str, frame: pd.DataFrame) -> pd.DataFrame:
    """Derived columns a suite's expectations read (none of the current suites need one beyond
    what the stages write; kept as the hook for rules such as 'score std > 0 per batch')."""
    return frame
