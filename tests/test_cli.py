"""The `rlhf` command as a user runs it: a subprocess, Prefect's ephemeral API, no server."""

import os
import re
import subprocess
import sys

import yaml

from stages import allocator, tracking
from stages.config import load_config


def _rlhf(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_config_prints_the_resolved_preset():
    out = _rlhf("config", "--preset", "tiny", "--set", "sft.lr=1e-4")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["sft"]["lr"] == 1e-4 and cfg["preset"] == "tiny"
    found = allocator.find_tcmalloc()
    assert (f"# training processes run on TCMalloc ({found}) (RLHF_ALLOCATOR=auto)" if found
            else "# training processes run on the system malloc (RLHF_ALLOCATOR=auto)") in out.stdout
    out = _rlhf("config", "--preset", "tiny", env={allocator.VARIABLE: "system"})
    assert "# training processes run on the system malloc (RLHF_ALLOCATOR=system)" in out.stdout


def test_bad_override_is_a_one_line_error():
    out = _rlhf("run", "--preset", "tiny", "--set", "sft.lrr=1")
    assert out.returncode == 2
    assert "rlhf: override: unknown key 'sft.lrr'" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_stage_and_unknown_run_are_one_line_errors_before_anything_starts():
    out = _rlhf("run", "--preset", "tiny", "--stages", "sft,critc")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr[-2000:]
    assert "rlhf: --stages: unknown stage 'critc' (did you mean 'critic'?); stages: data, sft" in out.stderr
    out = _rlhf("run", "--preset", "tiny", "--stages", "eval", "--from-run", "deadbeef")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "rlhf: --from-run deadbeef: no such run in the MLflow store" in out.stderr


def test_missing_data_file_is_a_one_line_error(tmp_path):
    out = _rlhf("run", "--preset", "tiny", "--stages", "data", "--set", f"data.pairs={tmp_path}/none.jsonl")
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(r"rlhf: .*none\.jsonl: file not found", out.stderr)
    assert "Traceback" not in out.stderr


def test_run_on_the_ephemeral_api():
    out = _rlhf("run", "--preset", "tiny", "--stages", "data")
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = re.search(r"Pipeline run (\w+) finished", out.stdout).group(1)
    assert tracking.client().get_run(run_id).info.status == "FINISHED"
    assert "mlflow ui --backend-store-uri sqlite:///" in out.stdout
    # The pipeline ran in the command's child, on TCMalloc where the machine has it (stages/allocator.py).
    (data,) = tracking.stage_runs(run_id)
    assert data.data.params["allocator"] == ("tcmalloc" if allocator.find_tcmalloc() else "system")

    # --resume continues with the run's own config (tiny here, not the default demo preset) and
    # refuses a --preset or --set that would change it.
    assert tracking.recorded_config(run_id) == load_config("tiny")
    out = _rlhf("run", "--resume", run_id, "--preset", "demo")
    assert out.returncode == 2 and f"rlhf: --resume {run_id}: a resumed run keeps the config it started with" in out.stderr
    out = _rlhf("run", "--resume", run_id)  # nothing left to run: it finishes at once
    assert out.returncode == 0, out.stderr[-3000:]
    assert tracking.client().get_run(run_id).data.params["registry_prefix"] == "rlhf-tiny"
