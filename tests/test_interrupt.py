"""Ctrl-C as a terminal sends it (SIGINT to the command's whole process group) to real `rlhf run`
commands on the tiny preset: during PPO the stage stops at the next iteration boundary with a
checkpoint, its MLflow runs end KILLED, the Prefect flow run Cancelled, and the printed resume
command continues it with every step logged once; during eval likewise; a second Ctrl-C ends
everything at once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from pipeline_helpers import TRL_NAMES, stage_run

from stages.leaves.tags import FLOW_RUN_TAG
from stages.orchestration import lineage, tracking


class Command:
    """`rlhf run ARGS` as a user starts it (the console command; its own process group, as a
    terminal gives it), its output collected."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}, **(env or {})}  # its own Prefect API
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *args], env=env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: os.read(self.proc.stdout.fileno(), 65536), b""):
            self.output += chunk

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in the output (exit {self.proc.poll()}):\n{self.text()[-3000:]}")

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group

    def finish(self, timeout: float = 600) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g} s; where its threads were:\n"
                                 f"{self.stacks_and_kill()[-12000:]}") from None
        self.reader.join(timeout=10)
        return code

    def stacks_and_kill(self) -> str:
        """Every `rlhf` process of this command prints its threads' stacks (SIGUSR1, flows/cli.py);
        then the command and all it started are killed; its output."""
        command = psutil.Process(self.proc.pid)
        tree = [command, *command.children(recursive=True)]
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                if "flows.cli" in proc.cmdline():
                    proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.proc.wait(30)
        self.reader.join(timeout=10)
        return self.text()


def flow_run_state(pipeline_run_id: str) -> str:
    """The state of the Prefect flow run behind a pipeline run, read from the database the commands used."""
    flow_run_id = tracking.client().get_run(pipeline_run_id).data.tags[FLOW_RUN_TAG]
    code = ("from prefect.client.orchestration import get_client\n"
            f"print(get_client(sync_client=True).read_flow_run('{flow_run_id}').state.type.value)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_ctrl_c_during_ppo_checkpoints_ends_killed_and_resumes_with_every_step_once(full_run):
    iterations = 24
    overrides = [f"ppo.iterations={iterations}", "ppo.checkpoint_every=100", "ppo.eval_every=100"]
    run = Command("--preset", "tiny", "--stages", "ppo", "--from-run", full_run,
                  *(a for o in overrides for a in ("--set", o)))
    run.wait_for(rf"\| *([3-9]|1\d)/{iterations} ")  # a few iterations in
    run.ctrl_c()
    assert run.finish(timeout=300) == 130, run.text()[-6000:]
    stopped = re.search(rf"stage ppo stopped on request after iteration (\d+) of {iterations}; checkpoint (\S+)\. "
                        r"Resume with: \S*rlhf run --resume ([0-9a-f]{32})", run.text())
    assert stopped, run.text()[-3000:]
    at, saved, pipeline_id = int(stopped.group(1)), Path(stopped.group(2)), stopped.group(3)
    assert 3 <= at < iterations and saved.name == f"iter-{at:06d}" and (saved / "manifest.json").exists()
    assert "stopping at the next step boundary" in run.text()
    assert tracking.client().get_run(pipeline_id).info.status == "KILLED"
    assert stage_run(pipeline_id, "ppo").info.status == "KILLED"
    assert flow_run_state(pipeline_id) == "CANCELLED"

    resumed = Command("--resume", pipeline_id)
    assert resumed.finish() == 0, resumed.text()[-3000:]
    (ppo,) = [r for r in lineage.stage_runs(pipeline_id) if r.data.tags["rlhf.stage"] == "ppo"]
    assert ppo.info.status == "FINISHED" and ppo.data.tags["rlhf.resumed_from"] == saved.name
    for name in TRL_NAMES:  # none lost, none twice
        steps = sorted(m.step for m in tracking.client().get_metric_history(ppo.info.run_id, name))
        assert steps == list(range(1, iterations + 1)), name


# A judge that takes its time: the tiny eval's other parts take milliseconds on a quiet machine
# (C-Eval 0-shot to the last judge in 0.17 s), less than the test needs to see a line and signal,
# so a Ctrl-C sent on seeing one could land after the stage's last stop point (the run then finished
# with 0). Sent while this judge scores, it lands before the next judge's stop point.
SLOW_JUDGE = """import time

def score(prompts, responses):
    print("slow judge: scoring", flush=True)
    time.sleep(3)
    return [0.0] * len(responses)
"""


@pytest.fixture
def slow_eval(tmp_path) -> tuple[list[str], dict[str, str]]:
    """(--set arguments, environment) for an eval stage whose first judge scores for 3 s."""
    (tmp_path / "slow_judge.py").write_text(SLOW_JUDGE)
    judges = [{"kind": "reward_source", "name": "slow", "source": "python:slow_judge:score"}, {"kind": "reward_model"}]
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return ["--set", f"eval.judges={json.dumps(judges)}"], {"PYTHONPATH": pythonpath}


def test_ctrl_c_during_eval_stops_it_and_a_second_ends_everything_at_once(full_run, slow_eval):
    overrides, env = slow_eval
    run = Command("--preset", "tiny", "--stages", "eval", "--from-run", full_run, *overrides, env=env)
    run.wait_for(r"slow judge: scoring")
    run.ctrl_c()
    assert run.finish(timeout=300) == 130, run.text()[-6000:]
    stopped = re.search(r"stage eval stopped on request before (.+?)\. Resume with: \S*rlhf run --resume "
                        r"([0-9a-f]{32})", run.text())
    assert stopped, run.text()[-3000:]
    assert stopped.group(1) == "judge reward_model"  # the Ctrl-C landed while the slow judge scored
    assert stage_run(stopped.group(2), "eval").info.status == "KILLED"
    assert tracking.client().get_run(stopped.group(2)).info.status == "KILLED"
    assert "Traceback" not in run.text() and "ConnectError" not in run.text()

    again = Command("--preset", "tiny", "--stages", "eval", "--from-run", full_run, *overrides, env=env)
    pipeline_id = again.wait_for(r"pipeline run ([0-9a-f]{32})").group(1)
    again.wait_for(r"slow judge: scoring")
    session = [p for p in psutil.Process(again.proc.pid).children(recursive=True)]
    again.ctrl_c()
    time.sleep(0.05)
    again.ctrl_c()
    started = time.monotonic()
    assert again.finish(timeout=60) == 130 and time.monotonic() - started < 30, again.text()[-6000:]
    assert re.search(rf"second SIGINT: stopped at once; continue it with: \S*rlhf run --resume {pipeline_id}",
                     again.text())
    gone, alive = psutil.wait_procs(session, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # the child, its Prefect API server: nothing left behind
