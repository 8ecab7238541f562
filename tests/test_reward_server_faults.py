"""Tiny PPO through the real flow against `rlhf serve-reward` processes that fail: one SIGKILLed
mid-run and started again (PPO's client rides it out, the run finishes), one that never comes back
(the stage stops at an iteration boundary with a checkpoint and a one-line error naming the URL,
and a resume finishes the run). Every iteration's metrics are logged exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stages.compute import checkpoint
from stages.compute.ppo.external_scores import RewardServerUnavailable
from stages.leaves.config import REPO_ROOT, rlhf_home
from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import StageLaunchError, execute, free_port

ITERATIONS = 3


def _start(folder: Path, port: int, log: Path) -> subprocess.Popen:
    """`rlhf serve-reward` on `port`; its output appended to `log`."""
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--model", str(folder), "--preset",
                                 "tiny", "--port", str(port)], cwd=REPO_ROOT,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=out, stderr=subprocess.STDOUT)


def _ready(url: str, server: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while _batches(url) < 0:
        assert server.poll() is None and time.time() < deadline, f"the server did not start: {log.read_text()}"
        time.sleep(0.2)


def _batches(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.loads(response.read())["batches"]
    except OSError:
        return -1


def _wait_for_batches(url: str, count: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while _batches(url) < count:
        assert time.time() < deadline, f"{url} scored fewer than {count} batches"
        time.sleep(0.02)


def _overrides(url: str, retries: int) -> dict:
    return {"ppo": {"reward": f"{url}/score", "reward_auth_env": None, "reward_retries": retries,
                    "iterations": ITERATIONS, "eval_every": 1, "checkpoint_every": ITERATIONS}}


def _each_iteration_logged_once(pipeline_run_id: str) -> None:
    (ppo_run,) = [r for r in lineage.stage_runs(pipeline_run_id) if r.data.tags["rlhf.stage"] == "ppo"]
    assert ppo_run.info.status == "FINISHED"
    client = tracking.client()
    for name, steps in (("objective/scores", range(1, ITERATIONS + 1)), ("eval/score", range(ITERATIONS + 1))):
        logged = sorted(m.step for m in client.get_metric_history(ppo_run.info.run_id, name))
        assert logged == list(steps), name


@pytest.fixture(scope="module")
def rm_folder(full_run) -> Path:
    return tracking.download(lineage.outputs_of(full_run)["reward_model"])


def test_ppo_rides_out_a_reward_server_killed_and_restarted(full_run, rm_folder, tmp_path):
    from flows.rlhf import rlhf

    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "server.log"
    servers = [_start(rm_folder, port, log)]
    _ready(url, servers[0], log)

    def kill_and_restart() -> None:
        _wait_for_batches(url, 2)  # the baseline evaluation and the first rollout
        servers[0].kill()
        servers[0].wait()
        time.sleep(1.0)
        servers.append(_start(rm_folder, port, log))

    killer = threading.Thread(target=kill_and_restart, daemon=True)
    killer.start()
    try:
        run_id = rlhf(preset="tiny", stages=["ppo"], from_run=full_run, overrides=_overrides(url, retries=8))
        killer.join(timeout=60)
        assert len(servers) == 2 and servers[0].returncode == -9
        assert _batches(url) >= 1  # the restarted server scored the rest of the run
        _each_iteration_logged_once(run_id)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_a_reward_server_that_never_comes_back_stops_ppo_with_a_checkpoint(full_run, rm_folder, tmp_path):
    from flows.rlhf import rlhf

    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "server.log"
    server = _start(rm_folder, port, log)
    _ready(url, server, log)
    runs = rlhf_home() / "runs"
    before = set(runs.glob("*/ppo/checkpoints"))

    def kill() -> None:
        _wait_for_batches(url, 3)  # the baseline evaluation, the first rollout and its evaluation
        server.kill()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        with pytest.raises(RewardServerUnavailable) as stopped:
            rlhf(preset="tiny", stages=["ppo"], from_run=full_run, overrides=_overrides(url, retries=2))
        message = str(stopped.value)
        assert "\n" not in message
        assert message.startswith(f"stage ppo stopped after iteration 1: reward server {url}/score unreachable "
                                  f"after 3 tries")
        (checkpoints,) = set(runs.glob("*/ppo/checkpoints")) - before
        assert checkpoint.latest(checkpoints).name == "iter-000001" and str(checkpoint.latest(checkpoints)) in message

        server = _start(rm_folder, port, log)  # back: the resumed run continues from the checkpoint
        _ready(url, server, log)
        killed = checkpoints.parents[1].name
        assert rlhf(preset="tiny", stages=["ppo"], overrides=_overrides(url, retries=2), resume=killed) == killed
        _each_iteration_logged_once(killed)
    finally:
        server.kill()
        server.wait()


class _AnswersThenFails(BaseHTTPRequestHandler):
    """A reward server that scores its first `answered` requests (0 for every row) and answers 500
    to every one after them."""

    answered = 3
    seen = 0

    def do_POST(self):
        rows = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        type(self).seen += 1
        ok = type(self).seen <= self.answered
        body = json.dumps({"scores": [0.0] * rows} if ok else {"error": "down"}).encode()
        self.send_response(200 if ok else 500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_two_deepspeed_ranks_stop_together_when_one_ranks_reward_request_fails(full_run):
    """Two ranks each score their share: the baseline evaluation (one request per rank) and one
    rank's first rollout are answered, the other rank's first rollout is refused. Both ranks stop
    at the same iteration boundary, write one checkpoint together and end with the URL named; a
    rank stopping alone would leave the other waiting in its next collective."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AnswersThenFails)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    cfg = load_config("tiny", ["ppo.launch.world_size=2", "ppo.launch.deepspeed=zero2", "ppo.iterations=2",
                               "ppo.rollout_batch_size=8", "ppo.minibatch_size=4", f"ppo.reward={url}",
                               "ppo.reward_retries=0", "ppo.eval_every=2"])
    pipeline = run_writers.PipelineRun.start(cfg, ["ppo"], full_run)
    try:
        with pytest.raises(StageLaunchError) as stopped:
            execute("ppo", cfg, pipeline.run_id, lineage.outputs_of(full_run))
    finally:
        pipeline.finish("FAILED")
        server.shutdown()
    assert _AnswersThenFails.seen == 4
    message = str(stopped.value)
    assert f"stage ppo stopped after iteration 0: reward server {url}" in message
    assert "iter-000000" in message
