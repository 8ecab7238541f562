"""The `rlhf` Prefect flow: one task per stage, in pipeline order. Orchestration only — the ML
lives in `stages/`, which never imports Prefect."""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from data_contracts import HANDOFFS, ContractError, check_handoff
from stages import tracking
from stages.config import PipelineConfig, load_config
from stages.launch import STAGE_MODULES, execute

STAGES = list(STAGE_MODULES)

# One Prefect task per stage. A stage failure is never retried automatically: a training or
# gate failure would only fail again, and a rerun with from_run resumes from its artifacts.
STAGE_TASKS = {name: task(execute, name=name, task_run_name=name, retries=0) for name in STAGES}


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
    return report.success


# A gate is never retried: the same data fails the same way.
GATE_TASKS = {name: task(contract_gate, name=f"gate-{name}", task_run_name=f"gate-{name}", retries=0)
              for name in STAGES if name in HANDOFFS}


def _summary(cfg: PipelineConfig, pipeline_run_id: str, outputs: dict[str, Any]) -> str:
    rows = "\n".join(f"| {name} | `{value}` |" for name, value in outputs.items())
    return (
        f"# RLHF pipeline run `{pipeline_run_id}`\n\n"
        f"Preset **{cfg.preset}**, MLflow tracking URI `{tracking.tracking_uri()}`, experiment `{cfg.experiment}`.\n\n"
        f"| output | URI |\n|---|---|\n{rows}\n"
    )


@flow(name="rlhf", log_prints=True)
def rlhf(
    preset: str = "demo",
    overrides: dict[str, Any] | list[str] | None = None,
    stages: list[str] | None = None,
    from_run: str | None = None,
    resume: str | None = None,
) -> str:
    """Run the pipeline stages in order; returns the MLflow run id of this pipeline run.

    overrides: `{"sft": {"lr": 1e-5}}` or `{"sft.lr": 1e-5}`. stages: a subset of the stage
    names (default: all). from_run: a previous pipeline run id (or `latest`) whose outputs feed
    the stages not run here. resume: a failed or killed pipeline run id to continue: its
    finished stages are kept, the others run again in its folders (training resumes from the
    last good checkpoint).
    """
    cfg = load_config(preset, overrides)
    if resume:
        if from_run:
            raise ValueError("give from_run or resume, not both")
        inputs, remaining = tracking.resume_plan(resume)
        stages = [name for name in (stages or remaining) if name in remaining]
    else:
        stages = stages or STAGES
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; stages: {', '.join(STAGES)}")
    if from_run == "latest":
        from_run = tracking.latest_pipeline_run(cfg)
        if from_run is None:
            raise ValueError(f"from_run=latest: no finished pipeline run of preset '{cfg.preset}' yet")
    if resume:
        pipeline = tracking.PipelineRun.reopen(cfg, resume)
    else:
        inputs = tracking.outputs_of(from_run) if from_run else {}
        pipeline = tracking.PipelineRun.start(cfg, stages, from_run)
    print(f"pipeline run {pipeline.run_id} (MLflow {tracking.tracking_uri()})")
    try:
        for name in STAGES:
            if name in stages:
                produced = STAGE_TASKS[name](name, cfg, pipeline.run_id, inputs)
                if name in GATE_TASKS:  # stops the flow here on failure (contracts.mode: stop)
                    GATE_TASKS[name](name, produced, cfg)
                inputs = {**inputs, **produced}
    except BaseException:
        pipeline.finish("FAILED")
        raise
    pipeline.finish("FINISHED")
    create_markdown_artifact(_summary(cfg, pipeline.run_id, inputs), key="rlhf-pipeline-run",
                             description=f"RLHF pipeline run {pipeline.run_id}")
    return pipeline.run_id


def deployments(preset: str):
    """`rlhf/full` and one deployment per stage (each reads the other stages' outputs from
    `from_run`, by default the latest finished pipeline run of the preset)."""
    out = [rlhf.to_deployment(name="full", parameters={"preset": preset})]
    for name in STAGES:
        if name != "data":
            out.append(rlhf.to_deployment(name=name, parameters={"preset": preset, "stages": [name], "from_run": "latest"}))
    return out
