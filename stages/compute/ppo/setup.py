"""What PPO starts from that other stages start from too: the prompts' token ids, and the running
score statistics the rewards are shaped with. The critic pre-trains on PPO's rollouts, the eval
stage and a study's best-of-n arm answer the same prompts; they import these from here, never from
another stage module."""

from __future__ import annotations

from stages.compute.ppo.reward_shaping import RunningMoments
from stages.leaves.rendering import render_prompt


def encode_prompts(tokenizer, rows: list[dict], max_prompt_len: int) -> list[list[int]]:
    """Prompt token ids, the oldest turns cut when longer than max_prompt_len."""
    return [tokenizer(render_prompt(tokenizer, r["messages"]), add_special_tokens=False)["input_ids"][-max_prompt_len:]
            for r in rows]


def initial_moments(reward_model, critic=None) -> RunningMoments:
    """Running score statistics: those critic pre-training ended with (every score it saw, with
    their count), else the reward model's held-out mean and std with count 1."""
    if critic is not None and critic.running_moments is not None:
        return RunningMoments(**critic.running_moments)
    return RunningMoments(mean=reward_model.score_mean, var=reward_model.score_std**2, count=1.0)
