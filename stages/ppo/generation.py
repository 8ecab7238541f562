"""Rollout sampling with a KV cache that also returns log π(a_j | s_j) of every sampled token.

The log-probabilities come from the very logits the token was sampled from, so the experience
needs no second forward pass of the actor (TRL reads them from `generate`'s scores the same way;
we keep one number per token instead of the [B, R, vocab] scores). The loop stops as soon as every
row has ended, and the LM head runs on one position per row and step, prompt included. The model
steps come from `stages.models.decoder` (a model's fast path, or its own forward).

Sampling follows transformers' order of logits processors: repetition penalty, temperature,
top-k, top-p. The repetition penalty reads the tokens generated so far, not the prompt's (paper
§6.1 and MOSS-RLHF penalise generated tokens only; transformers' processor also penalises every
prompt token and left pad). The recorded log-probability is under logits / temperature alone, over the whole
vocabulary (top-k, top-p and the penalty shape what is sampled, not it): the distribution PPO's ratio and
its tempered KL to SFT are taken under (`token_logprobs`: the reference and training forwards take log π
the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stages.models import decoder
from stages.logprobs import token_logprobs


@dataclass
class Rollout:
    sequences: torch.Tensor  # [B, P+R]: left-padded prompt, then the response padded after its EOS
    attention_mask: torch.Tensor  # [B, P+R]
    prompt_width: int  # P
    response_mask: torch.Tensor  # [B, R] float, 1 up to and including EOS
    ended_with_eos: torch.Tensor  # [B] bool
    logprobs: torch.Tensor  # [B, R] log π(a_j | s_j) under logits / temperature, 0 after the end
    model_logprobs: torch.Tensor  # [B, R] the same at T = 1, the model's own (its perplexity); `logprobs` when T = 1


def left_pad(prompts: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
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


def generate(actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, repetition_penalty: float, do_sample: bool = True, device: str = "cpu") -> Rollout:
    with torch.inference_mode():  # no autograd bookkeeping at all: a decode step is thousands of small operations
        rollout = _sample(actor, prompts, eos_id=eos_id, pad_id=pad_id, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                          do_sample=do_sample, device=device)
    # Tensors made in inference mode cannot be saved for a backward (the training step gathers at
    # the sampled tokens): ordinary copies.
    return replace(rollout, **{name: value.clone() for name, value in vars(rollout).items()
                               if isinstance(value, torch.Tensor)})


def _sample(actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float,
            top_p: float, top_k: int, repetition_penalty: float, do_sample: bool, device: str) -> Rollout:
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    batch = prompt_ids.shape[0]
    was_training = actor.training
    actor.eval()
    steps = max(max_new_tokens, 1)
    model = decoder(actor, prompt_ids, prompt_mask, steps)
    logits = model.prefill()
    ended = torch.zeros(batch, dtype=torch.bool, device=device)
    # The tokens each row generated so far, only when the penalty reads them. A row's pads after
    # its EOS are not generated tokens.
    generated = (torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=device)
                 if repetition_penalty != 1.0 else None)
    tokens, logprobs, model_logprobs, alive = [], [], [], []
    while True:
        logits = logits.float()
        token = next_tokens(logits, generated, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty, do_sample=do_sample)
        token = torch.where(ended, torch.full_like(token, pad_id), token)
        alive.append(~ended)
        logprobs.append(token_logprobs(logits, token, temperature))
        if temperature != 1.0:
            model_logprobs.append(token_logprobs(logits, token, 1.0))
        tokens.append(token)
        ended = ended | (token == eos_id)
        if bool(ended.all()) or len(tokens) == steps:
            break
        if generated is not None:
            rows = alive[-1]  # the rows that drew a token this step
            generated[rows, token[rows]] = True
        logits = model.step(token)
    actor.train(was_training)
    response_mask = torch.stack(alive, dim=1)
    response = torch.stack(tokens, dim=1)
    logprobs = torch.stack(logprobs, dim=1) * response_mask
    return Rollout(sequences=torch.cat([prompt_ids, response], dim=1),
                   attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1), prompt_width=prompt_ids.shape[1],
                   response_mask=response_mask.float(), ended_with_eos=ended,
                   logprobs=logprobs,
                   model_logprobs=torch.stack(model_logprobs, dim=1) * response_mask if model_logprobs else logprobs)
