"""Critic pre-training (paper §5.3.3, §5.4): the critic starts as the reward model (its scalar
head read at every token) and learns values on rollouts of the frozen SFT policy, with exactly
PPO's reward shaping and GAE returns, until its value loss is below a threshold or a step cap.
This replaces learning-rate warm-up for PPO. Registered as <prefix>-critic."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch

from stages.compute.model_loading import load_models, save_adapter
from stages.compute.ppo.advantages import needs_critic
from stages.compute.ppo.setup import encode_prompts, initial_moments
from stages.compute.ppo.trainer import PPOTrainer, check_algorithms, explained_variance
from stages.compute.reward.model import save_reward_model
from stages.compute.training import trained_model
from stages.leaves import precision
from stages.leaves.config import PipelineConfig
from stages.leaves.dist import Dist
from stages.leaves.tags import EXPLAINED_VARIANCE_TAG, VALUE_LOSS_TAG
from stages.leaves.tensors import masked_mean
from stages.orchestration import run_writers, tracking
from stages.pipeline.data import read_jsonl
from stages.reward.pyfunc import scorer_pack
from stages.runtime import lifecycle


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


# What a critic rollout logs: the value loss and fit under `critic/`, the rollout's numbers as PPO names them.
LOGGED = ("loss/value_avg", "val/explained_variance", "val/clipfrac_avg", "val/mean", "objective/scores",
          "objective/scores_shaped", "reward/running_mean", "reward/running_std", "policy/response_length",
          "time/rollout", "time/train")


class CriticTraining(lifecycle.TrainingStage):
    """One `step` is one rollout of the frozen policy and the critic's minibatch steps on it."""

    name, unit, checkpoint_unit = "critic", "rollout", "iter"
    progress_metrics = {"value_loss": "critic/value_avg", "explained_variance": "critic/explained_variance"}

    def __init__(self, cfg: PipelineConfig, inputs: dict, dist: Dist):
        critic_cfg = self.critic_cfg = cfg.critic
        # PPO's own settings (GAE, score shaping, value clipping), with the critic's batch sizes and lr:
        # everything the critic reads of `ppo` is in its cache key (config.CriticRollouts).
        ppo = cfg.critic_ppo()
        cfg = cfg.model_copy(update={"ppo": ppo})
        self.cfg, self.inputs, self.dist = cfg, inputs, dist
        torch.manual_seed(critic_cfg.seed)
        self.tokenizer, policy, _, self.reward_model, critic, score_fn = load_models(cfg, inputs, dist, train_actor=False)
        prompts = encode_prompts(self.tokenizer, read_jsonl(Path(inputs["splits_dir"]) / "ppo_prompts.jsonl"),
                                 ppo.max_prompt_len)
        # The frozen policy is its own reference: the KL penalty is zero, as for the SFT policy in PPO.
        self.trainer = PPOTrainer(ppo, actor=policy, critic=critic, reference=policy, score_fn=score_fn, prompts=prompts,
                                  ptx_examples=[], tokenizer=self.tokenizer, dist=dist,
                                  moments=initial_moments(self.reward_model), train_actor=False,
                                  precision=precision.resolve(cfg.model.precision, dist.device))
        self.steps_per_rollout = -(-ppo.rollout_batch_size // ppo.minibatch_size)
        self.total = -(-critic_cfg.max_steps // self.steps_per_rollout)
        self.checkpoint_every = critic_cfg.checkpoint_every
        # The critic's engine, running moments, RNG, prompt cursor and rollout count.
        self.engines, self.guard = self.trainer.checkpointed_engines(), self.trainer.guard
        self.params = {"critic": critic_cfg.model_dump(mode="json"), "critic.max_rollouts": self.total,
                       "critic.world_size": dist.world_size, "critic.reward_model": inputs["reward_model"],
                       "critic.switches": self.trainer.switches}
        self.metrics = {"loss/value_avg": math.nan, "val/explained_variance": math.nan}

    def state(self) -> dict:
        # The last rollout's losses: whether the critic converged, and what its end reports.
        return {**self.trainer.state(), "last_metrics": dict(self.metrics)}

    def load_state(self, state: dict) -> None:
        self.trainer.load_state(state)
        self.metrics = {**self.metrics, **state.get("last_metrics", {})}

    def step(self, number: int) -> dict[str, float]:
        # An iteration skipped for NaN/Inf scores (stages/compute/nonfinite.py) trained nothing: no losses.
        self.metrics = {"loss/value_avg": math.nan, "val/clipfrac_avg": math.nan, **self.trainer.step()}
        return {f"critic/{k.split('/')[-1]}" if k.startswith(("loss", "val")) else k: self.metrics[k] for k in LOGGED}

    def metric_step(self, number: int) -> int:
        return number * self.steps_per_rollout

    def stopped(self) -> bool:
        return self.metrics["loss/value_avg"] < self.critic_cfg.value_loss_threshold

    def finish(self) -> lifecycle.Finish:
        trainer, metrics = self.trainer, self.metrics
        # Held-out check for the critic contract: eval prompts the critic never trained on.
        heldout_rows = read_jsonl(Path(self.inputs["splits_dir"]) / "eval_prompts.jsonl")[: self.critic_cfg.heldout_prompts]
        heldout = encode_prompts(self.tokenizer, heldout_rows, self.cfg.ppo.max_prompt_len)
        probe = heldout_probe(trainer, heldout[self.dist.rank :: self.dist.world_size], [r["row"] for r in heldout_rows])

        critic_model = trained_model(trainer.critic)  # every rank: a ZeRO-3 engine's weights are gathered

        def save(out: Path) -> None:
            critic_model.score_mean, critic_model.score_std = self.reward_model.score_mean, self.reward_model.score_std
            # The running score statistics go with the critic: PPO continues them, count and all.
            save_reward_model(critic_model, self.tokenizer, out, {
                "role": "critic", "value_loss": metrics["loss/value_avg"],
                "explained_variance": metrics["val/explained_variance"], "running_moments": trainer.moments.state_dict()})
            save_adapter(critic_model, out)

        return lifecycle.Finish(
            metrics={"critic/final_value_loss": metrics["loss/value_avg"],
                     "critic/final_explained_variance": metrics["val/explained_variance"],
                     "critic/heldout_value_loss": float(probe["value_loss"].mean()),
                     "critic/heldout_explained_variance": float(probe["explained_variance"].iloc[0]),
                     "critic/converged": float(self.stopped()), "critic/rollouts": trainer.iteration},
            probe_name="critic_probe", probe=lambda: probe, save=save, pack=scorer_pack(self.cfg, self.dist),
            lineage={VALUE_LOSS_TAG: f"{metrics['loss/value_avg']:.6g}",
                     EXPLAINED_VARIANCE_TAG: f"{metrics['val/explained_variance']:.4f}"})


def run(cfg: PipelineConfig, tracker: run_writers.StageRun | None, inputs: dict, dist: Dist) -> dict:
    return lifecycle.run(CriticTraining(cfg, inputs, dist), cfg, tracker, inputs, dist)
