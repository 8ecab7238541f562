"""The processes that train run on TCMalloc where the machine has it (stages/leaves/allocator.py): the
environment `rlhf` starts them with, and what it changes — a large tensor freed and made again is
not faulted in afresh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stages.leaves import allocator

TCMALLOC = allocator.find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="no TCMalloc: make install adds libtcmalloc-minimal4")

# A 64 MiB tensor made and freed 20 times, then this process's allocator and the minor page faults
# (a page mapped anew and zeroed) the loop took.
LOOP = """
import resource, torch
from stages.leaves import allocator
torch.empty(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(16 << 20)
print(allocator.in_use(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_loop(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, check=True)
    name, faults = out.stdout.split()
    return name, int(faults)


@needs_tcmalloc
def test_a_child_started_with_the_environment_runs_on_tcmalloc_and_reuses_freed_pages():
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.VARIABLE)}
    system, tcmalloc = run_loop({**base, allocator.VARIABLE: "system"}), run_loop(allocator.environment(base))
    assert system[0] == "system" and tcmalloc[0] == "tcmalloc"
    pages = (64 << 20) // 4096
    assert system[1] > 10 * pages  # glibc unmaps a block this large when it is freed: every round faults it in
    assert tcmalloc[1] < 3 * pages  # TCMalloc keeps it: the first round faults, the others reuse it


@needs_tcmalloc
def test_the_environment_preloads_it_once_beside_what_is_preloaded_already():
    env = allocator.environment({"LD_PRELOAD": "/opt/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{TCMALLOC} /opt/other.so" and env["PATH"] == "/bin"
    assert allocator.environment(env) == env  # already preloaded: unchanged
    colons = {"LD_PRELOAD": f"/opt/other.so:{TCMALLOC}"}  # the loader's other separator
    assert allocator.environment(colons) == colons and allocator.preloaded(colons) == TCMALLOC
    assert allocator.environment({allocator.VARIABLE: "tcmalloc"})["LD_PRELOAD"] == TCMALLOC


def test_system_keeps_the_systems_malloc_and_a_missing_or_unknown_choice_is_a_clear_error():
    assert allocator.environment({allocator.VARIABLE: "system", "PATH": "/bin"}) == {allocator.VARIABLE: "system",
                                                                                      "PATH": "/bin"}
    assert "LD_PRELOAD" not in allocator.environment({}, folders=())  # auto, and none found: the system's
    with pytest.raises(allocator.AllocatorError, match="apt-get install libtcmalloc-minimal4"):
        allocator.environment({allocator.VARIABLE: "tcmalloc"}, folders=())
    with pytest.raises(allocator.AllocatorError, match="RLHF_ALLOCATOR='jemalloc': expected one of auto, tcmalloc, system"):
        allocator.environment({allocator.VARIABLE: "jemalloc"})
