"""The MLflow run writers: `PipelineRun`, the parent run of one pipeline run, and `StageRun`, a
stage's child run (params, metrics, artifacts, dataset inputs, the model it publishes), and the
names the runs are given.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from stages.compute import mlflow_models
from stages.leaves.config import PipelineConfig, rlhf_home
from stages.orchestration import registry
from stages.orchestration.lineage import stage_runs
from stages.leaves.tags import (ARM_TAG, CONFIG_HASH_TAG, DATA_DIGEST_TAG, DESCRIPTION_TAG, FAILED_STAGE_TAG, FROM_RUN_TAG,
                                GIT_COMMIT_TAG, INPUTS_TAG, INPUT_TAG_PREFIX, OUTPUTS_TAG, PIPELINE_RUN_TAG, PIPELINE_TAG,
                                PRESET_TAG, RESUMED_FROM_TAG, RESUMED_TAG, STAGES_TAG, STAGE_TAG, STAGE_TAG_PREFIX, STUDY_TAG)
from stages.orchestration.tracking import CONFIG_ARTIFACT, client, experiment_id, git_commit, log_params
from stages.orchestration.tracking_queue import QueuedCalls

TRACEBACK_ARTIFACT = "logs/traceback.txt"  # on a failed pipeline run and its failed stage run


HUB_SOURCE = re.compile(r"hf://datasets/(?P<repo>[^@\s]+)@(?P<revision>[0-9a-f]+)(?:/(?P<path>\S+))?")


def _dataset_source(source: str):
    """MLflow's source of a split: a hub data set's files (`hf://datasets/<repo>@<commit>/<path>`,
    stages.compute.loading's name for them) as MLflow's Hugging Face source, which no resolver makes from
    the string; anything else as the string, resolved by MLflow."""
    found = HUB_SOURCE.fullmatch(source.split(" (")[0])
    if found is None:
        return source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource  # deferred: MLflow

    return HuggingFaceDatasetSource(found["repo"], data_files=found["path"], revision=found["revision"])


class StageRun(QueuedCalls):
    """One stage's MLflow run, plus the local working folder of that stage.

    Every tracking call rides out an unreachable tracking server (stages.orchestration.tracking_queue).
    Metrics, sample tables and `log_artifact(..., buffered=True)` do not wait: they are queued and
    sent, in order, by the next call that finds the server back, so training goes on meanwhile.
    The queue is kept in the stage's folder too (`pending_calls.json`): a process that dies before
    the server is back leaves it to the resumed attempt (`start_attempt`), whose checkpoint may be
    past the steps those metrics belong to."""

    def __init__(self, mlflow_client, run_id: str, stage: str, workdir: Path, pipeline_run_id: str,
                 patience_s: float = 600.0):
        super().__init__(mlflow_client, run_id, workdir, pipeline_run_id, patience_s)
        self.stage = stage

    def start_attempt(self, params: dict, resumed_from) -> None:
        """A training stage's start in this run (on the main rank): its params when it starts fresh
        (a resumed attempt keeps the killed one's), the checkpoint folder it resumed from (a Path, or
        None) as the tag `rlhf.resumed_from`, no step logged twice (`skip_logged_steps`), and the
        calls a dead attempt left queued (`pending_calls.json`) delivered."""
        if resumed_from is None:
            self.log_params(params)
        self.set_tags({RESUMED_FROM_TAG: resumed_from.name if resumed_from else "none"})
        self.skip_logged_steps()
        self._replay_spooled()

    def skip_logged_steps(self) -> None:
        """From now on log no (metric, step) that the run already holds: a stage resumed from a
        checkpoint in the run of its killed attempt recomputes the steps between that checkpoint and
        the kill (the same values: the checkpoint restores the RNG), which the run has already."""
        metrics = self._call(self.client.get_run, self.run_id).data.metrics
        self._logged = {(key, m.step) for key in metrics
                        for m in self._call(self.client.get_metric_history, self.run_id, key)}

    # -- logging ---------------------------------------------------------------------------
    def log_params(self, params: dict) -> None:
        self._call(log_params, self.client, self.run_id, params)

    def log_attempt_params(self, params: dict[str, str]) -> None:
        """Params that describe where this attempt runs (precision, hardware, allocator). A
        resumed attempt logs into its killed attempt's run, and MLflow refuses to change a param:
        a value the run holds under `key` (or `key.attempt_<n>`) is kept, a new one is logged as
        the first free `key.attempt_<n>` (n ≥ 2), so every machine the run trained on is there."""
        held = self._call(self.client.get_run, self.run_id).data.params
        new = {}
        for key, value in params.items():
            taken = [name for name in held if name == key or name.startswith(f"{key}.attempt_")]
            if str(value) not in (held[name] for name in taken):
                new[f"{key}.attempt_{len(taken) + 1}" if taken else key] = str(value)
        if new:
            self.log_params(new)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # deferred: MLflow

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if (k, step) not in self._logged]
        if items:
            self._queue(self.client.log_batch, self.run_id, metrics=items)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self._call(self.client.set_tag, self.run_id, key, str(value))

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        self._call(self.client.log_artifacts, self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_file: Path, artifact_path: str | None = None, buffered: bool = False) -> None:
        """buffered: queued like metrics (the file must stay until it is sent)."""
        send = self._queue if buffered else self._call
        send(self.client.log_artifact, self.run_id, str(local_file), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self._call(self.client.log_dict, self.run_id, obj, artifact_file)

    def log_table(self, data, artifact_file: str) -> None:
        self._queue(self.client.log_table, self.run_id, data=data, artifact_file=artifact_file)

    def log_probe(self, frame, name: str) -> str:
        """A probe frame for the data contracts as `contracts/<name>.parquet`; returns its URI."""
        path = self.workdir / "contracts" / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path, index=False)
        self.log_artifact(path, "contracts")
        return self.artifact_uri(f"contracts/{name}.parquet")

    def log_input_rows(self, rows: list[dict], *, name: str, source: str, digest: str, context: str) -> None:
        """Record a data split as an MLflow dataset input of this run (`mlflow.log_input`)."""
        import mlflow.data  # deferred: MLflow
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag

        frame = pd.DataFrame(
            [{k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v for k, v in row.items()} for row in rows]
        )
        with warnings.catch_warnings():  # schema hints and "source can be read in several ways"
            warnings.simplefilter("ignore")
            dataset = mlflow.data.from_pandas(frame, source=_dataset_source(source), name=name,
                                              digest=f"{digest}-{name}"[:36])
            entity = dataset._to_mlflow_entity()
        tag = InputTag(key="mlflow.data.context", value=context)
        self._call(self.client.log_inputs, self.run_id, datasets=[DatasetInput(entity, tags=[tag])])

    # -- outputs ---------------------------------------------------------------------------
    def artifact_uri(self, path: str) -> str:
        return f"runs:/{self.run_id}/{path}"

    def artifact_location(self, path: str) -> str:
        """Where the store keeps artifact `path` of this run (a file:// or s3:// URL, for links)."""
        return f"{self._call(self.client.get_run, self.run_id).info.artifact_uri}/{path}"

    def set_model_alias(self, model_uri: str, alias: str) -> None:
        """Point alias `alias` of a registered model at the version `model_uri` (models:/name/version)."""
        name, version = model_uri.removeprefix("models:/").split("/")
        self._call(self.client.set_registered_model_alias, name, alias, version)

    def provenance(self, inputs: dict, config_hash: str) -> dict[str, str]:
        """The lineage tags every registered model carries: splits, data digest, code, config, pipeline run."""
        return {f"{INPUT_TAG_PREFIX}splits": inputs["splits"], DATA_DIGEST_TAG: inputs.get("data_digest", ""),
                GIT_COMMIT_TAG: git_commit(), CONFIG_HASH_TAG: config_hash,
                PIPELINE_RUN_TAG: self.pipeline_run_id}

    def publish_model(self, save, *, cfg: PipelineConfig, inputs: dict, pack: mlflow_models.Pack,
                      lineage: dict[str, Any] | None = None, inspect=None) -> dict[str, str]:
        """The one way a trained model leaves a stage: `save(folder)` writes it (safetensors and
        tokenizer), `inspect(folder)` (a probe of the saved weights, say) runs on it, `pack` makes
        the MLflow model around it (stages/compute/mlflow_models.py), logged as this run's LoggedModel
        `model`, and that is registered as `<registry_prefix>-<the stage's registers>` with the
        lineage tags: every model input of the stage (`rlhf.input.<name>`), `provenance`, and
        `lineage`. Returns {"<registers>_model": models:/<name>/<version>,
        "<registers>_model_artifact": models:/<model id>}."""
        spec = registry.get(self.stage)
        out = self.workdir / "model"
        shutil.rmtree(out, ignore_errors=True)
        save(out)
        if inspect is not None:
            inspect(out)
        model_id, location = self.log_model(out, pack)
        shutil.rmtree(out)  # the MLflow model is the copy that counts
        tags = {f"{INPUT_TAG_PREFIX}{name}": inputs.get(name, "") for name in spec.inputs if name.endswith("_model")}
        tags.update(self.provenance(inputs, spec.config_hash(cfg)))
        tags.update(lineage or {})
        version = self.register(spec.registers, model_id, location, cfg.registry_prefix, tags)
        return {f"{spec.registers}_model": version, f"{spec.registers}_model_artifact": f"models:/{model_id}"}

    def log_model(self, folder: Path, pack: mlflow_models.Pack) -> tuple[str, str]:
        """`folder` packed as an MLflow model and logged as this run's LoggedModel `model` (what
        `mlflow.<flavor>.log_model` does, through this run's client and outage handling); returns
        (its model id, where the store keeps it)."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus  # deferred: MLflow
        from mlflow.models import Model

        experiment = self._call(self.client.get_run, self.run_id).info.experiment_id
        logged = self._call(self.client.create_logged_model, experiment, name="model", source_run_id=self.run_id)
        packed = self.workdir / "mlflow-model"
        shutil.rmtree(packed, ignore_errors=True)
        try:
            pack(folder, packed, Model(artifact_path=logged.artifact_location, run_id=self.run_id,
                                       model_uuid=logged.model_id, model_id=logged.model_id))
            self._call(self.client.log_model_artifacts, logged.model_id, str(packed))
            self._call(self.client.log_outputs, self.run_id, [LoggedModelOutput(logged.model_id, step=0)])
        except Exception:
            self._call(self.client.finalize_logged_model, logged.model_id, LoggedModelStatus.FAILED)
            raise
        finally:
            shutil.rmtree(packed, ignore_errors=True)
        self._call(self.client.finalize_logged_model, logged.model_id, LoggedModelStatus.READY)
        return logged.model_id, logged.artifact_location

    def register(self, kind: str, model_id: str, location: str, prefix: str, lineage: dict[str, str]) -> str:
        """Register logged model `model_id` (kept at `location`) as a version of `<prefix>-<kind>`;
        returns `models:/name/version`."""
        from mlflow.exceptions import MlflowException  # deferred: MLflow

        name = f"{prefix}-{kind}"
        try:
            self._call(self.client.create_registered_model, name)
        except MlflowException as err:
            if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                raise
        tags = {k: str(v) for k, v in lineage.items()}
        # The source is the logged model's location, not `models:/<model id>`: the SQL registry
        # resolves that URI through MLflow's global default client, not this one (whose store it is).
        version = self._call(self.client.create_model_version, name, source=location, run_id=self.run_id, tags=tags,
                             model_id=model_id)
        return f"models:/{name}/{version.version}"

    def finish(self, status: str, outputs: dict | None = None) -> None:
        if outputs is not None:
            self._call(self.client.set_tag, self.run_id, OUTPUTS_TAG, json.dumps(outputs))
        self._call(self.client.set_terminated, self.run_id, status=status)


def ppo_arm(cfg: PipelineConfig) -> str:
    """What PPO ran as: its preset, and the advantage estimator when it is not GAE."""
    estimator = cfg.ppo.advantage_estimator
    return cfg.ppo.preset + ("" if estimator == "gae" else f", {estimator}")


def study_title(preset: str) -> str:
    """"tiny study"; the study preset's own study is just "study"."""
    return "study" if preset == "study" else f"{preset} study"


def run_title(cfg: PipelineConfig, stages: list[str], from_run: str | None) -> str:
    """A pipeline run's name says what ran: `demo · ppo-max` for the whole pipeline,
    `demo · ppo vanilla rerun of 4ac5fade` (or `demo · ppo-max rerun of …`) for PPO alone on an
    earlier run's artifacts."""
    if set(registry.pipeline_names()) <= set(stages):
        what = ppo_arm(cfg)
    else:
        arm = ppo_arm(cfg) if cfg.ppo.preset.startswith("ppo") else f"ppo {ppo_arm(cfg)}"
        what = ", ".join(arm if name == "ppo" else name for name in stages)
    return f"{cfg.preset} · {what}" + (f" rerun of {from_run[:8]}" if from_run else "")


class PipelineRun:
    """The MLflow parent run of one pipeline run; stages are its child runs."""

    def __init__(self, mlflow_client, run_id: str, cfg: PipelineConfig):
        self.client, self.run_id, self.cfg = mlflow_client, run_id, cfg

    @classmethod
    def start(cls, cfg: PipelineConfig, stages: list[str], from_run: str | None = None,
              inputs: dict[str, str] | None = None, extra_tags: dict[str, str] | None = None,
              study: str | None = None, arm: str | None = None) -> PipelineRun:
        """A new pipeline run; `inputs` (the outputs of `from_run` it starts from) are recorded as
        its tag `rlhf.inputs`, so a later run from this one finds them too. In a study (`study`: the
        study's MLflow run id) it is a child of the study's run, named and tagged by its `arm`."""
        mlflow_client = client()
        exp = experiment_id(mlflow_client, cfg.experiment)
        tags = {
            PIPELINE_TAG: "pipeline",
            PRESET_TAG: cfg.preset,
            STAGES_TAG: ",".join(stages),
            CONFIG_HASH_TAG: cfg.config_hash(),
            GIT_COMMIT_TAG: git_commit(),
            **(extra_tags or {}),
        }
        if from_run:
            tags[FROM_RUN_TAG] = from_run
        if inputs:
            tags[INPUTS_TAG] = json.dumps(inputs)
        title = run_title(cfg, stages, from_run)
        if study:
            tags.update({"mlflow.parentRunId": study, STUDY_TAG: study, ARM_TAG: arm or ""})
            title = f"{study_title(cfg.preset)} · {arm}"
        run = mlflow_client.create_run(exp, tags=tags, run_name=title)
        log_params(mlflow_client, run.info.run_id, cfg.model_dump(mode="json"))
        mlflow_client.log_dict(run.info.run_id, cfg.model_dump(mode="json"), CONFIG_ARTIFACT)
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
        mlflow_client.set_tag(run_id, RESUMED_TAG, time.strftime("%Y-%m-%dT%H:%M:%S"))
        if FAILED_STAGE_TAG in mlflow_client.get_run(run_id).data.tags:  # the failure it resumes from is over
            for tag in (FAILED_STAGE_TAG, DESCRIPTION_TAG):
                mlflow_client.delete_tag(run_id, tag)
        return cls(mlflow_client, run_id, cfg)

    @property
    def workdir(self) -> Path:
        return rlhf_home() / "runs" / self.run_id

    def stage(self, name: str, resumes: bool = False) -> StageRun:
        """A new child run for stage `name`. A stage that `resumes` from its checkpoints continues
        the run of its attempt that was killed or failed instead, so that run holds every step."""
        patience = self.cfg.orchestration.tracking_patience_s
        unfinished = [run for run in stage_runs(self.run_id) if run.data.tags.get(STAGE_TAG) == name
                      and run.info.status in ("KILLED", "FAILED")] if resumes else []
        if unfinished:
            run_id = unfinished[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return StageRun(self.client, run_id, name, self.workdir / name, self.run_id, patience)
        exp = self.client.get_run(self.run_id).info.experiment_id
        tags = {"mlflow.parentRunId": self.run_id, PIPELINE_TAG: "stage", STAGE_TAG: name,
                GIT_COMMIT_TAG: git_commit(), PRESET_TAG: self.cfg.preset}
        run = self.client.create_run(exp, tags=tags, run_name=f"ppo ({ppo_arm(self.cfg)})" if name == "ppo" else name)
        return StageRun(self.client, run.info.run_id, name, self.workdir / name, self.run_id, patience)

    def record_stage(self, name: str, stage_run_id: str, how: str) -> None:
        """Tag which stage run holds stage `name` of this pipeline run, and how (`ran`, `reused`, `deployed`)."""
        self.client.set_tag(self.run_id, f"{STAGE_TAG_PREFIX}{name}", f"{how}:{stage_run_id}")

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Metrics of the pipeline run itself (its stages' headline numbers, for MLflow's run list)."""
        from mlflow.entities import Metric  # deferred: MLflow

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, 0) for key, value in metrics.items()]
        for start in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[start : start + 500])

    def describe(self, markdown: str) -> None:
        """The description MLflow's UI shows first on the run's page."""
        self.client.set_tag(self.run_id, DESCRIPTION_TAG, markdown)

    def record_failure(self, stage: str, description: str, traceback_text: str) -> None:
        """A failed stage: its traceback as the artifact `TRACEBACK_ARTIFACT` of this run and of the
        stage's run (when it got one), and `description` (the failure as `rlhf run` prints it) as the
        description of both."""
        failed = [run for run in stage_runs(self.run_id)
                  if run.data.tags.get(STAGE_TAG) == stage and run.info.status == "FAILED"][:1]
        for run_id in (self.run_id, *(run.info.run_id for run in failed)):
            self.client.log_text(run_id, traceback_text, TRACEBACK_ARTIFACT)
            self.client.set_tag(run_id, DESCRIPTION_TAG, description)
        self.client.set_tag(self.run_id, FAILED_STAGE_TAG, stage)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
