"""Advantage estimators, registered by name (`ppo.advantage_estimator`), and advantage whitening.

Every estimator is one function of one signature, `fn(AdvantageInputs) -> (advantages, returns)`,
registered with `@register_advantage_estimator(name, needs_critic=...)`: adding one is one function
(the config and the trainer find it by name). The trainer calls the registered function in one
place (`PPOTrainer.rollout`). Built in:

- `gae` (the default; PPO-max, paper §5.3.2 eq. 3): GAE on the critic's values.
- `grpo` (DeepSeekMath, Shao et al. 2024), `rloo` (Ahmadian et al. 2024) and `reinforce++` (Hu 2025):
  no critic. `grpo` and `rloo` compare the samples of one prompt (`ppo.samples_per_prompt` ≥ 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stages.leaves.named_registry import add_entry, entry_named
from stages.leaves.tensors import masked_whiten

if TYPE_CHECKING:
    from stages.leaves.config import PPOConfig


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """(A_t, R_t) over response tokens, rows right-aligned or not: masked positions are skipped.
    δ_t = r_t + γ V(s_{t+1}) − V(s_t);  A_t = δ_t + γλ A_{t+1};  R_t = A_t + V(s_t)."""
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # Padding between response tokens never occurs; at pads carry the next token's state.
        advantages[:, t] = advantage * m
        next_value = torch.where(m.bool(), values[:, t], next_value)
        next_advantage = torch.where(m.bool(), advantage, next_advantage)
    return advantages, (advantages + values) * mask


def return_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ G_{t+1} over response tokens: GAE with V = 0 and λ = 1 (δ_t = r_t)."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


# -- the registry -------------------------------------------------------------------------------
@dataclass
class AdvantageInputs:
    """What an estimator may read. Per-token tensors are [B, R] over the response tokens."""

    rewards: torch.Tensor  # r_t = −β·KL_t (β = 0 unless the KL is in the reward), + the shaped score at the end
    mask: torch.Tensor  # 1 on response tokens
    values: torch.Tensor | None  # V_old(s_t); None for an estimator without a critic
    groups: torch.Tensor  # [B] long: rows with one index are the samples of one prompt (adjacent rows)
    ppo: PPOConfig  # γ, λ and whatever else an estimator reads
    all_reduce_sum: Callable[[list[float]], list[float]] | None = None  # sums over data-parallel ranks; None: one rank


# (advantages [B, R], returns [B, R] — the critic's targets — or None when there is no critic to train)
AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator. needs_critic: the trainer trains a critic and hands `values` in (else
    critic=None: no critic at all). min_samples_per_prompt: the group size it needs. whiten_switch:
    whether PPO's `whiten_advantages` switch applies to its advantages (per minibatch, in the trainer)."""

    name: str
    fn: AdvantageFn
    needs_critic: bool
    min_samples_per_prompt: int = 1
    whiten_switch: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, needs_critic: bool, min_samples_per_prompt: int = 1,
                                 whiten_switch: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register `fn` as `ppo.advantage_estimator=<name>`."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        estimator = AdvantageEstimator(name, fn, needs_critic, min_samples_per_prompt, whiten_switch)
        add_entry(ADVANTAGE_ESTIMATORS, "advantage estimator", name, estimator)
        return fn

    return register


def advantage_estimator(name: str) -> AdvantageEstimator:
    return entry_named(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def needs_critic(ppo: PPOConfig) -> bool:
    """Whether `ppo.advantage_estimator` trains a critic: else the pipeline needs no critic stage and
    PPO loads, builds and checkpoints none."""
    return advantage_estimator(ppo.advantage_estimator).needs_critic


# -- the estimators -----------------------------------------------------------------------------
@register_advantage_estimator("gae", needs_critic=True, whiten_switch=True)
def gae_advantages(inputs: AdvantageInputs):
    """GAE (paper §5.3.2, eq. 3) on the critic's V_old; returns R_t = A_t + V_old(s_t) train the critic."""
    return gae(inputs.rewards, inputs.values, inputs.mask, inputs.ppo.gamma, inputs.ppo.lam)


def sequence_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """[B] the outcome reward of each sequence, Σ_t r_t: its shaped score, less β·Σ_t KL_t when the KL
    penalty is in the reward (the sequence-level r(x, y) − β log π/π_SFT of RLOO's paper), the score
    alone when it is a loss term (kl_penalty_in=loss, as GRPO). Undiscounted: γ does not enter."""
    return (inputs.rewards * inputs.mask).sum(1)


def group_sums(x: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] per row: (the sum of x over the row's group, the group's size)."""
    _, index = torch.unique(groups, return_inverse=True)
    zeros = torch.zeros(int(index.max()) + 1, dtype=x.dtype, device=x.device)
    totals = zeros.index_add(0, index, x)
    sizes = zeros.index_add(0, index, torch.ones_like(x))
    return totals[index], sizes[index]


GRPO_EPS = 1e-6  # ε of (r − mean) / (std + ε): a group of equal rewards gets 0, not 0/0 (verl's default)


@register_advantage_estimator("grpo", needs_critic=False, min_samples_per_prompt=2)
def grpo_advantages(inputs: AdvantageInputs):
    """GRPO's outcome supervision (DeepSeekMath §4.1.2): Â_i = (r_i − mean_g) / (std_g + ε) over the
    k samples of the row's prompt, on every response token. std_g with Bessel's correction (n − 1,
    as torch.std in verl, TRL and OpenRLHF); a group of one gets 0. Already normalised: the
    `whiten_advantages` switch does not apply."""
    r = sequence_rewards(inputs)
    total, size = group_sums(r, inputs.groups)
    mean = total / size
    squares, _ = group_sums((r - mean) ** 2, inputs.groups)
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    return ((r - mean) / (std + GRPO_EPS))[:, None] * inputs.mask, None


@register_advantage_estimator("rloo", needs_critic=False, min_samples_per_prompt=2)
def rloo_advantages(inputs: AdvantageInputs):
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"): Â_i = r_i − (1/(k−1)) Σ_{j≠i} r_j over
    the k samples of the row's prompt, on every response token; a group of one gets 0. Unwhitened:
    the leave-one-out baseline is the estimator (the `whiten_advantages` switch does not apply)."""
    r = sequence_rewards(inputs)
    total, size = group_sums(r, inputs.groups)
    others = (total - r) / (size - 1).clamp(min=1)
    return torch.where(size > 1, r - others, torch.zeros_like(r))[:, None] * inputs.mask, None


@register_advantage_estimator("reinforce++", needs_critic=False)
def reinforce_plus_plus_advantages(inputs: AdvantageInputs):
    """REINFORCE++ (Hu 2025): the token rewards (the score and −β·KL_t per token when the KL penalty
    is in the reward) summed into the return-to-go G_t = r_t + γ G_{t+1}; Â = (G − mean) / std over
    every response token of the global batch (all ranks). It whitens by definition: the
    `whiten_advantages` switch does not apply again. Returns G (no critic trains on it)."""
    returns = return_to_go(inputs.rewards, inputs.mask, inputs.ppo.gamma)
    return masked_whiten(returns, inputs.mask, all_reduce_sum=inputs.all_reduce_sum), returns
