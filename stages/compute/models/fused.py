"""Fused elementwise kernels for the padding-free forward in bf16 under autograd.

Between its matrix products a decoder layer runs chains of small elementwise operations: the
RMSNorm's cast, square, mean, rsqrt, product and cast back, SwiGLU's SiLU and product. In eager
mode each is its own pass over a [tokens, hidden] matrix, and their backward as many again; on a
CPU in bf16 a reward-model training step spent more time in such passes than in its matrix
products (`bench/fused.py` times both forms), and on a GPU each pass is a kernel launch: a reward-model step on an
H200 was bound by the host launching ~5,600 kernels, not by the GPU. Here each chain is one
function compiled by torch's inductor into one loop forward and one backward: C++ on a CPU, Triton
on a GPU (`torch.compile`, shapes dynamic: one compilation serves every batch). The formulas are
the eager modules' (LlamaRMSNorm's two roundings to bf16 included); the results differ from eager
only in the order of fp32 sums and where a fused chain skips an intermediate rounding to bf16.
bench/fused.py compares the two.

Where they apply: a CPU or CUDA device, bf16, gradients on (the training forwards); elsewhere the
eager form. If compiling fails (no C++ compiler on the machine, no Triton), a warning says so once
and the eager form runs from then on. Compiled kernels are cached on disk by torch (the first
process compiles for a few seconds, later ones load them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: x / sqrt(mean(x²) + ε) in fp32, rounded to x's dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up, LlamaMLP's product before its down projection."""
    return F.silu(gate) * up


enabled = True  # off: the eager form everywhere (bench/fused.py compares the two)
_compiled: dict[Callable, Callable] = {}
_failed: list[str] = []  # why compiling failed, once it has


def applies(x: torch.Tensor) -> bool:
    return (enabled and x.device.type in ("cpu", "cuda") and x.dtype == torch.bfloat16 and torch.is_grad_enabled()
            and not _failed)


def fused(function: Callable, *args):
    """`function(*args)`, compiled where `applies` to the first argument, else eager."""
    if not applies(args[0]):
        return function(*args)
    return compiled(function, *args)


def compiled(function: Callable, *args):
    """`function(*args)` compiled (shapes dynamic), or eager where fused kernels are off or compiling
    failed."""
    if not enabled or _failed:
        return function(*args)
    if function not in _compiled:
        _compiled[function] = torch.compile(function, dynamic=True, fullgraph=True)
    try:
        return _compiled[function](*args)
    except Exception as error:  # noqa: BLE001 — inductor's failures (no compiler, a codegen bug) have no common type
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"fused kernels off: compiling {function.__name__} failed ({_failed[0][:300]}); "
                      "the eager operations run instead", RuntimeWarning, stacklevel=2)
        return function(*args)
