"""MLflow bookkeeping: a parent run per pipeline run, a child run per stage, registered versions.

Everything goes through an explicit `MlflowClient` and run ids (never MLflow's thread-local
"active run"), so stages behave the same in Prefect worker threads, in subprocess ranks and
when rerun alone on an earlier pipeline run's artifacts.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from stages import mlflow_models, registry
from stages.config import REPO_ROOT, PipelineConfig, load_config, rlhf_home, upgrade_recorded
from stages.tags import (ARM_TAG, CONFIG_HASH_TAG, CONTRACT_TAG, DATA_DIGEST_TAG, DESCRIPTION_TAG, FAILED_STAGE_TAG,
                         FLOW_RUN_TAG, FROM_RUN_TAG, GIT_COMMIT_TAG, INPUTS_TAG, INPUT_TAG_PREFIX, OUTPUTS_TAG,
                         PIPELINE_RUN_TAG, PIPELINE_TAG, PRESET_TAG, RESUMED_FROM_TAG, RESUMED_TAG, STAGES_TAG,
                         STAGE_TAG, STAGE_TAG_PREFIX, STUDY_TAG)

CONFIG_ARTIFACT = "config.json"  # on a pipeline run: the resolved config it ran with (a resume reuses it)
TRACEBACK_ARTIFACT = "logs/traceback.txt"  # on a failed pipeline run and its failed stage run


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


HUB_SOURCE = re.compile(r"hf://datasets/(?P<repo>[^@\s]+)@(?P<revision>[0-9a-f]+)(?:/(?P<path>\S+))?")


def _dataset_source(source: str):
    """MLflow's source of a split: a hub data set's files (`hf://datasets/<repo>@<commit>/<path>`,
    stages.loading's name for them) as MLflow's Hugging Face source, which no resolver makes from
    the string; anything else as the string, resolved by MLflow."""
    found = HUB_SOURCE.fullmatch(source.split(" (")[0])
    if found is None:
        return source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource  # deferred: MLflow

    return HuggingFaceDatasetSource(found["repo"], data_files=found["path"], revision=found["revision"])

class TrackingUnavailable(RuntimeError):
    """The tracking server stayed unreachable for longer than the stage's patience."""


def _unreachable(err: Exception) -> bool:
    """Whether a tracking call failed for want of a server (worth retrying), not because the
    server refused the request."""
    import requests  # deferred, as MLflow
    from mlflow.exceptions import MlflowException

    if isinstance(err, (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout)):
        return True
    # How MLflow's REST client reports a refused connection, a timeout or a 5xx after its retries.
    failed = re.match(r"API request to \S+ failed with (timeout )?exception", str(err))
    return isinstance(err, MlflowException) and failed is not None


@contextlib.contextmanager
def _no_http_retries():
    """MLflow's HTTP client retries a dead server for minutes inside one call (7 retries; it reads
    MLFLOW_HTTP_REQUEST_MAX_RETRIES per request): a StageRun backs off itself, between tries."""
    saved = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
        else:
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = saved


def _spooled_call(name: str, args: tuple, kwargs: dict) -> dict:
    """A queued client call as JSON (no pickle: the spool is data, read back without running code):
    `log_batch`'s metrics as [key, value, timestamp, step], a table's frame as its columns."""
    kwargs = dict(kwargs)
    if "metrics" in kwargs:
        kwargs["metrics"] = [[m.key, m.value, m.timestamp, m.step] for m in kwargs["metrics"]]
    if hasattr(kwargs.get("data"), "to_dict"):
        kwargs["data"] = kwargs["data"].to_dict(orient="list")
    return {"name": name, "args": list(args), "kwargs": kwargs}


def _queued_call(spooled: dict) -> tuple[str, tuple, dict]:
    """`_spooled_call` read back: (client method name, args, kwargs)."""
    from mlflow.entities import Metric  # deferred: MLflow

    kwargs = dict(spooled["kwargs"])
    if "metrics" in kwargs:
        kwargs["metrics"] = [Metric(*m) for m in kwargs["metrics"]]
    return spooled["name"], tuple(spooled["args"]), kwargs


class StageRun:
    """One stage's MLflow run, plus the local working folder of that stage.

    Every tracking call rides out an unreachable tracking server: it is retried with exponential
    backoff until the server has been unreachable for `patience_s`, then TrackingUnavailable.
    Metrics, sample tables and `log_artifact(..., buffered=True)` do not wait: they are queued and
    sent, in order, by the next call that finds the server back, so training goes on meanwhile.
    The queue is kept in the stage's folder too (`pending_calls.json`): a process that dies before
    the server is back leaves it to the resumed attempt (`start_attempt`), whose checkpoint may be
    past the steps those metrics belong to."""

    MAX_BACKOFF_S = 30.0
    SPOOL = "pending_calls.json"

    def __init__(self, mlflow_client, run_id: str, stage: str, workdir: Path, pipeline_run_id: str,
                 patience_s: float = 600.0):
        self.client, self.run_id, self.stage = mlflow_client, run_id, stage
        self.workdir, self.pipeline_run_id, self.patience_s = workdir, pipeline_run_id, patience_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pending: list = []  # queued (client method, args, kwargs) not yet delivered, oldest first
        self._owns_spool = False  # this StageRun wrote (or took over) `SPOOL`, so deletes it once delivered
        self._logged: set[tuple[str, int]] = set()  # (metric, step) the run held already (skip_logged_steps)
        self._down_since: float | None = None  # when the server became unreachable
        self._backoff_s = 1.0
        self._next_try = 0.0

    # -- riding out an unreachable server --------------------------------------------------------
    def _try(self, fn, *args, **kwargs) -> tuple[bool, Any]:
        """(True, result) of one tracking call; (False, None) when the server is unreachable and the
        patience is not spent yet (the next try is due after an exponentially growing backoff)."""
        try:
            with _no_http_retries():
                result = fn(*args, **kwargs)
        except Exception as err:
            if not _unreachable(err):
                raise
            now = time.monotonic()
            self._down_since = self._down_since or now
            if now - self._down_since >= self.patience_s:
                raise TrackingUnavailable(
                    f"MLflow tracking server {tracking_uri()} unreachable for {now - self._down_since:.0f} s, longer "
                    f"than orchestration.tracking_patience_s={self.patience_s:g}; {len(self._pending)} queued calls "
                    f"undelivered (kept in {self.workdir / self.SPOOL}). Its local files, checkpoints included, stay "
                    f"in {self.workdir}: `rlhf run --resume "
                    f"{self.pipeline_run_id}` continues once the server is back. Last error: {err}") from err
            self._next_try = now + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, self.MAX_BACKOFF_S)
            return False, None
        self._down_since, self._backoff_s, self._next_try = None, 1.0, 0.0
        return True, result

    def _call(self, fn, *args, **kwargs):
        """A tracking call, after the queued ones; waits (backing off) while the server is unreachable."""
        self.flush()
        while True:
            done, result = self._try(fn, *args, **kwargs)
            if done:
                return result
            time.sleep(max(0.0, self._next_try - time.monotonic()))

    def _queue(self, fn, *args, **kwargs) -> None:
        """A tracking call (a method of the client), now unless the server is unreachable, else
        later (in order)."""
        self._pending.append((fn.__name__, args, kwargs))
        self._send_pending(wait=False)

    def _send_pending(self, wait: bool) -> None:
        try:
            while self._pending:
                if not wait and time.monotonic() < self._next_try:
                    return  # backing off: training goes on, the calls stay queued
                time.sleep(max(0.0, self._next_try - time.monotonic()))
                name, args, kwargs = self._pending[0]
                if self._try(getattr(self.client, name), *args, **kwargs)[0]:
                    self._pending.pop(0)
        finally:
            self._spool()

    def _spool(self) -> None:
        """The queue, written to the stage's folder while it is not empty (atomically); deleted
        once delivered by the StageRun that wrote it or took it over (`_replay_spooled`): the
        launching process's StageRun of a stage that runs as ranks leaves rank 0's alone."""
        path = self.workdir / self.SPOOL
        if self._pending:
            tmp = path.with_name(f".{self.SPOOL}.tmp")
            tmp.write_text(json.dumps({"run_id": self.run_id, "calls": [_spooled_call(*c) for c in self._pending]}))
            os.replace(tmp, path)
            self._owns_spool = True
        elif self._owns_spool:
            path.unlink(missing_ok=True)
            self._owns_spool = False

    def _replay_spooled(self) -> None:
        """Queue the calls a dead attempt of this run left undelivered, but no (metric, step) the
        run holds already: the resumed attempt logs none of them again either."""
        path = self.workdir / self.SPOOL
        if not path.exists():
            return
        spooled = json.loads(path.read_text())
        self._owns_spool = True
        if spooled["run_id"] != self.run_id:  # another run's (a fresh attempt in a new run)
            path.unlink()
            return
        for name, args, kwargs in map(_queued_call, spooled["calls"]):
            if name == "log_batch":
                metrics = [m for m in kwargs["metrics"] if (m.key, m.step) not in self._logged]
                if not metrics:
                    continue
                self._logged.update((m.key, m.step) for m in metrics)
                kwargs = {**kwargs, "metrics": metrics}
            self._pending.append((name, args, kwargs))
        self._send_pending(wait=False)

    def flush(self) -> None:
        """Deliver the queued calls, waiting while the server is unreachable (within the patience)."""
        self._send_pending(wait=True)

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
        the MLflow model around it (stages/mlflow_models.py), logged as this run's LoggedModel
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
        where.append(f"tags.`rlhf.preset` = '{preset}'")
    if finished:
        where.append("attributes.status = 'FINISHED'")
    return mlflow_client.search_runs([found.experiment_id], filter_string=" and ".join(where),
                                     order_by=["attributes.start_time DESC"], max_results=max_results)


def latest_pipeline_run(cfg: PipelineConfig) -> str | None:
    runs = pipeline_runs(cfg.experiment, cfg.preset, finished=True, max_results=1)
    return runs[0].info.run_id if runs else None
