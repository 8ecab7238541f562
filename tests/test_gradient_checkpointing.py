"""`model.gradient_checkpointing`: one switch with one meaning for every trained model (the SFT
policy, the reward model, the critic and the PPO actor): the same losses and gradients on the same
batch, with fewer tensors kept for the backward pass."""

from __future__ import annotations

import pytest
import torch

from stages.compute import model_loading
from stages.leaves.config import ConfigError
from stages.leaves.logprobs import token_logprobs
from stages.leaves.rendering import collate
from stages.orchestration.config_loading import load_config, upgrade_recorded
from stages.orchestration.launch import Dist
from stages.pipeline.sft import response_nll

SWITCHES = ("model.fast_path=off",)  # transformers' forward both ways: the switch alone differs


def batch_of(tiny, rows: int = 4) -> dict[str, torch.Tensor]:
    _, tokenizer, prompts = tiny
    return collate([(ids, ids) for ids in prompts[:rows]], tokenizer.pad_token_id)


def loss_gradients_and_saved(model, loss_of) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, every gradient by parameter name, tensors the forward kept for the backward)."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss), gradients, sum(saved)


def assert_same(off, on) -> None:
    (loss_off, grads_off, saved_off), (loss_on, grads_on, saved_on) = off, on
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert saved_on < saved_off / 2  # checkpointed: each layer's input kept, its insides recomputed


def test_sft_policy_checkpointed_has_the_same_loss_and_gradients(tiny):
    folder = tiny[0]
    batch = batch_of(tiny)
    results = []
    for switch in ("false", "true"):
        cfg = load_config("tiny", [*SWITCHES, f"model.gradient_checkpointing={switch}"])
        model = model_loading.trained_lm(folder, cfg.model, "cpu")
        assert model.model.gradient_checkpointing == (switch == "true")
        results.append(loss_gradients_and_saved(model, lambda m: response_nll(m, batch)[0]))
    assert_same(*results)


def test_reward_model_checkpointed_has_the_same_loss_and_gradients(tiny):
    folder = tiny[0]
    batch = batch_of(tiny)
    lm_labels = batch["labels"].clone()
    lm_labels[2:] = -100  # the first rows are the "chosen" ones the LM term reads

    def loss_of(model):
        rewards, (logits, targets) = model(batch["input_ids"], batch["attention_mask"], lm_labels=lm_labels)
        return rewards.sum() + torch.nn.functional.cross_entropy(logits.float(), targets)

    results = []
    for switch in ("false", "true"):
        cfg = load_config("tiny", [*SWITCHES, f"model.gradient_checkpointing={switch}"])
        torch.manual_seed(0)  # the same fresh scalar head
        model = model_loading.trained_reward_model(folder, cfg.model, "cpu")
        results.append(loss_gradients_and_saved(model, loss_of))
    assert_same(*results)


def test_ppo_actor_and_critic_checkpointed_have_the_same_losses_and_gradients(tiny, reward_model_dir):
    """PPO's load_models checkpoints the two models it trains, not the frozen reference and reward model."""
    batch = batch_of(tiny)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def actor_loss(actor):
        logits = actor(input_ids=ids, attention_mask=mask).logits[:, :-1]
        return -(token_logprobs(logits, ids[:, 1:], 1.0) * mask[:, 1:]).sum()

    def critic_loss(critic):
        values, _ = critic(ids, mask)
        return (values ** 2).sum()

    actors, critics = [], []
    for switch in ("false", "true"):
        cfg = load_config("tiny", [*SWITCHES, f"model.gradient_checkpointing={switch}", "ppo.advantage_estimator=gae"])
        inputs = {"sft_model_dir": tiny[0], "reward_model_dir": reward_model_dir}
        _, actor, reference, reward_model, critic, _ = model_loading.load_models(cfg, inputs, Dist())
        assert actor.model.gradient_checkpointing == critic.lm.model.gradient_checkpointing == (switch == "true")
        assert not reference.model.gradient_checkpointing and not reward_model.lm.model.gradient_checkpointing
        actors.append(loss_gradients_and_saved(actor, actor_loss))
        critics.append(loss_gradients_and_saved(critic, critic_loss))
    assert_same(*actors)
    assert_same(*critics)


def test_the_sft_switch_names_the_one_for_every_model():
    """sft.gradient_checkpointing is the model-wide switch: a config naming the old key is told
    the new one, and a recorded run resumes with the value it had."""
    with pytest.raises(ConfigError, match="'sft.gradient_checkpointing' was renamed to 'model.gradient_checkpointing'"):
        load_config("tiny", ["sft.gradient_checkpointing=true"])
    assert upgrade_recorded({"sft": {"gradient_checkpointing": True}}) == {"sft": {}, "model": {"gradient_checkpointing": True}}
