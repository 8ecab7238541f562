"""Reward-model stage (paper §4.2): pairwise + LM loss, dynamic token batching."""

from stages.reward.model import RewardModel, load_reward_model
from stages.reward.stage import prepare, run

__all__ = ["RewardModel", "load_reward_model", "prepare", "run"]
