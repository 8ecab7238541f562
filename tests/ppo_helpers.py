"""Shared by the PPO tests: a PPO trainer on the tiny model (the `tiny` fixture of conftest.py)
with a rule reward."""

from __future__ import annotations

import torch

from stages.compute.loading import load_model
from stages.compute.ppo.experience import rule_scores
from stages.compute.ppo.trainer import PPOTrainer
from stages.compute.reward.model import RewardModel
from stages.leaves import precision
from stages.leaves.dist import Dist
from stages.orchestration.config_loading import load_config

RULE = "char_fraction:e"


def make_trainer(tiny, *overrides: str, **trainer_args) -> PPOTrainer:
    """A PPO trainer on the tiny model with a rule reward; `trainer_args` replace PPOTrainer's."""
    folder, tokenizer, prompts = tiny
    cfg = load_config("tiny", ["ppo.rollout_batch_size=32", "ppo.minibatch_size=16", "ppo.actor_lr=3e-3",
                               "ppo.critic_lr=3e-3", f"ppo.reward={RULE}", "ppo.ptx=false",
                               "ppo.eos_penalty=false", *overrides])
    model_cfg = cfg.model
    resolved = precision.resolve(model_cfg.precision, "cpu")  # tiny: fp32, unless a test sets model.precision
    torch.manual_seed(0)  # the critic's fresh value head: the same in every test
    reference = load_model(folder, model_cfg, precision.dtype(resolved)).eval().requires_grad_(False)
    args = dict(actor=load_model(folder, model_cfg), critic=RewardModel(load_model(folder, model_cfg)),
                reference=reference, score_fn=rule_scores(tokenizer, RULE), prompts=prompts, ptx_examples=[],
                tokenizer=tokenizer, dist=Dist(), precision=resolved)
    return PPOTrainer(cfg.ppo, **{**args, **trainer_args})


def greedy_one_minibatch_trainer(tiny, *overrides: str):
    """A PPO trainer on the tiny model: one minibatch of 8 rollouts, 8 greedy new tokens."""
    return make_trainer(tiny, "ppo.rollout_batch_size=8", "ppo.minibatch_size=8", "ppo.generation.do_sample=false",
                        "ppo.generation.max_new_tokens=8", *overrides)


def token_mean_minibatch():
    """(θ: logits of a 7-token policy, tokens, old log-probabilities, advantages, response mask) of 4
    rows; rows 0–1 (rank 0) have 6 and 5 response tokens, rows 2–3 (rank 1) 1 and 2."""
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=generator).requires_grad_()
    tokens = torch.randint(0, 7, (4, 6), generator=generator)
    old = torch.log_softmax(theta.detach(), -1)[tokens] + 0.3 * torch.randn(4, 6, generator=generator)
    advantages = torch.randn(4, 6, generator=generator)
    mask = (torch.arange(6) < torch.tensor([[6], [5], [1], [2]])).float()
    return theta, tokens, old, advantages, mask
