"""One precision for the whole pipeline (`model.precision`).

`auto` is bf16 where the hardware multiplies bf16 natively — a CUDA device with bf16 support, or a
CPU with AMX-BF16 or AVX512-BF16 — and fp32 elsewhere (a CPU without them emulates bf16 matmuls,
slower than fp32).

Under bf16:
- frozen models (the reference, the reward model during PPO, judges, C-Eval scoring) hold bf16
  weights: no per-op casts, half the bytes a decode step reads;
- trained models compute with bf16 weights while the optimiser keeps fp32 master weights and
  states (`stages.compute.training.PlainEngine` with `MasterWeights`; DeepSpeed's own bf16 mode under
  DeepSpeed); gradients are accumulated, reduced and clipped in fp32, and a published model is
  saved from its fp32 master weights.
Losses, log-probabilities, advantages and every statistic are computed in fp32.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

import torch

Precision = Literal["fp32", "bf16"]
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in Linux /proc/cpuinfo (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_bf16_flags() -> tuple[str, ...]:
    """The CPU's native bf16 matmul flags, in BF16_CPU_FLAGS order."""
    flags = set(_cpuinfo().get("flags", "").split())
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in flags)


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    return _cpuinfo().get("model name", "unknown CPU")


def cpu_vendor() -> str:
    """The CPU's vendor id: GenuineIntel, AuthenticAMD, … ('' where /proc/cpuinfo does not say)."""
    return _cpuinfo().get("vendor_id", "")


def native_bf16(device: str | torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_bf16_flags())


def resolve(setting: str, device: str | torch.device) -> Precision:
    """`model.precision` on `device`: auto → bf16 where it is native, else fp32."""
    if setting == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if setting not in ("fp32", "bf16"):
        raise ValueError(f"model.precision={setting!r}: expected auto, fp32 or bf16")
    return setting  # type: ignore[return-value]


def describe(device: str | torch.device) -> str:
    """What bf16 support `device` has, for `rlhf config` and the benches."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no CUDA"
        return f"{name}: {'native' if native_bf16(device) else 'no'} bf16"
    flags = cpu_bf16_flags()
    return f"CPU with {', '.join(flags)}" if flags else "CPU without AMX-BF16 or AVX512-BF16 (bf16 is emulated)"


def dtype(precision: Precision) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32
