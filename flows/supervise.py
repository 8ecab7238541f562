"""The console command's process supervisor: `rlhf run` and `rlhf study` run in a child process of
their own session, so Ctrl-C stops the running stage at a step boundary instead of killing Prefect's
API server and the stage's ranks with the terminal's process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

from flows import services
from stages.leaves import allocator

SUPERVISED = "RLHF_SUPERVISED"  # set in the child that `supervise` runs a command in


def supervise(argv: list[str]) -> int:
    """Run `rlhf <argv>` in a child process of its own session, and relay the user's signals to it.

    Ctrl-C in a terminal signals the whole foreground process group: without this, Prefect's
    temporary API server and a stage's ranks would die with the first one, and the flow could not
    record where it stopped. Here only this process gets it; the first SIGINT/SIGTERM is passed to
    the child alone, whose stage stops at its next step boundary; a second kills the child's
    session at once. The child's output passes through; this process notes the pipeline run it
    names, for the resume command."""

    env = allocator.environment({**os.environ, SUPERVISED: "1", "PYTHONUNBUFFERED": "1"})
    child = subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    received: list[int] = []
    seen = {"text": "", "run": None}
    lock = threading.Lock()

    def relay(source, target) -> None:
        for chunk in iter(lambda: os.read(source.fileno(), 65536), b""):
            target.buffer.write(chunk)
            target.flush()
            with lock:
                seen["text"] = (seen["text"] + chunk.decode(errors="replace"))[-8192:]
                found = re.findall(r"\bpipeline run ([0-9a-f]{32})\b", seen["text"])
                seen["run"] = found[-1] if found else seen["run"]

    def on_signal(signum, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            os.kill(child.pid, signal.SIGINT)
            return
        resume = f"; continue it with: {services.command('rlhf')} run --resume {seen['run']}" if seen["run"] else ""
        print(f"\nrlhf: second {signal.Signals(signum).name}: stopped at once{resume}", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    readers = [threading.Thread(target=relay, args=pair, daemon=True)
               for pair in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    try:
        for reader in readers:
            reader.start()
        code = child.wait()
        for reader in readers:
            reader.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 130 if len(received) > 1 else code


def die_with_the_supervisor() -> None:
    """In the supervised child: if the supervisor dies (SIGKILL leaves it no word to say), take this
    process's group with it (the Prefect API server and any ranks it started)."""

    supervisor = os.getppid()

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-supervisor", daemon=True).start()
