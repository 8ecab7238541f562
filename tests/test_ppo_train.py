"""PPO-max and vanilla PPO on tiny models: learning a rule reward, checkpoint and resume."""

from __future__ import annotations

import pytest
import torch

from stages.config import load_config
from stages.data import load_pairs
from stages.launch import Dist
from stages.ppo import checkpoint
from stages.ppo.experience import rule_scores
from stages.ppo.stage import encode_prompts
from stages.ppo.trainer import PPOTrainer
from stages.reward.model import RewardModel
from stages.sources import load_model, load_tokenizer, materialise_model

RULE = "char_fraction:e"


@pytest.fixture(scope="module")
def tiny(hh_file):
    cfg = load_config("tiny", [f"data.pairs={hh_file}"])
    _, pairs, _ = load_pairs(cfg)
    texts = [t for p in pairs for t in (p["prompt"], p["chosen"], p["rejected"])]
    folder = materialise_model(cfg.model, corpus=lambda: texts)
    tokenizer = load_tokenizer(folder, cfg.model)
    prompts = encode_prompts(tokenizer, pairs[:256], 64)
    return folder, tokenizer, prompts


def make_trainer(tiny, *overrides: str) -> PPOTrainer:
    folder, tokenizer, prompts = tiny
    cfg = load_config("tiny", ["ppo.rollout_batch_size=32", "ppo.minibatch_size=16", "ppo.actor_lr=3e-3",
                               "ppo.critic_lr=3e-3", f"ppo.reward={RULE}", "ppo.ptx=false",
                               "ppo.eos_penalty=false", *overrides])
    model_cfg = cfg.model
    torch.manual_seed(0)  # the critic's fresh value head: the same in every test
    reference = load_model(folder, model_cfg).eval().requires_grad_(False)
    return PPOTrainer(cfg.ppo, actor=load_model(folder, model_cfg), critic=RewardModel(load_model(folder, model_cfg)),
                      reference=reference, score_fn=rule_scores(tokenizer, RULE), prompts=prompts, ptx_examples=[],
                      tokenizer=tokenizer, dist=Dist())


@pytest.mark.parametrize("preset", ["ppo-max", "vanilla"])
def test_ppo_raises_a_rule_reward(tiny, preset):
    trainer = make_trainer(tiny, f"ppo.preset={preset}")
    scores = [trainer.step()["objective/scores"] for _ in range(30)]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.05, scores


def test_the_token_kl_penalty_holds_the_policy_near_sft(tiny):
    kl = {}
    for preset in ("ppo-max", "vanilla"):
        trainer = make_trainer(tiny, f"ppo.preset={preset}", "ppo.kl_coef=0.2")
        kl[preset] = sum([trainer.step()["objective/kl"] for _ in range(25)][-5:]) / 5
    assert kl["ppo-max"] < kl["vanilla"], kl


def test_resume_from_a_checkpoint_gives_the_same_run(tiny, tmp_path):
    def run(iterations, trainer):
        return [trainer.step() for _ in range(iterations)]

    whole = run(4, make_trainer(tiny))

    first = make_trainer(tiny)
    run(2, first)
    saved = checkpoint.save(first, tmp_path / "ckpt")
    assert checkpoint.latest(tmp_path / "ckpt") == saved
    del first  # "killed" after iteration 2

    second = make_trainer(tiny)
    torch.manual_seed(123)  # a different process state: everything must come from the checkpoint
    checkpoint.load(second, saved)
    resumed = run(2, second)
    assert second.iteration == 4 and second.episode == 4 * 32
    for name in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "episode"):
        assert resumed[-1][name] == pytest.approx(whole[-1][name], rel=1e-5, abs=1e-6), name


def test_a_half_written_or_corrupted_checkpoint_is_never_loaded(tiny, tmp_path):
    trainer = make_trainer(tiny)
    trainer.step()
    good = checkpoint.save(trainer, tmp_path)
    trainer.step()
    newer = checkpoint.save(trainer, tmp_path)
    (tmp_path / ".tmp-iter-000003").mkdir()  # a crash mid-write leaves only a temp folder
    assert checkpoint.latest(tmp_path) == newer
    with open(newer / "critic.safetensors", "r+b") as handle:  # flip bytes: checksum mismatch
        handle.seek(100)
        handle.write(b"\x00\x01\x02\x03")
    assert checkpoint.latest(tmp_path) == good
