"""The static-buffer decode step (stages/compute/ppo/static_sampling.py, `llama.StaticDecoder`) samples what
the eager loop samples: on a CPU uncaptured, on a CUDA device replayed as a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.compute import models
from stages.compute.models import set_cuda_graphs, static_decoder_class
from stages.compute.models.llama import StaticDecoder
from stages.compute.models.shapes import bucket
from stages.compute.ppo import static_sampling
from stages.compute.ppo.experience import response_logits
from stages.compute.ppo.generation import generate, left_pad
from stages.leaves.logprobs import token_logprobs
from stages.orchestration.config_loading import load_config

# Eight rows: a batch bucket, so a graph's batch is not padded and draws what the eager loop draws.
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17], [18, 19, 20], [21, 22], [23], [24, 25, 26, 27]]
SAMPLINGS = [
    {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
    {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
    {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1},
]


def llama(device: str = "cpu", dtype: torch.dtype = torch.float32, eos_bias: float = 1.0) -> LlamaForCausalLM:
    """Peaked distributions, and EOS (2) raised by `eos_bias`: at 1.0 some rows end early, some run
    to the last step, in every sampling of SAMPLINGS."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(97))
    with torch.no_grad():
        model.lm_head.bias[2] = eos_bias
    return model.to(device=device, dtype=dtype).eval()


def eager_and_static(model, sampling: dict, *, device: str = "cpu", graph: bool = False, max_new_tokens: int = 20):
    torch.manual_seed(3)
    eager = generate(model, PROMPTS, eos_id=2, pad_id=0, max_new_tokens=max_new_tokens, device=device, **sampling)
    torch.manual_seed(3)
    with torch.inference_mode():
        static = static_sampling.sample(StaticDecoder, model, PROMPTS, eos_id=2, pad_id=0,
                                        max_new_tokens=max_new_tokens, device=device, graph=graph, **sampling)
    return eager, static


def response(rollout):
    return rollout.sequences[:, rollout.prompt_width :]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_static_step_samples_the_eager_loops_tokens_and_log_probabilities(sampling):
    """Same seed, same draws in the same order (one uniform per row and step): the same tokens; the
    log-probs differ only by the order of sums over the masked cache slots."""
    eager, static = eager_and_static(llama(), sampling)
    assert torch.equal(response(static), response(eager))
    assert torch.equal(static.response_mask, eager.response_mask)
    assert torch.equal(static.ended_with_eos, eager.ended_with_eos)
    assert eager.ended_with_eos.any() and not eager.ended_with_eos.all()  # rows end at different steps
    assert torch.allclose(static.logprobs, eager.logprobs, atol=1e-5)
    assert torch.allclose(static.model_logprobs, eager.model_logprobs, atol=1e-5)


def test_the_response_stops_where_the_last_row_ended():
    """Every row ends within a few steps: the static loop runs on to its next check, and the
    response is cut to the eager loop's width, not the steps it ran."""
    model = llama(eos_bias=3.0)
    eager, static = eager_and_static(model, SAMPLINGS[1], max_new_tokens=40)
    assert eager.response_mask.shape[1] < static_sampling.CHECK_EVERY
    assert torch.equal(response(static), response(eager))
    assert torch.equal(static.response_mask, eager.response_mask)


def test_a_reused_sampler_reads_the_weights_after_a_training_step():
    """A sampler kept for the next rollout (as on a graph) copies the changed weights into its stacked
    ones (`refresh`): its samples equal a fresh eager loop's on the changed model."""
    model = llama()
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    with torch.inference_mode():
        sampler = static_sampling.StaticSampler(StaticDecoder, model, len(PROMPTS), ids.shape[1], 12, 97, eos_id=2,
                                                pad_id=0, graph=False, **SAMPLINGS[0])
        before = sampler.run(ids, mask)["tokens"].clone()
    with torch.no_grad():
        for parameter in model.parameters():  # an in-place update, as the optimiser's
            parameter.add_(torch.randn_like(parameter) * 0.3)
    with torch.inference_mode():
        sampler.decoder.refresh()
        after = sampler.run(ids, mask)["tokens"].clone()
    eager = generate(model, PROMPTS, eos_id=2, pad_id=0, max_new_tokens=12, **SAMPLINGS[0])
    assert torch.equal(after[:, : response(eager).shape[1]], response(eager))
    assert not torch.equal(before, after)


def test_bucket_pads_to_powers_of_two_then_multiples_of_the_quantum():
    assert [bucket(n, quantum=64) for n in (1, 2, 3, 5, 16, 17, 64, 65, 128, 129, 300)] == \
        [1, 2, 4, 8, 16, 32, 64, 128, 128, 192, 320]
    assert {bucket(n, quantum=16) for n in range(1, 200)} == {1, 2, 4, 8, 16, *range(32, 209, 16)}
    with pytest.raises(ValueError, match="power of two"):
        bucket(10, quantum=48)
    with pytest.raises(ValueError, match="at least one"):
        bucket(0)


def test_cuda_graphs_follows_the_config_and_stays_off_on_a_cpu(tiny):
    from stages.compute.loading import load_model

    folder, _, _ = tiny
    for setting in ("auto", "off"):
        model = load_model(folder, load_config("tiny", [f"model.cuda_graphs={setting}"]).model)
        assert static_decoder_class(model, "cpu") is None  # the eager decoder, whose attention reads the filled slots only
        assert (static_decoder_class(model, "cuda") is StaticDecoder) == (setting == "auto")
    models.set_fast_path(model, "off")
    set_cuda_graphs(model, "auto")
    assert static_decoder_class(model, "cuda") is None  # a static step needs the fast path's decoder
    with pytest.raises(ValueError, match="expected auto or off"):
        set_cuda_graphs(model, "on")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replayed_decode_equals_the_eager_loop_on_cuda(sampling, dtype):
    """On a GPU the step is captured once and replayed: greedy tokens equal the eager loop's; sampled
    log-probs equal a full forward's over the sampled sequences (the eager test's check), within
    fp32 rounding or `val/logprob_diff`'s bf16 tolerance (the graph's random draws need not be the
    eager loop's)."""
    model = llama("cuda", dtype)
    eager, static = eager_and_static(model, sampling, device="cuda", graph=True)
    sampler = next(iter(model.__dict__[static_sampling.SAMPLERS_ATTRIBUTE].values()))
    assert sampler.graph is not None
    if not sampling["do_sample"]:
        assert torch.equal(response(static), response(eager))
    with torch.no_grad():
        logits = response_logits(model, static.sequences, static.attention_mask, static.prompt_width)
    full = token_logprobs(logits, response(static), sampling["temperature"]) * static.response_mask
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(static.logprobs, full, atol=tolerance), (static.logprobs - full).abs().max()
    assert static.response_mask.sum() > len(PROMPTS)
    _, again = eager_and_static(model, sampling, device="cuda", graph=True)  # the captured graph, replayed again
    assert len(model.__dict__[static_sampling.SAMPLERS_ATTRIBUTE]) == 1
    if not sampling["do_sample"]:
        assert torch.equal(response(again), response(static))


@pytest.mark.parametrize("from_position", [0, 7])
def test_a_batch_padded_to_its_bucket_length_gives_the_same_hidden_states_and_gradients(from_position):
    """On a GPU the fast path right-pads a batch to its bucket length (`bucketed`); the extra pads
    change no hidden state and no gradient."""
    model = llama()
    ids = torch.randint(3, 97, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded prompt
    mask[1, -3:] = 0  # an early EOS
    hidden = {}
    grads = {}
    for bucketed in (False, True):
        hidden[bucketed] = models.last_hidden_state(model.base_model, ids, mask, from_position, bucketed=bucketed)
        grads[bucketed] = torch.autograd.grad(hidden[bucketed].square().sum(), list(model.base_model.parameters()))
    assert hidden[True].shape == hidden[False].shape == (3, 11 - from_position, 48)
    assert torch.allclose(hidden[True], hidden[False], atol=1e-5)
    for with_pads, without in zip(grads[True], grads[False]):
        assert torch.allclose(with_pads, without, atol=1e-5, rtol=1e-4)
