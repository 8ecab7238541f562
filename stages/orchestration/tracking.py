"""The MLflow store: its client and URI, experiments, flat params, and artifacts (where the store
keeps one, and a local copy of it to read).

Everything goes through an explicit `MlflowClient` and run ids (never MLflow's thread-local
"active run"), so stages behave the same in Prefect worker threads, in subprocess ranks and
when rerun alone on an earlier pipeline run's artifacts. Writing runs is stages.orchestration.run_writers';
reading a pipeline run's lineage back, stages.orchestration.lineage's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from stages.compute import mlflow_models
from stages.leaves.config import REPO_ROOT, rlhf_home

CONFIG_ARTIFACT = "config.json"  # on a pipeline run: the resolved config it ran with (a resume reuses it)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{rlhf_home() / 'mlflow.db'}"


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def client():
    _quiet_mlflow()
    from mlflow import MlflowClient  # deferred, as every MLflow import here: `rlhf --help` and the ranks load none

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def artifact_root() -> str | None:
    """Where a new experiment keeps its artifacts: `$RLHF_ARTIFACTS` (a folder, or
    `s3://bucket/prefix`, written and read through boto3 with `MLFLOW_S3_ENDPOINT_URL` and the
    AWS_* variables of the environment); else, with the embedded store, `mlartifacts/` beside the
    database; else (a tracking server) None: the server's own artifact store."""
    root = os.environ.get("RLHF_ARTIFACTS")
    if root:
        return root.rstrip("/") if "://" in root else Path(root).expanduser().resolve().as_uri()
    if "MLFLOW_TRACKING_URI" not in os.environ:
        return (rlhf_home() / "mlartifacts").as_uri()
    return None


# MLflow 3 opens an experiment without this tag in its GenAI view; ours is model training.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment_id(mlflow_client, name: str) -> str:
    root = artifact_root()
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        if any(found.tags.get(key) != value for key, value in EXPERIMENT_KIND.items()):
            for key, value in EXPERIMENT_KIND.items():
                mlflow_client.set_experiment_tag(found.experiment_id, key, value)
        if os.environ.get("RLHF_ARTIFACTS") and not found.artifact_location.startswith(root):
            raise ValueError(f"experiment '{name}' keeps its artifacts in {found.artifact_location}, not under "
                             f"RLHF_ARTIFACTS={root}: an experiment's artifact location is fixed when it is "
                             f"created, so use a new one (--set experiment=<name>)")
        return found.experiment_id
    location = f"{root}/{name}" if root else None
    try:
        return mlflow_client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except Exception:  # created concurrently by another run
        return mlflow_client.get_experiment_by_name(name).experiment_id


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def download(uri: str, into: Path | None = None) -> Path:
    """A local path for an artifact URI (`runs:/…`, `models:/…`, `file:…`, `s3://…`); for an MLflow
    model of ours (`models:/<name>/<version>`, `models:/<name>@<alias>`, a logged model `models:/<model
    id>`, `runs:/<run id>/model`), the Hugging Face folder inside it: what the stages load.

    An artifact the store keeps in a local folder (the embedded store's `mlartifacts/`) is read
    where it is. One behind a tracking server or in a bucket is copied under `into`, a folder of
    the caller's that it removes when done (a stage's `downloads`; the same URI twice: one copy);
    without `into`, under a folder of this process's, removed when it exits. (MLflow's own default,
    a fresh temp folder a download, is never removed: a run of a large model would leave every
    model it read in /tmp.)"""
    _quiet_mlflow()
    import mlflow.artifacts  # deferred: MLflow

    location = storage_location(uri)
    local = _local_path(location)
    # A copy where the store is remote; and for a run's `model` that is a logged model, kept
    # elsewhere than the run's folder: MLflow finds it. A local path that is missing fails where
    # it is read, by its name.
    if local is None or (not local.exists() and uri.startswith("runs:/")):
        into = _process_downloads() if into is None else into
        target = into / hashlib.sha256(uri.encode()).hexdigest()[:16]
        if not target.exists():
            into.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=into))  # complete once renamed
            try:
                mlflow.artifacts.download_artifacts(artifact_uri=uri if uri.startswith("runs:/") else location,
                                                    dst_path=str(partial), tracking_uri=tracking_uri())
                partial.rename(target)
            except OSError:
                if not target.exists():  # else another thread's copy of the same URI got there first
                    raise
            finally:
                shutil.rmtree(partial, ignore_errors=True)
        (local,) = target.iterdir()  # the artifact, under its own name
    return mlflow_models.hf_folder(local) if local.is_dir() else local


@contextlib.contextmanager
def fetched(uri: str):
    """An artifact to read once (a probe, a summary, a config): its local path while the block
    runs; a copy made for it is removed after."""
    with tempfile.TemporaryDirectory(prefix="rlhf-artifact-") as tmp:
        yield download(uri, Path(tmp))


def storage_location(uri: str) -> str:
    """Where the store keeps the artifact of `uri`: `file:…`, `s3://…`, `mlflow-artifacts:…` (a
    tracking server's)."""
    if uri.startswith("models:/"):  # resolve through our tracking store and registry, not MLflow's global default
        return model_location(uri)
    if uri.startswith("runs:/"):
        from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository  # deferred: MLflow

        return RunsArtifactRepository.get_underlying_uri(uri, tracking_uri())
    return uri


def _local_path(location: str) -> Path | None:
    """The local file or folder of a storage location, or None for a remote one."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    return Path(location) if parsed.scheme == "" else None


@functools.cache
def _process_downloads() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="rlhf-downloads-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def model_location(uri: str) -> str:
    """Where the store keeps the MLflow model `models:/<name>/<version>`, `models:/<name>@<alias>` or
    `models:/<model id>`."""
    ref = uri.removeprefix("models:/").rstrip("/")
    mlflow_client = client()
    if "@" in ref:
        name, alias = ref.split("@")
        ref = f"{name}/{mlflow_client.get_model_version_by_alias(name, alias).version}"
    if "/" in ref:
        return mlflow_client.get_model_version_download_uri(*ref.split("/"))
    return mlflow_client.get_logged_model(ref).artifact_location


def log_params(mlflow_client, run_id: str, params: dict) -> None:
    """Log a nested dict as flat `section.key` params (MLflow caps a value at 6000 chars)."""
    from mlflow.entities import Param  # deferred: MLflow

    items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
    for start in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[start : start + 100])
