"""One PPO-max iteration, top to bottom: roll out, shape rewards, estimate advantages (GAE by
default), then PPO epochs over minibatches updating actor and critic. Every paper trick is read
from `ppo.switches()`; the advantage estimator and the policy loss are looked up by name in their
registries (`ppo.advantage_estimator`, `ppo.policy_loss`). An estimator without a critic
(grpo, rloo, reinforce++) trains the actor alone: critic=None.

Groups (`ppo.samples_per_prompt` = k): an iteration's rollout_batch_size rows are
rollout_batch_size / k distinct prompts, each repeated k times in adjacent rows, so an iteration
costs the same whatever k; `Experience.groups` holds each row's group index."""

from __future__ import annotations

import math
import random
import time

from pathlib import Path

import numpy as np
import torch

from stages.compute import checkpoint
from stages.compute.nonfinite import NonFiniteGuard
from stages.leaves.config import ConfigError, PPOConfig
from stages.leaves.dist import Dist
from stages.compute.losses import (POLICY_STAT_NAMES, aggregate, kl_estimate, kl_loss, ptx_loss, registered_policy_loss,
                                   token_mean_share, value_loss)
from stages.compute.ppo.advantages import AdvantageInputs, advantage_estimator
from stages.compute.ppo.experience import Experience, make_experience, response_logits, token_values
from stages.compute.ppo.reward_shaping import RunningMoments, shape_scores, token_rewards
from stages.compute.training import adamw, clip_grad_norm, linear_warmup, make_engine
from stages.leaves.logprobs import logprobs_and_entropy
from stages.leaves.rendering import collate
from stages.leaves.tensors import masked_mean, masked_whiten


def shuffled_order(count: int, rng: random.Random) -> list[int]:
    """The order of one pass over `count` prompts. A trainer's first pass is
    `shuffled_order(len(prompts), random.Random(ppo.seed))`."""
    order = list(range(count))
    rng.shuffle(order)
    return order


def warmup_steps(ppo: PPOConfig, pretrained_critic: bool) -> int:
    """Linear lr warm-up over `ppo.warmup_ratio` of PPO's optimiser steps; none after critic
    pre-training, which replaces warm-up (paper §5.4)."""
    if pretrained_critic:
        return 0
    steps_per_iteration = ppo.ppo_epochs * math.ceil(ppo.rollout_batch_size / ppo.minibatch_size)
    return int(ppo.warmup_ratio * ppo.iterations * steps_per_iteration)


class PPOTrainer:
    def __init__(self, ppo: PPOConfig, *, actor, critic, reference, score_fn, prompts: list[list[int]],
                 ptx_examples: list, tokenizer, dist: Dist, precision: str, moments: RunningMoments | None = None,
                 train_actor: bool = True, warmup: int = 0):
        """train_actor=False freezes the policy: critic pre-training (paper §5.4) with exactly
        PPO's rollouts, reward shaping and GAE returns. warmup: lr warm-up steps (`warmup_steps`).
        critic: None exactly when the advantage estimator needs none. precision: the resolved
        `model.precision` the engines train in (`stages.leaves.precision`; the frozen models come loaded in it)."""
        self.ppo, self.switches, self.dist, self.train_actor = ppo, ppo.switches(), dist, train_actor
        self.estimator = advantage_estimator(ppo.advantage_estimator)
        self.policy_loss = registered_policy_loss(ppo.policy_loss)
        check_critic(ppo, critic, train_actor)
        # The config checks these too; critic pre-training's copy of it is not validated again.
        self.group_size = ppo.samples_per_prompt
        if ppo.rollout_batch_size % self.group_size or self.group_size < self.estimator.min_samples_per_prompt:
            raise ValueError(f"rollout_batch_size={ppo.rollout_batch_size} and samples_per_prompt={self.group_size}: "
                             f"the groups must divide the rollout, and advantage_estimator={self.estimator.name} "
                             f"needs samples_per_prompt ≥ {self.estimator.min_samples_per_prompt}")
        self.reference, self.score_fn, self.prompts, self.ptx_examples = reference, score_fn, prompts, ptx_examples
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.moments = moments or RunningMoments()
        # Global clipping clips actor and critic (if any) together below; the engines must not clip alone.
        self.joint_clip = self.switches["global_grad_clip"] and train_actor
        engine_clip = math.inf if self.joint_clip else ppo.max_grad_norm

        def engine(model, lr, decay):
            optimizer = adamw(model, dist, lr=lr, betas=ppo.adam_betas, weight_decay=decay)
            return make_engine(model, optimizer, linear_warmup(optimizer, warmup), micro_batch_size=ppo.minibatch_size,
                               grad_accum_steps=1, max_grad_norm=engine_clip, precision=precision, dist=dist)

        self.actor = engine(actor, ppo.actor_lr, ppo.actor_weight_decay) if train_actor else FrozenPolicy(actor.requires_grad_(False).eval())
        self.critic = engine(critic, ppo.critic_lr, ppo.critic_weight_decay) if critic is not None else None
        self.iteration, self.episode, self.cursor = 0, 0, 0
        self.guard = NonFiniteGuard("ppo" if train_actor else "critic", ppo.max_nonfinite_steps, dist)
        # One seeded stream per consumer: whether PPO-ptx draws examples or not, the prompts come
        # in the same order (a switch's ablation compares the same rollouts).
        self.rng = random.Random(ppo.seed)
        self.ptx_rng = random.Random(f"ptx-{ppo.seed}")
        self.order = self._shuffled()
        torch.manual_seed(ppo.seed + dist.rank)

    # -- prompts ------------------------------------------------------------------------------
    def _shuffled(self) -> list[int]:
        return shuffled_order(len(self.prompts), self.rng)

    def next_prompts(self) -> list[list[int]]:
        """This rank's rows of the next iteration: rollout_batch_size / k distinct prompts, each k
        times in adjacent rows (k = samples_per_prompt); a new seeded shuffle at each epoch end."""
        size = self.ppo.rollout_batch_size // self.group_size
        batch_span = size * self.dist.world_size
        if self.cursor + batch_span > len(self.order):
            self.order, self.cursor = self._shuffled(), 0
        start = self.cursor + self.dist.rank * size
        self.cursor += batch_span
        return [self.prompts[i] for i in self.order[start : start + size] for _ in range(self.group_size)]

    # -- one iteration ------------------------------------------------------------------------
    def rollout(self, prompts: list[list[int]], *, update_moments: bool = True,
                group_size: int = 1) -> tuple[Experience, torch.Tensor, float]:
        """Roll out on `prompts`, shape the rewards and estimate the advantages: (the experience with
        rewards, KL, advantages and returns; the shaped scores; β). Held-out rollouts pass
        update_moments=False: they are judged on the running score statistics without changing them.
        group_size: each `group_size` adjacent rows are samples of one prompt (`next_prompts`)."""
        ppo, sw = self.ppo, self.switches
        if len(prompts) % group_size or any(p != prompts[i - i % group_size] for i, p in enumerate(prompts)):
            raise ValueError(f"the rows of a rollout come in groups of {group_size} adjacent copies of one prompt")
        critic = self.critic.module if self.critic is not None else None
        exp = make_experience(self.actor.module, self.reference, critic, self.score_fn, prompts, eos_id=self.eos_id,
                              pad_id=self.pad_id, generation=ppo.generation.model_dump(), device=self.dist.device)
        exp.groups = torch.arange(len(prompts), device=exp.scores.device) // group_size
        # Score reparameterisation on running statistics of the RM's own scores, updated before use,
        # and the EOS penalty in the same units (§5.3.1).
        shaped = shape_scores(exp.scores, exp.ended_with_eos, self.moments, mode=sw["score_mode"], clip=ppo.score_clip,
                              eos_penalty_sigmas=ppo.eos_penalty_sigmas if sw["eos_penalty"] else None,
                              update_moments=update_moments,
                              all_reduce_sum=self.dist.all_reduce_sum if self.dist.distributed else None)
        # Token rewards (eq. 1–2) and the advantages (GAE: eq. 3). With kl_penalty_in=loss, β acts in
        # the policy loss instead (`optimise`) and the reward is the score alone.
        beta = ppo.kl_coef if sw["kl_penalty"] else 0.0
        reward_beta = beta if ppo.kl_penalty_in == "reward" else 0.0
        exp.rewards, exp.kl = token_rewards(shaped, exp.logprobs, exp.ref_logprobs, exp.response_mask, reward_beta,
                                            ppo.kl_estimator)
        # The registered advantage estimator: exp.advantages, and exp.returns (None without a critic).
        inputs = AdvantageInputs(exp.rewards, exp.response_mask, exp.values, exp.groups, ppo,
                                 self.dist.all_reduce_sum if self.dist.distributed else None)
        exp.advantages, exp.returns = self.estimator.fn(inputs)
        return exp, shaped, beta

    def kl_loss_coef(self) -> float:
        """β of the KL loss term: kl_penalty_in=loss with the KL penalty switched on, else 0."""
        return self.ppo.kl_coef if self.switches["kl_penalty"] and self.ppo.kl_penalty_in == "loss" else 0.0

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        exp, shaped, beta = self.rollout(self.next_prompts(), group_size=self.group_size)
        rollout_seconds = time.perf_counter() - started

        train_started = time.perf_counter()
        # NaN/Inf scores skip the iteration's update (the running moments already left them out).
        finite = self.guard.check({"scores": exp.scores, "rewards": exp.rewards}, f"iteration {self.iteration + 1}",
                                  last=False)
        stats = self.optimise(exp) if finite else {}
        self.iteration += 1
        self.episode += len(exp.scores) * self.dist.world_size
        elapsed = time.perf_counter() - started

        mask = exp.response_mask
        lengths = mask.sum(1)
        kl_per_sequence = exp.kl.sum(1)
        reward_beta = 0.0 if self.kl_loss_coef() else beta
        metrics = {
            "objective/scores": exp.scores.mean().item(),
            "objective/scores_shaped": shaped.mean().item(),
            # Per response, summed over tokens, with ppo.kl_estimator (k1 by default): unbiased, but a
            # batch mean can be negative when π samples tokens it rates below π_SFT. k3 beside it:
            # never negative, the number to read as "how far from SFT" (Schulman, "Approximating KL").
            # Both tempered: log π and log π_SFT of logits / T at the sampling temperature (as TRL),
            # the KL the reward penalises; the entropy below too.
            "objective/kl": kl_per_sequence.mean().item(),
            "objective/kl_k3": (kl_estimate(exp.logprobs, exp.ref_logprobs, "k3") * mask).sum(1).mean().item(),
            "objective/non_score_reward": (-reward_beta * kl_per_sequence).mean().item(),
            "objective/rlhf_reward": (exp.scores - reward_beta * kl_per_sequence).mean().item(),
            "objective/entropy": (-exp.logprobs.sum(1)).mean().item(),
            # The models' own perplexities (T = 1), as the paper's collapse indicator; the policy's
            # under the sampling temperature beside it.
            "policy/perplexity": math.exp(-masked_mean(exp.model_logprobs, mask).item()),
            "policy/ref_perplexity": math.exp(-masked_mean(exp.ref_model_logprobs, mask).item()),
            "policy/perplexity_tempered": math.exp(-masked_mean(exp.logprobs, mask).item()),
            "policy/response_length": lengths.mean().item(),
            "policy/response_length_p90": float(np.percentile(lengths.cpu().numpy(), 90)),
            "val/num_eos_tokens": exp.ended_with_eos.sum().item(),
            "train/skipped_steps": self.guard.skipped,
            "reward/running_mean": self.moments.mean,
            "reward/running_std": self.moments.std,
            **stats,
            "time/rollout": rollout_seconds,
            **{f"time/{phase}": seconds for phase, seconds in exp.seconds.items()},  # the rollout's parts
            "time/train": time.perf_counter() - train_started,
            "eps": len(exp.scores) * self.dist.world_size / elapsed,
        }
        if self.critic is not None:
            metrics["val/mean"] = masked_mean(exp.values, mask).item()
            metrics["val/explained_variance"] = explained_variance(exp.values, exp.returns, mask)
        metrics = self.mean_across_ranks(metrics)
        metrics.update({"lr": (self.actor if self.train_actor else self.critic).lr_scheduler.get_last_lr()[0],
                        "episode": self.episode})
        self.last_experience = exp
        return metrics

    def _advantages(self, mb: Experience) -> torch.Tensor:
        """A minibatch's advantages, whitened (the switch and the estimator allowing) over the global
        minibatch, the same on 1 rank or N, then clipped to ±advantage_clip."""
        advantages = mb.advantages
        if self.switches["whiten_advantages"] and self.estimator.whiten_switch:
            advantages = masked_whiten(advantages, mb.response_mask, all_reduce_sum=self.dist.all_reduce_sum)
        if self.ppo.advantage_clip is not None:
            advantages = advantages.clamp(-self.ppo.advantage_clip, self.ppo.advantage_clip)
        return advantages

    def optimise(self, exp: Experience) -> dict[str, float]:
        """PPO epochs over shuffled minibatches (§5.3.3): the registered policy loss (the clipped
        surrogate) + clipped value loss (with a critic), PPO-ptx, optional entropy bonus, one
        gradient-norm clip over actor and critic (the actor alone without a critic)."""
        ppo, sw = self.ppo, self.switches
        sums: dict[str, float] = {}
        steps = 0
        temperature = ppo.generation.temperature
        for _ in range(ppo.ppo_epochs):
            order = torch.randperm(len(exp.scores))
            for start in range(0, len(order), ppo.minibatch_size):
                mb = exp.rows(order[start : start + ppo.minibatch_size])
                mask = mb.response_mask
                step_stats: dict = {}
                if self.critic is not None:
                    values = token_values(self.critic.module, mb.sequences, mb.attention_mask, mb.prompt_width)
                advantages = self._advantages(mb)

                # This rank's token means as its share of the global minibatch's (1 on one rank).
                share = token_mean_share(mask, self.dist)
                if self.critic is not None:
                    v_loss, v_stats = value_loss(values, mb.values, mb.returns, mask,
                                                 ppo.value_clip_eps if sw["value_clip"] else None)
                    v_loss = v_loss * share
                    step_stats = {"loss/value_avg": v_loss, "val/clipfrac_avg": v_stats["clipfrac"]}

                if self.train_actor:
                    logits = response_logits(self.actor.module, mb.sequences, mb.attention_mask, mb.prompt_width)
                    logprobs, token_entropy = logprobs_and_entropy(logits, mb.sequences[:, mb.prompt_width :], temperature)
                    del logits  # the backward keeps its own reference
                    if steps == 0 and "val/logprob_diff" not in sums:
                        # Before any update θ = θ_old: the training forward must give the rollout's
                        # log-probabilities; what it does not is numerical (bf16, kernels) mismatch.
                        sums["val/logprob_diff"] = masked_mean((logprobs.detach() - mb.logprobs).abs(), mask).item()
                    actor_share = share if ppo.loss_agg == "token_mean" else 1.0
                    pg_loss, pg_stats = self.policy_loss(logprobs, mb.logprobs, advantages, mask, ppo)
                    pg_loss = pg_loss * actor_share
                    if ppo.entropy_coef == 0:  # only a statistic: no backward through it
                        token_entropy = token_entropy.detach()
                    policy_entropy = aggregate(token_entropy, mask, ppo.loss_agg) * actor_share
                    actor_loss = pg_loss - ppo.entropy_coef * policy_entropy
                    if self.kl_loss_coef():  # β · KL as a loss term on log π_θ (kl_penalty_in=loss)
                        kl_term = kl_loss(logprobs, mb.ref_logprobs, mask, ppo.kl_estimator,
                                          ppo.loss_agg) * actor_share
                        actor_loss = actor_loss + self.kl_loss_coef() * kl_term
                        step_stats["loss/kl_avg"] = kl_term
                    ptx = torch.zeros(())
                    if sw["ptx"] and self.ptx_examples:
                        ptx = self._ptx_loss()
                        actor_loss = actor_loss + ppo.ptx_coef * ptx
                    step_stats.update({POLICY_STAT_NAMES.get(name, f"policy/{name}_avg"): value
                                       for name, value in pg_stats.items()})
                    step_stats.update({"policy/entropy_avg": policy_entropy, "loss/policy_avg": pg_loss,
                                       "loss/ptx_avg": ptx})
                # Both losses are checked before either backward, alike on every rank: a skipped
                # minibatch leaves no gradient behind and steps no optimiser.
                losses = {**({"value loss": v_loss} if self.critic is not None else {}),
                          **({"policy loss": actor_loss} if self.train_actor else {})}
                minibatch = start // ppo.minibatch_size + 1
                if not self.guard.check(losses, f"iteration {self.iteration + 1}, minibatch {minibatch}"):
                    continue
                if self.critic is not None:
                    self.critic.backward(v_loss)
                if self.train_actor:
                    self.actor.backward(actor_loss)
                grad_norm = clip_grad_norm(self.engines(), ppo.max_grad_norm) if self.joint_clip else math.nan
                for engine in self.engines():
                    engine.step()
                for name, value in step_stats.items():
                    sums[name] = sums.get(name, 0.0) + float(value.detach() if torch.is_tensor(value) else value)
                if math.isfinite(grad_norm):  # NaN: no joint clip; inf/NaN from it: the engines skipped the step
                    sums["policy/grad_norm"] = sums.get("policy/grad_norm", 0.0) + grad_norm
                steps += 1
        logprob_diff = sums.pop("val/logprob_diff", None)
        stats = {name: total / steps for name, total in sums.items()} if steps else {}
        return stats if logprob_diff is None else {**stats, "val/logprob_diff": logprob_diff}

    def engines(self) -> list:
        """The engines that train: the actor (unless frozen) and the critic (if any)."""
        return ([self.actor] if self.train_actor else []) + ([self.critic] if self.critic is not None else [])

    def _ptx_loss(self) -> torch.Tensor:
        batch = [self.ptx_examples[self.ptx_rng.randrange(len(self.ptx_examples))] for _ in range(self.ppo.ptx_batch_size)]
        tensors = {k: v.to(self.dist.device) for k, v in collate(batch, self.pad_id).items()}
        logits = self.actor.module(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        return ptx_loss(logits, tensors["labels"])

    def mean_across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        if not self.dist.distributed:
            return metrics
        names = sorted(metrics)
        summed = self.dist.all_reduce_sum([metrics[n] for n in names])
        return {n: v / self.dist.world_size for n, v in zip(names, summed)}

    # -- state for checkpoints ----------------------------------------------------------------
    def state(self) -> dict:
        return {"iteration": self.iteration, "episode": self.episode, "cursor": self.cursor, "order": self.order,
                "rng": self.rng.getstate(), "ptx_rng": self.ptx_rng.getstate(), "moments": self.moments.state_dict()}

    def load_state(self, state: dict) -> None:
        self.iteration, self.episode, self.cursor = state["iteration"], state["episode"], state["cursor"]
        self.order = list(state["order"])
        self.rng.setstate(_as_random_state(state["rng"]))
        if "ptx_rng" in state:  # checkpoints before the separate stream: it starts afresh
            self.ptx_rng.setstate(_as_random_state(state["ptx_rng"]))
        if "torch_rng" in state:  # checkpoints before each rank kept its own (`checkpoint.save`)
            torch.set_rng_state(state["torch_rng"])
        self.moments.load_state_dict(state["moments"])


    # -- checkpoints: this trainer's engines, its rollback, its learning rate -----------------
    def checkpointed_engines(self) -> dict:
        """The engines a checkpoint of this trainer holds: the critic, if the advantage estimator
        has one, and the actor unless frozen (critic pre-training)."""
        engines = {"critic": self.critic} if self.critic is not None else {}
        if self.train_actor:
            engines["actor"] = self.actor
        return engines

    def save_checkpoint(self, directory: Path, keep: int | None = 2) -> Path:
        """Checkpoint `iter-<iteration>`: engines, running moments, prompt cursor, RNG states and
        non-finite guard; keep the newest `keep` (None: every one)."""
        return checkpoint.save(directory, self.iteration, self.checkpointed_engines(),
                               checkpoint.stage_state(self.iteration, self.guard, self.state()), self.dist,
                               keep=keep, unit="iter")

    def load_checkpoint(self, folder: Path) -> None:
        """Continue from a checkpoint folder of `save_checkpoint` (or of the lifecycle)."""
        state = checkpoint.load(folder, self.checkpointed_engines(), self.dist)
        self.load_state(state)
        self.guard.load_state_dict(state["guard"])

    def roll_back_to(self, folder: Path) -> None:
        """Restore the models, optimisers, schedulers and running score statistics of a checkpoint,
        but not its progress: iteration, episode, prompt cursor and RNG go on where they are (the
        collapse guard's rollback trains on fresh prompts, and the curves keep one step per iteration run)."""
        checkpoint.load_engines(folder, self.checkpointed_engines(), self.dist)
        self.moments.load_state_dict(checkpoint.read_state(folder)["moments"])

    def set_actor_lr(self, base_lr: float) -> None:
        """The actor's lr schedule with peak `base_lr`, at the point of the schedule it has reached. The
        scheduler state just restored holds the base lr of the checkpoint, which an earlier rollback may
        have cut already: the new one replaces it rather than scaling it."""
        scheduler = self.actor.lr_scheduler
        for group, lr, restored_base in zip(self.actor.optimizer.param_groups, scheduler.get_last_lr(),
                                            scheduler.base_lrs):
            group["lr"] = lr * base_lr / restored_base
        scheduler.base_lrs = [base_lr] * len(scheduler.base_lrs)

def check_algorithms(ppo: PPOConfig) -> None:
    """`ppo.advantage_estimator` and `ppo.policy_loss` are registered, and the group size fits the
    estimator: a ConfigError naming the key. The critic and PPO stages' `check`, which the flow runs
    before any stage starts (the registries import torch, the config does not)."""
    try:
        needed = advantage_estimator(ppo.advantage_estimator).min_samples_per_prompt
        registered_policy_loss(ppo.policy_loss)
    except ValueError as err:
        raise ConfigError(f"ppo: {err}") from None
    if ppo.samples_per_prompt < needed:
        raise ConfigError(f"ppo: advantage_estimator={ppo.advantage_estimator} compares the samples of one prompt: it "
                          f"needs samples_per_prompt ≥ {needed} (got {ppo.samples_per_prompt}); e.g. "
                          f"ppo.samples_per_prompt=4")


def check_critic(ppo: PPOConfig, critic, train_actor: bool) -> None:
    """A critic exactly when the advantage estimator needs one; critic pre-training needs one that does."""
    name = ppo.advantage_estimator
    needed = advantage_estimator(name).needs_critic
    if not train_actor and not needed:
        raise ValueError(f"critic pre-training fits a critic for PPO, and advantage_estimator={name} trains none: "
                         f"there is no critic stage to run (stages.compute.ppo.advantages.needs_critic)")
    if needed and critic is None:
        raise ValueError(f"advantage_estimator={name} needs a critic: pass critic=")
    if not needed and critic is not None:
        raise ValueError(f"advantage_estimator={name} needs no critic: pass critic=None (none is trained)")


class FrozenPolicy:
    """The policy during critic pre-training: sampled from, never stepped."""

    def __init__(self, model):
        self.module = model

    def step(self) -> None:
        pass


def _as_random_state(state) -> tuple:
    """random.getstate() survives a JSON/pickle round trip as nested lists; make it tuples again."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over response tokens: 1 is a perfect critic, ≤ 0 a useless one."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float(1.0 - var_residual / var_returns.clamp(min=1e-8))
