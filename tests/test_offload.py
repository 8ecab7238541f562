"""`launch.offload_optimizer` / `launch.offload_params`: DeepSpeed's own offload (ZeRO-Offload with
its CPU Adam) on two CPU ranks trains the same weights as the optimiser on the device; a stage
that does not run on DeepSpeed is told which switch needs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.leaves.config import ConfigError, LaunchConfig
from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute, resolve_deepspeed_config

RANKS = ["sft.launch.world_size=2", "sft.max_steps=2", "sft.epochs=1", "sft.probe_prompts=2",
         "sft.heldout_prompts=8", "sft.lr=1e-3"]


def trained_weights(splits_outputs, tmp_path: Path, *overrides: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The SFT model two ranks trained for two steps, and its stage run's params."""
    cfg = load_config("tiny", [*RANKS, *overrides])
    pipeline = run_writers.PipelineRun.start(cfg, ["sft"])
    outputs = execute("sft", cfg, pipeline.run_id, splits_outputs)
    pipeline.finish("FINISHED")
    (run,) = lineage.stage_runs(pipeline.run_id)
    folder = tracking.download(outputs["sft_model"], tmp_path)
    weights = {}
    for path in sorted(Path(folder).rglob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights, {**run.data.params, "metrics": run.data.metrics}


@pytest.fixture(scope="module")
def on_the_device(splits_outputs, tmp_path_factory):
    return trained_weights(splits_outputs, tmp_path_factory.mktemp("device"), "sft.launch.deepspeed=zero2")


@pytest.mark.parametrize("overrides", [
    ("sft.launch.deepspeed=zero2", "sft.launch.offload_optimizer=true"),
    ("sft.launch.deepspeed=zero3", "sft.launch.offload_optimizer=true", "sft.launch.offload_params=true"),
], ids=["zero2-optimizer", "zero3-optimizer-and-params"])
def test_offloaded_training_gives_the_same_weights(splits_outputs, on_the_device, tmp_path, overrides):
    expected, _ = on_the_device
    weights, params = trained_weights(splits_outputs, tmp_path, *overrides)
    assert params["sft.engine"] == "DeepSpeedEngine"
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    # the steps trained something: equal weights are not two untouched copies
    assert float(params["metrics"]["sft/perplexity_after"]) < float(params["metrics"]["sft/perplexity_before"])


def test_offload_without_deepspeed_names_the_switch():
    with pytest.raises(ConfigError, match=r"launch.offload_optimizer is DeepSpeed's offload and this stage does not "
                                          r"run on DeepSpeed: set launch.deepspeed"):
        load_config("tiny", ["reward.launch.offload_optimizer=true"])
    with pytest.raises(ConfigError, match="launch.offload_params needs launch.offload_optimizer"):
        load_config("tiny", ["ppo.launch.deepspeed=zero3", "ppo.launch.offload_params=true"])


def test_offload_params_needs_zero3():
    launch = LaunchConfig(deepspeed="zero2", offload_optimizer=True, offload_params=True)
    with pytest.raises(ConfigError, match="critic.launch.offload_params offloads ZeRO-3's parameter partitions and "
                                          "critic.launch.deepspeed=zero2 is ZeRO-2: set critic.launch.deepspeed=zero3"):
        resolve_deepspeed_config("critic", launch)
    zero = resolve_deepspeed_config("critic", launch.model_copy(update={"deepspeed": "zero3"}))["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
