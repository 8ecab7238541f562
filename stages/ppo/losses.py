"""PPO losses (paper §5.3.3): clipped surrogate, clipped value loss, PPO-ptx, entropy, and the KL
penalty as a loss term (`ppo.kl_penalty_in=loss`).

Policy losses are registered by name (`ppo.policy_loss`), one function of one signature each,
`fn(logprobs, old_logprobs, advantages, mask, ppo) -> (loss, stats)`: adding one is one function
with `@register_policy_loss(name)`. Built in: `ppo_clip`, the clipped surrogate."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from stages.ppo.advantages import masked_mean
from stages.ppo.rewards import KLEstimator, kl_estimate
from stages.sft import shifted_nll

if TYPE_CHECKING:
    from stages.config import PPOConfig


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L^CLIP = −E[min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)], ρ = π_θ / π_old; no clipping when ε is None."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    if clip_eps is None:
        surrogate, clipped_frac = unclipped, torch.zeros((), device=ratio.device)
    else:
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
        surrogate = torch.minimum(unclipped, clipped)
        clipped_frac = masked_mean((clipped < unclipped).float(), mask)
    stats = {
        "clipfrac": clipped_frac.detach(),
        "approxkl": masked_mean(0.5 * log_ratio.detach() ** 2, mask),  # ½ E[(log ρ)²], as TRL
        "ratio": masked_mean(ratio.detach(), mask),
        "ratio_var": masked_mean((ratio.detach() - masked_mean(ratio.detach(), mask)) ** 2, mask),
    }
    return -masked_mean(surrogate, mask), stats


# (log π_θ, log π_old, advantages, response mask, the PPO config) → (the loss to minimise, its
# statistics: scalars, logged as POLICY_STAT_NAMES says, or as policy/<name>_avg)
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "PPOConfig"],
                        tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}

# Metric names of the statistics `ppo_clip` returns (TRL's names).
POLICY_STAT_NAMES = {"approxkl": "policy/approxkl_avg", "clipfrac": "policy/clipfrac_avg", "ratio": "val/ratio",
                     "ratio_var": "val/ratio_var"}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register `fn` as `ppo.policy_loss=<name>`."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is registered already")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def registered_policy_loss(name: str) -> PolicyLossFn:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}") from None


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  ppo: PPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (paper §5.3.3) with ε = `ppo.clip_eps`: `policy_loss`."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, ppo.clip_eps)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L^V = ½ E[max((V − R)², (clip(V, V_old − ε_v, V_old + ε_v) − R)²)]; plain ½ E[(V − R)²]
    when ε_v is None."""
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * masked_mean(unclipped, mask), {"clipfrac": torch.zeros((), device=values.device)}
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    stats = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).detach()}
    return 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask), stats


def entropy(log_distribution: torch.Tensor) -> torch.Tensor:
    """H(π(·|s_t)) = −Σ π log π per position, from log π over the vocabulary."""
    return -(log_distribution.exp() * log_distribution).sum(-1)


def ptx_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PPO-ptx: the SFT language-modelling loss on pretraining/SFT data (labels −100 = ignore)."""
    nll, count = shifted_nll(logits, labels)
    return nll / max(count, 1)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """The KL penalty as a loss term (`ppo.kl_penalty_in=loss`, as GRPO and OpenRLHF's `use_kl_loss`):
    the mean estimator over response tokens on log π_θ with its graph. Its expected gradient on
    tokens sampled from π_θ: k2 → ∇KL(π ‖ π_SFT); k3 → ∇KL(π_SFT ‖ π), the reverse KL, equal to
    the forward one to second order around π_SFT; k1 → 0, which is why the config refuses k1 here."""
    return masked_mean(kl_estimate(logprobs, ref_logprobs, kind), mask)
