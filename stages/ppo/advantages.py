"""Generalised advantage estimation and advantage whitening (paper §5.3.2, eq. 3)."""

from __future__ import annotations

import math

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  all_reduce_sum=None) -> torch.Tensor:
    """(x − mean) / std over the masked entries (mean added back when shift_mean is False).
    `all_reduce_sum(list)` sums over ranks when given: a data-parallel minibatch is the union of
    the ranks' minibatches, so its mean and std are taken over all of them."""
    reduce = all_reduce_sum or list
    count, total = reduce([float(mask.sum()), float((x * mask).sum())])
    mean = total / max(count, 1.0)
    (squares,) = reduce([float(((x - mean) ** 2 * mask).sum())])
    whitened = (x - mean) / math.sqrt(squares / max(count, 1.0) + eps)
    return (whitened if shift_mean else whitened + mean) * mask


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
