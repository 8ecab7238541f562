"""Tensor helpers the training stages and the losses share: means and whitening over a mask of
valid tokens. A leaf module (it imports no other `stages` module), so losses, advantage
estimators and trainers can all import it without reaching up into the training engine."""

from __future__ import annotations

import math

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, all_reduce_sum=None) -> torch.Tensor:
    """(x − mean) / std over the masked entries.
    `all_reduce_sum(list)` sums over ranks when given: a data-parallel minibatch is the union of
    the ranks' minibatches, so its mean and std are taken over all of them."""
    reduce = all_reduce_sum or list
    count, total = reduce([float(mask.sum()), float((x * mask).sum())])
    mean = total / max(count, 1.0)
    (squares,) = reduce([float(((x - mean) ** 2 * mask).sum())])
    whitened = (x - mean) / math.sqrt(squares / max(count, 1.0) + eps)
    return whitened * mask
