"""PPO's reward sources beside the trained RM (stages/compute/ppo/external_scores.py): a python function and
a reward server over real HTTP each drive tiny PPO through the real flow; `rlhf serve-reward`
serves our RM with the server API and scores exactly as the RM does; retries, auth and bad
answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from stages.compute.ppo.external_scores import RewardSourceError, batch_texts, post_scores
from stages.leaves.config import REPO_ROOT
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import free_port

REWARD_MODULE = '''
import json, os

def e_fraction(prompts, responses):
    scores = [r.count("e") / max(len(r), 1) for r in responses]
    with open(os.environ["REWARD_CALLS"], "a") as log:
        log.write(json.dumps({"n": len(prompts), "scores": scores}) + "\\n")
    return scores
'''


def _ppo_metric(pipeline_run_id: str, name: str) -> list[float]:
    ppo_run = lineage.outputs_of(pipeline_run_id)["ppo_run"]
    history = tracking.client().get_metric_history(ppo_run, name)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def test_a_python_function_drives_ppo_through_the_flow(full_run, tmp_path, monkeypatch):
    from flows.rlhf import rlhf

    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REWARD_CALLS", str(tmp_path / "calls.jsonl"))
    run_id = rlhf(preset="tiny", stages=["ppo"], from_run=full_run,
                  overrides={"ppo": {"reward": "python:my_rewards:e_fraction", "iterations": 2}})
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    means = [sum(c["scores"]) / c["n"] for c in calls]
    scores = _ppo_metric(run_id, "objective/scores")
    assert len(scores) == 2 and all(any(abs(s - m) < 1e-6 for m in means) for s in scores)
    assert tracking.client().get_run(lineage.outputs_of(run_id)["ppo_run"]).data.params["ppo.reward"] == \
        "python:my_rewards:e_fraction"


def test_an_unknown_function_fails_before_any_rollout(full_run):
    from flows.rlhf import rlhf

    with pytest.raises(Exception, match=r"cannot import 'nothing' from 'json'"):
        rlhf(preset="tiny", stages=["ppo"], from_run=full_run, overrides={"ppo": {"reward": "python:json:nothing"}})


@pytest.fixture(scope="module")
def reward_server(full_run):
    """`rlhf serve-reward` on the tiny run's registered RM, as a real process, with a token."""
    port = free_port()
    env = {**os.environ, "RM_TOKEN": "s3cret-token"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--model",
                             lineage.outputs_of(full_run)["reward_model"], "--preset", "tiny", "--port", str(port),
                             "--auth-env", "RM_TOKEN"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                json.loads(response.read())
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"serve-reward did not start: {proc.stdout.read()}")
            time.sleep(0.5)
    yield url
    proc.terminate()  # as a service manager stops it: a clean exit (a model copied from a remote store is removed)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        return json.loads(response.read())


def test_serve_reward_scores_as_the_reward_model_does(reward_server, full_run):
    """The served score of a rollout's text equals the local RM's score of the rollout's tokens."""
    from stages.pipeline.data import read_jsonl
    from stages.compute.ppo.experience import reward_model_scores
    from stages.compute.ppo.setup import encode_prompts
    from stages.compute.reward.model import load_reward_model
    from stages.compute.loading import load_tokenizer

    cfg = load_config("tiny")
    outputs = lineage.outputs_of(full_run)
    rm_folder = tracking.download(outputs["reward_model"])
    rm, tokenizer = load_reward_model(rm_folder, cfg.model).eval(), load_tokenizer(str(rm_folder), cfg.model)
    prompts = encode_prompts(tokenizer, read_jsonl(tracking.download(outputs["splits"]) / "eval_prompts.jsonl")[:2], 64)
    # A rollout-shaped batch: left-padded prompts, then responses (one cut before EOS), right-padded.
    responses = [tokenizer(" the cat sat", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                 tokenizer(" a long answer that never", add_special_tokens=False)["input_ids"]]
    width, length = max(len(p) for p in prompts[:2]), max(len(r) for r in responses)
    pad = tokenizer.pad_token_id
    sequences = torch.tensor([[pad] * (width - len(p)) + p + r + [pad] * (length - len(r))
                              for p, r in zip(prompts[:2], responses)])
    attention = (torch.arange(width + length) >= torch.tensor([[width - len(p)] for p in prompts[:2]])).long()
    response_mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in responses])
    attention[:, width:] = response_mask
    with torch.no_grad():
        local = reward_model_scores(rm)(sequences, attention, width, response_mask)
    texts = batch_texts(tokenizer, sequences, attention, width, response_mask)
    assert texts[2] == [True, False]
    served = post_scores(f"{reward_server}/score", *texts, timeout_s=30, retries=0, auth_env="RM_TOKEN_FOR_TEST")
    assert served == pytest.approx(local.tolist(), abs=1e-4)


def test_serve_reward_refuses_a_request_without_the_token(reward_server, monkeypatch):
    monkeypatch.delenv("RM_TOKEN_FOR_TEST", raising=False)
    with pytest.raises(RewardSourceError, match=r"answered HTTP 401"):
        post_scores(f"{reward_server}/score", ["p"], ["r"], [True], timeout_s=30, retries=2, auth_env="RM_TOKEN_FOR_TEST")


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("RM_TOKEN_FOR_TEST", "s3cret-token")


def test_a_reward_server_drives_ppo_through_the_flow(reward_server, full_run):
    from flows.rlhf import rlhf

    before = _health(reward_server)["batches"]
    run_id = rlhf(preset="tiny", stages=["ppo"], from_run=full_run,
                  overrides={"ppo": {"reward": f"{reward_server}/score", "reward_auth_env": "RM_TOKEN_FOR_TEST",
                                     "iterations": 2}})
    assert _health(reward_server)["batches"] - before >= 2  # a batch per rollout, and the held-out checks
    assert len(_ppo_metric(run_id, "objective/scores")) == 2
    params = tracking.client().get_run(lineage.outputs_of(run_id)["ppo_run"]).data.params
    assert params["ppo.reward_auth_env"] == "RM_TOKEN_FOR_TEST" and "s3cret" not in json.dumps(params)


class _Flaky(BaseHTTPRequestHandler):
    """Fails the first `failures` requests with 503, then scores every response 1.0."""

    failures, seen = 0, 0

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen += 1
        status, payload = (503, {}) if type(self).seen <= type(self).failures else (200, {"rewards": [1.0] * len(body["prompts"])})
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("failures,retries,succeeds", [(1, 1, True), (2, 1, False)])
def test_a_failing_server_is_retried_then_reported(failures, retries, succeeds):
    _Flaky.failures, _Flaky.seen = failures, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        if succeeds:  # OpenRLHF's servers answer "rewards"; it is read as the scores
            assert post_scores(url, ["p", "q"], ["r", "s"], [True, True], timeout_s=5, retries=retries, auth_env=None) == [1.0, 1.0]
        else:
            with pytest.raises(RewardSourceError, match=r"answered HTTP 503"):
                post_scores(url, ["p"], ["r"], [True], timeout_s=5, retries=retries, auth_env=None)
        assert _Flaky.seen == min(failures, retries) + 1
    finally:
        server.shutdown()


def test_reward_sources_judge_in_the_eval_stage(reward_server, full_run, tmp_path, monkeypatch):
    """A reward server and a python function as score judges beside the RM: the served RM gives
    the RM judge's scores and verdicts pair for pair, the function's scores are the ones it
    returned, and each gets its net win and score delta with intervals."""
    import pandas as pd

    from flows.rlhf import rlhf

    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REWARD_CALLS", str(tmp_path / "calls.jsonl"))
    judges = [{"kind": "reward_model"},
              {"kind": "reward_source", "name": "served_rm", "source": f"{reward_server}/score",
               "auth_env": "RM_TOKEN_FOR_TEST"},
              {"kind": "reward_source", "name": "e_rule", "source": "python:my_rewards:e_fraction"}]
    run_id = rlhf(preset="tiny", stages=["eval"], from_run=full_run,
                  overrides={"eval": {"judges": judges, "ceval": {"shots": [0]}}})
    outputs = lineage.outputs_of(run_id)
    probe = pd.read_parquet(tracking.download(outputs["eval_probe"]))
    by_judge = {name: frame.sort_values("row").reset_index(drop=True)
                for name, frame in probe[probe["kind"] == "judge"].groupby("judge")}
    local, served = by_judge["reward_model"], by_judge["served_rm"]
    assert len(served) == len(local) > 0 and (served["judge_kind"] == "reward_source").all()
    for column in ("score_policy", "score_sft"):
        assert served[column].tolist() == pytest.approx(local[column].tolist(), abs=1e-4)
    assert served["verdict"].tolist() == local["verdict"].tolist()

    returned = {s for line in (tmp_path / "calls.jsonl").read_text().splitlines() for s in json.loads(line)["scores"]}
    rule = by_judge["e_rule"]
    assert set(rule["score_policy"]) | set(rule["score_sft"]) <= returned
    metrics = tracking.client().get_run(outputs["eval_run"]).data.metrics
    for name in ("served_rm", "e_rule"):
        assert metrics[f"eval/judge/{name}/score_delta_ci_low"] <= metrics[f"eval/judge/{name}/score_delta"] <= \
            metrics[f"eval/judge/{name}/score_delta_ci_high"]
    params = tracking.client().get_run(outputs["eval_run"]).data.params
    assert "s3cret" not in json.dumps(params)


def test_a_judges_unknown_function_is_named_with_its_setting(full_run):
    from flows.rlhf import rlhf

    with pytest.raises(Exception, match=r"eval.judges\[0\].source=python:json:nothing: cannot import 'nothing'"):
        rlhf(preset="tiny", stages=["eval"], from_run=full_run,
             overrides={"eval": {"judges": [{"kind": "reward_source", "source": "python:json:nothing"}]}})
