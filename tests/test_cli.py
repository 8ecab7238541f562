"""The `rlhf` command as a user runs it: a subprocess, Prefect's ephemeral API, no server."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.leaves import allocator
from stages.leaves.tags import FAILED_STAGE_TAG
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config


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
    # The pipeline ran in the command's child, on TCMalloc where the machine has it (stages/leaves/allocator.py).
    (data,) = lineage.stage_runs(run_id)
    assert data.data.params["allocator"] == ("tcmalloc" if allocator.find_tcmalloc() else "system")

    # --resume continues with the run's own config (tiny here, not the default demo preset) and
    # refuses a --preset or --set that would change it.
    assert lineage.recorded_config(run_id) == load_config("tiny")
    out = _rlhf("run", "--resume", run_id, "--preset", "demo")
    assert out.returncode == 2 and f"rlhf: --resume {run_id}: a resumed run keeps the config it started with" in out.stderr
    out = _rlhf("run", "--resume", run_id)  # nothing left to run: it finishes at once
    assert out.returncode == 0, out.stderr[-3000:]
    assert tracking.client().get_run(run_id).data.params["registry_prefix"] == "rlhf-tiny"


def _broken_copy(folder: str, target: Path, broken: str) -> Path:
    """The tiny preset's model folder with its weights pickled, or its tokenizer without a pad token."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(folder, target, ignore=shutil.ignore_patterns(".complete"))
    if broken == "pickled weights":  # as older hub models ship
        for weights in target.glob("*.safetensors"):
            torch.save(load_file(weights), target / "pytorch_model.bin")
            weights.unlink()
    else:
        settings = json.loads((target / "tokenizer_config.json").read_text())
        del settings["pad_token"]
        (target / "tokenizer_config.json").write_text(json.dumps(settings))
    return target


@pytest.mark.parametrize("broken, reason, fix", [
    ("pickled weights", "no safetensors weights (it has pytorch_model.bin); weights load as safetensors only",
     "Fix: convert it once, where you trust its files: python -c "),
    ("no pad token", "pad token must exist and differ from EOS",
     "Fix: set model.pad_token to a token of its vocabulary other than EOS (--set model.pad_token=<token>)"),
])
def test_a_failed_stage_ends_in_its_reason_and_fix_which_are_the_runs_description(tiny, tmp_path, broken, reason, fix):
    """A stage that fails: the command ends with the stage, the one-line reason and the fix (no
    traceback); the same lines are the pipeline run's MLflow description, the traceback its artifact."""
    folder = _broken_copy(tiny[0], tmp_path / "model", broken)
    out = _rlhf("run", "--preset", "tiny", "--set", f"model.name_or_path={folder}", timeout=900)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    ending = out.stderr.rstrip("\n").splitlines()[-3:]
    run_id = re.fullmatch(r"Pipeline run (\w{32}) failed \(full traceback in MLflow: run \1, artifact "
                          r"logs/traceback.txt\)", ending[0]).group(1)
    assert ending[1].startswith("Stage sft failed: ") and reason in ending[1] and str(folder) in ending[1]
    assert ending[2].startswith(fix), ending[2]

    run = tracking.client().get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags[FAILED_STAGE_TAG] == "sft"
    assert run.data.tags["mlflow.note.content"].split("\n\n") == ending
    traceback_text = Path(tracking.client().download_artifacts(run_id, "logs/traceback.txt", str(tmp_path))).read_text()
    assert traceback_text.startswith("Traceback (most recent call last):") and "ModelError: " in traceback_text
