"""The fast paths (stages/compute/models, `model.fast_path: auto`) compute what the plain path (`off`,
each model's own transformers forward) does; log π_old taken from the sampling loop equals a full
forward's."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import greedy_one_minibatch_trainer
from transformers import LlamaConfig, LlamaForCausalLM

from stages.compute import models
from stages.compute.loading import load_model
from stages.compute.models import CachedDecoder, last_hidden_state, set_fast_path
from stages.compute.models.llama import Decoder as LlamaDecoder
from stages.compute.ppo.experience import response_logits
from stages.compute.ppo.generation import generate, left_pad
from stages.leaves.logprobs import token_logprobs
from stages.orchestration.config_loading import load_config


def small_llama(fast_path: str = "auto", **extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, **extra))
    set_fast_path(model, fast_path)
    return model


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 97, (4, 11))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding (a short prompt)
    mask[1, -4:] = 0  # right padding (an early EOS)
    mask[2, :2] = 0
    mask[2, -3:] = 0  # both
    return ids, mask


@pytest.mark.parametrize("from_position", [0, 4, 10])  # 10: a row whose kept positions are all padding
def test_the_padding_free_forward_gives_the_plain_paths_hidden_states_and_gradients(from_position):
    ids, mask = padded_batch()
    real = mask.bool()[:, from_position:, None]
    plain, fast = small_llama("off"), small_llama("auto")  # the same weights (seed 0)
    own = last_hidden_state(plain.base_model, ids, mask, from_position=from_position)
    ours = last_hidden_state(fast.base_model, ids, mask, from_position=from_position)
    assert ours.shape == own.shape
    assert torch.allclose(own * real, ours, atol=1e-5)
    assert ours.masked_select(~real).abs().max() == 0  # the fast path: pads are never computed
    assert own.masked_select(~real).abs().max() > 0  # the plain path computes them too
    weights = torch.randn_like(own) * real
    own_grads = torch.autograd.grad((own * weights).sum(), list(plain.base_model.parameters()))
    our_grads = torch.autograd.grad((ours * weights).sum(), list(fast.base_model.parameters()))
    for own_grad, our_grad in zip(own_grads, our_grads):
        assert torch.isfinite(our_grad).all()
        assert torch.allclose(own_grad, our_grad, atol=1e-5, rtol=1e-4)


def test_model_fast_path_from_the_config_chooses_the_path(tiny):
    folder, _, _ = tiny
    ids, mask = padded_batch()
    for setting in ("auto", "off"):
        model = load_model(folder, load_config("tiny", [f"model.fast_path={setting}"]).model)
        assert models.fast_path(model.base_model) is (models.FAST_PATHS["llama"] if setting == "auto" else None)
        hidden = last_hidden_state(model.base_model, ids, mask)
        assert (hidden.masked_select(~mask.bool()[..., None]).abs().max() == 0) == (setting == "auto")
        decoder = models.decoder(model.eval(), *left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu"), 4)
        assert isinstance(decoder, LlamaDecoder if setting == "auto" else CachedDecoder)


def test_other_architectures_take_their_own_forward():
    model = small_llama()
    model.config.model_type = "not-llama"  # e.g. a model whose layers no fast path knows
    ids, mask = padded_batch()
    hidden = last_hidden_state(model.base_model, ids, mask)
    assert hidden.masked_select(~mask.bool()[..., None]).abs().max() > 0  # the model's own: pads computed too
    assert isinstance(models.decoder(model.eval(), ids, mask, 3), CachedDecoder)


def test_a_ppo_step_is_the_same_on_the_fast_and_the_plain_path(tiny):
    """One greedy PPO iteration with model.fast_path auto against off: the same rollout, losses and update."""
    results = {}
    for setting in ("auto", "off"):
        trainer = greedy_one_minibatch_trainer(tiny, f"model.fast_path={setting}")
        metrics = trainer.step()
        results[setting] = (metrics, trainer.last_experience.sequences,
                            [p.detach().clone() for p in trainer.actor.module.parameters()])
    (fast, fast_sequences, fast_actor), (plain, plain_sequences, plain_actor) = results["auto"], results["off"]
    assert torch.equal(fast_sequences, plain_sequences)
    for name in ("objective/scores", "objective/kl", "loss/value_avg", "loss/policy_avg", "policy/grad_norm",
                 "val/explained_variance"):
        assert fast[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), name
    # Adam's first step moves a weight by about lr whatever the gradient's size, so float rounding
    # in a near-zero gradient shows up in the weights: 1 % of a step is the same update.
    step = trainer.ppo.actor_lr
    for a, b in zip(fast_actor, plain_actor):
        assert torch.allclose(a, b, atol=0.01 * step), (a - b).abs().max()


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
    model = small_llama(**extra).eval()
    for parameter in model.parameters():  # weights far from init's near-uniform attention; biases ≠ 0
        torch.nn.init.normal_(parameter, std=0.3)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]], pad_id=0, device="cpu")
    ours = models.decoder(model, ids, mask, 6)
    set_fast_path(model, "off")
    theirs = models.decoder(model, ids, mask, 6)
    assert isinstance(ours, LlamaDecoder) and isinstance(theirs, CachedDecoder)
    a, b = ours.prefill(), theirs.prefill()
    assert torch.allclose(a, b, atol=1e-4) and a.std() > 0.3
    for tokens in ([20, 21, 22], [2, 30, 31], [40, 41, 42], [50, 51, 52], [60, 61, 62]):
        token = torch.tensor(tokens)
        a, b = ours.step(token), theirs.step(token)
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


@torch.no_grad()
def test_bf16_decode_steps_on_onednn_packed_weights_give_the_plain_products_logits(monkeypatch):
    """In bf16 the decoder packs its weights in oneDNN's blocked layout (`llama.PackedLinear`);
    its logits must be those of the same decoder on the plain weights."""
    from stages.compute.models import llama

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("this CPU or torch build has no oneDNN bf16: nothing is packed")
    model = small_llama().eval()
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model = model.to(torch.bfloat16)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]], pad_id=0, device="cpu")
    packed = LlamaDecoder(model, ids, mask, 4)
    linears = [packed.lm_head] + [l for layer in packed.layers for l in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(linear.packed is not None and linear.packed.is_mkldnn for linear in linears)
    monkeypatch.setattr(llama, "pack", lambda weight, batch: None)
    plain = LlamaDecoder(model, ids, mask, 4)
    assert plain.lm_head.packed is None
    pairs = [(packed.prefill(), plain.prefill())]
    for tokens in ([20, 21, 22], [2, 30, 31], [40, 41, 42]):
        pairs.append((packed.step(torch.tensor(tokens)), plain.step(torch.tensor(tokens))))
    for a, b in pairs:
        assert a.dtype == torch.bfloat16 and b.float().std() > 0.3
        torch.testing.assert_close(a, b, atol=0, rtol=0)


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


def test_inverse_cdf_sampling_draws_from_the_distribution():
    from stages.compute.ppo.generation import next_tokens

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


@pytest.mark.parametrize("form", ["explicit", "expanded"])
def test_the_explicit_and_expanded_attention_equal_sdpa_over_grouped_query_heads(form):
    """The forms of `llama.attention` that the padding-free forward uses in bf16 on a CPU under
    autograd (explicit products) and on a GPU (keys and values expanded to every query head, no
    cuDNN), against SDPA's grouped-query form: output and gradients, with a padded causal mask."""
    from stages.compute.models.llama import expanded_attention, explicit_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    allowed = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    allowed[0, :, :, :2] = False  # two left pads in row 0 ...
    allowed[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # ... which attend to themselves only
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.float64).masked_fill_(~allowed, -torch.inf)
    grad = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    ours = {"explicit": explicit_attention, "expanded": expanded_attention}[form](q, k, v, mask, 0.3)
    torch.testing.assert_close(ours, sdpa)
    for theirs, mine in zip(torch.autograd.grad(sdpa, (q, k, v), grad), torch.autograd.grad(ours, (q, k, v), grad)):
        torch.testing.assert_close(mine, theirs)


def test_the_explicit_attention_keeps_no_copy_of_its_scores_for_the_backward():
    """The mask goes onto the scores in place; through a view of them autograd records CopySlices,
    whose backward copies and zero-fills the whole [batch, heads, queries, keys] tensor."""
    from stages.compute.models.llama import explicit_attention

    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(2))
    mask = torch.zeros(2, 1, 6, 6).masked_fill_(~torch.ones(6, 6, dtype=torch.bool).tril(), -torch.inf)
    seen, nodes = set(), [explicit_attention(q, k, v, mask, 0.3).grad_fn]
    while nodes:
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.extend(next_node for next_node, _ in node.next_functions)
    assert not [node.name() for node in seen if "CopySlices" in node.name() or "AsStrided" in node.name()]


def test_the_explicit_attentions_mask_made_once_serves_every_layer_and_the_shorter_last_one():
    """A forward's layers share one expanded mask; its last layer, with the queries of
    from_position on only, gets its own."""
    from stages.compute.models.llama import explicit_attention

    torch.manual_seed(1)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    allowed[1, :, :, 4:] = torch.eye(6, dtype=torch.bool)[:, 4:]  # two right pads in row 1, attending to themselves
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.float64).masked_fill_(~allowed, -torch.inf)
    cache: dict = {}
    for queries in (6, 6, 2):
        q = torch.randn(2, 4, queries, 8, dtype=torch.float64)
        k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(2))
        rows = mask[..., -queries:, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rows, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(explicit_attention(q, k, v, rows, 0.3, cache), sdpa)
    assert len(cache) == 2
