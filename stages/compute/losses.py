"""Every loss the pipeline trains with, in one module:

- SFT: the shifted next-token NLL (also PPO-ptx's and the reward model's LM term);
- reward model (paper §4.2): −log σ(r(x, y_w) − r(x, y_l)) + β_rm · LM loss on (x, y_w);
- PPO (paper §5.3.3): policy losses registered by name (`ppo.policy_loss`, one function of one
  signature each, `fn(logprobs, old_logprobs, advantages, mask, ppo) -> (loss, stats)`: adding one
  is one function with `@register_policy_loss(name)`; built in: `ppo_clip`, the clipped
  surrogate), the clipped value loss, entropy, PPO-ptx, and the KL penalty: its per-token
  estimators (k1, k2, k3) and, with `ppo.kl_penalty_in=loss`, the KL loss term. The actor's
  per-token terms (policy loss, entropy bonus, KL loss term) reduce to one number by
  `ppo.loss_agg` (`aggregate`); the value loss is a token mean. Token means are over the global
  minibatch on any number of ranks (`token_mean_share`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from stages.leaves.dist import Dist
from stages.leaves.logprobs import token_logprobs
from stages.leaves.named_registry import add_entry, entry_named
from stages.leaves.tensors import masked_mean


def next_token_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions in [B, L] whose next token is labelled, those tokens): position t of a row
    predicts labels[t + 1]; labels are -100 where nothing is predicted (prompt, padding)."""
    following = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    positions = (following != -100).reshape(-1).nonzero().squeeze(1)
    return positions, following.reshape(-1).index_select(0, positions)


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """−Σ log p(target) over the rows of logits [M, vocab], in fp32 (`stages.leaves.logprobs`, in chunks of rows)."""
    return -token_logprobs(logits, targets, 1.0).sum()


def shifted_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the labelled positions (labels are -100 elsewhere), and their count.
    Only the rows of logits that predict a labelled token are read."""
    positions, targets = next_token_targets(labels)
    return nll_sum(logits.reshape(-1, logits.shape[-1]).index_select(0, positions), targets), len(targets)


# -- reward model ------------------------------------------------------------------------------
@dataclass
class RewardLoss:
    total: torch.Tensor  # what backward sees
    pairwise: torch.Tensor  # mean over pairs
    lm: torch.Tensor  # mean over the chosen answers' response tokens
    lm_tokens: int


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    # −log σ(r_w − r_l), averaged over pairs
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def reward_model_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, lm_logits: torch.Tensor | None,
                      lm_targets: torch.Tensor | None, beta_rm: float) -> RewardLoss:
    """`lm_logits` [M, vocab]: the logits at the M positions of the chosen answers that predict a
    response token, `lm_targets` [M] those tokens (`next_token_targets`); None where β_rm = 0 (no
    LM term: the pairwise loss alone, `lm_tokens` 0)."""
    pairwise = pairwise_loss(r_chosen, r_rejected)
    if lm_logits is None:
        return RewardLoss(total=pairwise, pairwise=pairwise, lm=pairwise.new_zeros(()), lm_tokens=0)
    # L_LM(x, y_w) = −(1/T) Σ_t log p(y_t | x, y_<t) over the T response tokens
    lm_tokens = len(lm_targets)
    lm = nll_sum(lm_logits, lm_targets) / max(lm_tokens, 1)
    # L = −log σ(r_w − r_l) + β_rm · L_LM(x, y_w)
    return RewardLoss(total=pairwise + beta_rm * lm, pairwise=pairwise, lm=lm, lm_tokens=lm_tokens)


# -- PPO ---------------------------------------------------------------------------------------
KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """Per-token KL(π ‖ π_SFT) estimate from sampled tokens (Schulman 2020): k1 = log π − log π_SFT,
    k2 = ½ (log π − log π_SFT)², k3 = (ρ − 1) − log ρ with ρ = π_SFT / π (unbiased, non-negative)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio


if TYPE_CHECKING:
    from stages.leaves.config import PPOConfig

LossAggregation = Literal["token_mean", "seq_mean"]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation) -> torch.Tensor:
    """A per-token loss ℓ_{i,t} over a minibatch of G responses o_i as one number (verl's
    loss_agg_mode): `token_mean` Σ_i Σ_t ℓ_{i,t} / Σ_i |o_i|, every response token weighs the same
    (MOSS, TRL); `seq_mean` (1/G) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}, every response weighs the same
    (DeepSeekMath's GRPO objective; verl's seq-mean-token-mean). Over this rank's rows: on several
    ranks the trainer scales a token mean by `token_mean_share`, so the gradient the ranks average
    is the token mean over the global minibatch (a seq_mean is one already: every rank has as many
    rows)."""
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; known: token_mean, seq_mean")


def token_mean_share(mask: torch.Tensor, dist: Dist) -> float:
    """n_r · W / N, for this rank's n_r response tokens of the N on all W ranks (one all-reduce): a
    token mean over this rank's rows times it is W · Σ_r ℓ / N, so the mean of the ranks' losses,
    and of their gradients (DeepSpeed averages them), is Σ ℓ / N over the global minibatch. A
    per-rank mean averaged over ranks would weigh a token of a rank with few response tokens more
    than one of a rank with many. 1 on one rank."""
    local = float(mask.sum())
    (total,) = dist.all_reduce_sum([local])
    return local * dist.world_size / max(total, 1.0)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float | None, loss_agg: LossAggregation = "token_mean"
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L^CLIP = −E[min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)], ρ = π_θ / π_old; no clipping when ε is None.
    E over the response tokens by `loss_agg` (`aggregate`); the statistics are token means."""
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
    return -aggregate(surrogate, mask, loss_agg), stats


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
        add_entry(POLICY_LOSSES, "policy loss", name, fn)
        return fn

    return register


def registered_policy_loss(name: str) -> PolicyLossFn:
    return entry_named(POLICY_LOSSES, "policy loss", name)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  ppo: PPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (paper §5.3.3) with ε = `ppo.clip_eps`, aggregated by `ppo.loss_agg`:
    `policy_loss`."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, ppo.clip_eps, ppo.loss_agg)


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


def ptx_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PPO-ptx: the SFT language-modelling loss on pretraining/SFT data (labels −100 = ignore)."""
    nll, count = shifted_nll(logits, labels)
    return nll / max(count, 1)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: KLEstimator,
            loss_agg: LossAggregation = "token_mean") -> torch.Tensor:
    """The KL penalty as a loss term (`ppo.kl_penalty_in=loss`, as GRPO and OpenRLHF's `use_kl_loss`):
    the mean estimator over response tokens (by `loss_agg`, as the policy loss) on log π_θ with its
    graph. Its expected gradient on tokens sampled from π_θ: k2 → ∇KL(π ‖ π_SFT); k3 → ∇KL(π_SFT ‖ π),
    the reverse KL, equal to the forward one to second order around π_SFT; k1 → 0, which is why the
    config refuses k1 here."""
    return aggregate(kl_estimate(logprobs, ref_logprobs, kind), mask, loss_agg)
