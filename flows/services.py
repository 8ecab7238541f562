"""`rlhf up` and `rlhf down`: a Prefect server, an MLflow tracking server and `rlhf serve` on this
machine, as background processes. Their ids and URLs go into a state file under the RLHF home,
so `rlhf down` stops exactly the processes `rlhf up` started (and what they started)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import shutil

from stages.leaves import allocator
from stages.leaves.config import REPO_ROOT, rlhf_home


class ServicesError(RuntimeError):
    """The services could not be started (or are up already); the message says why."""


@dataclass
class Service:
    name: str
    command: list[str]
    url: str  # what a user opens
    ready: str  # answers 200 once the service is up
    env: dict[str, str]


def state_dir() -> Path:
    return rlhf_home() / "services"


def prefect_home() -> str:
    """Where `rlhf up`'s Prefect server and `rlhf run`'s ephemeral API keep their database: the same
    folder, so the UI shows the flow runs of both."""
    return str(rlhf_home() / "prefect")


def running_env() -> dict[str, str]:
    """PREFECT_API_URL and MLFLOW_TRACKING_URI of the servers `rlhf up` started, if they still run."""
    if not _state_file().exists():
        return {}
    state = json.loads(_state_file().read_text())
    if "env" not in state or not all(_running(record) for record in state["processes"].values()):
        return {}
    return state["env"] if _answers(f"{state['env']['PREFECT_API_URL']}/health") else {}


def _state_file() -> Path:
    return state_dir() / "state.json"


def _bin(name: str) -> str:
    """A console script of this environment (beside the running interpreter)."""
    return str(Path(sys.executable).with_name(name))


def command(name: str) -> str:
    """How a printed next step calls a console script of this environment so that it works when
    pasted: bare when the shell finds this one on PATH, else its path (relative below the current
    folder: `.venv/bin/rlhf`)."""
    path = Path(_bin(name))
    if shutil.which(name) == str(path):
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: closed connections don't count
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def services(preset: str, host: str, prefect_port: int, mlflow_port: int, artifacts: str) -> list[list[Service]]:
    """The services in waves: the two servers, then `rlhf serve`, which talks to both."""
    home = rlhf_home()
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # where a client connects
    prefect_url, mlflow_url = f"http://{client_host}:{prefect_port}", f"http://{client_host}:{mlflow_port}"
    base = {**os.environ, "PREFECT_HOME": os.environ.get("PREFECT_HOME", prefect_home())}
    clients = {**base, "PREFECT_API_URL": f"{prefect_url}/api", "MLFLOW_TRACKING_URI": mlflow_url}
    # The UI's browser code calls the API at PREFECT_UI_API_URL, which Prefect otherwise derives
    # from its default port 4200: set it to the port this server listens on.
    prefect_env = {**base, "PREFECT_UI_API_URL": f"{prefect_url}/api"}
    servers = [
        Service("prefect", [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)],
                prefect_url, f"{prefect_url}/api/health", prefect_env),
        # The same SQLite store as `rlhf run` without a server, so both kinds of runs show up in
        # one UI; artifacts are proxied by the server to a folder or an S3 bucket (boto3, with
        # MLFLOW_S3_ENDPOINT_URL and the AWS_* variables of this environment).
        Service("mlflow", [_bin("mlflow"), "server", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
                           "--artifacts-destination", artifacts, "--host", host, "--port", str(mlflow_port),
                           "--workers", "1"],
                mlflow_url, f"{mlflow_url}/health", base),
    ]
    serve = Service("serve", [sys.executable, "-m", "flows.cli", "serve", "--preset", preset],
                    f"{prefect_url}/deployments", f"{prefect_url}/api/deployments/name/rlhf/full",
                    allocator.environment(clients))  # its flow runs train
    return [servers, [serve]]


def _running(record: dict) -> psutil.Process | None:
    """The recorded process if it still runs (the same process: its start time matches)."""
    try:
        proc = psutil.Process(record["pid"])
        return proc if abs(proc.create_time() - record["started"]) < 1 else None
    except psutil.NoSuchProcess:
        return None


def _stop(proc: psutil.Process, timeout: float = 20) -> None:
    """Terminate a service (SIGTERM to its process group: each one shuts down cleanly on it); kill
    what is left of it and of what it started after `timeout`."""
    try:
        everything = [proc, *proc.children(recursive=True)]
        os.killpg(proc.pid, signal.SIGTERM)  # its own group: started with start_new_session
    except (psutil.NoSuchProcess, ProcessLookupError):
        return
    _, alive = psutil.wait_procs(everything, timeout=timeout)
    for left in alive:
        try:
            left.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def up(preset: str, host: str = "127.0.0.1", prefect_port: int = 4200, mlflow_port: int = 5000,
       artifacts: str | None = None, timeout: float = 300) -> dict:
    """Start the services and wait until each answers; returns the state recorded (written as
    each process starts, so `rlhf down` finds it even if this is interrupted)."""
    if _state_file().exists():
        if any(_running(record) for record in json.loads(_state_file().read_text())["processes"].values()):
            raise ServicesError(f"already up (state in {_state_file()}): run `rlhf down` first")
    for port in (prefect_port, mlflow_port):
        if not _port_free(host, port):
            raise ServicesError(f"port {port} on {host} is in use: choose another (--prefect-port / --mlflow-port)")
    artifacts = artifacts or str(rlhf_home() / "mlartifacts")
    state_dir().mkdir(parents=True, exist_ok=True)
    state = {"processes": {}, "urls": {}, "logs": {}, "preset": preset, "artifacts": artifacts}
    for wave in services(preset, host, prefect_port, mlflow_port, artifacts):
        procs = {}
        for service in wave:
            log = state_dir() / f"{service.name}.log"
            with open(log, "w") as out:
                procs[service.name] = subprocess.Popen(service.command, env=service.env, cwd=REPO_ROOT, stdout=out,
                                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                       start_new_session=True)
            state["processes"][service.name] = {"pid": procs[service.name].pid,
                                                "started": psutil.Process(procs[service.name].pid).create_time()}
            state["urls"][service.name], state["logs"][service.name] = service.url, str(log)
            _state_file().write_text(json.dumps(state, indent=1))
        deadline = time.monotonic() + timeout
        for service in wave:
            proc = procs[service.name]
            while not _answers(service.ready):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with {proc.returncode}" if proc.poll() is not None
                           else f"did not answer in {timeout:.0f} s")
                    down()
                    log = Path(state["logs"][service.name])
                    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
                    raise ServicesError(f"{service.name} {why}; log {log}:\n{tail}")
                time.sleep(1)
    state["env"] = {"PREFECT_API_URL": f"{state['urls']['prefect']}/api",
                    "MLFLOW_TRACKING_URI": state["urls"]["mlflow"]}
    _state_file().write_text(json.dumps(state, indent=1))
    return state


def down() -> list[str]:
    """Stop the services `rlhf up` recorded; returns the names of those that were running."""
    if not _state_file().exists():
        return []
    state = json.loads(_state_file().read_text())
    running = {name: proc for name, record in state["processes"].items() if (proc := _running(record))}
    for proc in reversed(running.values()):  # `serve` first, while the servers it talks to still answer
        _stop(proc)
    _state_file().unlink()
    return list(running)
