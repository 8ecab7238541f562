"""Shared by the pipeline tests: PPO's metric names (TRL's), a pipeline run's stage run, a model
version's tags."""

from __future__ import annotations

from stages import tracking

TRL_NAMES = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
             "loss/value_avg", "loss/ptx_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens",
             "lr", "episode", "eps", "policy/perplexity", "policy/ref_perplexity", "policy/response_length",
             "policy/response_length_p90"]


def stage_run(pipeline_run_id: str, stage: str):
    return next(run for run in tracking.stage_runs(pipeline_run_id) if run.data.tags["rlhf.stage"] == stage)


def version_tags(uri: str) -> dict:
    name, version = uri.removeprefix("models:/").split("/")
    return tracking.client().get_model_version(name, version).tags
