"""The SFT loss of one optimiser step: one token mean over every micro-batch it accumulates."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.training import PlainEngine
from stages.leaves.dist import Dist
from stages.leaves.rendering import collate
from stages.pipeline.sft import accumulate_step, response_nll

VOCAB, PAD = 40, 0


def example(rng: random.Random, prompt_len: int, response_len: int) -> tuple[list[int], list[int]]:
    ids = [rng.randrange(1, VOCAB) for _ in range(prompt_len + response_len)]
    return ids, [-100] * prompt_len + ids[prompt_len:]


def tiny_lm() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_sft_loss_is_one_token_mean_over_accumulated_batch():
    """A micro-batch of long responses and one of short ones: each response token weighs the same
    in the step's gradient, whichever micro-batch it came in."""
    rng = random.Random(0)
    long_batch = [example(rng, 5, 40), example(rng, 3, 36)]
    short_batch = [example(rng, 6, 2), example(rng, 4, 1)]

    reference = tiny_lm()
    nll, n = response_nll(reference, collate(long_batch + short_batch, PAD))
    (nll / n).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    model = tiny_lm()
    before = copy.deepcopy(model.state_dict())
    # SGD with lr 1 and no clipping: the step moves each weight by minus its gradient.
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PlainEngine(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                         grad_accum_steps=2, max_grad_norm=math.inf)
    dist = Dist()
    loss_sum, tokens = accumulate_step(engine, [long_batch, short_batch], PAD, NonFiniteGuard("sft", 3, dist), dist, 1)

    assert tokens == n and loss_sum == pytest.approx(nll.item(), rel=1e-5)
    assert engine.micro_steps == 2  # the optimiser stepped once, at the end of the accumulation
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=2e-6, rtol=1e-4,
                                   msg=lambda detail: f"{name}: {detail}")


def test_a_skipped_nonfinite_micro_batch_keeps_each_optimiser_step_on_its_step():
    """grad_accum 4 with step 2's second micro-batch NaN (its tokens' embedding is NaN): that
    micro-batch adds no gradient, and every step still ends in exactly one optimiser step with
    nothing left accumulated for the next step's micro-batches."""
    poison, rng = VOCAB - 1, random.Random(1)

    def clean() -> tuple[list[int], list[int]]:
        ids = [rng.randrange(1, poison) for _ in range(8)]
        return ids, [-100] * 3 + ids[3:]

    model = tiny_lm()
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine = PlainEngine(model, optimizer, scheduler, grad_accum_steps=4, max_grad_norm=1.0)
    dist = Dist()
    guard = NonFiniteGuard("sft", 3, dist)
    for step in range(1, 5):
        micro_batches = [[clean()] for _ in range(4)]
        if step == 2:
            micro_batches[1] = [([poison] * 8, [-100] * 3 + [poison] * 5)]
        before = scheduler.last_epoch
        accumulate_step(engine, micro_batches, PAD, guard, dist, step)
        assert (scheduler.last_epoch - before, engine.micro_steps) == (1, 4 * step), f"step {step}"
        assert all(p.grad is None for p in model.parameters()), f"gradient carried over after step {step}"
    assert guard.skipped == 1


def test_sft_schedule_decays_to_ten_percent_of_the_peak():
    """Paper §5.1: SFT's cosine decays to 10 % of the peak lr (transformers' schedule: to 0)."""
    from stages.leaves.config import SFTConfig
    from stages.compute.training import cosine_with_warmup

    sft = SFTConfig()
    assert (sft.lr, sft.epochs, sft.min_lr_ratio) == (9.5e-6, 2, 0.1)
    optimizer = torch.optim.SGD(tiny_lm().parameters(), lr=sft.lr)
    schedule = cosine_with_warmup(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=sft.min_lr_ratio)
    lrs = []
    for _ in range(12):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs[1] == pytest.approx(sft.lr)  # the peak, after the warm-up
    assert lrs[10] == pytest.approx(0.1 * sft.lr) and lrs[11] == pytest.approx(0.1 * sft.lr)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
