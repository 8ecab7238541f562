"""stages.allocator: a process that builds a training engine on a CPU keeps the memory tensors
free, so the next tensor of the same size faults no fresh pages (Linux with glibc)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stages import allocator

pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")

SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "engine":
        from stages.launch import Dist
        from stages.training import make_engine
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        make_engine(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), micro_batch_size=1,
                    grad_accum_steps=1, max_grad_norm=1.0, precision="fp32", dist=Dist(device="cpu"))
    elements = 64 * 2**20 // 4  # 64 MiB of fp32: above glibc's largest mmap threshold
    torch.ones(elements)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(elements)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_of_a_second_64_mib_tensor(mode: str, env: dict | None = None) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env)
    return int(done.stdout.split()[-1])


def test_after_make_engine_a_freed_large_tensor_is_reused_without_page_faults():
    pages = 64 * 2**20 // 4096
    assert faults_of_a_second_64_mib_tensor("plain") > pages // 2  # glibc's default: a fresh mapping each time
    assert faults_of_a_second_64_mib_tensor("engine") < pages // 20


def test_the_users_own_malloc_settings_are_kept():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert faults_of_a_second_64_mib_tensor("engine", env) > 64 * 2**20 // 4096 // 2
