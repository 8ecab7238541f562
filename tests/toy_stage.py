"""A stage added in a test (tests/test_registry.py): it counts the SFT split's rows. Nothing but
this module and its registry entry names it."""

from __future__ import annotations

from pathlib import Path

from stages.orchestration import tracking
from stages.pipeline.data import read_jsonl


def prepare(cfg, inputs: dict, downloads) -> dict:
    return {"splits_dir": str(tracking.download(inputs["splits"], downloads))}


def run(cfg, tracker, inputs: dict, dist) -> dict:
    rows = read_jsonl(Path(inputs["splits_dir"]) / "sft.jsonl")  # prepare ran first, in the launching process
    tracker.log_metrics({"toy/sft_rows": len(rows)}, step=0)
    return {"toy_run": tracker.run_id, "toy_rows": str(len(rows))}
