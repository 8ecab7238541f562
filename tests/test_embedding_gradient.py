"""The fast path's input embedding gradient added into `.grad` in place (stages/compute/models/embedding.py)
is autograd's: tied to the LM head or not, over micro-batches, with the padding row untrained."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.compute.models import last_hidden_state, set_fast_path
from stages.compute.models.embedding import IN_PLACE_ATTRIBUTE, add_gradients_in_place
from stages.compute.training import PlainEngine, linear_warmup

PAD = 5
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # PlainEngine turns it on on both


def tied_llama(dtype: torch.dtype, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         pad_token_id=PAD))
    set_fast_path(model, "auto")
    return model.to(device=device, dtype=dtype)


def micro_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (4, 9), generator=generator)  # a small range: every token comes many times
    ids[:, 3] = PAD  # the pad token as a real token (SmolLM2's pad is a token it reads) never trains its row
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return ids, mask


def graph_nodes(tensor: torch.Tensor) -> set[str]:
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def backward(model: LlamaForCausalLM, micro_batches: int, lm_head: bool) -> set[str]:
    device = model.device
    for seed in range(micro_batches):
        ids, mask = (tensor.to(device) for tensor in micro_batch(seed))
        hidden = last_hidden_state(model.base_model, ids, mask)
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(10 + seed)).to(device, hidden.dtype)
        loss = (hidden.float() * weights.float()).sum()
        if lm_head:  # the LM loss on some rows, through the tied head (as the reward model's and the actor's)
            logits = model.lm_head(hidden[mask.bool()][::2]).float()
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[mask.bool()][::2], reduction="sum")
        loss.backward()
    return graph_nodes(loss)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("lm_head", [True, False])
def test_the_embedding_gradient_added_in_place_is_autograds(device, dtype, micro_batches, lm_head):
    autograds, ours = tied_llama(dtype, device), tied_llama(dtype, device)
    add_gradients_in_place(ours)
    assert ours.lm_head.weight is ours.get_input_embeddings().weight
    assert "LookupWithGradientInPlaceBackward" not in backward(autograds, micro_batches, lm_head)
    assert "LookupWithGradientInPlaceBackward" in backward(ours, micro_batches, lm_head)
    embedding = ours.get_input_embeddings().weight.grad
    assert embedding.dtype == dtype
    rows_with_gradient = embedding.abs().sum(dim=1).count_nonzero()
    if lm_head:
        assert rows_with_gradient == 97  # the head's softmax reaches every row
    else:  # the looked-up tokens' rows, less the padding row (nn.Embedding's padding_idx)
        looked_up = {token for seed in range(micro_batches) for ids, mask in [micro_batch(seed)]
                     for token in ids[mask.bool()].tolist()}
        assert PAD in looked_up and rows_with_gradient == len(looked_up) - 1
        assert embedding[PAD].abs().max() == 0
    for (name, expected), ours_parameter in zip(autograds.named_parameters(), ours.parameters()):
        scale = expected.grad.float().abs().max()
        error = (ours_parameter.grad.float() - expected.grad.float()).abs().max()
        if dtype == torch.float32:
            # The same sums up to their order, which on a GPU is the atomics' (run to run): a row whose
            # terms cancel differs by ulps of its largest terms, not of itself, so the bound is on the
            # scale of the gradient (seen on an H200: 8.6e-8 of it; a missing or doubled term is ~1e-2).
            assert error <= 1e-6 * scale, name
        else:  # ours rounds each row's sum to bf16 once, autograd's sum of bf16 rows rounds at every term
            assert error <= 1e-2 * scale, name


def test_the_plain_engine_turns_the_in_place_gradient_on():
    model = tied_llama(torch.float32)
    assert not getattr(model.get_input_embeddings(), IN_PLACE_ATTRIBUTE, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    PlainEngine(model, optimizer, linear_warmup(optimizer, 0), grad_accum_steps=1, max_grad_norm=1.0)
    assert getattr(model.get_input_embeddings(), IN_PLACE_ATTRIBUTE)


def test_without_gradients_the_lookup_is_the_modules():
    model = tied_llama(torch.float32)
    add_gradients_in_place(model)
    ids, mask = micro_batch(0)
    with torch.no_grad():
        hidden = last_hidden_state(model.base_model, ids, mask)
    assert hidden.grad_fn is None
