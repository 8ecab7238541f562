"""stages.leaves.logprobs: log π(a | s) and H(π(· | s)) in chunks of rows, with their own backward,
against the whole-matrix formulas under autograd."""

from __future__ import annotations

import pytest
import torch

from stages.leaves import logprobs as chunked
from stages.leaves.logprobs import logprobs_and_entropy, token_logprobs

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # each device has its own chunk size


def small_chunks(monkeypatch, rows: int, vocab: int) -> None:
    """Chunks of `rows` rows on every device, so that rows cross chunk edges."""
    for name in ("CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS"):
        monkeypatch.setattr(chunked, name, rows * vocab)


def whole_matrix(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_pi.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("differentiated", ["both", "logprobs", "entropy"])
def test_chunked_logprobs_and_entropy_and_their_gradients_equal_the_whole_matrix_formulas(monkeypatch, temperature,
                                                                                          differentiated, device):
    small_chunks(monkeypatch, 3, 37)  # chunks of 3 rows: 7 rows cross chunk edges
    torch.manual_seed(0)
    logits = (torch.randn(7, 37, dtype=torch.float64) * 4).to(device).requires_grad_()
    tokens = torch.randint(0, 37, (7,)).to(device)
    weights = torch.randn(2, 7, dtype=torch.float64).to(device)
    results = {}
    for name, function in (("whole", whole_matrix), ("chunked", logprobs_and_entropy)):
        logprobs, entropy = function(logits, tokens, temperature)
        loss = (logprobs.double() * weights[0]).sum() * (differentiated != "entropy")
        loss = loss + (entropy.double() * weights[1]).sum() * (differentiated != "logprobs")
        results[name] = (logprobs.detach(), entropy.detach(), torch.autograd.grad(loss, logits)[0])
    for whole, ours in zip(results["whole"], results["chunked"]):
        torch.testing.assert_close(ours.double(), whole.double(), atol=2e-6, rtol=1e-5)
    assert results["chunked"][2].abs().max() > 0


def test_a_bf16_logits_matrix_gets_a_bf16_gradient_and_fp32_outputs():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 11).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 11, (2, 5))
    logprobs, entropy = logprobs_and_entropy(logits, tokens, 0.7)
    assert logprobs.shape == entropy.shape == (2, 5) and logprobs.dtype == entropy.dtype == torch.float32
    expected = whole_matrix(logits.detach(), tokens, 0.7)
    torch.testing.assert_close(logprobs.detach(), expected[0])
    torch.testing.assert_close(entropy.detach(), expected[1])
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    assert grad.dtype == torch.bfloat16


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_alone_and_its_gradient_equal_the_whole_matrix_formula(monkeypatch, temperature):
    """`token_logprobs` skips the entropy: the same log π and gradient as the whole-matrix formula."""
    small_chunks(monkeypatch, 3, 37)
    torch.manual_seed(2)
    logits = (torch.randn(2, 4, 37, dtype=torch.float64) * 4).requires_grad_()
    tokens = torch.randint(0, 37, (2, 4))
    weights = torch.randn(2, 4, dtype=torch.float64)
    expected = whole_matrix(logits, tokens, temperature)[0]
    ours = token_logprobs(logits, tokens, temperature)
    assert ours.shape == tokens.shape
    torch.testing.assert_close(ours.double(), expected.double(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.autograd.grad((ours.double() * weights).sum(), logits)[0],
                               torch.autograd.grad((expected.double() * weights).sum(), logits)[0], atol=2e-6, rtol=1e-5)


def test_fp32_logits_at_temperature_one_are_left_as_they_were():
    """The chunks are worked on in place: from a copy, even where fp32 logits need no cast and
    T = 1 no division."""
    torch.manual_seed(3)
    logits = torch.randn(3, 4, 11, requires_grad=True)
    before = logits.detach().clone()
    logprobs, entropy = logprobs_and_entropy(logits, torch.randint(0, 11, (3, 4)), 1.0)
    torch.autograd.grad((logprobs + entropy).sum(), logits)
    assert torch.equal(logits.detach(), before)
