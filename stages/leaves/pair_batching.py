"""Batches of preference pairs: dynamic token batching (paper §4.2) or a fixed pair count.

Dynamic: sort the pairs by length (bucketing: neighbours have similar lengths, so little
padding) and cut the sorted list into batches whose padded size, pairs × 2 × longest answer,
stays within a token budget, with a pair count clamped to [min_pairs, max_pairs]. Where the clamp
(or an equal number of batches per rank) makes that impossible, the cut with the fewest tokens
over the budget wins; with min_pairs = 1 on one rank only a single pair longer than the budget
exceeds it. Fixed: shuffled pairs, a fixed count per batch. Either way every pair is used exactly once per epoch, and the
batches are dealt to ranks in steps of one batch per rank, larger with smaller, so all ranks run
the same number of steps (collectives never wait for a missing rank) with balanced token counts.
Every rank computes the same plan from the same seed and takes its own column.
"""

from __future__ import annotations

import math
import random

import numpy as np


def padded_tokens(batch: list[int], lengths: list[int]) -> int:
    """Tokens of a batch once both answers of every pair are padded to its longest answer."""
    return len(batch) * 2 * max(lengths[i] for i in batch)


def plan_token_batches(lengths_desc: list[int], token_budget: int, min_pairs: int, max_pairs: int,
                       multiple_of: int) -> list[int]:
    """Sizes of consecutive batches over pairs sorted longest first: every size in
    [min_pairs, max_pairs], a number of batches divisible by `multiple_of` (the world size).
    Among such cuts, the fewest tokens over the budget first, then the fewest batches.
    Exact dynamic programme over cut points (the min clamp can force a batch over the budget)."""
    n, lengths = len(lengths_desc), np.asarray(lengths_desc, dtype=np.int64)
    unreachable = np.iinfo(np.int64).max // 4
    # best[end, m]: score of the best cut of the first `end` pairs into k ≡ m (mod multiple_of)
    # batches, score = tokens over budget × (n + 1) + k, i.e. over-budget first, then count.
    best = np.full((n + 1, multiple_of), unreachable, dtype=np.int64)
    best[0, 0] = 0
    cut = np.zeros((n + 1, multiple_of), dtype=np.int64)
    columns = np.arange(multiple_of)
    for end in range(min_pairs, n + 1):
        starts = np.arange(max(0, end - max_pairs), end - min_pairs + 1)
        # a batch starts at its longest pair: cost = size × 2 × lengths[start]
        over_budget = np.maximum(0, (end - starts) * 2 * lengths[starts] - token_budget)
        scores = np.roll(best[starts], 1, axis=1) + (over_budget * (n + 1) + 1)[:, None]
        pick = scores.argmin(axis=0)
        best[end], cut[end] = scores[pick, columns], starts[pick]
    if best[n, 0] >= unreachable:
        raise ValueError(f"cannot cut {n} pairs into a multiple of {multiple_of} batches of {min_pairs} to "
                         f"{max_pairs} pairs; change min_pairs/max_pairs or the number of pairs")
    sizes, end, batches_mod = [], n, 0
    while end > 0:
        start = int(cut[end, batches_mod])
        sizes.append(end - start)
        end, batches_mod = start, (batches_mod - 1) % multiple_of
    return sizes[::-1]


def row_batches(lengths: list[int], token_budget: int, max_rows: int) -> list[list[int]]:
    """Single sequences (a reward server's rows, not pairs) cut as the pairs are: sorted longest
    first, batches of rows × longest row within `token_budget`, at most `max_rows` each (a single row
    over the budget goes alone). Returns row indices per batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if not order:
        return []
    # plan_token_batches prices a batch of pairs at size × 2 × longest: twice the budget prices rows at size × longest.
    sizes = plan_token_batches([lengths[i] for i in order], 2 * token_budget, 1, max_rows, 1)
    bounds = np.cumsum([0, *sizes])
    return [order[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def even_sizes(n: int, max_size: int, multiple_of: int) -> list[int]:
    """Sizes of the fewest batches (a multiple of `multiple_of`) of at most max_size, as even as possible."""
    count = multiple_of * math.ceil(math.ceil(n / max_size) / multiple_of)
    return [n // count + (1 if i < n % count else 0) for i in range(count)]


def deal_to_ranks(batches: list[list[int]], lengths: list[int], world_size: int, rng: random.Random) -> list[list[list[int]]]:
    """Steps of one batch per rank. Batches sorted by padded size fill the steps in turn, and the
    rank order alternates from step to step (a rank given the largest batch of one step gets the
    smallest of the next), so every rank's token total stays within one batch of the others'."""
    by_size = sorted(batches, key=lambda batch: padded_tokens(batch, lengths), reverse=True)
    steps = []
    for number, first in enumerate(range(0, len(by_size), world_size)):
        step = by_size[first : first + world_size]
        steps.append(step if number % 2 == 0 else step[::-1])
    rng.shuffle(steps)
    return steps


class PairBatchSampler:
    """The batches (lists of pair indices) of one rank, epoch by epoch."""

    def __init__(self, lengths: list[int], *, dynamic: bool, token_budget: int, min_pairs: int, max_pairs: int,
                 fixed_pairs: int, seed: int, rank: int = 0, world_size: int = 1):
        if not 1 <= min_pairs <= max_pairs or fixed_pairs < 1:
            raise ValueError(f"need 1 <= min_pairs <= max_pairs and fixed_pairs >= 1 "
                             f"(got {min_pairs}, {max_pairs}, {fixed_pairs})")
        smallest = world_size * (min_pairs if dynamic else 1)
        if len(lengths) < smallest:
            raise ValueError(f"{len(lengths)} pairs cannot fill one batch on each of {world_size} ranks (need {smallest})")
        self.lengths, self.dynamic, self.token_budget = list(lengths), dynamic, token_budget
        self.min_pairs, self.max_pairs, self.fixed_pairs = min_pairs, max_pairs, fixed_pairs
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.steps_per_epoch = len(self.global_steps(0))

    def global_steps(self, epoch: int) -> list[list[list[int]]]:
        """Every rank's batches of an epoch: a list of steps, each one batch per rank."""
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        if self.dynamic:
            order.sort(key=lambda i: -self.lengths[i])  # stable: equal lengths keep the shuffled order
            sizes = plan_token_batches([self.lengths[i] for i in order], self.token_budget, self.min_pairs,
                                       self.max_pairs, self.world_size)
        else:
            sizes = even_sizes(len(order), self.fixed_pairs, self.world_size)
        bounds = np.cumsum([0, *sizes])
        batches = [order[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
        return deal_to_ranks(batches, self.lengths, self.world_size, rng)

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of an epoch, in training order."""
        return [step[self.rank] for step in self.global_steps(epoch)]
