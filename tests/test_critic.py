"""The critic starts as the reward model (paper §5.3.3) on the scale of the rewards it must
predict: PPO-max's rewards are the RM's scores reparameterised on their running statistics
(§5.3.1), so the critic's first values are the RM's scores put through the same map."""

from __future__ import annotations

import pytest
import torch

from stages.compute.loading import load_model
from stages.compute.model_loading import load_models
from stages.compute.ppo.reward_shaping import RunningMoments, reparameterise_scores
from stages.compute.reward.model import RewardModel, save_reward_model
from stages.leaves.dist import Dist
from stages.orchestration.config_loading import load_config


@pytest.fixture(scope="module")
def offset_reward_model(tiny, tmp_path_factory):
    """A reward model whose held-out scores sit at mean 2.5, std 4 (an RM's offset is arbitrary)."""
    folder, tokenizer, _ = tiny
    cfg = load_config("tiny")
    torch.manual_seed(0)
    rm = RewardModel(load_model(folder, cfg.model))
    with torch.no_grad():
        rm.score_head.bias.fill_(1.5)
    rm.score_mean, rm.score_std = 2.5, 4.0
    out = tmp_path_factory.mktemp("offset-rm")
    save_reward_model(rm, tokenizer, out, {"role": "reward"})
    return folder, out


@pytest.mark.parametrize("preset,mode", [("ppo-max", "normalise"), ("vanilla", "none")])
def test_a_critic_made_from_the_reward_model_predicts_the_shaped_score(offset_reward_model, preset, mode):
    sft_dir, rm_dir = offset_reward_model
    cfg = load_config("tiny", [f"ppo.preset={preset}"])
    assert cfg.ppo.switches()["score_mode"] == mode
    _, _, _, reward_model, critic, _ = load_models(cfg, {"sft_model_dir": str(sft_dir), "reward_model_dir": str(rm_dir)},
                                                   Dist(), train_actor=False)
    hidden = torch.randn(64, reward_model.score_head.in_features)
    with torch.no_grad():
        scores = reward_model.score_head(hidden).squeeze(-1)
        values = critic.score_head(hidden).squeeze(-1)
    moments = RunningMoments(mean=reward_model.score_mean, var=reward_model.score_std**2, count=1.0)
    expected = reparameterise_scores(scores, moments, mode, clip=float("inf"))
    assert values == pytest.approx(expected, abs=1e-5)


def test_a_pretrained_critic_loads_as_it_was_saved(offset_reward_model):
    """PPO's critic comes from critic pre-training, already on the shaped scale: no second map."""
    sft_dir, rm_dir = offset_reward_model
    cfg = load_config("tiny")
    _, _, _, reward_model, critic, _ = load_models(
        cfg, {"sft_model_dir": str(sft_dir), "reward_model_dir": str(rm_dir), "critic_model_dir": str(rm_dir)},
        Dist(), train_actor=False)
    assert torch.equal(critic.score_head.weight, reward_model.score_head.weight.float())
    assert torch.equal(critic.score_head.bias, reward_model.score_head.bias.float())
