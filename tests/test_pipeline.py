"""The tiny pipeline (data + SFT) through the real Prefect flow and a real MLflow SQLite store."""

from __future__ import annotations

import subprocess

import pytest

from stages.leaves import precision
from stages.leaves.config import REPO_ROOT
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config


@pytest.fixture(scope="module")
def tiny_run(prefect_server):
    from flows.rlhf import rlhf

    return rlhf(preset="tiny", overrides={"sft.epochs": 1}, stages=["data", "sft"])


def test_pipeline_registers_an_sft_model_that_lowers_perplexity(tiny_run):
    client = tracking.client()
    parent = client.get_run(tiny_run)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["rlhf.kind"] == "pipeline" and parent.data.tags["rlhf.preset"] == "tiny"
    assert parent.data.params["sft.lr"] == "0.003"  # the resolved config is the parent's params

    children = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(tiny_run)}
    assert set(children) == {"data", "sft"}
    assert all(run.info.status == "FINISHED" for run in children.values())

    sft = children["sft"]
    # The resolved model.precision (the tiny preset asks for fp32), logged by the stage.
    assert sft.data.params["precision"] == "fp32"
    assert sft.data.params["precision.hardware"] == precision.describe("cpu")
    before, after = sft.data.metrics["sft/perplexity_before"], sft.data.metrics["sft/perplexity_after"]
    assert after < before
    history = client.get_metric_history(sft.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, len(history) + 1))

    outputs = lineage.outputs_of(tiny_run)
    name, version = outputs["sft_model"].removeprefix("models:/").split("/")
    assert name == "rlhf-tiny-sft"
    mv = client.get_model_version(name, version)
    assert mv.run_id == sft.info.run_id
    assert mv.tags["rlhf.input.splits"] == outputs["splits"]
    assert mv.tags["rlhf.data_digest"] == outputs["data_digest"]
    assert mv.tags["rlhf.pipeline_run"] == tiny_run
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    assert mv.tags["rlhf.git_commit"] == (head or "unknown")
    assert mv.tags["rlhf.config_hash"] == load_config("tiny", {"sft.epochs": 1}).section_hash("model", "data", "sft")

    # The registered files are a loadable model + tokenizer in safetensors.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = tracking.download(outputs["sft_model"])
    assert (local / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(local).eos_token == "<|endoftext|>"
    assert AutoModelForCausalLM.from_pretrained(local, use_safetensors=True).config.num_hidden_layers == 2


def test_data_stage_logs_splits_as_inputs(tiny_run):
    children = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(tiny_run)}
    data_run = tracking.client().get_run(children["data"].info.run_id)
    contexts = {d.dataset.name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for d in data_run.inputs.dataset_inputs}
    assert contexts == {name: name for name in ("sft", "rm_train", "rm_eval", "ppo_prompts", "eval_prompts")}
    assert data_run.data.metrics["data/dropped"] == 9  # the shared file's known dirty rows
    splits = tracking.download(lineage.outputs_of(tiny_run)["splits"])
    assert sorted(p.name for p in splits.iterdir()) == sorted(
        ["dropped_rows.jsonl", "eval_prompts.jsonl", "ppo_prompts.jsonl", "rm_eval.jsonl", "rm_train.jsonl", "sft.jsonl"]
    )


def test_sft_reruns_alone_on_an_earlier_run(tiny_run):
    from flows.rlhf import rlhf

    client = tracking.client()
    first_version = lineage.outputs_of(tiny_run)["sft_model"]
    rerun = rlhf(preset="tiny", overrides={"sft.max_steps": 2}, stages=["sft"], from_run=tiny_run)
    assert rerun != tiny_run
    assert client.get_run(rerun).data.tags["rlhf.from_run"] == tiny_run
    children = lineage.stage_runs(rerun)
    assert [run.data.tags["rlhf.stage"] for run in children] == ["sft"]
    outputs = lineage.outputs_of(rerun)
    assert outputs["sft_model"] != first_version
    name, version = outputs["sft_model"].removeprefix("models:/").split("/")
    assert client.get_model_version(name, version).tags["rlhf.input.splits"] == lineage.outputs_of(tiny_run)["splits"]
    # The earlier run and its registered version are untouched.
    assert lineage.outputs_of(tiny_run)["sft_model"] == first_version
    assert [run.data.tags["rlhf.stage"] for run in lineage.stage_runs(tiny_run)] == ["sft", "data"]


def test_a_stage_without_its_inputs_fails_clearly(prefect_server):
    from flows.rlhf import rlhf

    with pytest.raises(ValueError, match="stage 'sft' needs splits"):
        rlhf(preset="tiny", stages=["sft"])
    with pytest.raises(ValueError, match=r"unknown stage 'sfft' \(did you mean 'sft'\?\); stages: data, sft"):
        rlhf(preset="tiny", stages=["sfft"])
