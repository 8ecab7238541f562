"""Tracking calls that ride out an unreachable MLflow server: retried with backoff within a
patience, or queued in order (and spooled to the stage's folder) to be sent once it is back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from stages.orchestration.tracking import tracking_uri


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
    MLFLOW_HTTP_REQUEST_MAX_RETRIES per request): QueuedCalls backs off itself, between tries."""
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


class QueuedCalls:
    """The tracking calls of one run, made through an explicit client.

    Every call rides out an unreachable tracking server: it is retried with exponential backoff
    until the server has been unreachable for `patience_s`, then TrackingUnavailable. Queued calls
    (`_queue`) do not wait: they are sent, in order, by the next call that finds the server back.
    The queue is kept in `workdir` too (`SPOOL`): a process that dies before the server is back
    leaves it to the next attempt of the same run (`_replay_spooled`)."""

    MAX_BACKOFF_S = 30.0
    SPOOL = "pending_calls.json"

    def __init__(self, mlflow_client, run_id: str, workdir: Path, pipeline_run_id: str, patience_s: float):
        self.client, self.run_id = mlflow_client, run_id
        self.workdir, self.pipeline_run_id, self.patience_s = workdir, pipeline_run_id, patience_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pending: list = []  # queued (client method, args, kwargs) not yet delivered, oldest first
        self._owns_spool = False  # this writer wrote (or took over) `SPOOL`, so deletes it once delivered
        self._logged: set[tuple[str, int]] = set()  # (metric, step) the run held already (skip_logged_steps)
        self._down_since: float | None = None  # when the server became unreachable
        self._backoff_s = 1.0
        self._next_try = 0.0

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
