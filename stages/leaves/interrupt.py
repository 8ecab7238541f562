"""Stopping a run when the user asks (Ctrl-C, SIGTERM): the running stage stops at its next step
boundary, PPO writes a checkpoint first, the stage's MLflow run ends KILLED, and the command line
prints how to resume. A second Ctrl-C exits at once (flows/cli.py's supervisor).

The request reaches a stage as an event set by the signal handler of the process that runs the
flow, and, for a stage on DeepSpeed/torchrun ranks, as the file `STOP_FILE` in the stage's working
folder (the ranks run in other processes). `stop_point` is collective on ranks: every rank stops at
the same step, or none (a rank that stopped alone would leave the others waiting in a collective).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

STOP_FILE = "stop-requested"
_requested = threading.Event()
_rank_workdirs: list[Path] = []  # working folders of ranks launched from this process, running now


class StageInterrupted(Exception):
    """The stage stopped at a step boundary because the user asked; `saved` says what was kept."""

    def __init__(self, stage: str, where: str, saved: str = ""):
        self.stage, self.where, self.saved = stage, where, saved
        super().__init__(f"stage {stage} stopped on request {where}" + (f"; {saved}" if saved else ""))


def request() -> None:
    """Ask the running stage to stop (what the first SIGINT/SIGTERM does)."""
    _requested.set()
    for workdir in _rank_workdirs:
        (workdir / STOP_FILE).touch()


def requested(workdir: Path | None = None) -> bool:
    return _requested.is_set() or (workdir is not None and (workdir / STOP_FILE).exists())


def stop_point(dist, stage: str, where: str, save=None) -> None:
    """A step boundary: if a stop was asked (on any rank), run `save` (returns what it kept, e.g.
    the checkpoint's path) and raise StageInterrupted on every rank."""
    asked = requested(dist.workdir)
    if dist.distributed:
        asked = dist.all_reduce_sum([float(asked)])[0] > 0
    if asked:
        saved = save() if save is not None else ""
        raise StageInterrupted(stage, where, saved)


class RanksRunning:
    """While a stage's ranks run from this process: a stop request reaches them through the file."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def __enter__(self):
        (self.workdir / STOP_FILE).unlink(missing_ok=True)
        _rank_workdirs.append(self.workdir)
        if _requested.is_set():
            (self.workdir / STOP_FILE).touch()
        return self

    def __exit__(self, *exc) -> None:
        _rank_workdirs.remove(self.workdir)

    def stopped(self) -> bool:
        return (self.workdir / STOP_FILE).exists()


def install_handlers() -> None:
    """SIGINT and SIGTERM ask the running stage to stop (in the process that runs the flow)."""

    def on_signal(signum, frame) -> None:
        if not _requested.is_set():
            print(f"\nrlhf: {signal.Signals(signum).name}: stopping at the next step boundary (PPO saves a "
                  f"checkpoint first); Ctrl-C again to exit at once", file=sys.stderr, flush=True)
        request()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
