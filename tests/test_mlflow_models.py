"""The registered models are MLflow models (stages/compute/mlflow_models.py, stages/mlflow_chat.py,
stages/reward/pyfunc.py): on the tiny pipeline's versions, MLflow's own loaders give a text-generation
pipeline (SFT, policy) and a scorer (reward model, critic) that answer as the project's code does,
and `mlflow models serve` answers a chat request with the policy over HTTP on loopback as the eval
stage would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jinja2
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from stages.compute import loading
from stages.leaves.config import REPO_ROOT
from stages.leaves.rendering import HH_CHAT_TEMPLATE, dialogue_text, render_prompt
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import free_port
from stages.pipeline.data import read_jsonl

ALIAS = "mlflow-test"  # not @champion: the eval stage decides that one
MESSAGES = [{"role": "user", "content": "How do I bake bread?"}, {"role": "assistant", "content": "With flour."},
            {"role": "user", "content": "And then?"}]
NEW_TOKENS = 8


@pytest.fixture
def mlflow_env(monkeypatch):
    """MLflow's own loaders resolve `models:/` through its default tracking URI: this session's store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri())
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking.tracking_uri())


def _name_version(uri: str) -> tuple[str, str]:
    name, version = uri.removeprefix("models:/").split("/")
    return name, version


def _greedy(folder: Path, messages: list[dict], new_tokens: int, repetition_penalty: float = 1.0) -> str:
    """The project's own answer: its prompt rendering, its safetensors loader, greedy decoding."""
    cfg = load_config("tiny").model
    tokenizer, model = loading.load_tokenizer(str(folder), cfg), loading.load_model(str(folder), cfg).eval()
    ids = tokenizer(render_prompt(tokenizer, messages), return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             repetition_penalty=repetition_penalty)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _eval_stage_answer(folder, tokenizer, cfg) -> str:
    """The eval stage's answer to MESSAGES under cfg.eval.generation (its own sampling loop)."""
    from stages.pipeline.evaluate import respond

    model = loading.load_model(str(folder), cfg.model).eval()
    (answer,), _ = respond(model, tokenizer, [{"messages": MESSAGES}], cfg, "cpu")
    return answer


def test_the_hh_chat_template_renders_as_training_does():
    rendered = jinja2.Environment().from_string(HH_CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    assert rendered == dialogue_text(MESSAGES)


def test_sft_and_policy_load_as_transformers_pipelines(full_run, mlflow_env):
    import mlflow.transformers
    from mlflow.entities import LoggedModelStatus

    outputs = lineage.outputs_of(full_run)
    client = tracking.client()
    name, version = _name_version(outputs["policy_model"])
    client.set_registered_model_alias(name, ALIAS, version)
    for uri in (f"models:/{name}@{ALIAS}", outputs["sft_model"]):
        pipeline = mlflow.transformers.load_model(uri)
        assert pipeline.task == "text-generation"
        folder = tracking.download(uri)  # the Hugging Face folder the stages read, inside the MLflow model
        # The pipeline's weights are the stage's safetensors, and its chat template renders our prompts.
        saved = load_file(str(folder / "model.safetensors"))
        state = pipeline.model.state_dict()
        assert saved and all(torch.equal(state[key], tensor) for key, tensor in saved.items())
        chat = pipeline.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert chat == render_prompt(loading.load_tokenizer(str(folder), load_config("tiny").model), MESSAGES)
        generated = pipeline(chat, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)
        # Greedy, under the model's own generation config (test_a_chat_model_samples_as_the_eval_stage_did),
        # with transformers' repetition penalty, which lowers the prompt's tokens too
        penalty = load_config("tiny").eval.generation.repetition_penalty
        assert generated[0]["generated_text"] == _greedy(folder, MESSAGES, NEW_TOKENS, penalty)

    # The version's logged model is the PPO run's, and its id (the `_model_artifact` output) and
    # `runs:/<run>/model` name the same folder.
    model_id = outputs["policy_model_artifact"].removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    assert logged.source_run_id == outputs["ppo_run"] and logged.status == LoggedModelStatus.READY
    assert client.get_model_version(name, version).source == logged.artifact_location
    weights = {uri: load_file(str(tracking.download(uri) / "model.safetensors"))
               for uri in (outputs["policy_model"], outputs["policy_model_artifact"], f"runs:/{outputs['ppo_run']}/model")}
    first = next(iter(weights.values()))
    assert all(w.keys() == first.keys() and all(torch.equal(w[k], first[k]) for k in first) for w in weights.values())


@pytest.mark.parametrize("kind", ["reward", "critic"])
def test_reward_model_and_critic_load_as_pyfuncs_scoring_as_serve_reward_does(full_run, mlflow_env, kind):
    import mlflow.pyfunc

    from stages.compute.reward.serve import RewardScorer

    outputs = lineage.outputs_of(full_run)
    cfg = load_config("tiny")
    rows = read_jsonl(tracking.download(outputs["splits"]) / "rm_eval.jsonl")[:6]
    frame = pd.DataFrame({"prompt": [r["prompt"] for r in rows for _ in (0, 1)],
                          "response": [answer for r in rows for answer in (r["chosen"], r["rejected"])],
                          "ended": [True, False] * len(rows)})
    model = mlflow.pyfunc.load_model(outputs[f"{kind}_model"])
    scores = model.predict(frame)
    assert list(scores.columns) == ["score"] and len(scores) == len(frame)

    local = RewardScorer(tracking.download(outputs[f"{kind}_model"]), cfg.model, cfg.reward.max_seq_len)
    expected = local.scores(frame["prompt"].tolist(), frame["response"].tolist(), frame["ended"].tolist())
    assert scores["score"].tolist() == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 6) for s in expected}) > 1  # the texts score differently: the comparison says something
    # Without `ended`, every response counts as finished (serve-reward's default).
    assert model.predict(frame[["prompt", "response"]])["score"].tolist() == pytest.approx(
        local.scores(frame["prompt"].tolist(), frame["response"].tolist(), [True] * len(frame)), abs=1e-4)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def test_mlflow_models_serve_answers_a_chat_request_with_the_policy(full_run, tmp_path):
    outputs = lineage.outputs_of(full_run)
    name, version = _name_version(outputs["policy_model"])
    port = free_port()
    # The shell of an activated virtualenv: `mlflow models serve` runs `uvicorn` from PATH.
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking.tracking_uri(), "PYTHONPATH": str(REPO_ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m",
                                   f"models:/{name}/{version}", "--env-manager", "local", "-h", "127.0.0.1",
                                   "-p", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as ping:
                    if ping.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        # top_k 1: the served model's own sampling settings, made deterministic (its argmax).
        answer = _post(f"http://127.0.0.1:{port}/invocations",
                       {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "top_k": 1})
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    assert isinstance(answer, list) and len(answer) == 1, answer  # MLflow 3.17: one completion per request, in a list
    (answer,) = answer
    assert answer["object"] == "chat.completion", answer
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert 0 < answer["usage"]["completion_tokens"] <= NEW_TOKENS
    # The eval stage's greedy answer under its repetition penalty (on the generated tokens only).
    cfg = load_config("tiny", ["eval.generation.do_sample=false", f"eval.generation.max_new_tokens={NEW_TOKENS}"])
    folder = tracking.download(outputs["policy_model"])
    assert message["content"].strip() == _eval_stage_answer(folder, loading.load_tokenizer(str(folder), cfg.model), cfg)


def test_a_chat_models_pyfunc_penalises_repetition_as_the_eval_stage_does(tiny, tmp_path):
    """The eval stage's repetition penalty lowers the tokens generated so far; transformers' also
    lowers the prompt's. The pyfunc MLflow loads and serves answers as the eval stage does."""
    import mlflow.pyfunc
    import mlflow.transformers
    from mlflow.models import Model

    from stages.compute.mlflow_models import chat

    folder, tokenizer, _ = tiny
    cfg = load_config("tiny", ["eval.generation.do_sample=false", "eval.generation.repetition_penalty=2.0",
                               f"eval.generation.max_new_tokens={NEW_TOKENS}"])
    chat(cfg)(Path(folder), tmp_path / "chat", Model())
    (answer,) = mlflow.pyfunc.load_model(str(tmp_path / "chat")).predict({"messages": MESSAGES})
    expected = _eval_stage_answer(folder, tokenizer, cfg)
    assert answer["choices"][0]["message"]["content"].strip() == expected
    # transformers' plain pipeline penalises the prompt too: on this prompt it answers otherwise, so
    # the comparison above tells the two penalties apart.
    pipeline = mlflow.transformers.load_model(str(tmp_path / "chat"))
    chat_prompt = pipeline.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    plain = pipeline(chat_prompt, return_full_text=False)[0]["generated_text"]
    assert plain.strip() != expected


def test_a_chat_model_samples_as_the_eval_stage_did(full_run):
    """Saved without a generation config, a model gets the text-generation pipeline's own defaults
    when MLflow serves it (sampling at temperature 0.7, 256 new tokens): it carries the eval stage's."""
    sampling = load_config("tiny").eval.generation
    for kind in ("sft", "policy"):
        folder = tracking.download(lineage.outputs_of(full_run)[f"{kind}_model"])
        saved = json.loads((folder / "generation_config.json").read_text())
        assert not saved.get("_from_model_config"), kind
        assert {key: saved.get(key) for key in ("do_sample", "temperature", "top_p", "repetition_penalty",
                                                "max_new_tokens")} == {
            "do_sample": sampling.do_sample, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "repetition_penalty": sampling.repetition_penalty, "max_new_tokens": sampling.max_new_tokens}, kind


def test_a_version_registered_as_a_bare_folder_still_reads_as_that_folder(tmp_path):
    """Versions registered before models were MLflow models point at the Hugging Face folder itself."""
    from stages.compute.mlflow_models import hf_folder

    (tmp_path / "config.json").write_text("{}")
    assert hf_folder(tmp_path) == tmp_path
