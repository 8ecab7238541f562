"""Reward-model loss (paper §4.2): −log σ(r(x, y_w) − r(x, y_l)) + β_rm · LM loss on (x, y_w)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stages.sft import shifted_nll


@dataclass
class RewardLoss:
    total: torch.Tensor  # what backward sees
    pairwise: torch.Tensor  # mean over pairs
    lm: torch.Tensor  # mean over the chosen answers' response tokens
    lm_tokens: int


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    # −log σ(r_w − r_l), averaged over pairs
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def response_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(mean next-token NLL over labelled tokens, their count); labels are -100 elsewhere."""
    # −(1/T) Σ_t log p(y_t | x, y_<t) over the response tokens
    nll, count = shifted_nll(logits, labels)
    return nll / max(count, 1), count


def reward_model_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, chosen_logits: torch.Tensor,
                      chosen_labels: torch.Tensor, beta_rm: float) -> RewardLoss:
    pairwise = pairwise_loss(r_chosen, r_rejected)
    lm, lm_tokens = response_lm_loss(chosen_logits, chosen_labels)
    # L = −log σ(r_w − r_l) + β_rm · L_LM(x, y_w)
    return RewardLoss(total=pairwise + beta_rm * lm, pairwise=pairwise, lm=lm, lm_tokens=lm_tokens)
