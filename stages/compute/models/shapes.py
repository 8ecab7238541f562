"""Bucketed shapes for a GPU: a batch padded to one of a few lengths, so that every kernel that
plans, compiles or autotunes per shape (cuDNN's attention plans, inductor's kernels, a captured
CUDA graph) does so once per bucket instead of once per batch. Token-budget batches of sequences
of any length then run in at most ⌈max length / quantum⌉ + log₂(quantum) shapes."""

from __future__ import annotations


def bucket(length: int, quantum: int = 64) -> int:
    """The bucket `length` pads to: the next power of two up to `quantum`, above it the next multiple
    of `quantum` (at most quantum − 1 pads, under 2× below it)."""
    if length < 1:
        raise ValueError(f"length {length}: a batch has at least one position")
    if quantum < 1 or quantum & (quantum - 1):
        raise ValueError(f"quantum {quantum}: a power of two")
    if length <= quantum:
        return 1 << (length - 1).bit_length()
    return -(-length // quantum) * quantum
