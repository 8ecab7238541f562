"""Lineage queries: what a pipeline run recorded, read back. Its stage runs, their outputs, which
a later run may reuse, the config it ran with, what a resume still has to run, and the pipeline
runs of an experiment.
"""

from __future__ import annotations

import json

from stages.leaves.config import PipelineConfig
from stages.orchestration.config_loading import load_config, upgrade_recorded
from stages.leaves.tags import (CONTRACT_TAG, FLOW_RUN_TAG, INPUTS_TAG, OUTPUTS_TAG, PIPELINE_TAG, PRESET_TAG, STAGES_TAG,
                                STAGE_TAG, STAGE_TAG_PREFIX)
from stages.orchestration.tracking import CONFIG_ARTIFACT, client, experiment_id, fetched


def stage_runs(pipeline_run_id: str) -> list:
    """Child runs of a pipeline run, newest first."""
    mlflow_client = client()
    parent = mlflow_client.get_run(pipeline_run_id)
    return mlflow_client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{pipeline_run_id}'",
        order_by=["attributes.start_time DESC"],
    )


def recorded_stages(pipeline_run) -> dict[str, tuple[str, str]]:
    """Stage name → (how, stage run id), from a pipeline run's `rlhf.stage.*` tags."""
    out = {}
    for key, value in pipeline_run.data.tags.items():
        if key.startswith(STAGE_TAG_PREFIX):
            how, _, run_id = value.partition(":")
            out[key.removeprefix(STAGE_TAG_PREFIX)] = (how, run_id)
    return out


def _feeds_later_stages(run) -> bool:
    tags = run.data.tags
    if tags.get(CONTRACT_TAG) == "failed" and tags.get(f"{CONTRACT_TAG}_mode", "stop") == "stop":
        return False  # its gate stopped the pipeline: its outputs feed nothing
    return run.info.status == "FINISHED" and OUTPUTS_TAG in tags


def reusable(stage_run_id: str, gated: bool) -> bool:
    """Whether a later pipeline run may skip a stage by reusing this finished stage run: it still
    exists, its outputs feed later stages and, for a stage with a contract, its gate passed."""
    from mlflow.exceptions import MlflowException  # deferred: MLflow

    try:
        run = client().get_run(stage_run_id)
    except MlflowException:
        return False
    passed = not gated or run.data.tags.get(CONTRACT_TAG) == "passed"
    return run.info.lifecycle_stage == "active" and _feeds_later_stages(run) and passed


def stage_outputs(stage_run_id: str) -> dict[str, str]:
    return json.loads(client().get_run(stage_run_id).data.tags[OUTPUTS_TAG])


def pipeline_run_of_flow_run(experiment: str, flow_run_id: str):
    """The pipeline run that a Prefect flow run made."""
    mlflow_client = client()
    runs = mlflow_client.search_runs([experiment_id(mlflow_client, experiment)],
                                     filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'", max_results=1)
    if not runs:
        raise LookupError(f"no pipeline run made by Prefect flow run {flow_run_id}")
    return runs[0]


def outputs_of(pipeline_run_id: str) -> dict[str, str]:
    """Everything an earlier pipeline run had at its end (URIs by name): what it started from,
    then the outputs of its stages (its own finished child runs and the stage runs it reused or
    had its deployments run), later ones winning."""
    mlflow_client = client()
    parent = mlflow_client.get_run(pipeline_run_id)
    merged: dict[str, str] = json.loads(parent.data.tags.get(INPUTS_TAG, "{}"))
    elsewhere = [mlflow_client.get_run(run_id) for how, run_id in recorded_stages(parent).values() if how != "ran"]
    for run in sorted(elsewhere + stage_runs(pipeline_run_id), key=lambda r: r.info.start_time):
        if _feeds_later_stages(run):
            merged.update(json.loads(run.data.tags[OUTPUTS_TAG]))
    return merged


def recorded_config(pipeline_run_id: str) -> PipelineConfig:
    """The resolved config a pipeline run started with (its config.json); for a run made before
    that artifact existed, its preset's defaults."""
    from mlflow.exceptions import MlflowException  # deferred: MLflow

    try:
        with fetched(f"runs:/{pipeline_run_id}/{CONFIG_ARTIFACT}") as recorded_file:
            recorded = json.loads(recorded_file.read_text())
        return PipelineConfig.model_validate(upgrade_recorded(recorded))
    except (MlflowException, OSError):
        return load_config(client().get_run(pipeline_run_id).data.tags[PRESET_TAG])


def resume_plan(pipeline_run_id: str) -> tuple[dict[str, str], list[str]]:
    """(inputs, stages still to run) of a pipeline run being resumed: everything it has so far
    (outputs_of); its stages neither finished nor reused yet."""
    parent = client().get_run(pipeline_run_id)
    done = set(recorded_stages(parent)) | {run.data.tags[STAGE_TAG] for run in stage_runs(pipeline_run_id)
                                           if run.info.status == "FINISHED" and OUTPUTS_TAG in run.data.tags}
    stages = parent.data.tags.get(STAGES_TAG, "").split(",")
    return outputs_of(pipeline_run_id), [name for name in stages if name and name not in done]


def pipeline_runs(experiment: str, preset: str | None = None, finished: bool = False, max_results: int = 20) -> list:
    """Pipeline runs (parent runs) of an experiment, newest first."""
    mlflow_client = client()
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        return []
    where = [f"tags.`{PIPELINE_TAG}` = 'pipeline'"]
    if preset:
        where.append(f"tags.`{PRESET_TAG}` = '{preset}'")
    if finished:
        where.append("attributes.status = 'FINISHED'")
    return mlflow_client.search_runs([found.experiment_id], filter_string=" and ".join(where),
                                     order_by=["attributes.start_time DESC"], max_results=max_results)


def latest_pipeline_run(cfg: PipelineConfig) -> str | None:
    runs = pipeline_runs(cfg.experiment, cfg.preset, finished=True, max_results=1)
    return runs[0].info.run_id if runs else None
