"""Shared by the pipeline tests: PPO's metric names (TRL's), a pipeline run's stage run, a model
version's tags, a real MLflow tracking server to stop and start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from stages.orchestration import lineage, tracking
from stages.orchestration.launch import free_port

TRL_NAMES = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
             "loss/value_avg", "loss/ptx_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens",
             "lr", "episode", "eps", "policy/perplexity", "policy/ref_perplexity", "policy/response_length",
             "policy/response_length_p90"]


def stage_run(pipeline_run_id: str, stage: str):
    return next(run for run in lineage.stage_runs(pipeline_run_id) if run.data.tags["rlhf.stage"] == stage)


def version_tags(uri: str) -> dict:
    name, version = uri.removeprefix("models:/").split("/")
    return tracking.client().get_model_version(name, version).tags


class MlflowServer:
    """A real `mlflow server` on a free loopback port over the session's SQLite store."""

    def __init__(self, home: Path):
        self.home, self.port, self.proc = home, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{self.home / 'mlflow.db'}",
               "--artifacts-destination", str(self.home / "mlflow-server-artifacts")]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{self.uri}/health", timeout=5).ok:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy starting
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, at once
            self.proc.wait()
