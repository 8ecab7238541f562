"""The `rlhf` Prefect flow: one task per stage, in pipeline order. Orchestration only — the ML
lives in `stages/`, which never imports Prefect."""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from pathlib import Path
from typing import Any

import requests
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.states import Cancelled

from data_contracts import ContractError, check_handoff
from flows import services
from stages.leaves.config import PipelineConfig, rlhf_home
from stages.leaves.interrupt import StageInterrupted
from stages.leaves.tags import FLOW_RUN_TAG
from stages.orchestration import lineage, registry, run_writers, runs, tracking, tracking_queue
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import StageLaunchError, execute

# What a stage is retried on (orchestration.retries times): its ranks crashed, or a connection
# to MLflow, the artifact store or the Prefect API dropped. Anything else (a gate, a bad config,
# a training error) would fail the same way again.
INFRASTRUCTURE_ERRORS = (StageLaunchError, ConnectionError, TimeoutError, requests.exceptions.ConnectionError)


def retry_on_infrastructure_errors(task, task_run, state) -> bool:
    return isinstance(state.result(raise_on_failure=False), INFRASTRUCTURE_ERRORS)


def stage_cache_key(context, parameters: dict[str, Any]) -> str:
    """A stage is skipped when it ran before on the same inputs with the same config: its key is
    the stage, the URIs it reads, the hash of the config sections it depends on and the MLflow
    store those URIs live in."""
    stage, cfg, inputs = parameters["stage"], parameters["cfg"], parameters["inputs"]
    key = {"stage": stage, "inputs": {name: inputs[name] for name in registry.get(stage).inputs if name in inputs},
           "config": registry.get(stage).config_hash(cfg), "store": tracking.tracking_uri()}
    return f"{stage}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}"


def result_storage() -> Path | str:
    """Where the stage tasks' results (their outputs: the cache that lets a rerun skip a stage)
    persist: `$RLHF_RESULTS`, an absolute folder (shared storage such as NFS when stages run on
    several hosts) or a Prefect storage block (`s3-bucket/rlhf-results`); else the RLHF home."""
    configured = os.environ.get("RLHF_RESULTS")
    if not configured:
        return rlhf_home() / "prefect-results"
    return Path(configured) if Path(configured).expanduser().is_absolute() else configured


def use_aws_credentials_block() -> None:
    """With RLHF_AWS_CREDENTIALS_BLOCK=<name>, put the credentials of that prefect-aws
    `AwsCredentials` block (and its endpoint URL) into this process's environment, where boto3
    (MLflow's S3 artifact store) and the stages' ranks read them; they never reach MLflow."""
    name = os.environ.get("RLHF_AWS_CREDENTIALS_BLOCK")
    if not name:
        return
    from prefect_aws import AwsCredentials  # deferred: the optional s3 extra

    block = AwsCredentials.load(name)
    secret = block.aws_secret_access_key
    values = {"AWS_ACCESS_KEY_ID": block.aws_access_key_id,
              "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret else None,
              "AWS_SESSION_TOKEN": block.aws_session_token, "AWS_DEFAULT_REGION": block.region_name,
              "MLFLOW_S3_ENDPOINT_URL": block.aws_client_parameters.endpoint_url}
    os.environ.update({key: value for key, value in values.items() if value})


def stage_task(name: str):
    """The Prefect task of a stage; its result is the stage's outputs (URIs and its MLflow run id
    `<stage>_run`), cached under stage_cache_key. Stages that run models carry the tag `gpu`, so
    a Prefect concurrency limit on that tag bounds how many run at once."""
    return task(execute, name=name, task_run_name=name, cache_key_fn=stage_cache_key, result_serializer="json",
                tags=["gpu"] if registry.get(name).gpu else [])


def contract_gate(stage: str, outputs: dict[str, Any], cfg: PipelineConfig) -> bool:
    """The data contract after `stage` (data_contracts); publishes its summary as a Prefect
    artifact. Raises ContractError when it fails and contracts.mode is `stop`."""
    try:
        report = check_handoff(stage, outputs, cfg)
    except ContractError as err:
        create_markdown_artifact(err.report.markdown(), key=f"contract-{stage}",
                                 description=f"data contract after {stage}: failed")
        raise
    if report is None:
        return True
    create_markdown_artifact(report.markdown(), key=f"contract-{stage}",
                             description=f"data contract after {stage}: {'passed' if report.success else 'failed (warn)'}")
    if not report.success:
        print(f"WARNING (contracts: warn, continuing): {report.message()}")
    elif any(not suite.success for suite in report.suites):  # a judge that cannot judge, the others stand
        print(f"WARNING: {report.message()}")
    return report.success


def gate_task(name: str):
    """The contract gate after stage `name`. Never retried: the same data fails the same way."""
    return task(contract_gate, name=f"gate-{name}", task_run_name=f"gate-{name}", retries=0)


def run_stage(name: str, cfg: PipelineConfig, pipeline: run_writers.PipelineRun, inputs: dict[str, Any],
              force: bool) -> dict[str, Any]:
    """Run stage `name`, or reuse the stage run that an earlier pipeline run made with the same
    cache key; record which in the pipeline run (`rlhf.stage.<name>`) and gate what ran."""
    spec = registry.get(name)
    configured = stage_task(name).with_options(
        # force reruns; otherwise Prefect's PREFECT_TASKS_REFRESH_CACHE decides (off by default)
        refresh_cache=force or None,
        result_storage=result_storage(),
        retries=cfg.orchestration.retries,
        retry_delay_seconds=cfg.orchestration.retry_delay_seconds,
        retry_condition_fn=retry_on_infrastructure_errors,
    )
    state = configured(name, cfg, pipeline.run_id, inputs, return_state=True)
    produced = state.result()
    reused = state.name == "Cached"
    if reused and not lineage.reusable(produced[spec.run_output], gated=bool(spec.contract)):
        produced = configured.with_options(refresh_cache=True)(name, cfg, pipeline.run_id, inputs)
        reused = False
    pipeline.record_stage(name, produced[spec.run_output], "reused" if reused else "ran")
    if f"{name}_summary" in produced:  # a stage's own report (eval): its markdown summary, linking to it
        with tracking.fetched(produced[f"{name}_summary"]) as summary:
            create_markdown_artifact(summary.read_text(), key=f"{name}-report",
                                     description=f"{name} report, MLflow run {produced[spec.run_output]}")
    if reused:
        print(f"stage {name}: unchanged inputs and config, reusing stage run {produced[spec.run_output]}")
    elif spec.contract:  # stops the flow here on failure (contracts.mode: stop)
        gate_task(name)(name, produced, cfg)
    return produced


def run_on_deployment(name: str, deployment: str, parameters: dict[str, Any], cfg: PipelineConfig,
                      pipeline: run_writers.PipelineRun) -> dict[str, Any]:
    """Run stage `name` as a flow run of its own deployment (e.g. on the GPU work pool), from
    this pipeline run's outputs so far; record its stage run here and return its outputs."""
    child = run_deployment(deployment, parameters={**parameters, "stages": [name], "from_run": pipeline.run_id},
                           # a retried parent finds the child it started instead of starting another
                           idempotency_key=f"{flow_run.id}-{name}")
    if not child.state.is_completed():
        raise RuntimeError(f"stage {name}: flow run {child.name} of deployment {deployment} ended {child.state.name}")
    _, stage_run_id = lineage.recorded_stages(lineage.pipeline_run_of_flow_run(cfg.experiment, str(child.id)))[name]
    pipeline.record_stage(name, stage_run_id, "deployed")
    return lineage.stage_outputs(stage_run_id)


def failure_lines(pipeline_run_id: str, stage: str, err: Exception) -> list[str]:
    """How a pipeline run that failed in `stage` ends: where the full traceback is, the stage and
    the one-line reason, and the fix: the error's own `fix` where it has one, else to read the
    traceback and resume. `rlhf run` prints these lines; they are the run's MLflow description."""
    first_line = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    fix = getattr(err, "fix", None)
    reason = first_line if fix and first_line else f"{type(err).__name__}: {first_line}".rstrip(": ")
    fix = fix or (f"read the traceback, remove its cause, then continue the run: "
                  f"{services.command('rlhf')} run --resume {pipeline_run_id}")
    return [f"Pipeline run {pipeline_run_id} failed (full traceback in MLflow: run {pipeline_run_id}, artifact "
            f"{run_writers.TRACEBACK_ARTIFACT})", f"Stage {stage} failed: {reason}", f"Fix: {fix}"]


def _summary(cfg: PipelineConfig, pipeline_run_id: str, outputs: dict[str, Any]) -> str:
    rows = "\n".join(f"| {name} | `{value}` |" for name, value in outputs.items())
    return (
        f"# RLHF pipeline run `{pipeline_run_id}`\n\n"
        f"Preset **{cfg.preset}**, MLflow tracking URI `{tracking.tracking_uri()}`, experiment `{cfg.experiment}`.\n\n"
        f"| output | URI |\n|---|---|\n{rows}\n"
    )


def _check_stages(cfg: PipelineConfig, stages: list[str]) -> None:
    """An unknown stage name, or a setting a later stage cannot run with, fails before the first
    stage runs."""
    unknown = [name for name in stages if name not in registry.STAGES]
    if unknown:
        raise ValueError(registry.unknown_stage_message(unknown))
    for name in stages:
        registry.get(name).check(cfg)


@flow(name="rlhf", log_prints=True)
def rlhf(
    preset: str = "demo",
    overrides: dict[str, Any] | list[str] | None = None,
    stages: list[str] | None = None,
    from_run: str | None = None,
    resume: str | None = None,
    force: bool = False,
    study: str | None = None,
    arm: str | None = None,
) -> str:
    """Run the pipeline stages in order; returns the MLflow run id of this pipeline run.

    overrides: `{"sft": {"lr": 1e-5}}` or `{"sft.lr": 1e-5}`. stages: a subset of the stage
    names (default: the pipeline's, registry.pipeline_names()). from_run: a previous pipeline run id (or `latest`) whose outputs feed
    the stages not run here. resume: a failed or killed pipeline run id to continue, with
    the config it started with (preset and overrides are not read): its finished stages are kept, the others run again in its folders (training resumes from the
    last good checkpoint). force: run every stage, even one whose inputs and config match an
    earlier run's (by default such a stage is skipped and its earlier outputs are used). study,
    arm: this run is arm `arm` of the study whose MLflow run id is `study` (flows/study.py).
    """
    # A resumed run continues with the config it started with (its preset and overrides).
    cfg = lineage.recorded_config(resume) if resume else load_config(preset, overrides)
    use_aws_credentials_block()
    if resume:
        if from_run:
            raise ValueError("give from_run or resume, not both")
        inputs, remaining = lineage.resume_plan(resume)
        stages = [name for name in (stages or remaining) if name in remaining]
    else:
        stages = stages or registry.pipeline_names()
    _check_stages(cfg, stages)
    if from_run == "latest":
        from_run = lineage.latest_pipeline_run(cfg)
        if from_run is None:
            raise ValueError(f"from_run=latest: no finished pipeline run of preset '{cfg.preset}' yet")
    if resume:
        pipeline = run_writers.PipelineRun.reopen(cfg, resume)
    else:
        inputs = lineage.outputs_of(from_run) if from_run else {}
        pipeline = run_writers.PipelineRun.start(cfg, stages, from_run, inputs,
                                              extra_tags={FLOW_RUN_TAG: str(flow_run.id)}, study=study, arm=arm)
    print(f"pipeline run {pipeline.run_id} (MLflow {tracking.tracking_uri()})")
    try:
        for name in registry.names():
            if name not in stages:
                continue
            reason = registry.get(name).skipped(cfg)
            if reason:
                print(f"stage {name}: not run ({reason})")
                continue
            deployment = cfg.orchestration.deployments.get(name) if len(stages) > 1 else None
            if deployment:  # a run of that one stage runs it in place
                parameters = {"preset": preset, "overrides": overrides, "force": force}
                produced = run_on_deployment(name, deployment, parameters, cfg, pipeline)
            else:
                produced = run_stage(name, cfg, pipeline, inputs, force)
            inputs = {**inputs, **produced}
    except StageInterrupted as err:  # stopped on request at a step boundary (stages/leaves/interrupt.py)
        pipeline.finish("KILLED")
        message = f"{err}. Resume with: {services.command('rlhf')} run --resume {pipeline.run_id}"
        print(message)
        return Cancelled(message=message)
    except BaseException as err:
        if not isinstance(err, tracking_queue.TrackingUnavailable):  # else there is nowhere to record it
            if isinstance(err, Exception):
                try:
                    pipeline.record_failure(name, "\n\n".join(failure_lines(pipeline.run_id, name, err)),
                                            "".join(traceback.format_exception(err)))
                except Exception as unrecorded:  # the stage's own error is what the run ends with
                    print(f"WARNING: the failure of stage {name} is not in MLflow ({unrecorded})")
            pipeline.finish("FAILED")
        raise
    ending = runs.ending(pipeline.run_id)
    pipeline.log_metrics(ending.metrics)
    pipeline.describe(ending.markdown)
    pipeline.finish("FINISHED")
    create_markdown_artifact(_summary(cfg, pipeline.run_id, inputs) + f"\n```\n{ending.text}\n```\n",
                             key="rlhf-pipeline-run", description=f"RLHF pipeline run {pipeline.run_id}")
    return pipeline.run_id


def deployments(preset: str):
    """`rlhf/full` and one deployment per stage (each reads the other stages' outputs from
    `from_run`, by default the latest finished pipeline run of the preset)."""
    out = [rlhf.to_deployment(name="full", parameters={"preset": preset})]
    for name, spec in registry.STAGES.items():
        if spec.deployed:
            out.append(rlhf.to_deployment(name=name, parameters={"preset": preset, "stages": [name], "from_run": "latest"}))
    return out
