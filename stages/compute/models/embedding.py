"""The input embedding's weight gradient added into the weight's `.grad` in place.

Autograd gives an `nn.Embedding` weight a dense [vocab, hidden] gradient: a fresh zero matrix with
the looked-up rows added in. Where the weight is tied to the LM head (SmolLM2, Llama 3.2, the tiny
test models) the head's gradient is a second dense matrix, and autograd adds the two into a third.
At SmolLM2's size each is 56 MB in bf16, above what malloc keeps for reuse, so each is mapped and
faulted in afresh at every backward. Here the lookup's backward adds its rows (each token's rows
summed in fp32 first) into the weight's `.grad` as it stands: the head's gradient, which autograd
has put there by then, or the last micro-batch's, or zeros where there is none.

For an engine that reads `.grad` after the backward (`PlainEngine` turns it on); not under
DeepSpeed, whose ZeRO takes each gradient from a hook on its accumulation, which this bypasses;
and `torch.autograd.grad` would see no gradient for the weight while `.grad` changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IN_PLACE_ATTRIBUTE = "rlhf_gradient_into_grad"


def add_gradients_in_place(model: torch.nn.Module) -> None:
    """Turn the in-place gradient on for every `nn.Embedding` in `model` (for `embed`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            setattr(module, IN_PLACE_ATTRIBUTE, True)


def embed(embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """`embedding(ids)`; where the in-place gradient is on and the weight is trained, with its
    gradient added into `embedding.weight.grad` by the backward."""
    weight = embedding.weight
    if (getattr(embedding, IN_PLACE_ATTRIBUTE, False) and weight.requires_grad and torch.is_grad_enabled()
            and embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse):
        # A lookup of the detached weight, so that autograd sends the weight no gradient from here
        # (its accumulation would wait for this one and add a dense matrix); the empty tensor that
        # requires a gradient only makes autograd run this backward (as torch.utils.checkpoint's does).
        anchor = torch.empty(0, device=weight.device, requires_grad=True)
        return LookupWithGradientInPlace.apply(ids, weight.detach(), anchor, embedding)
    return embedding(ids)


class LookupWithGradientInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, anchor, embedding):
        ctx.save_for_backward(ids)
        ctx.embedding = embedding
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        embedding = ctx.embedding
        weight = embedding.weight
        tokens, occurrence = ids.reshape(-1).unique(return_inverse=True)
        grad = grad.reshape(-1, grad.shape[-1])
        sums = torch.zeros(len(tokens), grad.shape[-1], dtype=torch.float32, device=grad.device)
        sums.index_add_(0, occurrence, grad.float())
        if embedding.padding_idx is not None:  # nn.Embedding never trains its padding row
            sums[tokens == embedding.padding_idx] = 0
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, tokens, sums.to(weight.grad.dtype))
        return None, None, None, None
