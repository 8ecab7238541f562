"""The reward model (model.py) and its HTTP server (serve.py). The stage is
stages/pipeline/reward.py; the model's pyfunc is stages/reward/pyfunc.py, whose path registered
models record."""

from stages.compute.reward.model import RewardModel, load_reward_model

__all__ = ["RewardModel", "load_reward_model"]
