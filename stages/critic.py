"""Critic pre-training (paper §5.3.3, §5.4): the critic starts as the reward model (its scalar
head read at every token) and learns values on rollouts of the frozen SFT policy, with exactly
PPO's reward shaping and GAE returns, until its value loss is below a threshold or a step cap.
This replaces learning-rate warm-up for PPO. Registered as <prefix>-critic."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from stages import interrupt, precision, tracking
from stages.config import PipelineConfig
from stages.data import read_jsonl
from stages.launch import Dist
from stages.ppo import checkpoint
from stages.ppo.stage import encode_prompts, initial_moments, load_models
from stages.ppo.advantages import needs_critic
from stages.ppo.trainer import PPOTrainer, check_algorithms, explained_variance
from stages.reward.model import save_reward_model
from stages.tensors import masked_mean
from stages.training import trained_model


def check(cfg: PipelineConfig) -> None:
    check_algorithms(cfg.ppo)


def skip_reason(cfg: PipelineConfig) -> str | None:
    """A critic-free advantage estimator (grpo, rloo, reinforce++) trains no critic."""
    return None if needs_critic(cfg.ppo) else f"ppo.advantage_estimator={cfg.ppo.advantage_estimator} trains no critic"


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    return {"splits_dir": str(tracking.download(inputs["splits"], downloads)),
            "sft_model_dir": str(tracking.download(inputs["sft_model"], downloads)),
            "reward_model_dir": str(tracking.download(inputs["reward_model"], downloads))}


@torch.no_grad()
def heldout_probe(trainer: PPOTrainer, prompts: list[list[int]], rows: list[int]) -> pd.DataFrame:
    """The trained critic on rollouts of the frozen policy for held-out prompts (this rank's share
    of `rows`), without a step: per rollout ½ mean (V − R)², the mean value and return; explained
    variance is the batch's (averaged over ranks, as in training), repeated on every row."""
    exp, _, _ = trainer.rollout(prompts, update_moments=False)
    mask = exp.response_mask
    columns = {"response_tokens": mask.sum(1), "score": exp.scores,
               "values_mean": masked_mean(exp.values, mask, dim=1), "returns_mean": masked_mean(exp.returns, mask, dim=1),
               "value_loss": 0.5 * masked_mean((exp.values - exp.returns) ** 2, mask, dim=1)}
    gathered = trainer.dist.gather_rows(len(rows), {name: values.tolist() for name, values in columns.items()})
    batch = trainer.mean_across_ranks({"explained_variance": explained_variance(exp.values, exp.returns, mask)})
    frame = pd.DataFrame({"row": rows, **gathered}).astype({"response_tokens": int})
    frame["explained_variance"] = batch["explained_variance"]
    return frame


def run(cfg: PipelineConfig, tracker: tracking.StageRun | None, inputs: dict, dist: Dist) -> dict:
    critic_cfg = cfg.critic
    # PPO's own settings (GAE, score shaping, value clipping), with the critic's batch sizes and lr:
    # everything the critic reads of `ppo` is in its cache key (config.CriticRollouts).
    ppo = cfg.critic_ppo()
    cfg = cfg.model_copy(update={"ppo": ppo})
    torch.manual_seed(critic_cfg.seed)
    tokenizer, policy, _, reward_model, critic, score_fn = load_models(cfg, inputs, dist, train_actor=False)
    prompts = encode_prompts(tokenizer, read_jsonl(Path(inputs["splits_dir"]) / "ppo_prompts.jsonl"),
                             ppo.max_prompt_len)
    # The frozen policy is its own reference: the KL penalty is zero, as for the SFT policy in PPO.
    trainer = PPOTrainer(ppo, actor=policy, critic=critic, reference=policy, score_fn=score_fn, prompts=prompts,
                         ptx_examples=[], tokenizer=tokenizer, dist=dist, moments=initial_moments(reward_model),
                         train_actor=False, precision=precision.resolve(cfg.model.precision, dist.device))
    steps_per_rollout = -(-ppo.rollout_batch_size // ppo.minibatch_size)
    max_rollouts = -(-critic_cfg.max_steps // steps_per_rollout)
    # PPO's checkpoints (the critic's engine, running moments, RNG, prompt cursor, rollout count),
    # the newest one kept: a rerun in this folder (`rlhf run --resume`) continues from it.
    checkpoints = dist.workdir / "checkpoints"
    resume_from = checkpoint.latest(checkpoints)
    if resume_from is not None:
        checkpoint.load(trainer, resume_from)
    if dist.is_main:
        tracker.start_attempt({"critic": critic_cfg.model_dump(mode="json"), "critic.max_rollouts": max_rollouts,
                               "critic.world_size": dist.world_size, "critic.reward_model": inputs["reward_model"],
                               "critic.switches": trainer.switches}, resume_from)

    progress = tqdm(total=max_rollouts, initial=trainer.iteration, desc="critic", disable=not dist.is_main,
                    dynamic_ncols=True)
    started, converged = time.perf_counter(), False
    while trainer.iteration < max_rollouts and not converged:
        interrupt.stop_point(dist, "critic", f"after rollout {trainer.iteration} of {max_rollouts}",
                             save=lambda: f"checkpoint {checkpoint.save(trainer, checkpoints, keep=1)}")
        # An iteration skipped for NaN/Inf scores (stages/guards.py) trained nothing: no losses.
        metrics = {"loss/value_avg": math.nan, "val/clipfrac_avg": math.nan, **trainer.step()}
        keep = ("loss/value_avg", "val/explained_variance", "val/clipfrac_avg", "val/mean", "objective/scores",
                "objective/scores_shaped", "reward/running_mean", "reward/running_std", "policy/response_length",
                "time/rollout", "time/train")
        if dist.is_main:
            tracker.log_metrics({f"critic/{k.split('/')[-1]}" if k.startswith(("loss", "val")) else k: metrics[k]
                                 for k in keep}, step=trainer.iteration * steps_per_rollout)
        converged = metrics["loss/value_avg"] < critic_cfg.value_loss_threshold
        every = critic_cfg.checkpoint_every
        if every and trainer.iteration % every == 0 and trainer.iteration < max_rollouts and not converged:
            checkpoint.save(trainer, checkpoints, keep=1)
        progress.update(1)
        progress.set_postfix(value_loss=f"{metrics['loss/value_avg']:.4f}",
                             explained_variance=f"{metrics['val/explained_variance']:.3f}")
    progress.close()
    train_seconds = time.perf_counter() - started

    # Held-out check for the critic contract: eval prompts the critic never trained on.
    heldout_rows = read_jsonl(Path(inputs["splits_dir"]) / "eval_prompts.jsonl")[: critic_cfg.heldout_prompts]
    heldout = encode_prompts(tokenizer, heldout_rows, cfg.ppo.max_prompt_len)[dist.rank :: dist.world_size]
    probe = heldout_probe(trainer, heldout, [r["row"] for r in heldout_rows])
    outputs: dict = {}
    if dist.is_main:
        tracker.log_metrics({"critic/final_value_loss": metrics["loss/value_avg"],
                             "critic/final_explained_variance": metrics["val/explained_variance"],
                             "critic/heldout_value_loss": float(probe["value_loss"].mean()),
                             "critic/heldout_explained_variance": float(probe["explained_variance"].iloc[0]),
                             "critic/converged": float(converged), "critic/rollouts": trainer.iteration,
                             "critic/train_seconds": train_seconds}, step=trainer.iteration * steps_per_rollout)
        critic_model = trained_model(trainer.critic)
        critic_model.score_mean, critic_model.score_std = reward_model.score_mean, reward_model.score_std
        # The running score statistics go with the critic: PPO continues them, count and all.
        from stages.reward.pyfunc import scorer  # imports MLflow's pyfunc: only where a model is published

        published = tracker.publish_model(
            lambda out: save_reward_model(critic_model, tokenizer, out, {
                "role": "critic", "value_loss": metrics["loss/value_avg"],
                "explained_variance": metrics["val/explained_variance"], "running_moments": trainer.moments.state_dict()}),
            cfg=cfg, inputs=inputs, pack=scorer(cfg),
            lineage={"rlhf.value_loss": f"{metrics['loss/value_avg']:.6g}",
                     "rlhf.explained_variance": f"{metrics['val/explained_variance']:.4f}"})
        outputs = {**published, "critic_run": tracker.run_id, "critic_probe": tracker.log_probe(probe, "critic_probe")}
    dist.barrier()
    checkpoint.discard(dist, checkpoints)  # the published critic is the result
    return outputs
