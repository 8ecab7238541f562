"""glibc's malloc told to keep the memory that tensors free, in a process that trains on a CPU.

PyTorch's CPU tensors come from malloc. By default glibc gives every block over its mmap threshold
(at most 32 MiB) a fresh mapping that it unmaps on free, and gives the top of the heap back to the
kernel once more than the trim threshold of it is free. A training step frees and allocates the
same large tensors again and again (logits, a weight's gradient, attention probabilities), so
without this each step makes the kernel map and zero fresh pages: tens of thousands of page faults
per PPO iteration, a few µs each on a busy machine. With M_MMAP_MAX = 0 large blocks come from
the heap, and with a high M_TRIM_THRESHOLD freed heap memory stays mapped: the next tensor reuses
pages already faulted in. The cost: the process keeps its high-water mark mapped until it exits
(its peak RSS is the same; its RSS between peaks is higher).

Linux with glibc only; elsewhere nothing. A user who sets glibc's own variables
(MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, or GLIBC_TUNABLES) keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
KEPT_FREE_BYTES = 2**31 - 1  # free heap top that glibc keeps before it trims (mallopt takes a C int)
USER_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@cache
def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt  # absent outside glibc (musl, macOS)
        libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return None
    return libc


@cache
def keep_freed_memory() -> bool:
    """Large blocks from the heap, freed memory kept mapped (once per process). Returns whether
    that is the setting now: glibc, and none of the user's own variables."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in USER_VARIABLES):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))
