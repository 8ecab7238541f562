"""From reward-model scores to per-token rewards (paper §5.3.1 and eq. 1–2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from stages.compute.losses import KLEstimator, kl_estimate


@dataclass
class RunningMoments:
    """Mean and variance of every score seen so far (all batches, all ranks), merged batch by
    batch with the parallel update of Chan et al. (exact, not an exponential average)."""

    mean: float = 0.0
    var: float = 1.0
    count: float = 0.0

    @property
    def std(self) -> float:
        return max(self.var, 1e-12) ** 0.5

    def merge(self, mean: float, var: float, count: float) -> None:
        """Fold in a batch given by its (population) mean, variance and count."""
        if count <= 0:
            return
        total = self.count + count
        delta = mean - self.mean
        # M2 = M2_a + M2_b + δ² · n_a · n_b / (n_a + n_b)
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / total
        self.mean, self.var, self.count = self.mean + delta * count / total, m2 / total, total

    def update(self, scores: torch.Tensor, all_reduce_sum=None) -> None:
        """Merge a batch of scores; `all_reduce_sum([n, Σx, Σx²])` sums over ranks when given."""
        x = scores.detach().double().flatten()
        sums = [float(x.numel()), float(x.sum()), float((x * x).sum())]
        if all_reduce_sum is not None:
            sums = all_reduce_sum(sums)
        n, total, squares = sums
        # NaN/Inf scores would spoil the statistics for good; the trainer skips that iteration.
        # The sums are the same on every rank, so every rank leaves them out alike.
        if n == 0 or not math.isfinite(total + squares):
            return
        mean = total / n
        self.merge(mean, max(squares / n - mean * mean, 0.0), n)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


ScoreMode = Literal["none", "scale", "normalise"]


def reparameterise_scores(scores: torch.Tensor, moments: RunningMoments, mode: ScoreMode, clip: float) -> torch.Tensor:
    """r̃ = r (none), r / σ (scale), or clip((r − μ) / σ, −δ, δ) (normalise) — paper §5.3.1."""
    if mode == "none":
        return scores
    if mode == "scale":
        return scores / moments.std
    return ((scores - moments.mean) / moments.std).clamp(-clip, clip)


def eos_penalty_scores(scores: torch.Tensor, ended_with_eos: torch.Tensor, moments: RunningMoments,
                       sigmas: float | None) -> torch.Tensor:
    """A response cut off before EOS scores μ − κσ (κ = `sigmas`) on the running statistics of the
    RM's own scores instead of its RM score: after reparameterisation that is −κ (clipped to −δ)
    in `normalise` mode, so it ranks at the bottom of the batch whatever the RM's offset. A fixed
    raw value would be a penalty only where the RM's scores sit above it. Call it after the
    moments took in the RM's scores: the substitute never enters the statistics."""
    if sigmas is None:
        return scores
    penalty = torch.full_like(scores, moments.mean - sigmas * moments.std)
    return torch.where(ended_with_eos, scores, penalty)


def shape_scores(scores: torch.Tensor, ended_with_eos: torch.Tensor, moments: RunningMoments, *, mode: ScoreMode,
                 clip: float, eos_penalty_sigmas: float | None, update_moments: bool = True,
                 all_reduce_sum=None) -> torch.Tensor:
    """Raw RM scores → the scores the token rewards carry (§5.3.1): the running moments take in
    the RM's own scores (update_moments; in `none` mode they are not used), a response without EOS
    gets the EOS penalty on those statistics, then every score is reparameterised alike."""
    if mode != "none" and update_moments:
        moments.update(scores, all_reduce_sum)
    scores = eos_penalty_scores(scores, ended_with_eos, moments, eos_penalty_sigmas)
    return reparameterise_scores(scores, moments, mode, clip)


def token_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float, kl_kind: KLEstimator) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_t, KL_t) over response tokens: r_t = −β · KL_t, plus the score on the last response
    token (eq. 1–2). `mask` is 1 on response tokens; rows have at least one. A KL term in the
    reward reaches the policy gradient as E_π[∇log π · KL_t], which is ∇KL(π ‖ π_SFT) for k1 only
    (the config refuses other estimators here; they go in `kl_loss`). β = 0 leaves the KL out of
    the reward (it is still returned for the metrics)."""
    kl = kl_estimate(logprobs, ref_logprobs, kl_kind) * mask
    rewards = -kl_coef * kl
    last = mask.long().cumsum(dim=1).argmax(dim=1)  # index of the last response token
    rewards[torch.arange(rewards.shape[0]), last] += scores.to(rewards.dtype)
    return rewards, kl
