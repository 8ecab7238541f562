"""The eval stage through the real flow on the tiny preset (real Prefect, MLflow, GX): SFT only
(C-Eval of the SFT model, through the CLI with --from-run), then reward → PPO → eval with the
HTTP judge on loopback, the reward model and the local judge; the report, the @champion alias,
the gate, the Prefect artifact; the API key nowhere in MLflow. And the eval contract on made-up
frames: one that passes and two that fail."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import pandas as pd
import pytest

from conftest import HUB_MIRROR
from data_contracts import validate
from eval_helpers import SECRET, JudgeServer
from leaks import files, leaks, mlflow_texts
from pipeline_helpers import stage_run
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config

KEY_ENV = "RLHF_TEST_JUDGE_KEY"


@pytest.fixture(scope="module")
def sft_only(prefect_server, hh_file):
    from flows.rlhf import rlhf

    return rlhf(preset="tiny", overrides={"sft.max_steps": 2}, stages=["data", "sft"])


@pytest.fixture(scope="module")
def evaluated(sft_only):
    """reward → PPO → eval on the SFT-only run, judged over HTTP (first), by the RM and locally."""
    from flows.rlhf import rlhf

    os.environ[KEY_ENV] = SECRET
    try:
        with JudgeServer() as server:
            judges = [{"kind": "openai", "base_url": server.base_url, "api_key_env": KEY_ENV, "timeout_s": 10},
                      {"kind": "reward_model"}, {"kind": "local", "max_prompts": 2, "max_new_tokens": 4}]
            # below any net win, and judges at chance allowed to decide: the policy is champion
            overrides = {"reward.max_steps": 2, "ppo.iterations": 2, "eval.judges": judges,
                         "eval.champion_min_lower_bound": -2.0, "eval.judge_accuracy_gate": False,
                         "eval.judge_control_pairs": 4}
            run_id = rlhf(preset="tiny", overrides=overrides, stages=["reward", "ppo", "eval"], from_run=sft_only)
            return run_id, server.calls
    finally:
        del os.environ[KEY_ENV]


def test_eval_of_an_sft_only_run_scores_the_sft_model_alone(sft_only, capsys):
    from flows.cli import main

    assert main(["run", "--preset", "tiny", "--stages", "eval", "--from-run", sft_only]) == 0
    run_id = capsys.readouterr().out.split("Pipeline run ")[1].split()[0]
    run = stage_run(run_id, "eval")
    assert run.data.tags["rlhf.contract"] == "passed" and run.data.tags["rlhf.champion"] == "no policy"
    metrics = run.data.metrics
    assert 0.0 <= metrics["eval/ceval_0shot/overall/sft"] <= 1.0 and "eval/ceval_5shot/law/sft" not in metrics
    assert "eval/ceval_5shot/humanities/sft" in metrics and "eval/ceval_5shot/subject/law/sft" in metrics
    assert not any(name.startswith("eval/judge/") or name.endswith("/policy") for name in metrics)
    probe = pd.read_parquet(tracking.download(lineage.outputs_of(run_id)["eval_probe"]))
    assert set(probe["kind"]) == {"ceval"} and len(probe) == 2 * 3 * 4  # shots × subjects × questions
    # C-Eval's lineage: the session's hub mirror, and every CSV the stage read with its sha256.
    assert (run.data.params["ceval.repo"], run.data.params["ceval.revision"]) == ("ceval/ceval-exam", "mirror")
    ceval_files = json.loads((tracking.download(f"runs:/{run.info.run_id}/ceval_files.json")).read_text())
    assert sorted(ceval_files) == sorted(f"{split}/{subject}_{split}.csv" for split in ("val", "dev")
                                   for subject in ("computer_network", "law", "physician"))
    assert ceval_files["val/law_val.csv"] == hashlib.sha256((HUB_MIRROR / "datasets/ceval/ceval-exam/val/law_val.csv")
                                                      .read_bytes()).hexdigest()


def test_eval_reports_judges_and_sets_the_champion(evaluated):
    run_id, http_calls = evaluated
    outputs = lineage.outputs_of(run_id)
    run = stage_run(run_id, "eval")
    metrics = run.data.metrics
    for judge, n in (("openai", 8), ("reward_model", 8), ("local", 2)):
        rates = [metrics[f"eval/judge/{judge}/{v}_rate"] for v in ("win", "tie", "lose", "invalid")]
        assert metrics[f"eval/judge/{judge}/n"] == n and sum(rates) == pytest.approx(1.0)
        low, net, high = (metrics[f"eval/judge/{judge}/net_win{end}"] for end in ("_ci_low", "", "_ci_high"))
        assert -1.0 <= low <= net <= high <= 1.0 and net == pytest.approx(metrics[f"eval/judge/{judge}/net_win"])
    # The score judge's paired delta: its interval brackets the mean of the judged pairs' deltas.
    judged_by_rm = pd.read_json(tracking.download(f"runs:/{run.info.run_id}/report") / "judgements.jsonl", lines=True)
    judged_by_rm = judged_by_rm[judged_by_rm["judge"] == "reward_model"]
    assert metrics["eval/judge/reward_model/score_delta"] == pytest.approx(
        (judged_by_rm["score_policy"] - judged_by_rm["score_sft"]).mean(), abs=1e-6)
    assert metrics["eval/judge/reward_model/score_delta_ci_low"] <= metrics["eval/judge/reward_model/score_delta"]
    # (8 pairs + 4 control pairs) × 2 orders, some cached
    assert metrics["eval/judge/openai/invalid"] == 0 and 0 < http_calls <= 24
    for model in ("sft", "policy", "delta"):
        assert f"eval/ceval_0shot/overall/{model}" in metrics and f"eval/ceval_5shot/stem/{model}" in metrics
    assert metrics["eval/ceval_0shot/overall/delta"] == pytest.approx(
        metrics["eval/ceval_0shot/overall/policy"] - metrics["eval/ceval_0shot/overall/sft"])

    # @champion on the policy version this run registered; the contract passed.
    assert metrics["eval/champion"] == 1.0 and run.data.tags["rlhf.champion"].startswith("yes (judge openai")
    assert "accuracy gate off (eval.judge_accuracy_gate)" in run.data.tags["rlhf.champion"]
    name, version = outputs["policy_model"].removeprefix("models:/").split("/")
    assert str(tracking.client().get_model_version_by_alias(name, "champion").version) == version
    assert run.data.tags["rlhf.contract"] == "passed"

    report = tracking.download(f"runs:/{run.info.run_id}/report")
    for png in ("ceval.png", "judges.png"):
        assert (report / png).read_bytes()[:4] == b"\x89PNG"
    text = (report / "report.md").read_text()
    assert "| harmless | openai |" in text and "| harmless | reward_model |" in text and "delta" in text
    assert "net_win 95% CI" in text and "score_delta 95% CI" in text
    # report.html: the same report with its charts inline, as MLflow's artifact view renders it.
    import base64

    page = (report / "report.html").read_text()
    inlined = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(data) for data in inlined] == [(report / png).read_bytes() for png in ("judges.png", "ceval.png")]
    assert page.count("<table>") == text.count("\n|---") and "net_win 95% CI" in page
    judged = pd.read_json(report / "judgements.jsonl", lines=True)
    assert set(judged["verdict"]) <= {"win", "tie", "lose", "invalid"} and len(judged) == 8 + 8 + 2
    summary = tracking.download(outputs["eval_summary"]).read_text()
    assert "report/report.md" in summary and "champion yes" in summary

    from prefect.artifacts import Artifact

    published = Artifact.get("eval-report")
    assert published is not None and published.data == summary


def test_a_judge_that_cannot_judge_is_reported_by_name_and_the_other_judges_stand(evaluated):
    """An OpenAI-compatible judge whose every reply lacks a verdict fails its own contract, named;
    the reward-model judge's results stand and decide the champion."""
    from flows.rlhf import rlhf

    run_id, _ = evaluated
    os.environ[KEY_ENV] = SECRET
    try:
        with JudgeServer(verdicts=False) as server:
            judges = [{"kind": "openai", "name": "weak", "base_url": server.base_url, "api_key_env": KEY_ENV,
                       "timeout_s": 10}, {"kind": "reward_model"}]
            again = rlhf(preset="tiny", stages=["eval"], from_run=run_id,
                         overrides={"eval.judges": judges, "eval.ceval.shots": [0], "eval.judge_accuracy_gate": False,
                                    "contracts.eval.max_invalid_fraction": 0.1, "eval.champion_min_lower_bound": -2.0})
    finally:
        del os.environ[KEY_ENV]
    run = stage_run(again, "eval")
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["rlhf.contract"] == "passed"
    assert tags["rlhf.contract.judge.weak"] == "failed" and tags["rlhf.contract.judge.reward_model"] == "passed"
    assert metrics["eval/judge/weak/invalid_rate"] == 1.0 and metrics["eval/judge/reward_model/invalid_rate"] == 0.0
    assert "eval/judge/reward_model/net_win_ci_low" in metrics
    assert tags["rlhf.champion"].startswith("yes (judge reward_model")
    gate = tracking.download(f"runs:/{run.info.run_id}/contracts/eval_gate.md").read_text()
    assert "judge.weak" in gate and "8 of 8 rows unexpected" in gate and "| judge.reward_model | passed |" in gate


TIE_MODULE = """
def same_score(prompts, responses):
    return [0.0] * len(responses)
"""


def test_a_judge_at_chance_cannot_decide_and_grants_no_champion(evaluated, tmp_path, monkeypatch):
    """A judge that scores every answer alike ties every labelled control pair: accuracy 0.5, its
    interval around chance. It gives no win or loss, the verdict says it cannot decide and why,
    and @champion stays where it was; the reward-model judge carries the accuracy the reward stage
    recorded on the version it reads, and every judge its length-controlled net win."""
    from flows.rlhf import rlhf
    from stages.orchestration import runs

    (tmp_path / "tie_judge.py").write_text(TIE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_id, _ = evaluated
    policy = lineage.outputs_of(run_id)["policy_model"]
    name, _ = policy.removeprefix("models:/").split("/")
    tracking.client().delete_registered_model_alias(name, "champion")
    judges = [{"kind": "reward_source", "name": "coin", "source": "python:tie_judge:same_score"},
              {"kind": "reward_model"}]
    again = rlhf(preset="tiny", stages=["eval"], from_run=run_id,
                 overrides={"eval.judges": judges, "eval.ceval.shots": [0], "eval.judge_control_pairs": 16,
                            "eval.champion_min_lower_bound": -2.0})
    run = stage_run(again, "eval")
    tags, metrics = run.data.tags, run.data.metrics
    assert metrics["eval/judge/coin/accuracy"] == 0.5 and metrics["eval/judge/coin/accuracy_pairs"] == 16
    assert metrics["eval/judge/coin/accuracy_ci_low"] < 0.5 < metrics["eval/judge/coin/accuracy_ci_high"]
    assert metrics["eval/judge/coin/can_judge"] == 0.0 and metrics["eval/judge/coin/net_win"] == 0.0
    low, high = (metrics[f"eval/judge/coin/accuracy_ci_{end}"] for end in ("low", "high"))
    reason = f"cannot decide: coin's accuracy 0.500 [{low:.3f}, {high:.3f}] on 16 held-out pairs includes chance"
    assert reason in tags["rlhf.champion"]

    # The reward model judge: the reward stage's held-out accuracy, from its registered version's tags.
    reward_run = stage_run(run_id, "reward").data.metrics
    assert metrics["eval/judge/reward_model/accuracy"] == pytest.approx(reward_run["eval/accuracy"], abs=1e-4)
    assert metrics["eval/judge/reward_model/accuracy_ci_low"] == pytest.approx(reward_run["eval/accuracy_ci_low"], abs=1e-4)
    assert metrics["eval/judge/reward_model/accuracy_pairs"] == 32
    rm_can_judge = metrics["eval/judge/reward_model/accuracy_ci_low"] > 0.5
    assert metrics["eval/judge/reward_model/can_judge"] == float(rm_can_judge)
    for judge in ("coin", "reward_model"):
        for name in ("net_win_lc", "net_win_lc_ci_low", "net_win_lc_ci_high", "length_corr"):
            assert math.isfinite(metrics[f"eval/judge/{judge}/{name}"]), (judge, name)
    assert metrics["eval/judge/reward_model/score_delta_lc_ci_low"] <= metrics["eval/judge/reward_model/score_delta_lc"]
    if rm_can_judge:
        pytest.skip("the tiny reward model judged above chance: the champion is its to decide")
    assert metrics["eval/champion"] == 0.0 and tags["rlhf.champion"].startswith(f"no ({reason}")
    assert "cannot decide: reward_model's accuracy" in tags["rlhf.champion"]
    with pytest.raises(Exception, match="RESOURCE_DOES_NOT_EXIST|not found|No model version"):
        tracking.client().get_model_version_by_alias(name, "champion")

    # The ending: the verdict names the judge at chance, its accuracy, and the length-controlled numbers.
    lines = runs.ending(again).text.splitlines()
    verdict = next(line for line in lines if line.startswith("Verdict: "))
    assert verdict.startswith(f"Verdict: {reason} (coin judge on 8 held-out prompts: win 0 / tie 8 / lose 0;")
    numbers = lines[lines.index(verdict) + 1]
    assert numbers.startswith(f"  coin judge: accuracy 0.500 [{low:.3f}, {high:.3f}] on 16 held-out pairs; ")
    assert "length-controlled" in numbers and "corr(score, length)" in numbers
    report = tracking.download(f"runs:/{run.info.run_id}/report")
    text = (report / "report.md").read_text()
    assert "net_win_lc 95% CI" in text and "| harmless | coin | 0.500 [" in text and "| no |" in text


def test_the_api_key_is_nowhere_in_mlflow(evaluated):
    run_id, _ = evaluated
    runs = [tracking.client().get_run(run_id), *lineage.stage_runs(run_id)]
    artifacts = files(*(tracking.download(f"runs:/{run.info.run_id}/") for run in runs))
    assert leaks([SECRET], texts=mlflow_texts(runs), blobs=artifacts) == []
    assert any(run.data.params.get("eval.judges", "").count(KEY_ENV) for run in runs)  # the variable's name only


# -- the eval contract on made-up frames -------------------------------------------------------


def _frame(verdicts=("win", "tie", "lose", "win"), predicted="ABCD", score=-1.2, rm_score=0.3):
    ceval_rows = [{"row": 2 + i, "kind": "ceval", "model": "sft", "shots": 0, "subject": "law", "predicted": p,
                   "score": score} for i, p in enumerate(predicted)]
    judge_rows = [{"row": 100 + i, "kind": "judge", "judge": "reward_model", "judge_kind": "reward_model",
                   "verdict": v, "score_policy": rm_score, "score_sft": 0.1} for i, v in enumerate(verdicts)]
    columns = ["row", "kind", "model", "shots", "subject", "predicted", "score", "judge", "judge_kind", "verdict",
               "score_policy", "score_sft"]
    return pd.DataFrame(ceval_rows + judge_rows).reindex(columns=columns)


def _failed(report) -> dict[str, set]:
    out: dict[str, set] = {}
    for failure in report.failures:
        out.setdefault(failure.column, set()).update(e["row"] for e in failure.examples)
    return out


def test_eval_contract_passes_a_sane_probe():
    cfg = load_config("demo")
    assert validate("evaluation", _frame(verdicts=("win", "tie", "lose") * 4 + ("invalid",)), cfg).success  # 1 in 13 < 0.1
    assert validate("evaluation", _frame(verdicts=()), cfg).success  # C-Eval only (no policy)


def test_eval_contract_fails_on_answers_outside_a_to_d_and_nan_scores():
    report = validate("evaluation", _frame(predicted="AB?D", score=math.nan), load_config("demo"))
    assert not report.success
    failed = _failed(report)
    assert failed["predicted"] == {4} and failed["score"] == {2, 3, 4, 5}


def test_eval_contract_fails_on_too_many_invalid_verdicts_and_infinite_rm_scores():
    frame = _frame(verdicts=("win", "invalid", "invalid", "maybe"), rm_score=math.inf)
    report = validate("evaluation", frame, load_config("demo"))
    failed = _failed(report)
    assert failed["verdict"] == {103} and failed["score_policy"] == {100, 101, 102, 103}  # 'maybe' is no verdict
    judge = validate("judge", frame[frame["kind"] == "judge"], load_config("demo"))
    assert not judge.success and _failed(judge)["verdict"] == {101, 102, 103}  # 3 of 4 are not valid
