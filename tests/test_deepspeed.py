"""SFT under DeepSpeed ZeRO-2 on two CPU ranks (torchrun), logging from rank 0 only."""

from __future__ import annotations

import pytest
import torch

from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute


def test_sft_on_two_deepspeed_ranks(splits_outputs):
    cfg = load_config("tiny", ["sft.launch.world_size=2", "sft.launch.deepspeed=zero2", "sft.epochs=1",
                               "model.gradient_checkpointing=true"])
    pipeline = run_writers.PipelineRun.start(cfg, ["sft"])
    outputs = execute("sft", cfg, pipeline.run_id, splits_outputs)
    pipeline.finish("FINISHED")

    children = lineage.stage_runs(pipeline.run_id)
    assert len(children) == 1  # the ranks share the one stage run; no rank made its own
    run = children[0]
    assert run.data.params["sft.world_size"] == "2"
    steps = 128 // (8 * 1 * 2)  # examples // (micro batch × accumulation × ranks)
    history = tracking.client().get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, steps + 1))  # one value per step: rank 0 only
    assert run.data.metrics["sft/perplexity_after"] < run.data.metrics["sft/perplexity_before"]
    assert outputs["sft_model"].startswith("models:/rlhf-tiny-sft/")
    assert run.data.params["sft.engine"] == "DeepSpeedEngine" and run.data.params["sft.zero_stage"] == "2"
    assert run.data.metrics["stage/seconds"] > 0  # rank 0's wall time, and on a GPU its peak memory
    assert ("stage/peak_gpu_memory_gib" in run.data.metrics) == torch.cuda.is_available()


def test_a_failing_rank_fails_the_stage_with_its_log(splits_outputs):
    from stages.orchestration.launch import StageLaunchError

    cfg = load_config("tiny", ["sft.launch.world_size=2", "sft.launch.deepspeed=zero2", "sft.micro_batch_size=200"])
    pipeline = run_writers.PipelineRun.start(cfg, ["sft"])
    with pytest.raises(StageLaunchError, match="less than one global batch"):
        execute("sft", cfg, pipeline.run_id, splits_outputs)
    assert lineage.stage_runs(pipeline.run_id)[0].info.status == "FAILED"
