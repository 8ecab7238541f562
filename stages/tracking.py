"""MLflow bookkeeping: a parent run per pipeline run, a child run per stage, registered versions.

Everything goes through an explicit `MlflowClient` and run ids (never MLflow's thread-local
"active run"), so stages behave the same in Prefect worker threads, in subprocess ranks and
when rerun alone on an earlier pipeline run's artifacts.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

from stages.config import REPO_ROOT, PipelineConfig, rlhf_home

PIPELINE_TAG = "rlhf.kind"
OUTPUTS_TAG = "rlhf.outputs"
CONTRACT_TAG = "rlhf.contract"  # passed | failed, set by the gate after the stage (data_contracts)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{rlhf_home() / 'mlflow.db'}"


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def client():
    _quiet_mlflow()
    from mlflow import MlflowClient

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow_client, name: str) -> str:
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if "MLFLOW_TRACKING_URI" not in os.environ:  # embedded store: artifacts beside the database
        location = (rlhf_home() / "mlartifacts" / name).as_uri()
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
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


def download(uri: str) -> Path:
    """A local path for an artifact URI (`runs:/…`, `models:/…`, `file:…`, `s3://…`)."""
    _quiet_mlflow()
    import mlflow.artifacts

    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith("models:/"):  # resolve through our registry, not MLflow's global default
        name, version = uri.removeprefix("models:/").split("/")
        uri = client().get_model_version_download_uri(name, version)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, tracking_uri=tracking_uri()))


def log_params(mlflow_client, run_id: str, params: dict) -> None:
    """Log a nested dict as flat `section.key` params (MLflow caps a value at 6000 chars)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
    for start in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[start : start + 100])


class StageRun:
    """One stage's MLflow run, plus the local working folder of that stage."""

    def __init__(self, mlflow_client, run_id: str, stage: str, workdir: Path, pipeline_run_id: str):
        self.client, self.run_id, self.stage = mlflow_client, run_id, stage
        self.workdir, self.pipeline_run_id = workdir, pipeline_run_id
        self.workdir.mkdir(parents=True, exist_ok=True)

    # -- logging ---------------------------------------------------------------------------
    def log_params(self, params: dict) -> None:
        log_params(self.client, self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_file: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_input_rows(self, rows: list[dict], *, name: str, source: str, digest: str, context: str) -> None:
        """Record a data split as an MLflow dataset input of this run (`mlflow.log_input`)."""
        import mlflow.data
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag

        frame = pd.DataFrame(
            [{k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v for k, v in row.items()} for row in rows]
        )
        with warnings.catch_warnings():  # schema hints and "source can be read in several ways"
            warnings.simplefilter("ignore")
            dataset = mlflow.data.from_pandas(frame, source=source, name=name, digest=f"{digest}-{name}"[:36])
            entity = dataset._to_mlflow_entity()
        tag = InputTag(key="mlflow.data.context", value=context)
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(entity, tags=[tag])])

    # -- outputs ---------------------------------------------------------------------------
    def artifact_uri(self, path: str) -> str:
        return f"runs:/{self.run_id}/{path}"

    def register(self, kind: str, artifact_path: str, prefix: str, lineage: dict[str, str]) -> str:
        """Register `<prefix>-<kind>` from this run's artifacts; returns `models:/name/version`."""
        from mlflow.exceptions import MlflowException

        name = f"{prefix}-{kind}"
        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                raise
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        tags = {k: str(v) for k, v in lineage.items()}
        version = self.client.create_model_version(name, source=source, run_id=self.run_id, tags=tags)
        return f"models:/{name}/{version.version}"

    def finish(self, status: str, outputs: dict | None = None) -> None:
        if outputs is not None:
            self.client.set_tag(self.run_id, OUTPUTS_TAG, json.dumps(outputs))
        self.client.set_terminated(self.run_id, status=status)


class PipelineRun:
    """The MLflow parent run of one pipeline run; stages are its child runs."""

    def __init__(self, mlflow_client, run_id: str, cfg: PipelineConfig):
        self.client, self.run_id, self.cfg = mlflow_client, run_id, cfg

    @classmethod
    def start(cls, cfg: PipelineConfig, stages: list[str], from_run: str | None = None) -> PipelineRun:
        mlflow_client = client()
        exp = experiment_id(mlflow_client, cfg.experiment)
        tags = {
            PIPELINE_TAG: "pipeline",
            "rlhf.preset": cfg.preset,
            "rlhf.stages": ",".join(stages),
            "rlhf.config_hash": cfg.config_hash(),
            "rlhf.git_commit": git_commit(),
        }
        if from_run:
            tags["rlhf.from_run"] = from_run
        run = mlflow_client.create_run(exp, tags=tags, run_name=f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
        log_params(mlflow_client, run.info.run_id, cfg.model_dump(mode="json"))
        return cls(mlflow_client, run.info.run_id, cfg)

    @classmethod
    def reopen(cls, cfg: PipelineConfig, run_id: str) -> PipelineRun:
        """Continue a pipeline run that failed or was killed: same run, same working folders
        (so a training stage finds its checkpoints)."""
        mlflow_client = client()
        for stage in stage_runs(run_id):
            if stage.info.status == "RUNNING":  # its process died: the run never finished
                mlflow_client.set_terminated(stage.info.run_id, status="KILLED")
        mlflow_client.update_run(run_id, status="RUNNING")
        mlflow_client.set_tag(run_id, "rlhf.resumed", time.strftime("%Y-%m-%dT%H:%M:%S"))
        return cls(mlflow_client, run_id, cfg)

    @property
    def workdir(self) -> Path:
        return rlhf_home() / "runs" / self.run_id

    def stage(self, name: str) -> StageRun:
        exp = self.client.get_run(self.run_id).info.experiment_id
        tags = {"mlflow.parentRunId": self.run_id, PIPELINE_TAG: "stage", "rlhf.stage": name,
                "rlhf.git_commit": git_commit(), "rlhf.preset": self.cfg.preset}
        run = self.client.create_run(exp, tags=tags, run_name=name)
        return StageRun(self.client, run.info.run_id, name, self.workdir / name, self.run_id)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def stage_runs(pipeline_run_id: str) -> list:
    """Child runs of a pipeline run, newest first."""
    mlflow_client = client()
    parent = mlflow_client.get_run(pipeline_run_id)
    return mlflow_client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{pipeline_run_id}'",
        order_by=["attributes.start_time DESC"],
    )


def finished_stages(pipeline_run_id: str) -> set[str]:
    return {run.data.tags["rlhf.stage"] for run in stage_runs(pipeline_run_id)
            if run.info.status == "FINISHED" and OUTPUTS_TAG in run.data.tags}


def outputs_of(pipeline_run_id: str) -> dict[str, str]:
    """Everything the finished stages of an earlier pipeline run produced (URIs by name)."""
    merged: dict[str, str] = {}
    for run in reversed(stage_runs(pipeline_run_id)):  # oldest first: later stages win
        tags = run.data.tags
        if tags.get(CONTRACT_TAG) == "failed" and tags.get(f"{CONTRACT_TAG}_mode", "stop") == "stop":
            continue  # its gate stopped the pipeline: its outputs feed nothing
        if run.info.status == "FINISHED" and OUTPUTS_TAG in tags:
            merged.update(json.loads(run.data.tags[OUTPUTS_TAG]))
    return merged


def resume_plan(pipeline_run_id: str) -> tuple[dict[str, str], list[str]]:
    """(inputs, stages still to run) of a pipeline run being resumed: the outputs of the run it
    was started from, then its own finished stages' outputs; its stages not finished yet."""
    tags = client().get_run(pipeline_run_id).data.tags
    inputs = outputs_of(tags["rlhf.from_run"]) if tags.get("rlhf.from_run") else {}
    inputs.update(outputs_of(pipeline_run_id))
    done = finished_stages(pipeline_run_id)
    return inputs, [name for name in tags.get("rlhf.stages", "").split(",") if name and name not in done]


def latest_pipeline_run(cfg: PipelineConfig) -> str | None:
    mlflow_client = client()
    found = mlflow_client.get_experiment_by_name(cfg.experiment)
    if found is None:
        return None
    runs = mlflow_client.search_runs(
        [found.experiment_id],
        filter_string=f"tags.`{PIPELINE_TAG}` = 'pipeline' and tags.`rlhf.preset` = '{cfg.preset}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None
