"""Shared fixtures: a private RLHF home (cache + MLflow SQLite store) and a real Prefect server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.sources import default_data_dir

HH_FILE = (default_data_dir() or Path("/nonexistent")) / "hh-rlhf" / "harmless-base-test.jsonl.gz"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
def hh_file() -> Path:
    if not HH_FILE.exists():
        pytest.skip(f"shared data not found at {HH_FILE}")
    return HH_FILE
