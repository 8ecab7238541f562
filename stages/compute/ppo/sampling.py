"""What the eager and the static sampling loops share: a rollout's tensors, left-padding the
prompts, and one sampling step from logits (repetition penalty, temperature, top-k, top-p, in
transformers' order of logits processors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    sequences: torch.Tensor  # [B, P+R]: left-padded prompt, then the response padded after its EOS
    attention_mask: torch.Tensor  # [B, P+R]
    prompt_width: int  # P
    response_mask: torch.Tensor  # [B, R] float, 1 up to and including EOS
    ended_with_eos: torch.Tensor  # [B] bool
    logprobs: torch.Tensor  # [B, R] log π(a_j | s_j) under logits / temperature, 0 after the end
    model_logprobs: torch.Tensor  # [B, R] the same at T = 1, the model's own (its perplexity); `logprobs` when T = 1


def left_pad(prompts: list[list[int]], pad_id: int, device: str,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, width] ids and mask, each prompt at the right end; width: the longest prompt's, or wider."""
    width = max(len(p) for p in prompts) if width is None else width
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def next_tokens(logits: torch.Tensor, generated: torch.Tensor | None, *, temperature: float, top_k: int, top_p: float,
                repetition_penalty: float, do_sample: bool) -> torch.Tensor:
    """One token per row from [B, vocab] logits; `generated` [B, vocab] bool marks the tokens this
    row has generated so far, which the repetition penalty lowers (None: no penalty)."""
    if repetition_penalty != 1.0 and generated is not None:  # CTRL's penalty, transformers' formula
        penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(generated, penalised, logits)
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:  # drop the tail whose total probability is at most 1 − top_p; keep the top token
        ascending, order = logits.sort(dim=-1)
        tail = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        tail[:, -1] = False
        logits = logits.masked_fill(tail.scatter(1, order, tail), -torch.inf)
    # Inverse-CDF sampling: exact like torch.multinomial, which draws one exponential variate per
    # vocabulary entry at every step.
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    u = torch.rand(logits.shape[0], 1, device=logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
