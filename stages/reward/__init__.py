"""Reward-model stage (paper §4.2): pairwise + LM loss, dynamic token batching. The stage is
`stages.reward.stage`; the package exports the model alone, so importing the model (as PPO's
rollouts and every stage's model loading do) does not import the stage, which loads its models
through `stages.model_loading`."""

from stages.reward.model import RewardModel, load_reward_model

__all__ = ["RewardModel", "load_reward_model"]
