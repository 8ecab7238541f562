"""Dynamic token batching and fixed-count batching of preference pairs: the sampler's properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.leaves.pair_batching import PairBatchSampler, padded_tokens


def samplers(lengths, world_size, **kwargs):
    return [PairBatchSampler(lengths, rank=rank, world_size=world_size, **kwargs) for rank in range(world_size)]


def can_cut(n: int, min_pairs: int, max_pairs: int, world_size: int) -> bool:
    """Some number of batches, a multiple of the world size, fits n pairs at min..max pairs each."""
    return any(k % world_size == 0 for k in range(max(1, math.ceil(n / max_pairs)), n // min_pairs + 1))


settings.register_profile("reward", max_examples=60, deadline=None)
settings.load_profile("reward")

lengths_lists = st.lists(st.integers(1, 400), min_size=1, max_size=160)


@given(lengths=lengths_lists, min_pairs=st.integers(1, 6), extra=st.integers(0, 40), world_size=st.integers(1, 4),
       budget=st.integers(64, 20_000), seed=st.integers(0, 10))
def test_dynamic_batches_cover_every_pair_once_with_counts_in_range(lengths, min_pairs, extra, world_size, budget, seed):
    max_pairs = min_pairs + extra
    kwargs = dict(dynamic=True, token_budget=budget, min_pairs=min_pairs, max_pairs=max_pairs, fixed_pairs=1, seed=seed)
    if not can_cut(len(lengths), min_pairs, max_pairs, world_size):
        with pytest.raises(ValueError):
            samplers(lengths, world_size, **kwargs)
        return
    ranks = samplers(lengths, world_size, **kwargs)
    for epoch in (0, 1):
        per_rank = [s.batches(epoch) for s in ranks]
        assert len({len(batches) for batches in per_rank}) == 1  # same number of steps on every rank
        assert all(len(batches) == s.steps_per_epoch for s, batches in zip(ranks, per_rank))
        used = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(used) == list(range(len(lengths)))  # every pair once; ranks disjoint
        assert all(min_pairs <= len(batch) <= max_pairs for batches in per_rank for batch in batches)


@given(lengths=lengths_lists, max_pairs=st.integers(1, 64), budget=st.integers(64, 20_000))
def test_token_budget_holds_except_for_single_over_budget_pairs(lengths, max_pairs, budget):
    sampler = PairBatchSampler(lengths, dynamic=True, token_budget=budget, min_pairs=1, max_pairs=max_pairs,
                               fixed_pairs=1, seed=0)
    for batch in sampler.batches(0):
        assert padded_tokens(batch, lengths) <= budget or len(batch) == 1


@given(lengths=st.lists(st.integers(1, 400), min_size=8, max_size=160), world_size=st.integers(2, 4),
       budget=st.integers(500, 20_000), dynamic=st.booleans())
def test_ranks_get_balanced_token_counts(lengths, world_size, budget, dynamic):
    if len(lengths) < 2 * world_size:
        return
    ranks = samplers(lengths, world_size, dynamic=dynamic, token_budget=budget, min_pairs=2, max_pairs=64,
                     fixed_pairs=4, seed=3)
    per_rank = [s.batches(0) for s in ranks]
    totals = [sum(padded_tokens(batch, lengths) for batch in batches) for batches in per_rank]
    largest = max(padded_tokens(batch, lengths) for batches in per_rank for batch in batches)
    assert max(totals) - min(totals) <= largest


def test_batches_fill_the_budget_with_the_fewest_batches():
    lengths = [100] * 95  # 10 pairs of 100 tokens fill a budget of 2000 exactly
    sampler = PairBatchSampler(lengths, dynamic=True, token_budget=2000, min_pairs=4, max_pairs=128, fixed_pairs=1, seed=0)
    sizes = sorted(len(batch) for batch in sampler.batches(0))
    assert len(sizes) == 10 and sum(sizes) == 95 and max(sizes) == 10
    # The min clamp wins over the budget: 4 pairs even where one pair alone fills it.
    clamped = PairBatchSampler([1000] * 12, dynamic=True, token_budget=2000, min_pairs=4, max_pairs=128, fixed_pairs=1, seed=0)
    assert [len(batch) for batch in clamped.batches(0)] == [4, 4, 4]


def test_same_seed_same_batches_other_seed_other_order():
    rng = random.Random(1)
    lengths = [rng.randint(10, 300) for _ in range(300)]
    kwargs = dict(dynamic=True, token_budget=4000, min_pairs=4, max_pairs=128, fixed_pairs=1)
    first = PairBatchSampler(lengths, seed=7, **kwargs).batches(0)
    assert PairBatchSampler(lengths, seed=7, **kwargs).batches(0) == first
    assert PairBatchSampler(lengths, seed=8, **kwargs).batches(0) != first
    assert PairBatchSampler(lengths, seed=7, **kwargs).batches(1) != first  # a new order every epoch


def test_fixed_count_batches():
    rng = random.Random(2)
    lengths = [rng.randint(10, 300) for _ in range(101)]
    ranks = samplers(lengths, 2, dynamic=False, token_budget=1, min_pairs=4, max_pairs=128, fixed_pairs=8, seed=0)
    per_rank = [s.batches(0) for s in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == 7  # 101 pairs → 14 batches of 7–8 pairs
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == list(range(101))
    assert all(7 <= len(batch) <= 8 for batches in per_rank for batch in batches)


def test_length_bucketing_pads_less_than_fixed_batches():
    rng = random.Random(3)
    lengths = [rng.randint(20, 500) for _ in range(256)]

    def padding(sampler):
        batches = sampler.batches(0)
        padded = sum(padded_tokens(batch, lengths) for batch in batches)
        return 1 - 2 * sum(lengths) / padded

    dynamic = PairBatchSampler(lengths, dynamic=True, token_budget=8000, min_pairs=4, max_pairs=128, fixed_pairs=8, seed=0)
    fixed = PairBatchSampler(lengths, dynamic=False, token_budget=8000, min_pairs=4, max_pairs=128, fixed_pairs=8, seed=0)
    assert padding(dynamic) < 0.1 < 0.3 < padding(fixed)
