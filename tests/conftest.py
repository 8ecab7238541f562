"""Shared fixtures: a private RLHF home (cache + MLflow SQLite store), a real Prefect server and a
real S3-API server; the tiny model with HH prompts (the PPO trainer tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.orchestration.launch import free_port

# The data the tests read: the offline mirror of the hub's data sets in the project's surroundings
# (CI clones the repository with shared/ beside it; RLHF_TEST_HUB_MIRROR names it for a checkout
# elsewhere). Every process the tests start reads it too, so no test reaches the hub;
# tests/test_hub.py serves it as the hub instead.
HUB_MIRROR = Path(os.environ.get("RLHF_TEST_HUB_MIRROR") or Path(__file__).resolve().parents[2] / "shared" / "hub-mirror")
os.environ["RLHF_DATA_DIR"] = str(HUB_MIRROR)
HH_FILE = HUB_MIRROR / "datasets" / "Anthropic" / "hh-rlhf" / "harmless-base" / "test.jsonl.gz"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests share one RLHF home: a stage another test already ran with the same inputs and config
# would be skipped (flows/rlhf.py caches stages), making what a test sees depend on the order.
# Here every stage runs; the tests of the skip (test_serving.py) turn this off in their processes.
os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"


@pytest.fixture(scope="session", autouse=True)
def rlhf_home(tmp_path_factory) -> Path:
    """One RLHF home per test session: the tiny tokenizer/model cache is built once."""
    home = tmp_path_factory.mktemp("rlhf-home")
    os.environ["RLHF_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    prefect_home = home / "prefect"
    prefect_home.mkdir()
    os.environ["PREFECT_HOME"] = str(prefect_home)
    return home


@pytest.fixture(scope="session")
def prefect_server(rlhf_home):
    """The real Prefect engine against a temporary Prefect server and database."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def full_run(prefect_server) -> str:
    """The whole tiny pipeline through the real Prefect flow: its pipeline run id."""
    from flows.rlhf import rlhf

    return rlhf(preset="tiny", overrides={"sft.epochs": 1})


@pytest.fixture(scope="session")
def hh_file() -> Path:
    if not HH_FILE.exists():
        pytest.skip(f"the hub mirror's HH-RLHF file not found at {HH_FILE}")
    return HH_FILE


@dataclass
class S3Server:
    endpoint: str
    # Fake credentials that no MLflow param, tag or artifact may contain (tests look for them).
    credentials: dict[str, str]

    @property
    def env(self) -> dict[str, str]:
        return {"MLFLOW_S3_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1", **self.credentials}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"])

    def objects(self, bucket: str) -> dict[str, bytes]:
        client = self.client()
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
        return {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-API server over HTTP on loopback (moto's server mode)."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = S3Server(f"http://127.0.0.1:{port}", {"AWS_ACCESS_KEY_ID": "AKIARLHFTESTKEY00042",
                                                     "AWS_SECRET_ACCESS_KEY": "rlhf-test-secret-9f8e7d6c5b4a"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                server.client().list_buckets()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny(hh_file):
    """The tiny preset's model folder (random Llama, BPE tokenizer trained on HH text), its tokenizer
    and 256 encoded HH prompts."""
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs
    from stages.compute.ppo.setup import encode_prompts
    from stages.compute.loading import load_tokenizer, materialise_model

    cfg = load_config("tiny", [f"data.pairs={hh_file}"])
    _, pairs, _ = load_pairs(cfg)
    texts = [t for p in pairs for t in (p["prompt"], p["chosen"], p["rejected"])]
    folder = materialise_model(cfg.model, corpus=lambda: texts)
    tokenizer = load_tokenizer(folder, cfg.model)
    prompts = encode_prompts(tokenizer, pairs[:256], 64)
    return folder, tokenizer, prompts


@pytest.fixture(scope="module")
def reward_model_dir(tiny, tmp_path_factory):
    """A reward model on the tiny preset's model (random head, seed 0), saved as the reward stage saves one."""
    import torch  # deferred: conftest loads before any test needs torch

    from stages.orchestration.config_loading import load_config
    from stages.compute.loading import load_model
    from stages.compute.reward.model import RewardModel, save_reward_model

    folder, tokenizer, _ = tiny
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm")
    save_reward_model(RewardModel(load_model(folder, load_config("tiny").model)), tokenizer, out, {"role": "reward"})
    return str(out)


@pytest.fixture(scope="module")
def splits_outputs():
    """The tiny preset's data stage, run once per module in its own pipeline run: its outputs."""
    from stages.orchestration import run_writers
    from stages.orchestration.config_loading import load_config
    from stages.orchestration.launch import execute

    cfg = load_config("tiny")
    pipeline = run_writers.PipelineRun.start(cfg, ["data"])
    outputs = execute("data", cfg, pipeline.run_id, {})
    pipeline.finish("FINISHED")
    return outputs
