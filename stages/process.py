"""Process-wide allocator settings every process of ours starts with (`stages/__init__.py` applies
them on first import, before torch allocates). Each is a default: a value already in the
environment (the user's) is kept.

- `THP_MEM_ALLOC_ENABLE=1`: torch's CPU allocator asks for transparent huge pages
  (madvise(MADV_HUGEPAGE)) on blocks of 2 MiB and more. A training step frees and allocates its
  large activations anew; glibc returns blocks above its mmap threshold to the kernel, which maps
  and zeroes them again on first touch, one fault per 4 KiB page. With huge pages that is one
  fault per 2 MiB (a 64 MiB tensor: ~550 faults instead of 16,384), which matters where a fault
  is expensive (memory pressure; tens of thousands of faults in a PPO iteration). It is read at
  torch's first CPU allocation, so it has to be set before it. A kernel whose THP setting is
  `never` ignores the advice.
- `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: the CUDA caching allocator grows its
  segments in place instead of reserving a new one for each new block size. Dynamic token batches
  (the reward stage's) have a new shape at most steps, and with fixed segments an epoch's first
  steps spent most of their time in cudaMalloc/cudaFree (bench/README.md, H200 rows). Read at the
  first CUDA allocation.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "THP_MEM_ALLOC_ENABLE": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


def apply_defaults(environ=os.environ) -> None:
    """Set each of `DEFAULTS` that `environ` does not set already."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
