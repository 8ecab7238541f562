"""PPO-max and vanilla PPO on tiny models: learning a rule reward, checkpoint and resume."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_helpers import make_trainer

from stages.compute import checkpoint
from stages.compute.loading import load_model
from stages.compute.ppo.experience import response_logits
from stages.compute.ppo.trainer import warmup_steps
from stages.compute.reward.model import RewardModel
from stages.leaves.dist import Dist
from stages.leaves.logprobs import token_logprobs
from stages.leaves.tensors import masked_mean
from stages.orchestration.config_loading import load_config


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
    saved = first.save_checkpoint(tmp_path / "ckpt")
    assert checkpoint.latest(tmp_path / "ckpt") == saved
    del first  # "killed" after iteration 2

    second = make_trainer(tiny)
    torch.manual_seed(123)  # a different process state: everything must come from the checkpoint
    second.load_checkpoint(saved)
    resumed = run(2, second)
    assert second.iteration == 4 and second.episode == 4 * 32
    for name in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "episode"):
        assert resumed[-1][name] == pytest.approx(whole[-1][name], rel=1e-5, abs=1e-6), name


def test_a_half_written_or_corrupted_checkpoint_is_never_loaded(tiny, tmp_path):
    trainer = make_trainer(tiny)
    trainer.step()
    good = trainer.save_checkpoint(tmp_path)
    trainer.step()
    newer = trainer.save_checkpoint(tmp_path)
    (tmp_path / ".tmp-iter-000003").mkdir()  # a crash mid-write leaves only a temp folder
    assert checkpoint.latest(tmp_path) == newer
    with open(newer / "critic.safetensors", "r+b") as handle:  # flip bytes: checksum mismatch
        handle.seek(100)
        handle.write(b"\x00\x01\x02\x03")
    assert checkpoint.latest(tmp_path) == good


def test_ptx_switch_leaves_the_prompt_order_unchanged(tiny):
    """PPO-ptx draws its examples from a stream of its own: switching it on or off must not change
    which prompts the policy is rolled out on (the old shared RNG changed it from the second pass)."""
    _, tokenizer, prompts = tiny
    ptx = [(ids, list(ids)) for ids in prompts[:20]]
    seen = {}
    for switch in ("true", "false"):
        trainer = make_trainer(tiny, f"ppo.ptx={switch}", "ppo.rollout_batch_size=8", "ppo.minibatch_size=8",
                               "ppo.generation.max_new_tokens=4", "ppo.ptx_batch_size=2", prompts=prompts[:16],
                               ptx_examples=ptx)
        seen[switch] = []
        for _ in range(5):  # two prompts' passes and a half
            metrics = trainer.step()
            seen[switch].append(tokenizer.batch_decode(trainer.last_experience.sequences[:, :trainer.last_experience.prompt_width]))
        assert (metrics["loss/ptx_avg"] > 0) == (switch == "true")
    assert seen["true"] == seen["false"]


def test_actor_and_critic_adamw_weight_decay_is_explicit_and_zero_by_default(tiny):
    """The paper's code trains with weight decay 0; torch's AdamW default (0.01) must not slip in."""
    trainer = make_trainer(tiny)
    assert [g["weight_decay"] for g in trainer.actor.optimizer.param_groups] == [0.0]
    assert [g["weight_decay"] for g in trainer.critic.optimizer.param_groups] == [0.0]
    trainer = make_trainer(tiny, "ppo.actor_weight_decay=0.1", "ppo.critic_weight_decay=0.2")
    assert [g["weight_decay"] for g in trainer.actor.optimizer.param_groups] == [0.1]
    assert [g["weight_decay"] for g in trainer.critic.optimizer.param_groups] == [0.2]


def test_ppo_warmup_is_ten_percent_without_a_pretrained_critic(tiny):
    """Paper: 10 % lr warm-up, replaced by critic pre-training (§5.4) when that stage ran."""
    cfg = load_config("tiny", ["ppo.iterations=20", "ppo.rollout_batch_size=16", "ppo.minibatch_size=8",
                               "ppo.ppo_epochs=2"])
    assert warmup_steps(cfg.ppo, pretrained_critic=False) == 8  # 10 % of 20 × 2 × 2 optimiser steps
    assert warmup_steps(cfg.ppo, pretrained_critic=True) == 0
    trainer = make_trainer(tiny, warmup=8)
    assert trainer.actor.lr_scheduler.get_last_lr()[0] == pytest.approx(trainer.ppo.actor_lr / 8)


def test_policy_perplexity_is_the_models_own_at_temperature_one(tiny):
    """The paper's collapse indicator is the model's own perplexity (T = 1), not the one under the
    sampling temperature; the tempered one is logged beside it."""
    _, tokenizer, prompts = tiny
    trainer = make_trainer(tiny, "ppo.generation.temperature=0.7", "ppo.rollout_batch_size=8",
                           "ppo.minibatch_size=8", "ppo.generation.max_new_tokens=8")
    exp, _, _ = trainer.rollout(prompts[:8])
    mask, response = exp.response_mask, exp.sequences[:, exp.prompt_width :]
    with torch.no_grad():
        for model, logprobs in ((trainer.actor.module, exp.model_logprobs), (trainer.reference, exp.ref_model_logprobs)):
            logits = response_logits(model, exp.sequences, exp.attention_mask, exp.prompt_width)
            torch.testing.assert_close(logprobs, token_logprobs(logits, response, 1.0) * mask, atol=2e-5, rtol=1e-5)
    metrics = trainer.step()
    exp = trainer.last_experience
    assert metrics["policy/ref_perplexity"] == pytest.approx(
        torch.exp(-masked_mean(exp.ref_model_logprobs, exp.response_mask)).item(), rel=1e-5)
    assert metrics["policy/perplexity_tempered"] == pytest.approx(
        torch.exp(-masked_mean(exp.logprobs, exp.response_mask)).item(), rel=1e-5)
    assert metrics["policy/perplexity"] != pytest.approx(metrics["policy/perplexity_tempered"], rel=1e-3)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_kl_penalty_in_the_loss_trains_with_finite_numbers_and_logs_it(tiny, loss_agg):
    trainer = make_trainer(tiny, "ppo.kl_penalty_in=loss", "ppo.kl_estimator=k3", "ppo.rollout_batch_size=8",
                           "ppo.minibatch_size=8", "ppo.generation.max_new_tokens=8", f"ppo.loss_agg={loss_agg}")
    first = trainer.step()
    second = trainer.step()
    assert first["objective/non_score_reward"] == 0.0  # no KL inside the reward
    assert first["loss/kl_avg"] == pytest.approx(0.0, abs=1e-6)  # π = π_SFT before the first step
    assert second["loss/kl_avg"] > 0 and all(math.isfinite(v) for v in second.values())


def test_checkpoint_keeps_the_cuda_rng_states(tiny, tmp_path, monkeypatch):
    """On a GPU machine the sampling draws from the CUDA generators: a checkpoint must keep them
    (each rank its own). torch.cuda's RNG calls are replaced by an in-memory pair of devices here;
    the checkpoint code is ours, unchanged."""
    trainer = make_trainer(tiny)
    trainer.step()
    devices = {0: torch.arange(8, dtype=torch.uint8), 1: torch.arange(8, 16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [devices[0].clone(), devices[1].clone()])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: devices.__setitem__(device, state.clone()))
    saved = trainer.save_checkpoint(tmp_path)
    devices[0], devices[1] = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    trainer.load_checkpoint(saved)
    assert devices[0].tolist() == list(range(8)) and devices[1].tolist() == list(range(8, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_restores_real_cuda_sampling(tmp_path):
    torch.cuda.manual_seed_all(3)
    state = checkpoint.rng_state()
    first = torch.rand(4, device="cuda")
    checkpoint.load_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_ptx_data_reads_a_separate_text_dataset(tiny, tmp_path):
    """PPO-ptx on pretraining-style text (eq. 17) when `ppo.ptx_data` names a file: every token a
    target; a row without text is a DataError naming file and row. Default: the SFT split."""
    from stages.pipeline.ppo import ptx_examples
    from stages.compute.loading import DataError

    _, tokenizer, _ = tiny
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "The cat sat on the mat."}\n{"text": "Bread needs flour, water and time."}\n')
    cfg = load_config("tiny", [f"ppo.ptx_data={corpus}"])
    source, examples = ptx_examples(cfg, tokenizer, tmp_path)
    assert source == str(corpus.resolve()) and len(examples) == 2
    ids, labels = examples[1]
    assert ids == labels and tokenizer.decode(ids) == "Bread needs flour, water and time."
    corpus.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl, row 2: .*`text`"):
        ptx_examples(cfg, tokenizer, tmp_path)


# -- critic-free advantage estimators (stages/compute/ppo/advantages.py) ---------------------------------
@pytest.mark.parametrize("estimator, k", [("grpo", 4), ("rloo", 4), ("reinforce++", 1)])
def test_a_critic_free_estimator_raises_a_rule_reward_without_a_critic(tiny, tmp_path, estimator, k):
    trainer = make_trainer(tiny, f"ppo.advantage_estimator={estimator}", f"ppo.samples_per_prompt={k}", critic=None)
    assert trainer.critic is None and trainer.engines() == [trainer.actor]
    metrics = [trainer.step() for _ in range(30)]
    scores = [m["objective/scores"] for m in metrics]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.05, scores
    last_metrics = metrics[-1]
    assert not [name for name in last_metrics if name in ("loss/value_avg", "val/clipfrac_avg", "val/mean",
                                                           "val/explained_variance")]
    assert last_metrics["loss/policy_avg"] != 0 and math.isfinite(last_metrics["policy/grad_norm"])
    # 32 rows: 32 / k prompts, each sampled k times in adjacent rows, one group index per prompt.
    exp = trainer.last_experience
    assert exp.groups.tolist() == [i // k for i in range(32)]
    cursor, rows = trainer.cursor, trainer.next_prompts()
    assert len(rows) == 32 and all(rows[i] == rows[i - i % k] for i in range(32))
    assert trainer.cursor in (cursor + 32 // k, 32 // k)  # (or a new pass began)
    # No critic in the checkpoint; it resumes into a critic-free trainer.
    saved = trainer.save_checkpoint(tmp_path)
    files = {p.name for p in saved.iterdir()}
    assert "actor.safetensors" in files and not [name for name in files if name.startswith("critic")]
    resumed = make_trainer(tiny, f"ppo.advantage_estimator={estimator}", f"ppo.samples_per_prompt={k}", critic=None)
    resumed.load_checkpoint(saved)
    assert resumed.iteration == 30 and resumed.critic is None


def test_a_critic_exactly_when_the_estimator_needs_one(tiny):
    with pytest.raises(ValueError, match="advantage_estimator=reinforce\\+\\+ needs no critic"):
        make_trainer(tiny, "ppo.advantage_estimator=reinforce++")  # make_trainer's default builds one
    with pytest.raises(ValueError, match="advantage_estimator=gae needs a critic"):
        make_trainer(tiny, critic=None)
    with pytest.raises(ValueError, match="no critic stage to run"):
        make_trainer(tiny, "ppo.advantage_estimator=reinforce++", critic=None, train_actor=False)
    pretraining = make_trainer(tiny, "ppo.rollout_batch_size=8", "ppo.minibatch_size=8",
                               "ppo.generation.max_new_tokens=8", train_actor=False)  # gae: its critic alone
    assert pretraining.engines() == [pretraining.critic] and "loss/value_avg" in pretraining.step()


def test_an_estimator_and_a_policy_loss_registered_in_a_test_train(tiny, monkeypatch):
    """Adding an estimator or a policy loss is one function with its decorator: here, in this test,
    plain REINFORCE (the sequence reward on every token, no baseline) and an unclipped surrogate."""
    from stages.compute import losses
    from stages.compute.ppo import advantages

    monkeypatch.setattr(advantages, "ADVANTAGE_ESTIMATORS", dict(advantages.ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(losses, "POLICY_LOSSES", dict(losses.POLICY_LOSSES))

    @advantages.register_advantage_estimator("toy_reinforce", needs_critic=False)
    def toy_reinforce(inputs):
        return advantages.sequence_rewards(inputs)[:, None] * inputs.mask, None

    @losses.register_policy_loss("toy_unclipped")
    def toy_unclipped(logprobs, old_logprobs, adv, mask, ppo):
        ratio = torch.exp(logprobs - old_logprobs)
        return -masked_mean(ratio * adv, mask), {"ratio_max": ratio.detach().max()}

    trainer = make_trainer(tiny, "ppo.advantage_estimator=toy_reinforce", "ppo.policy_loss=toy_unclipped",
                           "ppo.rollout_batch_size=8", "ppo.minibatch_size=4", "ppo.generation.max_new_tokens=8",
                           critic=None)
    trainer.step()
    second = trainer.step()
    assert trainer.critic is None and second["policy/ratio_max_avg"] >= 1.0
    assert all(math.isfinite(v) for v in second.values()) and "loss/value_avg" not in second


def test_ppo_loads_no_critic_when_its_estimator_needs_none(tiny, monkeypatch):
    """load_models: the reward model always (scores, initial statistics), the critic only for an
    estimator that needs one; the stage's prepare fetches no critic for one that does not."""
    from stages.compute import model_loading
    from stages.pipeline import ppo as stage

    folder, _, _ = tiny
    loaded = []

    def fake_reward_model(path, model_cfg, dtype=None):
        loaded.append(path)
        return RewardModel(load_model(folder, model_cfg, dtype))

    monkeypatch.setattr(model_loading, "load_reward_model", fake_reward_model)
    monkeypatch.setattr(stage.tracking, "download", lambda uri, into: f"{into}/{uri}")
    inputs = {"sft_model_dir": folder, "reward_model_dir": "rm", "critic_model_dir": "critic"}
    for estimator, expected in (("gae", ["rm", "critic"]), ("reinforce++", ["rm"])):
        loaded.clear()
        cfg = load_config("tiny", [f"ppo.advantage_estimator={estimator}"])
        *_, critic, _ = model_loading.load_models(cfg, inputs, Dist())
        assert loaded == expected and (critic is None) == (estimator == "reinforce++")
        local = stage.prepare(cfg, {"splits": "s", "sft_model": "m", "reward_model": "r", "critic_model": "c"}, "here")
        assert ("critic_model_dir" in local) == (estimator == "gae")
