"""End to end, as a user runs it: `rlhf up` starts a Prefect server, an MLflow tracking server
(artifacts in an S3 bucket on a real S3-API server) and `rlhf serve` on loopback; `prefect
deployment run` runs rlhf/full on the tiny preset (its PPO stage on its own deployment), then
rlhf/ppo from that run, unchanged (skipped) and as vanilla PPO; `rlhf runs` and `rlhf compare`
read them back; `rlhf down` stops every process `rlhf up` started."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from leaks import leaks, mlflow_texts
from stages.orchestration import lineage, tracking
from stages.orchestration.launch import free_port

STAGES = ["data", "sft", "reward", "critic", "ppo"]
SMALL = {
    "sft": {"max_steps": 2},
    "reward": {"max_steps": 2},
    "critic": {"max_steps": 2},
    "ppo": {"iterations": 2, "eval_every": 1, "samples_every": 2, "checkpoint_every": 2},
}
BUCKET = "rlhf-served"


@dataclass
class Stack:
    env: dict[str, str]  # what a user's shell has after `rlhf up`: PREFECT_API_URL, MLFLOW_TRACKING_URI
    state: dict  # the state file `rlhf up` wrote
    home: Path


def _command(name: str, *args: str, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name(name)), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, rlhf_home, s3_server, hh_file):
    home = tmp_path_factory.mktemp("served-home")
    (rlhf_home / "cache").mkdir(exist_ok=True)
    (home / "cache").symlink_to(rlhf_home / "cache")  # the tiny model and tokenizer, built once per session
    s3_server.client().create_bucket(Bucket=BUCKET)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    # A fresh home, and stage skipping as users get it (the rest of the suite turns it off).
    env.update(RLHF_HOME=str(home), PREFECT_HOME=str(home / "prefect"), PREFECT_TASKS_REFRESH_CACHE="false",
               **s3_server.env)
    out = _command("rlhf", "up", "--preset", "tiny", "--prefect-port", str(free_port()), "--mlflow-port",
                   str(free_port()), "--artifacts", f"s3://{BUCKET}/mlflow", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    state = json.loads((home / "services" / "state.json").read_text())
    env.update(state["env"])
    try:
        with pytest.MonkeyPatch.context() as patch:  # this process reads the same MLflow server
            patch.setenv("MLFLOW_TRACKING_URI", state["env"]["MLFLOW_TRACKING_URI"])
            yield Stack(env, state, home)
    finally:
        _command("rlhf", "down", env=env)


def _deployment_run(stack: Stack, deployment: str, parameters: dict) -> str:
    """`prefect deployment run NAME --params … --watch`; returns the MLflow pipeline run it made."""
    out = _command("prefect", "deployment", "run", deployment, "--params", json.dumps(parameters), "--watch",
                   "--watch-interval", "2", env=stack.env, timeout=900)
    assert out.returncode == 0 and "Completed" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    return lineage.pipeline_run_of_flow_run("rlhf", flow_run_id).info.run_id


def _snapshot(pipeline_run_id: str) -> tuple:
    client = tracking.client()
    run = client.get_run(pipeline_run_id)
    children = sorted((r.info.run_id, r.info.status, tuple(sorted(r.data.tags.items())))
                      for r in lineage.stage_runs(pipeline_run_id))
    return run.info.status, sorted(run.data.tags.items()), children


@pytest.fixture(scope="module")
def runs(stack):
    routed = {**SMALL, "orchestration": {"deployments": {"ppo": "rlhf/ppo"}}}
    full = _deployment_run(stack, "rlhf/full", {"stages": STAGES, "overrides": routed})
    after_full = _snapshot(full)
    skipped = _deployment_run(stack, "rlhf/ppo", {"from_run": full, "overrides": SMALL})
    vanilla = _deployment_run(stack, "rlhf/ppo", {"from_run": full,
                                                  "overrides": {**SMALL, "ppo": {**SMALL["ppo"], "preset": "vanilla"}}})
    return {"full": full, "skipped": skipped, "vanilla": vanilla, "full_before_reruns": after_full}


def _stage_tag(pipeline_run_id: str, stage: str) -> tuple[str, str]:
    return lineage.recorded_stages(tracking.client().get_run(pipeline_run_id))[stage]


def test_full_deployment_runs_every_stage_and_its_gpu_stage_on_its_own_deployment(runs, s3_server):
    client = tracking.client()
    full = client.get_run(runs["full"])
    assert full.info.status == "FINISHED" and full.data.tags["rlhf.stages"] == ",".join(STAGES)
    children = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(runs["full"])}
    assert set(children) == {"data", "sft", "reward", "critic"}
    for stage, run in children.items():
        assert run.info.status == "FINISHED"
        assert _stage_tag(runs["full"], stage) == ("ran", run.info.run_id)
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied by the MLflow server

    # PPO ran as a flow run of rlhf/ppo, a pipeline run of its own started from this one.
    how, ppo_run_id = _stage_tag(runs["full"], "ppo")
    assert how == "deployed"
    ppo = client.get_run(ppo_run_id)
    child_pipeline = client.get_run(ppo.data.tags["mlflow.parentRunId"])
    assert child_pipeline.data.tags["rlhf.from_run"] == runs["full"]

    outputs = lineage.outputs_of(runs["full"])
    name, version = outputs["policy_model"].removeprefix("models:/").split("/")
    version_tags = client.get_model_version(name, version).tags
    assert version_tags["rlhf.input.sft_model"] == outputs["sft_model"]
    assert version_tags["rlhf.input.critic_model"] == outputs["critic_model"]
    # Every model went to the bucket through the server (boto3) and came back for the next stage.
    keys = set(s3_server.objects(BUCKET))
    for kind in ("sft", "reward", "critic", "policy"):
        model_id = outputs[f"{kind}_model_artifact"].removeprefix("models:/")
        assert any(f"/models/{model_id}/artifacts/" in key and key.endswith("/model.safetensors") for key in keys), kind


def test_ppo_from_run_with_nothing_changed_reuses_the_stage_and_leaves_the_old_run_alone(runs):
    client = tracking.client()
    skipped = client.get_run(runs["skipped"])
    assert skipped.info.status == "FINISHED"
    assert skipped.data.tags["rlhf.from_run"] == runs["full"]
    full_outputs = lineage.outputs_of(runs["full"])
    assert json.loads(skipped.data.tags["rlhf.inputs"]) == full_outputs  # every input resolved from that run
    assert _stage_tag(runs["skipped"], "ppo") == ("reused", full_outputs["ppo_run"])
    assert lineage.stage_runs(runs["skipped"]) == []  # nothing ran
    assert lineage.outputs_of(runs["skipped"])["policy_model"] == full_outputs["policy_model"]
    assert _snapshot(runs["full"]) == runs["full_before_reruns"]


def test_ppo_from_run_with_a_changed_config_runs_on_that_runs_models(runs):
    client = tracking.client()
    how, ppo_run_id = _stage_tag(runs["vanilla"], "ppo")
    assert how == "ran"
    assert client.get_run(ppo_run_id).data.params["ppo.preset"] == "vanilla"
    full_outputs, outputs = lineage.outputs_of(runs["full"]), lineage.outputs_of(runs["vanilla"])
    assert outputs["policy_model"] != full_outputs["policy_model"]
    name, version = outputs["policy_model"].removeprefix("models:/").split("/")
    version_tags = client.get_model_version(name, version).tags
    assert version_tags["rlhf.input.sft_model"] == full_outputs["sft_model"]
    assert version_tags["rlhf.pipeline_run"] == runs["vanilla"]


def test_runs_lists_stages_status_and_headline_metrics(stack, runs):
    out = _command("rlhf", "runs", "--preset", "tiny", env=stack.env)
    assert out.returncode == 0, out.stderr
    blocks = {block.split()[0]: block for block in out.stdout.split("\n\n")}
    assert {runs["full"], runs["skipped"], runs["vanilla"]} <= set(blocks)
    assert re.search(r"\n  ppo +reused +" + lineage.outputs_of(runs["full"])["ppo_run"], blocks[runs["skipped"]])
    number = r"-?[\d.]+(?:e-?\d+)?"  # the paired score delta comes with its interval
    assert re.search(rf"\n  ppo +deployed .*eval/score {number} → {number} +eval/score_delta {number} "
                     rf"\[{number}, {number}\] +eval/score_delta_lc {number} \[{number}, {number}\] +eval/kl ",
                     blocks[runs["full"]]), blocks[runs["full"]]
    assert re.search(r"\n  reward +FINISHED .*eval/accuracy ", blocks[runs["full"]])


def test_compare_prints_the_headline_table_and_writes_the_curves(stack, runs, tmp_path):
    png = tmp_path / "compare.png"
    out = _command("rlhf", "compare", runs["full"], runs["vanilla"], "--png", str(png), env=stack.env)
    assert out.returncode == 0, out.stderr
    assert re.search(r"param +ppo\.preset +ppo-max +vanilla", out.stdout)
    assert re.search(r"param +ppo\.switches\.score_mode +normalise +none", out.stdout)
    for metric in ("eval/score", "eval/kl", "eval/response_length", "eval/eos_rate", "eval/perplexity"):
        assert re.search(rf"\n\w+ +{re.escape(metric)} +-?[\d.]+ +-?[\d.]+", out.stdout), metric
    number = r"[-+\d.e]+"  # the PPO score delta comes with its interval (the eval stage's: test_ppo_stage)
    assert re.search(rf"\nppo +eval/score_delta +{number} \[{number}, {number}\] +{number} \[", out.stdout), out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_credentials_stay_out_of_mlflow(runs, s3_server):
    client = tracking.client()
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    texts = mlflow_texts(client.search_runs([experiment]), client.search_model_versions())
    assert leaks(s3_server.credentials.values(), texts=texts, blobs=s3_server.objects(BUCKET)) == []


def test_servers_listen_on_loopback_only(stack):
    """`rlhf up` without --host: every socket its processes (and their workers) listen on is on
    loopback. (test_security.py checks the command lines for other hosts.)"""
    processes = [psutil.Process(record["pid"]) for record in stack.state["processes"].values()]
    listening = {(conn.laddr.ip, conn.laddr.port) for proc in processes for p in (proc, *proc.children(recursive=True))
                 for conn in p.net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN}
    ports = {int(url.rsplit(":", 1)[1].split("/")[0]) for url in stack.state["urls"].values()}
    assert ports <= {port for _, port in listening}  # the Prefect and MLflow servers' ports
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, listening


def test_the_prefect_ui_calls_the_api_on_its_own_port(stack):
    """`rlhf up --prefect-port N`: the UI's settings point its browser code at port N, not 4200."""
    import urllib.request

    prefect_url = stack.state["urls"]["prefect"]
    with urllib.request.urlopen(f"{prefect_url}/ui-settings", timeout=30) as response:
        settings = json.loads(response.read())
    assert settings["api_url"] == f"{prefect_url}/api"


def test_rlhf_run_reports_to_the_servers_rlhf_up_started(stack):
    """A user's shell without the exports: `rlhf run` still lands its flow run in the Prefect
    server's database, where the UI shows it."""
    import urllib.request

    def flow_runs() -> set[str]:
        request = urllib.request.Request(f"{stack.state['env']['PREFECT_API_URL']}/flow_runs/filter",
                                         data=json.dumps({"limit": 200}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return {run["id"] for run in json.loads(response.read())}

    before = flow_runs()
    env = {key: value for key, value in stack.env.items() if not key.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    out = _command("rlhf", "run", "--preset", "tiny", "--stages", "data", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(flow_runs() - before) == 1


def test_down_stops_every_process_it_started(stack):
    processes = [psutil.Process(record["pid"]) for record in stack.state["processes"].values()]
    descendants = [child for proc in processes for child in proc.children(recursive=True)]
    out = _command("rlhf", "down", env=stack.env)
    assert out.returncode == 0 and out.stdout.strip() == "stopped prefect, mlflow, serve", out.stdout + out.stderr
    assert not any(proc.is_running() for proc in processes + descendants)
    assert not (stack.home / "services" / "state.json").exists()
    for url in stack.state["urls"].values():
        port = int(re.search(r":(\d+)", url.removeprefix("http://")).group(1))
        with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
            socket.create_connection(("127.0.0.1", port), timeout=5)
