"""Two pipeline runs at once on one machine and one store: two `rlhf run --preset tiny` processes
started together on a fresh RLHF home (same MLflow SQLite store, same model cache, same Prefect
home and result storage), so both create the stores and ask for the tiny tokenizer and model
before either is cached. Both are forced (`--force`): with the same preset their data stages
share a cache key and would otherwise reuse each other's, while the point is two runs that
really train side by side. Then two unforced runs race to reuse the data stage the forced ones
left. The last test makes processes ask for one cache entry at the very same moment (in the
pipeline runs, the one that starts Prefect first is seconds ahead)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from stages.compute import loading
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config

SMALL = ["--set", "sft.max_steps=2", "--set", "reward.max_steps=2", "--set", "critic.max_steps=2",
         "--set", "ppo.iterations=2", "--set", "ppo.eval_every=1", "--set", "ppo.samples_every=2"]
REGISTERED = {"sft": "sft", "reward": "reward", "critic": "critic", "ppo": "policy"}  # stage → model kind


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env.update(RLHF_HOME=str(home), PREFECT_HOME=str(home / "prefect"), **extra)
    return env


def _together(env: dict[str, str], logs: Path, *args: str, timeout: float = 1800) -> list[tuple[int, str, str]]:
    """Start two `rlhf run --preset tiny ARGS` at the same moment; (exit code, stdout, stderr) of
    each. Output goes to files: a full pipe would stall one run while the other goes on."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for k in range(2):
        out, err = open(logs / f"{k}.out", "w"), open(logs / f"{k}.err", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", *args],
                                       env=env, stdout=out, stderr=err), out, err))
    results = []
    for k, (proc, out, err) in enumerate(procs):
        proc.wait(timeout=timeout)
        out.close(), err.close()
        results.append((proc.returncode, (logs / f"{k}.out").read_text(), (logs / f"{k}.err").read_text()))
    return results


def _pipeline_run(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 0, out[-2000:] + err[-6000:]
    assert "database is locked" not in err
    return re.search(r"Pipeline run (\w+) finished", out).group(1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A fresh RLHF home, read by this process too (tracking.client())."""
    home = tmp_path_factory.mktemp("concurrent-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLHF_HOME", str(home))
        patch.setenv("PREFECT_HOME", str(home / "prefect"))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield home


@pytest.fixture(scope="module")
def forced(store, hh_file):
    """The two forced runs started together; their pipeline run ids."""
    started = time.monotonic()
    results = _together(_env(store), store.parent / f"{store.name}-logs", "--force", *SMALL)
    print(f"two concurrent forced tiny runs: {time.monotonic() - started:.0f} s")
    return [_pipeline_run(result) for result in results]


def test_both_runs_train_every_stage_in_their_own_runs_and_folders(forced, store):
    client = tracking.client()
    assert forced[0] != forced[1]
    stage_runs = {}
    for pipeline in forced:
        recorded = lineage.recorded_stages(client.get_run(pipeline))
        assert sorted(recorded) == sorted(["data", "sft", "reward", "critic", "ppo", "eval"])
        for stage, (how, run_id) in recorded.items():
            run = client.get_run(run_id)
            assert how == "ran" and run.data.tags["mlflow.parentRunId"] == pipeline, (stage, how)
            assert run.info.status == "FINISHED"
            stage_runs[run_id] = pipeline
        assert (store / "runs" / pipeline).is_dir()
    assert len(stage_runs) == 12  # no stage run shared

    # Every file the runs wrote is in a folder of its own (runs/<pipeline run>/, the artifacts of
    # one MLflow run) or in a store built for sharing: the MLflow database, the model cache
    # (built under locks), Prefect's home and its result storage.
    artifacts = store / "mlartifacts" / "rlhf"
    shared = ("mlflow.db", "mlflow.db.lock", "cache/", "prefect/", "prefect-results/")
    owners: dict[str, set[str]] = {}
    for path in store.rglob("*"):
        if not path.is_file():
            continue
        relative = path.relative_to(store).as_posix()
        if relative.startswith("runs/"):
            owner = relative.split("/")[1]
        elif path.is_relative_to(artifacts):
            parts = path.relative_to(artifacts).parts
            # A logged model (models/<model id>/) belongs to the stage run that logged it.
            run_id = client.get_logged_model(parts[1]).source_run_id if parts[0] == "models" else parts[0]
            owner = stage_runs.get(run_id) or run_id
        else:
            assert relative.startswith(shared) or relative in shared, f"{relative}: written outside any run's folder"
            continue
        owners.setdefault(owner, set()).add(relative)
    assert set(owners) == set(forced)  # pipeline and stage runs of the two, nothing else
    assert not owners[forced[0]] & owners[forced[1]]


def test_registered_versions_are_distinct_and_each_points_at_its_own_run(forced):
    client = tracking.client()
    prefix = load_config("tiny").registry_prefix
    for stage, kind in REGISTERED.items():
        versions = client.search_model_versions(f"name = '{prefix}-{kind}'")
        assert sorted(int(v.version) for v in versions) == [1, 2], kind
        assert {v.tags["rlhf.pipeline_run"] for v in versions} == set(forced)
        for version in versions:
            outputs = lineage.outputs_of(version.tags["rlhf.pipeline_run"])
            assert outputs[f"{kind}_model"] == f"models:/{prefix}-{kind}/{version.version}"
            assert version.run_id == outputs[f"{stage}_run"]
            logged = client.get_logged_model(outputs[f"{kind}_model_artifact"].removeprefix("models:/"))
            assert logged.source_run_id == version.run_id and version.source == logged.artifact_location
            downloaded = tracking.download(f"models:/{prefix}-{kind}/{version.version}")
            assert (Path(downloaded) / "model.safetensors").is_file()


def test_cache_entries_are_built_once_and_load(forced, store):
    entries = sorted(p.name for p in (store / "cache").iterdir() if p.is_dir() and p.name != "judge")
    assert [name.split("-")[0] for name in entries] == ["bpe", "random"], entries  # no half-built temp folders
    cfg = load_config("tiny")
    model_dir = store / "cache" / entries[1]
    assert (model_dir / ".complete").exists() and (store / "cache" / entries[0] / ".complete").exists()
    tokenizer = loading.load_tokenizer(str(model_dir), cfg.model)
    assert loading.load_model(str(model_dir), cfg.model).config.vocab_size == len(tokenizer)


def test_stage_results_are_whole(forced, store):
    """The data stages of both runs wrote the same cache key in the result storage: what is
    there is one whole result, naming one of them."""
    client = tracking.client()
    data_runs = {lineage.recorded_stages(client.get_run(p))["data"][1] for p in forced}
    records = {path.name: json.loads(path.read_bytes()) for path in (store / "prefect-results").iterdir()}
    keyed = Counter(name.split("-")[0] for name in records if "-" in name)  # <stage>-<cache key>
    assert keyed == {"data": 1, "sft": 2, "reward": 2, "critic": 2, "ppo": 2, "eval": 2}
    data = next(record for name, record in records.items() if name.startswith("data-"))
    assert json.loads(data["result"])["data_run"] in data_runs


def test_runs_racing_to_reuse_a_stage_reuse_the_same_one(forced, store):
    client = tracking.client()
    data_runs = {lineage.recorded_stages(client.get_run(p))["data"][1] for p in forced}
    results = _together(_env(store, PREFECT_TASKS_REFRESH_CACHE="false"), store.parent / f"{store.name}-reuse",
                        "--stages", "data", timeout=900)
    reused = {lineage.recorded_stages(client.get_run(_pipeline_run(result)))["data"] for result in results}
    assert len(reused) == 1 and next(iter(reused))[0] == "reused" and next(iter(reused))[1] in data_runs


def _build_in_process(home: str, started, built: str, out) -> None:
    os.environ["RLHF_HOME"] = home
    started.wait()  # all processes ask for the entry at the same moment

    def build(folder: Path) -> None:
        with open(built, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # long enough for the others to find no entry yet
        (folder / "weights.txt").write_text("whole")

    out.put(str(loading.cached("concurrent-entry", build)))


def test_a_cache_entry_asked_for_by_several_processes_at_once_is_built_once(tmp_path):
    context = multiprocessing.get_context("fork")
    started, out = context.Barrier(3), context.Queue()
    built = tmp_path / "built.log"
    procs = [context.Process(target=_build_in_process, args=(str(tmp_path), started, str(built), out))
             for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    paths = {out.get(timeout=5) for _ in procs}
    assert len(built.read_text().splitlines()) == 1
    assert paths == {str(tmp_path / "cache" / "concurrent-entry")}
    assert (tmp_path / "cache" / "concurrent-entry" / "weights.txt").read_text() == "whole"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["concurrent-entry", "concurrent-entry.lock"]
