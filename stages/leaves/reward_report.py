"""Held-out views of a reward model: the histogram of r(chosen) − r(rejected) (paper Fig. 2) and
the pairs it gets most wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def margin_histogram(margins: np.ndarray, path: Path) -> None:
    """PNG histogram of the score differences; right of zero is a pair ranked correctly."""
    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.hist(margins, bins=min(50, max(10, len(margins) // 4)), color="tab:blue", alpha=0.8)
    axes.axvline(0.0, color="black", linewidth=1)
    axes.set_xlabel("r(chosen) − r(rejected)")
    axes.set_ylabel("held-out pairs")
    axes.set_title(f"accuracy {np.mean(margins > 0):.3f}, mean margin {np.mean(margins):.3f}")
    figure.tight_layout()
    figure.savefig(path)


def worst_pairs(rows: list[dict], r_chosen: np.ndarray, r_rejected: np.ndarray, count: int) -> pd.DataFrame:
    """The `count` pairs with the lowest margin, worst first."""
    margins = r_chosen - r_rejected
    worst = np.argsort(margins, kind="stable")[:count]
    return pd.DataFrame({
        "prompt": [rows[i]["prompt"] for i in worst],
        "chosen": [rows[i]["chosen"] for i in worst],
        "rejected": [rows[i]["rejected"] for i in worst],
        "r_chosen": r_chosen[worst],
        "r_rejected": r_rejected[worst],
        "margin": margins[worst],
    })


# The reward stage's outcome on every pair it is evaluated on, one row a pair: `pair` (the pair's
# identity, stages.pipeline.data.pair_digest of its prompt and answers as the split holds them), `split`,
# both scores, the margin and whether it ranked the chosen answer first. Two reward models scored
# on the same split compare pair by pair on it (a study's gold and proxy RM on rm_eval).
PAIR_OUTCOMES = "eval/pair_outcomes.json"
PAIR_OUTCOME_COLUMNS = ["pair", "split", "r_chosen", "r_rejected", "margin", "correct"]


def pair_outcomes(keys: list[str], split: str, r_chosen: np.ndarray, r_rejected: np.ndarray) -> pd.DataFrame:
    """The PAIR_OUTCOMES rows of one split's scored pairs (`keys`: their identities, in order)."""
    margins = np.asarray(r_chosen, dtype=float) - np.asarray(r_rejected, dtype=float)
    return pd.DataFrame({"pair": list(keys), "split": split, "r_chosen": np.asarray(r_chosen, dtype=float),
                         "r_rejected": np.asarray(r_rejected, dtype=float), "margin": margins,
                         "correct": (margins > 0).astype(int)}, columns=PAIR_OUTCOME_COLUMNS)
