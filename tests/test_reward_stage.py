"""The reward stage through the real Prefect flow and MLflow store, and on two DeepSpeed CPU ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.compute import loading
from stages.compute.reward import load_reward_model
from stages.leaves import stats
from stages.leaves.dist import Dist
from stages.orchestration import lineage, registry, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute
from stages.pipeline.data import read_jsonl
from stages.pipeline.reward import WORST_PAIRS, encode_pairs, make_sampler, score_heldout

OVERRIDES = {"sft.epochs": 1}


@pytest.fixture(scope="module")
def reward_run(prefect_server):
    from flows.rlhf import rlhf

    return rlhf(preset="tiny", overrides=OVERRIDES, stages=["data", "sft", "reward"])


def stage_run(pipeline_run_id: str, stage: str):
    return next(run for run in lineage.stage_runs(pipeline_run_id) if run.data.tags["rlhf.stage"] == stage)


def test_flow_registers_a_reward_model_with_its_lineage(reward_run):
    client, cfg = tracking.client(), load_config("tiny", OVERRIDES)
    run = stage_run(reward_run, "reward")
    assert run.info.status == "FINISHED"
    for name in ("train/loss", "train/accuracy", "train/margin", "train/tokens_per_s", "train/padding_fraction",
                 "eval/loss", "eval/accuracy", "eval/margin", "eval/score_mean", "eval/score_std"):
        assert np.isfinite(run.data.metrics[name]), name
    accuracy = stats.wilson(round(run.data.metrics["eval/accuracy"] * cfg.reward.heldout_pairs), cfg.reward.heldout_pairs)
    assert (run.data.metrics["eval/accuracy_ci_low"], run.data.metrics["eval/accuracy_ci_high"]) == pytest.approx(
        (accuracy.low, accuracy.high))  # Wilson's interval on the held-out pairs
    steps = int(run.data.params["reward.total_steps"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, steps + 1))

    outputs = lineage.outputs_of(reward_run)
    name, version = outputs["reward_model"].removeprefix("models:/").split("/")
    assert name == "rlhf-tiny-reward"
    # The version is the logged model `model` of the stage's run (an MLflow model: test_mlflow_models.py).
    logged = client.get_logged_model(outputs["reward_model_artifact"].removeprefix("models:/"))
    assert logged.name == "model" and logged.source_run_id == run.info.run_id
    assert client.get_model_version(name, version).source == logged.artifact_location
    tags = client.get_model_version(name, version).tags
    assert tags["rlhf.input.sft_model"] == outputs["sft_model"]  # the SFT version of this very run
    assert tags["rlhf.input.splits"] == outputs["splits"]
    assert tags["rlhf.data_digest"] == outputs["data_digest"]
    assert tags["rlhf.pipeline_run"] == reward_run
    assert tags["rlhf.config_hash"] == registry.get("reward").config_hash(cfg)  # the sections its registry entry names
    assert tags["rlhf.git_commit"] == tracking.git_commit()

    evaluation = tracking.download(f"runs:/{run.info.run_id}/eval")
    assert (evaluation / "margin_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((evaluation / "worst_pairs.json").read_text())
    margins = [row[table["columns"].index("margin")] for row in table["data"]]
    assert len(margins) == WORST_PAIRS and margins == sorted(margins)


def test_reward_gate_judges_one_row_per_heldout_pair(reward_run):
    import pandas as pd

    outputs, run = lineage.outputs_of(reward_run), stage_run(reward_run, "reward")
    assert outputs["reward_run"] == run.info.run_id
    assert run.data.tags["rlhf.contract"] == run.data.tags["rlhf.contract.reward"] == "passed"
    probe = pd.read_parquet(tracking.download(outputs["reward_probe"]))
    heldout = read_jsonl(tracking.download(outputs["splits"]) / "rm_eval.jsonl")[: load_config("tiny").reward.heldout_pairs]
    assert probe["row"].tolist() == [r["row"] for r in heldout]  # line numbers in the source file
    assert (probe["margin"] > 0).mean() == pytest.approx(run.data.metrics["eval/accuracy"])


def test_registered_model_loads_back_with_its_score_statistics(reward_run):
    cfg = load_config("tiny", OVERRIDES)
    outputs = lineage.outputs_of(reward_run)
    folder = tracking.download(outputs["reward_model"])
    assert {"model.safetensors", "score_head.safetensors", "reward_config.json", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    model = load_reward_model(folder, cfg.model)
    tokenizer = loading.load_tokenizer(str(folder), cfg.model)
    rows = read_jsonl(tracking.download(outputs["splits"]) / "rm_eval.jsonl")[: cfg.reward.heldout_pairs]
    heldout = encode_pairs(tokenizer, rows, cfg.reward.max_seq_len, cfg.reward.max_response_len)
    dist = Dist()
    metrics = score_heldout(model, heldout, make_sampler(cfg.reward, heldout, dist), tokenizer.pad_token_id,
                            cfg.reward.beta_rm, dist).metrics(cfg.statistics.ci_level)
    eval_metrics = stage_run(reward_run, "reward").data.metrics
    assert model.score_mean == pytest.approx(metrics["eval/score_mean"], abs=1e-4) == eval_metrics["eval/score_mean"]
    assert model.score_std == pytest.approx(metrics["eval/score_std"], abs=1e-4) == eval_metrics["eval/score_std"]
    assert metrics["eval/accuracy"] == eval_metrics["eval/accuracy"]


def test_reward_on_two_deepspeed_ranks(reward_run):
    cfg = load_config("tiny", {**OVERRIDES, "reward.launch.world_size": 2, "reward.launch.deepspeed": "zero2"})
    inputs = lineage.outputs_of(reward_run)
    pipeline = run_writers.PipelineRun.start(cfg, ["reward"], from_run=reward_run)
    outputs = execute("reward", cfg, pipeline.run_id, inputs)
    pipeline.finish("FINISHED")

    children = lineage.stage_runs(pipeline.run_id)
    assert len(children) == 1  # the ranks share the one stage run
    run = children[0]
    params = run.data.params
    assert params["reward.world_size"] == "2"
    assert params["reward.engine"] == "DeepSpeedEngine" and params["reward.zero_stage"] == "2"
    steps = int(params["reward.total_steps"])
    history = tracking.client().get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, steps + 1))  # one value per step: rank 0 only
    assert np.isfinite(run.data.metrics["eval/accuracy"])
    name, version = outputs["reward_model"].removeprefix("models:/").split("/")
    tags = tracking.client().get_model_version(name, version).tags
    assert tags["rlhf.input.sft_model"] == inputs["sft_model"]
