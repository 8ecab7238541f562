"""Security properties: secrets in the environment reach nothing a run writes; remote code runs
only when the config trusts it; weights load as safetensors (or torch.load with weights_only)
only; the servers `rlhf up` starts listen on loopback unless told otherwise."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eval_helpers import JudgeServer
from leaks import files, leaks, mlflow_texts
from stages.compute import loading
from stages.leaves.config import REPO_ROOT, ModelConfig
from stages.orchestration import lineage, tracking

# Distinctive fake secrets, with the characters that URL- and base64-encoding change.
JUDGE_KEY = "sk-rlhf-leakcheck/7f3a+9c1e=d42b"
AWS = {"AWS_ACCESS_KEY_ID": "AKIARLHFLEAKCHECK042", "AWS_SECRET_ACCESS_KEY": "rlhf/LeakCheck+9f8e7d6c5b4a3210zyxwvuts",
       "AWS_SESSION_TOKEN": "FwoGZXIvYXdzELeakCheckSessionToken/+=0042"}
KEY_ENV = "RLHF_TEST_JUDGE_KEY"
BUCKET = "rlhf-leakcheck"
SMALL = ["--set", "sft.max_steps=2", "--set", "reward.max_steps=2", "--set", "critic.max_steps=2",
         "--set", "ppo.iterations=2", "--set", "ppo.eval_every=1", "--set", "ppo.samples_every=2"]
SOURCE_DIRS = ("stages", "flows", "data_contracts", "bench")


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory, s3_server, hh_file):
    """The tiny pipeline through `rlhf run` with the secrets in its environment, each in use: the
    judge key by the eval stage's HTTP judge, the AWS credentials by the S3 artifact store. Its
    own RLHF home, Prefect home and result storage, so everything it wrote can be read back."""
    home = tmp_path_factory.mktemp("secret-home")
    s3_server.client().create_bucket(Bucket=BUCKET)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING", "AWS_"))}
    env.update(s3_server.env, **AWS, RLHF_HOME=str(home / "rlhf"), PREFECT_HOME=str(home / "prefect"),
               RLHF_RESULTS=str(home / "results"), RLHF_ARTIFACTS=f"s3://{BUCKET}/mlflow", **{KEY_ENV: JUDGE_KEY})
    with JudgeServer(key=JUDGE_KEY) as judge:
        judges = (f"eval.judges=[{{kind: openai, base_url: '{judge.base_url}', api_key_env: {KEY_ENV}}}, "
                  f"{{kind: reward_model}}]")
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", *SMALL, "--set", judges],
                             env=env, capture_output=True, text=True, timeout=1800)
        judge_calls = judge.statuses[200]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    run_id = re.search(r"Pipeline run (\w+) finished", out.stdout).group(1)
    with pytest.MonkeyPatch.context() as patch:  # this process reads the run's MLflow store
        patch.setenv("RLHF_HOME", str(home / "rlhf"))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield {"home": home, "run_id": run_id, "stdout": out.stdout, "stderr": out.stderr, "judge_calls": judge_calls}


def test_secrets_reach_nothing_the_run_wrote(secret_run, s3_server):
    secrets = [JUDGE_KEY, *AWS.values()]
    assert secret_run["judge_calls"] > 0  # the key was used (sent to the judge), not just set

    client = tracking.client()
    runs = [client.get_run(secret_run["run_id"]), *lineage.stage_runs(secret_run["run_id"])]
    versions = [version for model in client.search_registered_models() for version in
                client.search_model_versions(f"name = '{model.name}'")]
    assert len(runs) == 7 and len(versions) == 4
    # Everything on disk: the RLHF home (MLflow's SQLite database, the cache, runs/), Prefect's
    # home (its database with flow and task runs, parameters and logs), the result storage; and
    # every object in the artifact bucket, the run's output.
    written = files(secret_run["home"])
    written.update({f"s3://{BUCKET}/{key}": blob for key, blob in s3_server.objects(BUCKET).items()})
    written.update({"stdout": secret_run["stdout"].encode(), "stderr": secret_run["stderr"].encode()})
    assert any(name.endswith("prefect.db") for name in written) and any("/results/" in name for name in written)
    assert any(name.endswith("/artifacts/model/model.safetensors") for name in written)

    found = leaks(secrets, texts=mlflow_texts(runs, versions), blobs=written)
    print(f"\nsecrets planted: {len(secrets)}; scanned {len(written)} files and streams, "
          f"{sum(map(len, written.values()))} bytes, {len(mlflow_texts(runs, versions))} MLflow texts; "
          f"leaks: {len(found)}")
    assert found == []
    assert any(KEY_ENV in run.data.params.get("eval.judges", "") for run in runs)  # the variable's name only


# -- remote code -------------------------------------------------------------------------------


def _tiny_model_folder(folder: Path, safetensors: bool = True) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    model = LlamaForCausalLM(config)
    if safetensors:
        model.save_pretrained(folder)
    else:  # a pickled checkpoint, as older hub models ship
        config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def test_custom_model_code_runs_only_when_the_config_trusts_it(tmp_path):
    folder = _tiny_model_folder(tmp_path / "model")
    marker = tmp_path / "custom-code-ran"
    (folder / "custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n"
        "class CustomConfig(LlamaConfig):\n    pass\n\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))

    assert ModelConfig().trust_remote_code is False
    model = loading.load_model(str(folder), ModelConfig())
    assert type(model).__name__ == "LlamaForCausalLM" and not marker.exists()  # transformers' own class
    model = loading.load_model(str(folder), ModelConfig(trust_remote_code=True))
    assert type(model).__name__ == "CustomModel" and marker.exists()  # the setting reaches transformers


def test_a_pickled_checkpoint_is_refused(tmp_path):
    folder = _tiny_model_folder(tmp_path / "model", safetensors=False)
    with pytest.raises(ValueError, match=r"no safetensors weights \(it has pytorch_model.bin\); weights load as "
                                         r"safetensors only"):
        loading.load_model(str(folder), ModelConfig())


# -- what the source code does, read with the ast module ----------------------------------------


def _calls() -> list[tuple[str, ast.Call]]:
    out = []
    for folder in SOURCE_DIRS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            where = path.relative_to(REPO_ROOT)
            if any(part.startswith(".") for part in where.parts):  # a virtual environment (bench/.venv-trl)
                continue
            out += [(f"{where}:{node.lineno}", node) for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Call)]
    return out


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def test_no_code_path_hardcodes_trust_remote_code():
    passed = [(where, ast.unparse(_keyword(call, "trust_remote_code"))) for where, call in _calls()
              if _keyword(call, "trust_remote_code") is not None]
    assert passed, "no call passes trust_remote_code: the scan reads nothing"
    # Always the config's setting (cfg.trust_remote_code), never a literal.
    assert [(where, value) for where, value in passed if not value.endswith(".trust_remote_code")] == []


def test_weights_load_only_as_safetensors_or_with_weights_only():
    torch_loads, weight_loads, unsafe = 0, 0, []
    for where, call in _calls():
        func = call.func
        name = ast.unparse(func)
        if name in ("torch.load", "pickle.load", "pickle.loads", "joblib.load"):
            torch_loads += name == "torch.load"
            if not (name == "torch.load" and _is_true(_keyword(call, "weights_only"))):
                unsafe.append(f"{where}: {name} without weights_only=True")
        elif isinstance(func, ast.Attribute) and func.attr == "from_pretrained":
            if re.search(r"Tokenizer|Config", ast.unparse(func.value)):
                continue  # tokenizers and configs are JSON and vocab files, no pickled weights
            weight_loads += 1
            # GGUF files hold tensors only; anything else must ask for safetensors.
            if not (_is_true(_keyword(call, "use_safetensors")) or _keyword(call, "gguf_file") is not None):
                unsafe.append(f"{where}: {name} without use_safetensors=True")
    assert torch_loads and weight_loads, "the scan found no weight loading at all"
    assert unsafe == []


# -- servers bind to loopback --------------------------------------------------------------------


def test_rlhf_up_binds_its_servers_to_loopback_unless_told_otherwise(monkeypatch, tmp_path):
    from flows import cli, services

    assert inspect.signature(services.up).parameters["host"].default == "127.0.0.1"
    asked = {}

    def fake_up(preset, host, *args):
        asked["host"] = host
        raise services.ServicesError("not starting anything in this test")

    monkeypatch.setattr(services, "up", fake_up)
    assert cli.main(["up", "--preset", "tiny"]) == 1 and asked["host"] == "127.0.0.1"

    for host in ("127.0.0.1", "0.0.0.0"):
        waves = services.services("tiny", host, 4200, 5000, str(tmp_path))
        listening = {s.name: s.command[s.command.index("--host") + 1] for wave in waves for s in wave
                     if "--host" in s.command}
        assert listening == {"prefect": host, "mlflow": host}
        serve = next(s for wave in waves for s in wave if s.name == "serve")
        assert serve.env["PREFECT_API_URL"].startswith("http://127.0.0.1:")  # clients connect on loopback
        assert "serve" in serve.command and "--host" not in serve.command  # it listens on nothing
