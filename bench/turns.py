"""Sides of a benchmark taking turns in one run (peer_trl.py, peer_trl_rm.py).

Each side lives in its own process, built once (loading is not measured, and each side's peak RSS
is its own). It says `READY {json}` on stdout when built, then runs one chunk of its work each time
the parent writes `go` on its stdin, answering with one `TURN {json}` line, and ends with one
`RESULT {json}` line carrying its peak RSS. Other stdout lines (a library's log lines) are skipped;
stderr goes to a log file whose tail is shown if the side fails. The order of the sides rotates from
one turn to the next, so a slow phase of a shared machine (minutes long) hits all sides of a turn
alike: the turn's ratios are the numbers to trust, and the median and range of them say how much
the machine moved them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


# -- inside a side's process -------------------------------------------------------------------
def ready(**fields) -> None:
    """Built: `fields` for the parent, with the malloc this process runs on (the benches put this
    checkout on sys.path, on TRL's side too; stages/leaves/allocator.py imports nothing else of it)."""
    from stages.leaves import allocator

    print("READY " + json.dumps({**fields, "allocator": allocator.in_use()}), flush=True)


_faults_at_turn_start = (0, 0)


def _faults() -> tuple[int, int]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt


def wait_for_turn() -> float:
    """Block until the parent gives this side its next turn; the time it starts."""
    global _faults_at_turn_start
    if sys.stdin.readline().strip() != "go":
        sys.exit("bench worker: the parent ended the run")
    _faults_at_turn_start = _faults()
    return time.perf_counter()


def report_turn(**fields) -> None:
    """The turn's fields, with the page faults this process took since its turn began (minor: a page
    mapped anew and zeroed; major: one read back from a file). On a GPU the side first hands the
    memory its allocator holds unused back to the driver: the sides share one GPU, and each side's
    cache of its own turn's peak (TRL's fp32 side at a ~1B model: 27 GiB) left the next side too little
    (three sides of a ~1B model ran out of memory on one H100). Every side pays it alike, after its timed turn."""
    (minor, major), (minor_0, major_0) = _faults(), _faults_at_turn_start
    if (cuda := _cuda_in_use()) is not None:
        cuda.empty_cache()
    print("TURN " + json.dumps({**fields, "page_faults": minor - minor_0, "major_faults": major - major_0}), flush=True)


def page_faults(reports: dict[str, dict]) -> str:
    """The page faults of a turn's reports (`report_turn`), by side, for a bench's turn line."""
    return "page faults minor/major: " + ", ".join(f"{side} {report['page_faults']}/{report['major_faults']}"
                                                   for side, report in reports.items())


_ended = False


def wait_for_the_end() -> None:
    """After this side's last turn: wait, idle, until the parent says every side has had all its
    turns (`Worker.peak_rss_mib`). A side's process that went on to its own end at once (a
    trainer's wrap-up after its last step, gigabytes freed at exit) did so while the other side's
    last turn was timed: with TRL's PPO process ending beside it, our last iteration was slower
    than the others in every peer_trl.py run, and in no run of ours alone."""
    global _ended
    if not _ended:
        if sys.stdin.readline().strip() != "finish":
            sys.exit("bench worker: the parent ended the run")
        _ended = True


def finish() -> None:
    """Once every side is done (`wait_for_the_end`): this side's peak memory, for the parent."""
    import resource

    wait_for_the_end()

    result = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if (cuda := _cuda_in_use()) is not None:
        result["peak_gpu_mib"] = cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def synchronize() -> None:
    """Wait for the GPU's queued work (a no-op on CPU), so that a turn's time includes it."""
    if (cuda := _cuda_in_use()) is not None:
        cuda.synchronize()


def _cuda_in_use():
    """torch.cuda where this side has used the GPU, else None (torch is not imported for it)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


# -- in the parent -----------------------------------------------------------------------------
def side_environment(kind: str, trl_allocator: str) -> dict[str, str]:
    """A side's process environment: ours as `rlhf` starts the processes that train
    (stages/leaves/allocator.py: TCMalloc where the machine has it); TRL's as it runs out of the box, on
    the system's malloc, or on TCMalloc too with `--trl-allocator tcmalloc`."""
    from stages.leaves import allocator

    if kind == "ours":
        return allocator.environment(dict(os.environ))
    return allocator.environment({**os.environ, allocator.VARIABLE: trl_allocator})


ALLOCATOR_HELP = ("TRL's malloc: system (default: as TRL runs out of the box) or tcmalloc (as ours, "
                  "stages/leaves/allocator.py; RLHF_ALLOCATOR=system runs ours on the system's)")


class Worker:
    """One side's process: `ready()` once it is built, then one chunk per `turn()`."""

    def __init__(self, side: str, command: list, log: Path, env: dict[str, str] | None = None):
        self.side, self.log = side, log
        with open(log, "w") as stderr:
            self.process = subprocess.Popen([str(part) for part in command], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=env)

    def expect(self, prefix: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
        self.process.wait()
        sys.exit(f"{self.side}'s side failed (exit {self.process.returncode}):\n{self.log.read_text()[-4000:]}")

    def ready(self) -> dict:
        return self.expect("READY ")

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def turn(self) -> dict:
        self.send("go")
        return self.expect("TURN ")

    def peak_rss_mib(self) -> float:
        """The side's peak RSS, once it has finished (its peak GPU memory, on a GPU, in `peak_gpu_mib`)."""
        self.send("finish")
        result = self.expect("RESULT ")
        self.process.stdin.close()
        self.process.wait()
        self.peak_gpu_mib = result.get("peak_gpu_mib")
        return result["peak_rss_mib"]


def take_turns(workers: dict[str, Worker], turns: int, on_turn=None) -> dict[str, list[dict]]:
    """`turns` rounds in which every side runs one chunk; round k starts with side k mod n, so who
    goes first rotates. `on_turn(k, {side: its report})` is called after each round (to print it)."""
    sides = list(workers)
    reports: dict[str, list[dict]] = {side: [] for side in sides}
    for k in range(turns):
        for side in sides[k % len(sides):] + sides[: k % len(sides)]:
            reports[side].append(workers[side].turn())
        if on_turn is not None:
            on_turn(k, {side: reports[side][-1] for side in sides})
    return reports


def chunk_bounds(steps: int, turns: int) -> list[int]:
    """Cut `steps` consecutive steps into `turns` chunks as even as possible: the chunks' bounds."""
    if not 1 <= turns <= steps:
        raise ValueError(f"{turns} turns need between 1 and {steps} (the steps) chunks")
    return [round(i * steps / turns) for i in range(turns + 1)]


def spread(ratios: list[float]) -> str:
    ordered = sorted(ratios)
    return f"median ×{statistics.median(ordered):.2f}, range ×{ordered[0]:.2f} … ×{ordered[-1]:.2f}"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min) on {os.cpu_count()} cores"


def trl_python(venv: Path, version: str, check: str) -> Path:
    """venv/bin/python with trl==version installed (`check`, a Python statement, must succeed);
    created once. The environment sees the torch and transformers of the running interpreter's
    environment through a .pth file, so both sides run the same builds of them; only trl and its
    own extra dependencies (datasets) go into it. Where the running interpreter has that trl already
    (a machine without network, given wheels), it is the one."""
    from importlib import metadata

    try:
        if metadata.version("trl") == version:
            return Path(sys.executable)
    except metadata.PackageNotFoundError:
        pass
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} with trl=={version} (torch and transformers shared from {sys.prefix})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_shared_with_rlhf_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"trl=={version}"], check=True)
    subprocess.run([python, "-c", check], check=True)
    return python
