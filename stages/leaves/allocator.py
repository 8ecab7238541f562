"""The host memory allocator of the processes that train: TCMalloc where the machine has it, as
PyTorch's own launcher for Xeon CPUs (`python -m torch.backends.xeon.run_cpu`) preloads by default.

glibc's malloc gives a freed block above its mmap threshold (32 MiB at most) back to the kernel, so
a step's large tensors — the activations of a longer batch than the last, the embedding's gradient
— are mapped again and every page faulted in and zeroed, tens of thousands of faults in a step.
TCMalloc keeps freed pages for the next step (`bench/peer_trl_rm.py --trl-allocator tcmalloc` gives
TRL's side the same allocator, so its ratio shows what the allocator alone is worth).

A process's allocator is chosen when it starts (LD_PRELOAD): `rlhf run` and `rlhf study` start
their pipeline in a child (flows/cli.py), `rlhf serve` starts itself again, `rlhf up` its serve
process, and a stage its DeepSpeed ranks, each with `environment()`. The allocator in use is logged
with every stage's params (`allocator`).

RLHF_ALLOCATOR: `auto` (default: TCMalloc where found, else the system's), `tcmalloc` (an error
where it is missing), `system` (glibc's malloc)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

VARIABLE = "RLHF_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "system")
# Debian/Ubuntu's libtcmalloc-minimal4 (what `make install` adds), then gperftools' full library.
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class AllocatorError(RuntimeError):
    pass


def find_tcmalloc(folders: tuple[str, ...] = FOLDERS) -> str | None:
    """The path of a TCMalloc shared library on this machine, or None."""
    for folder in (*folders, os.path.join(sys.prefix, "lib")):
        for name in LIBRARIES:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def preloaded(env: dict[str, str]) -> str | None:
    """The TCMalloc library that `env`'s LD_PRELOAD names (entries separated by spaces or colons, as
    the dynamic loader takes them), or None."""
    return next((entry for entry in re.split(r"[\s:]+", env.get("LD_PRELOAD", "")) if "tcmalloc" in entry), None)


def environment(env: dict[str, str], folders: tuple[str, ...] = FOLDERS) -> dict[str, str]:
    """`env` for a child process that trains: with TCMalloc (looked for in `folders`) preloaded
    where RLHF_ALLOCATOR asks for it (or `auto` finds it) and it is not preloaded already."""
    choice = env.get(VARIABLE, "auto")
    if choice not in CHOICES:
        raise AllocatorError(f"{VARIABLE}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "system" or preloaded(env):
        return dict(env)
    path = find_tcmalloc(folders)
    if path is None:
        if choice == "tcmalloc":
            raise AllocatorError(f"{VARIABLE}=tcmalloc, but no {' or '.join(LIBRARIES)} in {', '.join(folders)}: "
                                 "install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) or set "
                                 f"{VARIABLE}=auto")
        return dict(env)
    return {**env, "LD_PRELOAD": f"{path} {env.get('LD_PRELOAD', '')}".strip(),
            # TCMalloc reports every allocation above 1 GiB on stderr; a large model's buffers are.
            "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": env.get("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))}


def in_use() -> str:
    """`tcmalloc` where this process has TCMalloc loaded, else `system`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"
