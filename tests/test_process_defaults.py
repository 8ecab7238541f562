"""stages/process.py: the allocator defaults every process of ours starts with, in fresh processes
(they are read once per process, at torch's first allocation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Faults taken by allocating and touching a 64 MiB CPU tensor ten times, after `import stages`.
FAULTS = """
import json, os, resource, sys
import stages
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16 << 20)  # 64 MiB, freed at once: the next one is mapped anew
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"faults": faults, "env": {k: os.environ.get(k) for k in ("THP_MEM_ALLOC_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")}}))
"""


def run_fresh(**env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", FAULTS], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def thp_available() -> bool:
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def test_importing_stages_sets_the_defaults_and_keeps_the_users_own():
    assert run_fresh()["env"] == {"THP_MEM_ALLOC_ENABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    kept = run_fresh(THP_MEM_ALLOC_ENABLE="0", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128")["env"]
    assert kept == {"THP_MEM_ALLOC_ENABLE": "0", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


@pytest.mark.skipif(not thp_available(), reason="this kernel's transparent huge pages are off ('never')")
def test_a_large_cpu_tensor_is_mapped_in_huge_pages_after_importing_stages():
    pages_4k = (64 << 20) // 4096  # 16,384 faults with 4 KiB pages
    with_defaults = run_fresh()["faults"]
    without = run_fresh(THP_MEM_ALLOC_ENABLE="0")["faults"]
    assert without > 0.9 * pages_4k, without  # the measurement sees 4 KiB faults where THP is off
    assert with_defaults < pages_4k / 8, with_defaults  # 2 MiB pages: ~32, plus 4 KiB ones at unaligned ends
