"""`rlhf study` on the tiny preset through the real Prefect flow and MLflow store: one chain, two
PPO arms on its artifacts, the figure and the table with intervals on the study's run; a resumed
study keeps its finished arms."""

from __future__ import annotations

import pytest
from pipeline_helpers import version_tags

from stages import study as studies
from stages import tracking
from stages.config import ConfigError, load_config

FAST = ["ppo.iterations=2", "ppo.eval_every=1", "eval.ceval.shots=[0]", "eval.judges=[{kind: reward_model}]"]


def test_an_arm_may_not_change_the_shared_chain():
    with pytest.raises(ConfigError, match="study arm 'bigger-rm' sets 'reward.lr': an arm may set only keys under ppo"):
        load_config("tiny", ["study.arms={bigger-rm: {reward.lr: 1.0e-4}}"])
    with pytest.raises(ConfigError, match="study arm name 'lr×15': letters, digits"):
        load_config("tiny", ["study.arms={lr×15: {ppo.actor_lr: 1.0e-4}}"])


def test_a_two_arm_study_shares_its_chain_and_reports_intervals(prefect_server, capsys):
    from flows.cli import main

    assert main(["study", "--preset", "tiny", *(a for o in FAST for a in ("--set", o))]) == 0
    out = capsys.readouterr().out
    study_id = out.split("Study run ", 1)[1].split()[0]
    runs = studies.arm_runs(study_id)
    assert set(runs) == {"chain", "ppo-max", "vanilla"}
    assert all(run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == study_id
               for run in runs.values())
    assert runs["vanilla"].info.run_name == "tiny study · vanilla"
    chain = tracking.outputs_of(runs["chain"].info.run_id)
    for arm, preset in (("ppo-max", "ppo-max"), ("vanilla", "vanilla")):
        policy = version_tags(tracking.outputs_of(runs[arm].info.run_id)["policy_model"])
        assert policy["rlhf.ppo_preset"] == preset
        for model in ("sft_model", "reward_model", "critic_model"):  # both arms start from the chain's models
            assert policy[f"rlhf.input.{model}"] == chain[model]

    client = tracking.client()
    study = client.get_run(study_id)
    assert study.info.status == "FINISHED" and study.data.tags["rlhf.kind"] == "study"
    for arm in ("ppo-max", "vanilla"):
        assert f"{arm}/eval/score_delta" in study.data.metrics and f"{arm}/eval/judge/reward_model/net_win_ci_low" in study.data.metrics
    folder = tracking.download(f"runs:/{study_id}/study")
    assert (folder / "study.png").read_bytes()[:4] == b"\x89PNG"
    table = (folder / "study.md").read_text()
    assert "| ppo-max | 2 |" in table and "| vanilla | 2 |" in table and " [" in table and "collapse guard" in table
    assert 'src="data:image/png;base64,' in (folder / "study.html").read_text()  # the figure inline
    assert "Figure:" in out and "| ppo-max |" in out
    for arm in ("ppo-max", "vanilla"):  # a finished arm's PPO checkpoints are gone (each is the size of 3 models)
        ppo_folder = tracking.rlhf_home() / "runs" / runs[arm].info.run_id / "ppo"
        assert ppo_folder.is_dir() and not {"checkpoints", "passing"} & {p.name for p in ppo_folder.iterdir()}

    # Resumed, a finished study runs nothing again.
    assert main(["study", "--resume", study_id]) == 0
    again = studies.arm_runs(study_id)
    assert {arm: run.info.run_id for arm, run in again.items()} == {arm: run.info.run_id for arm, run in runs.items()}

    # An arm joins the finished study on its chain; the arms before it are not run again.
    capsys.readouterr()
    assert main(["study", "--resume", study_id, "--arm", "vanilla={ppo.actor_lr: 1.0e-3}"]) == 2
    assert f"study {study_id} already has an arm named 'vanilla'" in capsys.readouterr().err
    assert main(["study", "--resume", study_id, "--arm", "bigger-rm={reward.lr: 1.0e-4}"]) == 2
    assert "study arm 'bigger-rm' sets 'reward.lr'" in capsys.readouterr().err
    assert main(["study", "--resume", study_id, "--arm", "no overrides"]) == 2
    assert "write NAME={key: value, ...}" in capsys.readouterr().err
    assert client.get_run(study_id).info.status == "FINISHED"  # a refused arm leaves the study as it was
    assert main(["study", "--resume", study_id, "--arm", "vanilla lr x10={ppo.preset: vanilla, ppo.actor_lr: 1.0e-3}"]) == 0
    grown = studies.arm_runs(study_id)
    assert {arm: grown[arm].info.run_id for arm in runs} == {arm: run.info.run_id for arm, run in runs.items()}
    new = grown["vanilla lr x10"]
    assert new.info.status == "FINISHED" and new.data.tags["mlflow.parentRunId"] == study_id
    policy = version_tags(tracking.outputs_of(new.info.run_id)["policy_model"])
    assert policy["rlhf.ppo_preset"] == "vanilla" and policy["rlhf.input.critic_model"] == chain["critic_model"]
    assert tracking.recorded_config(new.info.run_id).ppo.actor_lr == 1.0e-3
    study = client.get_run(study_id)
    assert study.info.run_name == "tiny study · ppo-max vs vanilla vs vanilla lr x10"
    assert "| vanilla lr x10 | 2 |" in tracking.download(f"runs:/{study_id}/study").joinpath("study.md").read_text()
    assert "vanilla lr x10/eval/score_delta" in study.data.metrics


def test_the_study_presets_runs_are_not_named_study_study():
    from stages import tracking

    assert (tracking.study_title("tiny"), tracking.study_title("study")) == ("tiny study", "study")
