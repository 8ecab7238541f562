"""The PPO speed paths compute what the plain ones do: the padding-free forward, log π_old taken
from the sampling loop, and V_old taken from the critic's training forward."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import greedy_one_minibatch_trainer
from transformers import LlamaConfig, LlamaForCausalLM

from stages.ppo.experience import response_logits
from stages.ppo.generation import generate, token_logprobs
from stages.unpadded import last_hidden_state, position_ids


def small_llama(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, **extra))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 97, (4, 11))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding (a short prompt)
    mask[1, -4:] = 0  # right padding (an early EOS)
    mask[2, :2] = 0
    mask[2, -3:] = 0  # both
    return ids, mask


@pytest.mark.parametrize("from_position", [0, 4, 10])  # 10: a row whose kept positions are all padding
def test_the_padding_free_forward_gives_the_models_own_hidden_states_and_gradients(from_position):
    model = small_llama()
    ids, mask = padded_batch()
    real = mask.bool()[:, from_position:, None]
    own = model.base_model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                           use_cache=False).last_hidden_state[:, from_position:]
    ours = last_hidden_state(model.base_model, ids, mask, from_position=from_position)
    assert ours.shape == own.shape
    assert torch.allclose(own * real, ours, atol=1e-5)
    assert ours.masked_select(~real).abs().max() == 0
    weights = torch.randn_like(own) * real
    own_grads = torch.autograd.grad((own * weights).sum(), list(model.base_model.parameters()))
    our_grads = torch.autograd.grad((ours * weights).sum(), list(model.base_model.parameters()))
    for own_grad, our_grad in zip(own_grads, our_grads):
        assert torch.isfinite(our_grad).all()
        assert torch.allclose(own_grad, our_grad, atol=1e-5, rtol=1e-4)


def test_a_prefix_of_keys_and_values_with_its_graph_stands_in_for_the_prompt_positions():
    """The PPO actor's training forward over the response positions only, on the prefill's graph:
    the same hidden states and the same gradients as the forward over all positions."""
    model = small_llama()
    ids, mask = padded_batch()
    mask[:, 5] = 1  # prompts end at position 5, as left-padded prompts do
    start = 6
    real = mask.bool()[:, start:, None]
    whole = last_hidden_state(model.base_model, ids, mask, from_position=start)
    prefix: list = []
    last_prompt = last_hidden_state(model.base_model, ids[:, :start], mask[:, :start], keys_values=prefix,
                                    from_position=start - 1)
    rest = last_hidden_state(model.base_model, ids, mask, from_position=start, prefix=prefix)
    assert rest.shape == whole.shape
    assert torch.allclose(whole, rest, atol=1e-5)
    assert rest.masked_select(~real).abs().max() == 0
    before = last_hidden_state(model.base_model, ids, mask, from_position=start - 1)[:, :1]
    assert torch.allclose(before, last_prompt, atol=1e-5)
    weights = torch.randn_like(whole) * real
    parameters = list(model.base_model.parameters())
    whole_grads = torch.autograd.grad((whole * weights).sum() + before.sum(), parameters)
    rest_grads = torch.autograd.grad((rest * weights).sum() + last_prompt.sum(), parameters)
    for whole_grad, rest_grad in zip(whole_grads, rest_grads):
        assert torch.allclose(whole_grad, rest_grad, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="inside the 6 prefix positions"):
        last_hidden_state(model.base_model, ids, mask, from_position=start - 1, prefix=prefix)


def test_other_architectures_take_their_own_forward():
    model = small_llama()
    model.config.model_type = "not-llama"  # e.g. a model whose layers this module does not know
    ids, mask = padded_batch()
    hidden = last_hidden_state(model.base_model, ids, mask)
    assert hidden.masked_select(~mask.bool()[..., None]).abs().max() > 0  # the model's own: pads computed too


@pytest.mark.parametrize("sampling", [
    {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
    {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1},
    {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
])
def test_sampled_log_probabilities_equal_a_full_forward(sampling):
    model = small_llama().eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    torch.manual_seed(1)
    rollout = generate(model, prompts, eos_id=2, pad_id=0, max_new_tokens=9, **sampling)
    with torch.no_grad():
        logits = response_logits(model, rollout.sequences, rollout.attention_mask, rollout.prompt_width)
    full = token_logprobs(logits, rollout.sequences[:, rollout.prompt_width :], sampling["temperature"])
    assert torch.allclose(rollout.logprobs, full * rollout.response_mask, atol=1e-4)
    assert rollout.response_mask.sum() > 0


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True, "mlp_bias": True}])
@torch.no_grad()
def test_our_llama_decode_steps_give_transformers_logits(extra):
    """Prefill and decode steps of our Llama decoder (fused, packed weights; attention over the
    filled cache) against transformers' forward over its static cache, on left-padded prompts."""
    from stages.ppo.decoding import CachedDecoder, LlamaDecoder, decoder
    from stages.ppo.generation import left_pad

    model = small_llama(**extra).eval()
    for parameter in model.parameters():  # weights far from init's near-uniform attention; biases ≠ 0
        torch.nn.init.normal_(parameter, std=0.3)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]], pad_id=0, device="cpu")
    ours, theirs = LlamaDecoder(model, ids, mask, 6), CachedDecoder(model, ids, mask, 6)
    assert isinstance(decoder(model, ids, mask, 6), LlamaDecoder)
    (a, _), (b, _) = ours.prefill(), theirs.prefill()
    assert torch.allclose(a, b, atol=1e-4) and a.std() > 0.3
    for tokens in ([20, 21, 22], [2, 30, 31], [40, 41, 42], [50, 51, 52], [60, 61, 62]):
        token = torch.tensor(tokens)
        a, b = ours.step(token), theirs.step(token)
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    model.config.model_type = "not-llama"
    assert isinstance(decoder(model, ids, mask, 6), CachedDecoder)


def test_greedy_sampling_with_a_repetition_penalty_matches_transformers_on_generated_tokens():
    """transformers' repetition-penalty processor given the generated tokens only (the prompt's are
    not penalised, paper §6.1), one full forward per step: the same tokens as our cached loop."""
    from transformers import RepetitionPenaltyLogitsProcessor

    model = small_llama().eval()
    prompt = [5, 6, 7, 5, 6, 7]
    rollout = generate(model, [prompt], eos_id=96, pad_id=0, max_new_tokens=12, do_sample=False, temperature=1.0,
                       top_p=1.0, top_k=0, repetition_penalty=1.3)
    penalty, generated = RepetitionPenaltyLogitsProcessor(1.3), []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([prompt + generated])).logits[:, -1]
            if generated:
                logits = penalty(torch.tensor([generated]), logits)
            generated.append(int(logits.argmax()))
    assert rollout.sequences[0, len(prompt) :].tolist() == generated


def _bias_only_llama(bias: dict[int, float]) -> LlamaForCausalLM:
    """Logits = a fixed bias at every step, whatever the context."""
    model = small_llama().eval()
    model.lm_head = torch.nn.Linear(48, 97)
    torch.nn.init.zeros_(model.lm_head.weight)
    torch.nn.init.zeros_(model.lm_head.bias)
    for token, value in bias.items():
        model.lm_head.bias.data[token] = value
    return model


def test_repetition_penalty_ignores_prompt_tokens_and_pads():
    """Token 5 is the favourite (logit 4.0, penalised 4.0 / 1.3 ≈ 3.08 < 3.5, token 6's). Only in
    the prompt, or as a left pad of a shorter prompt, it is not penalised: the first token is 5;
    once generated it is, so the second is 6."""
    model = _bias_only_llama({5: 4.0, 6: 3.5})
    greedy = dict(eos_id=96, max_new_tokens=2, do_sample=False, temperature=1.0, top_p=1.0, top_k=0,
                  repetition_penalty=1.3)
    rollout = generate(model, [[5, 5, 5]], pad_id=0, **greedy)
    assert rollout.sequences[0, 3:].tolist() == [5, 6]
    rollout = generate(model, [[7, 8, 9], [9]], pad_id=5, **greedy)  # row 1 is left-padded with 5s
    assert rollout.sequences[:, 3:].tolist() == [[5, 6], [5, 6]]


def test_generation_stops_when_every_row_has_ended_and_masks_after_eos():
    model = small_llama().eval()
    model.lm_head = torch.nn.Linear(48, 97)  # logits = bias: EOS (2) has p ≈ 0.36 at every step
    torch.nn.init.zeros_(model.lm_head.weight)
    torch.nn.init.zeros_(model.lm_head.bias)
    model.lm_head.bias.data[2] = 4.0
    torch.manual_seed(0)
    rollout = generate(model, [[5, 6], [7, 8, 9], [10]], eos_id=2, pad_id=0, max_new_tokens=40, do_sample=True,
                       temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    response = rollout.sequences[:, rollout.prompt_width :]
    lengths = rollout.response_mask.sum(1).long()
    assert rollout.ended_with_eos.all() and response.shape[1] == lengths.max() < 40  # no step after the last EOS
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps
    assert (response[torch.arange(3), lengths - 1] == 2).all()
    after = rollout.response_mask == 0
    assert (response[after] == 0).all() and (rollout.logprobs[after] == 0).all()


def test_values_from_the_training_forward_give_the_same_update(tiny):
    """One epoch, one minibatch: V_old from the critic's training forward, or from a forward of
    its own in the rollout: the same losses and the same weights after the step."""
    results = []
    for in_training in (True, False):
        trainer = greedy_one_minibatch_trainer(tiny, "ppo.ppo_epochs=1")
        assert trainer.values_in_training
        trainer.values_in_training = in_training
        metrics = trainer.step()
        assert ("time/values" in metrics) != in_training  # the rollout skipped the critic's forward
        results.append((metrics, [p.detach().clone() for p in trainer.critic.module.parameters()],
                        [p.detach().clone() for p in trainer.actor.module.parameters()]))
    (fused, critic_a, actor_a), (plain, critic_b, actor_b) = results
    for name in ("loss/value_avg", "loss/policy_avg", "val/explained_variance", "objective/kl", "policy/grad_norm"):
        assert fused[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), name
    # Adam's first step moves a weight by about lr whatever the gradient's size, so float rounding
    # in a near-zero gradient shows up in the weights: 1 % of a step is the same update.
    step = trainer.ppo.actor_lr
    assert step == trainer.ppo.critic_lr
    for a, b in zip(critic_a + actor_a, critic_b + actor_b):
        assert torch.allclose(a, b, atol=0.01 * step), (a - b).abs().max()


def test_the_prefills_graph_in_the_actors_training_forward_gives_the_same_update(tiny):
    """One epoch, one minibatch: the actor's training forward runs the response positions only, on
    the graph its rollout's prefill kept, or runs the whole sequences: the same update."""
    trainer = greedy_one_minibatch_trainer(tiny, "ppo.ppo_epochs=1")
    assert trainer.prompt_pass_in_training
    exp, _, _ = trainer.rollout(trainer.next_prompts(), with_values=False, keep_prompt_graph=True)
    assert exp.prompt_pass.last_hidden.requires_grad and len(exp.prompt_pass.keys_values) == 2
    assert exp.rows(torch.arange(2)).prompt_pass is None
    results = []
    for reuse in (True, False):
        trainer = greedy_one_minibatch_trainer(tiny, "ppo.ppo_epochs=1")
        trainer.prompt_pass_in_training = reuse
        metrics = trainer.step()
        assert trainer.last_experience.prompt_pass is None  # freed with its graph
        results.append((metrics, [p.detach().clone() for p in trainer.actor.module.parameters()]))
    (reused, actor_a), (plain, actor_b) = results
    for name in ("loss/policy_avg", "policy/approxkl_avg", "policy/entropy_avg", "policy/grad_norm"):
        assert reused[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), name
    step = trainer.ppo.actor_lr  # 1 % of an Adam step: the same update (see the test above)
    for a, b in zip(actor_a, actor_b):
        assert torch.allclose(a, b, atol=0.01 * step), (a - b).abs().max()


def test_inverse_cdf_sampling_draws_from_the_distribution():
    from stages.ppo.generation import next_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 20) * 2
    logits[:, 5] = -torch.inf  # a token top-p/top-k removed: never drawn
    counts = torch.zeros(3, 20)
    draws = 4000
    for _ in range(draws):
        token = next_tokens(logits, None, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, do_sample=True)
        counts[torch.arange(3), token] += 1
    assert counts[:, 5].sum() == 0
    assert (counts / draws - logits.softmax(-1)).abs().max() < 0.03  # ~4 standard errors at p = 0.5


def test_the_entropy_bonus_reaches_the_actor_only_when_its_coefficient_is_set(tiny):
    """Without a bonus the entropy is a statistic computed without a graph; with one it moves the actor."""
    runs = {}
    for coef in ("0.0", "0.5"):
        trainer = greedy_one_minibatch_trainer(tiny, f"ppo.entropy_coef={coef}")
        metrics = trainer.step()
        runs[coef] = (metrics, [p.detach().clone() for p in trainer.actor.module.parameters()])
    (plain, plain_actor), (bonus, bonus_actor) = runs["0.0"], runs["0.5"]
    assert plain["policy/entropy_avg"] == pytest.approx(bonus["policy/entropy_avg"], rel=1e-6)
    assert plain["policy/entropy_avg"] > 0
    assert any(not torch.allclose(a, b) for a, b in zip(plain_actor, bonus_actor))
