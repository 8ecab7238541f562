"""Rollout sampling with a KV cache that also returns log π(a_j | s_j) of every sampled token.

The log-probabilities come from the very logits the token was sampled from, so the experience
needs no second forward pass of the actor (TRL reads them from `generate`'s scores the same way;
we keep one number per token instead of the [B, R, vocab] scores). The loop stops as soon as every
row has ended (on every rank, when a ZeRO-3 actor's ranks sample in step), and the LM head runs on one position per row and step, prompt included. The model
steps come from `stages.compute.models.decoder` (a model's fast path, or its own forward); on a CUDA device
under `model.cuda_graphs: auto` the loop runs on static buffers with its step replayed as a CUDA
graph instead (stages/compute/ppo/static_sampling.py), sampling the same way.

Sampling follows transformers' order of logits processors: repetition penalty, temperature,
top-k, top-p. The repetition penalty reads the tokens generated so far, not the prompt's (paper
§6.1 and MOSS-RLHF penalise generated tokens only; transformers' processor also penalises every
prompt token and left pad). The recorded log-probability is under logits / temperature alone, over the whole
vocabulary (top-k, top-p and the penalty shape what is sampled, not it): the distribution PPO's ratio and
its tempered KL to SFT are taken under (`token_logprobs`: the reference and training forwards take log π
the same way).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from stages.compute.models import decoder, static_decoder_class
from stages.compute.models.plain import partitioned
from stages.compute.ppo import static_sampling
from stages.compute.ppo.sampling import Rollout, left_pad, next_tokens
from stages.leaves.logprobs import token_logprobs


def generate(actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, repetition_penalty: float, do_sample: bool = True, device: str = "cpu") -> Rollout:
    settings = dict(eos_id=eos_id, pad_id=pad_id, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, repetition_penalty=repetition_penalty, do_sample=do_sample, device=device)
    static = static_decoder_class(actor, device)
    was_training = actor.training
    actor.eval()
    with _without_autograd(actor):
        if static is not None:  # `model.cuda_graphs`: the step replayed as a CUDA graph
            rollout = static_sampling.sample(static, actor, prompts, graph=True, **settings)
        else:
            rollout = _sample(actor, prompts, **settings)
    actor.train(was_training)
    # Tensors made in inference mode cannot be saved for a backward (the training step gathers at
    # the sampled tokens): ordinary copies.
    return replace(rollout, **{name: value.clone() for name, value in vars(rollout).items()
                               if isinstance(value, torch.Tensor)})


def samples_in_step(actor) -> bool:
    """Whether the ranks sample in step: a ZeRO-3 actor's forward gathers each layer's weights from
    every rank, so one rank's step with no partner's waits for ever (transformers' `synced_gpus`)."""
    return (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
            and any(partitioned(p) for p in actor.parameters()))


def every_row_ended(ended: torch.Tensor, synced: bool) -> bool:
    """Whether sampling stops: every row has ended, on every rank when they sample in step (a rank
    whose rows ended steps on, drawing pads, until the others' have too)."""
    if not synced:
        return bool(ended.all())
    flag = ended.all().to(torch.int32).reshape(1)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _without_autograd(actor):
    """Inference mode: no autograd bookkeeping at all (a decode step is thousands of small
    operations). Under ZeRO-3 no_grad instead: the weights DeepSpeed gathers while sampling (and
    keeps gathered, for its persistent parameters) would be inference tensors, which the training
    step's forward cannot save for its backward."""
    if any(partitioned(p) for p in actor.parameters()):
        return torch.no_grad()
    return torch.inference_mode()


def _sample(actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float,
            top_p: float, top_k: int, repetition_penalty: float, do_sample: bool, device: str) -> Rollout:
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    batch = prompt_ids.shape[0]
    steps = max(max_new_tokens, 1)
    model = decoder(actor, prompt_ids, prompt_mask, steps)
    logits = model.prefill()
    ended = torch.zeros(batch, dtype=torch.bool, device=device)
    # The tokens each row generated so far, only when the penalty reads them. A row's pads after
    # its EOS are not generated tokens.
    generated = (torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=device)
                 if repetition_penalty != 1.0 else None)
    tokens, logprobs, model_logprobs, alive = [], [], [], []
    synced = samples_in_step(actor)
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
        if len(tokens) == steps or every_row_ended(ended, synced):
            break
        if generated is not None:
            rows = alive[-1]  # the rows that drew a token this step
            generated[rows, token[rows]] = True
        logits = model.step(token)
    response_mask = torch.stack(alive, dim=1)
    response = torch.stack(tokens, dim=1)
    logprobs = torch.stack(logprobs, dim=1) * response_mask
    return Rollout(sequences=torch.cat([prompt_ids, response], dim=1),
                   attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1), prompt_width=prompt_ids.shape[1],
                   response_mask=response_mask.float(), ended_with_eos=ended,
                   logprobs=logprobs,
                   model_logprobs=torch.stack(model_logprobs, dim=1) * response_mask if model_logprobs else logprobs)
