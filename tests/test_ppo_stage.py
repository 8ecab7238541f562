"""The whole tiny pipeline (data → SFT → reward → critic → PPO-max) through the real Prefect flow,
a PPO rerun as vanilla on the same artifacts, and PPO on two DeepSpeed CPU ranks. A killed PPO run
resuming: tests/test_faults.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from pipeline_helpers import TRL_NAMES, stage_run, version_tags

from stages.leaves.config import rlhf_home
from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute
from stages.pipeline.data import read_jsonl


def test_full_pipeline_registers_critic_and_policy_with_lineage(full_run):
    runs = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(full_run)}
    assert set(runs) == {"data", "sft", "reward", "critic", "ppo", "eval"}
    assert all(run.info.status == "FINISHED" for run in runs.values())
    outputs = lineage.outputs_of(full_run)

    critic = version_tags(outputs["critic_model"])
    assert outputs["critic_model"].startswith("models:/rlhf-tiny-critic/")
    assert critic["rlhf.input.reward_model"] == outputs["reward_model"]
    critic_metrics = runs["critic"].data.metrics
    assert np.isfinite(critic_metrics["critic/final_value_loss"]) and "critic/final_explained_variance" in critic_metrics

    # The reward model's held-out accuracy with its interval and pair count: what the eval stage reads
    # to decide whether it can judge.
    reward, reward_metrics = version_tags(outputs["reward_model"]), runs["reward"].data.metrics
    for tag, metric in (("rlhf.heldout_accuracy", "eval/accuracy"), ("rlhf.heldout_accuracy_ci_low", "eval/accuracy_ci_low"),
                        ("rlhf.heldout_accuracy_ci_high", "eval/accuracy_ci_high")):
        assert float(reward[tag]) == pytest.approx(reward_metrics[metric], abs=1e-4), tag
    assert reward["rlhf.heldout_pairs"] == "32"

    policy = version_tags(outputs["policy_model"])
    assert outputs["policy_model"].startswith("models:/rlhf-tiny-policy/")
    assert policy["rlhf.input.sft_model"] == outputs["sft_model"]
    assert policy["rlhf.input.reward_model"] == outputs["reward_model"]
    assert policy["rlhf.input.critic_model"] == outputs["critic_model"]
    assert policy["rlhf.ppo_preset"] == "ppo-max"


def test_ppo_continues_the_critic_stages_running_moments_without_warmup(full_run):
    """PPO starts its score statistics where critic pre-training left them, count included (not
    from the RM's held-out stats with count 1), and skips lr warm-up, which the critic replaces."""
    outputs = lineage.outputs_of(full_run)
    critic_config = json.loads((tracking.download(outputs["critic_model"]) / "reward_config.json").read_text())
    carried = critic_config["running_moments"]
    assert carried["count"] > 1  # every score of the critic's rollouts
    params = stage_run(full_run, "ppo").data.params
    for key in ("mean", "var", "count"):
        assert float(params[f"ppo.initial_moments.{key}"]) == pytest.approx(carried[key], rel=1e-9)
    assert params["ppo.warmup_steps"] == "0" and params["ppo.ptx_source"] == "sft split"


def test_a_run_ends_with_its_headline_and_a_verdict_and_logs_them_on_the_parent_run(full_run):
    """The parent run holds each stage's headline numbers (MLflow's run list and compare view show
    them), each stage's name once in a metric's name, under a run name that says what ran; the
    run's ending is a line per stage and a verdict, and its MLflow description holds both."""
    from stages.orchestration import runs

    client = tracking.client()
    parent = client.get_run(full_run)
    assert parent.info.run_name == "tiny · ppo-max"
    assert stage_run(full_run, "ppo").info.run_name == "ppo (ppo-max)"
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    metrics = parent.data.metrics
    for name in ("data/rows", "sft/eval/perplexity", "sft/eval/perplexity/before", "reward/eval/accuracy",
                 "critic/final_value_loss", "ppo/eval/score", "ppo/eval/score/before", "ppo/eval/kl",
                 "ppo/eval/response_length/before", "eval/judge/reward_model/win_rate", "eval/judge/reward_model/net_win"):
        assert name in metrics, name
    assert not [name for name in metrics if name.split("/")[1:2] == name.split("/")[:1]]
    ppo_scores = [m.value for m in sorted(client.get_metric_history(stage_run(full_run, "ppo").info.run_id, "eval/score"),
                                          key=lambda m: m.step)]
    assert (metrics["ppo/eval/score/before"], metrics["ppo/eval/score"]) == pytest.approx((ppo_scores[0], ppo_scores[-1]))
    ending = runs.ending(full_run)
    text, lines = ending.text, ending.text.splitlines()
    assert lines[0] == f"Pipeline run {full_run} finished: tiny · ppo-max"
    assert [line.split()[0] for line in lines[1:7]] == ["data", "sft", "reward", "critic", "ppo", "eval"]
    assert "eval/score " in lines[5] and " → " in lines[5]
    assert "eval/score_delta_lc " in lines[5] and "eval/judge/reward_model/accuracy " in lines[6]
    verdict = next(line for line in lines if line.startswith("Verdict: "))
    assert "reward_model judge on 8 held-out prompts" in verdict
    # The judge's accuracy, with its interval, on the reward stage's held-out pairs; a judge at chance
    # cannot decide, and says so.
    reward, judged = stage_run(full_run, "reward").data.metrics, stage_run(full_run, "eval").data.metrics
    for end in ("", "_ci_low", "_ci_high"):
        assert judged[f"eval/judge/reward_model/accuracy{end}"] == pytest.approx(reward[f"eval/accuracy{end}"], abs=1e-4)
    accuracy = (f"{judged['eval/judge/reward_model/accuracy']:.3f} [{judged['eval/judge/reward_model/accuracy_ci_low']:.3f}, "
                f"{judged['eval/judge/reward_model/accuracy_ci_high']:.3f}] on 32 held-out pairs")
    at_chance = judged["eval/judge/reward_model/accuracy_ci_low"] <= 0.5
    assert verdict.startswith(f"Verdict: cannot decide: reward_model's accuracy {accuracy} ") == at_chance, verdict
    assert verdict.startswith("Verdict: the policy ") != at_chance
    if at_chance:  # the reason once, and what it means for the champion
        assert verdict.count("cannot decide") == 1 and "the policy is not the champion" in verdict, verdict
    numbers = lines[lines.index(verdict) + 1]
    assert numbers.startswith(f"  reward_model judge: accuracy {accuracy}; "), numbers
    # each number beside its length-controlled value, which leads where the judge goes by length
    corr = judged["eval/judge/reward_model/length_corr"]
    assert f"corr(score, length) {corr:+.2f}" in numbers
    for label in ("net win", "score Δ"):
        assert (f"length-controlled {label} " in numbers) == (abs(corr) > 0.3), numbers
        assert re.search(rf"{label} [-+\d.]+ \[[-+\d.]+, [-+\d.]+\] \(length-controlled [-+\d.]+ \[", numbers) or \
            re.search(rf"length-controlled {label} [-+\d.]+ \[[-+\d.]+, [-+\d.]+\] \(raw [-+\d.]+ \[", numbers), numbers
    # only a loss can blame the sample size
    assert ("cannot separate" in text) == ("did not beat" in verdict)
    assert ("the reward model the policy was trained against" in text) == verdict.startswith("Verdict: the policy beat")
    assert "Report: runs:/" in text

    description = parent.data.tags["mlflow.note.content"]
    assert description == ending.markdown
    paragraphs = description.split("\n\n")
    assert paragraphs[0] == f"**{lines[0]}**" and paragraphs[1] == verdict
    table = next(p for p in paragraphs if p.startswith("| stage | status | headline |")).splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| data", "| sft", "| reward", "| critic", "| ppo", "| eval"]
    assert table[2].startswith("| data | FINISHED | data/rows ")


def test_compare_lists_the_eval_stages_judges_with_their_intervals(full_run, tmp_path):
    """`rlhf compare`: the eval stage's headline patterns hold wildcards (a row per judge), each
    net win printed with its confidence interval."""
    from stages.orchestration import runs

    table = runs.compare(full_run, full_run, tmp_path / "compare.png")
    number = r"[-+\d.e]+"
    assert re.search(rf"\neval +eval/judge/reward_model/net_win +{number} \[{number}, {number}\] +{number} \[", table), table


def test_reward_critic_and_policy_pass_their_gates_on_heldout_probes(full_run):
    import pandas as pd

    runs = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(full_run)}
    outputs = lineage.outputs_of(full_run)
    for stage, suite, model in (("reward", "reward", "reward_model"), ("critic", "critic", "critic_model"),
                                ("ppo", "policy", "policy_model")):
        assert runs[stage].data.tags[f"rlhf.contract.{suite}"] == "passed", stage
        assert version_tags(outputs[model])["rlhf.contract"] == "passed", stage
    cfg = load_config("tiny")
    eval_rows = [r["row"] for r in read_jsonl(tracking.download(outputs["splits"]) / "eval_prompts.jsonl")]

    critic = pd.read_parquet(tracking.download(outputs["critic_probe"]))
    assert critic["row"].tolist() == eval_rows[: cfg.critic.heldout_prompts]  # line numbers in the source file
    assert critic["value_loss"].mean() == pytest.approx(runs["critic"].data.metrics["critic/heldout_value_loss"])
    assert critic["explained_variance"].nunique() == 1  # the batch's, on every row

    policy = pd.read_parquet(tracking.download(outputs["policy_probe"]))
    assert policy["row"].tolist() == eval_rows[: cfg.ppo.heldout_prompts]
    history = {name: tracking.client().get_metric_history(runs["ppo"].info.run_id, name)
               for name in ("eval/kl", "eval/response_length", "eval/eos_rate")}
    assert policy["kl"].mean() == pytest.approx(history["eval/kl"][-1].value, rel=1e-5, abs=1e-6)  # the final evaluation
    assert policy["ended_with_eos"].mean() == pytest.approx(history["eval/eos_rate"][-1].value)
    baseline = next(m for m in history["eval/response_length"] if m.step == 0)  # the SFT policy
    assert policy["sft_response_tokens_mean"].iloc[0] == pytest.approx(baseline.value)


def test_ppo_logs_trl_metrics_samples_evals_and_drops_its_checkpoints(full_run):
    client = tracking.client()
    ppo = stage_run(full_run, "ppo")
    cfg = load_config("tiny").ppo
    for name in TRL_NAMES:
        history = client.get_metric_history(ppo.info.run_id, name)
        assert [m.step for m in history] == list(range(1, cfg.iterations + 1)), name
        assert all(np.isfinite(m.value) for m in history), name
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "eval/kl")] == [0, 3, 6]  # 0: the SFT policy
    k3 = client.get_metric_history(ppo.info.run_id, "objective/kl_k3")  # beside k1, which may be negative: never
    assert len(k3) == cfg.iterations and all(m.value >= 0 for m in k3)
    # Each later held-out evaluation is paired with the SFT policy's: deltas with intervals, and the guard.
    for name in ("eval/score_delta", "eval/score_delta_lc", "eval/response_length_delta", "eval/perplexity_delta",
                 "eval/eos_rate_delta", "guard/passed", "guard/policy_iteration"):
        assert [m.step for m in client.get_metric_history(ppo.info.run_id, name)] == [3, 6], name
    for name in ("eval/distinct_2", "eval/score_length_corr"):  # the SFT policy's too
        assert [m.step for m in client.get_metric_history(ppo.info.run_id, name)] == [0, 3, 6], name
    metrics = ppo.data.metrics
    assert metrics["eval/score_delta_ci_low"] <= metrics["eval/score_delta"] <= metrics["eval/score_delta_ci_high"]
    # the same delta at equal lengths (the intercept of Δscore on Δlength over the held-out prompts)
    assert metrics["eval/score_delta_lc_ci_low"] <= metrics["eval/score_delta_lc"] <= metrics["eval/score_delta_lc_ci_high"]
    assert metrics["guard/passed"] == 1.0 and ppo.data.tags["rlhf.collapse"] == "none"  # tiny's bands are wide
    assert ppo.data.tags["rlhf.policy_iteration"] == str(cfg.iterations)
    samples = tracking.download(f"runs:/{ppo.info.run_id}/samples")
    table = json.loads((samples / "iteration_00006.json").read_text())
    assert table["columns"] == ["prompt", "response", "score", "ended_with_eos"]
    assert len(table["data"]) == cfg.rollout_batch_size
    assert (samples / "scores_00006.png").read_bytes()[:4] == b"\x89PNG"
    params = ppo.data.params  # the effective switches, one param each
    assert params["ppo.switches.score_mode"] == "normalise" and params["ppo.switches.value_clip"] == "True"
    # The checkpoints (every ppo.checkpoint_every iterations, and the guard's last passing one)
    # served resuming and rolling back: once the policy is published they are gone.
    folder = rlhf_home() / "runs" / full_run / "ppo"
    assert folder.is_dir() and not {"checkpoints", "passing"} & {p.name for p in folder.iterdir()}


def test_vanilla_ppo_reruns_on_the_same_artifacts(full_run):
    from flows.rlhf import rlhf

    rerun = rlhf(preset="tiny", overrides={"ppo.preset": "vanilla", "ppo.iterations": 2}, stages=["ppo"],
                 from_run=full_run)
    outputs = lineage.outputs_of(rerun)
    tags = version_tags(outputs["policy_model"])
    assert tags["rlhf.ppo_preset"] == "vanilla"
    assert tags["rlhf.input.reward_model"] == lineage.outputs_of(full_run)["reward_model"]
    ppo = stage_run(rerun, "ppo")
    assert ppo.data.params["ppo.preset"] == "vanilla"
    assert set(TRL_NAMES) <= set(ppo.data.metrics)  # the same names as the PPO-max run: comparable in MLflow


def test_a_failed_policy_gate_tags_its_version_and_leaves_earlier_versions_as_they_were(full_run):
    from data_contracts import ContractError
    from flows.rlhf import rlhf

    client = tracking.client()
    names = [f"rlhf-tiny-{kind}" for kind in ("sft", "reward", "critic", "policy")]

    def versions() -> dict[str, dict[str, dict]]:
        return {name: {mv.version: dict(mv.tags) for mv in client.search_model_versions(f"name = '{name}'")}
                for name in names}

    before = versions()
    with pytest.raises(ContractError) as err:  # no policy can be shorter than 0 × the SFT policy's length
        rlhf(preset="tiny", overrides={"ppo.iterations": 1, "contracts.policy.max_length_ratio": 0.0}, stages=["ppo"],
             from_run=full_run)
    assert ("contract gate after 'ppo': suite 'policy' failed: expect_column_mean_to_be_between on column "
            "'length_ratio'") in str(err.value)
    after = versions()
    (new,) = set(after["rlhf-tiny-policy"]) - set(before["rlhf-tiny-policy"])
    assert after["rlhf-tiny-policy"][new]["rlhf.contract"] == "failed"
    assert {name: {v: tags for v, tags in after[name].items() if v in before[name]} for name in names} == before
    run = client.get_run(client.get_model_version("rlhf-tiny-policy", new).run_id)
    assert run.data.tags["rlhf.contract.policy"] == "failed"
    assert "policy.validation.json" in {f.path.split("/")[-1] for f in client.list_artifacts(run.info.run_id, "contracts")}


def test_the_collapse_guard_rolls_back_then_stops_and_registers_the_last_passing_policy(full_run):
    """A real breach: a 10× actor lr against a KL band of 1e-3 nats. The guard rolls back once,
    stops at the next breach, and the stage registers the last policy that passed (here the SFT
    policy, iteration 0), tagged with the iteration and rule that broke; the gate then passes."""
    from safetensors.torch import load_file

    from flows.rlhf import rlhf

    rerun = rlhf(preset="tiny", overrides={"ppo.iterations": 4, "ppo.eval_every": 1, "ppo.actor_lr": 1e-2,
                                           "ppo.on_collapse": "rollback", "ppo.max_rollbacks": 1,
                                           "contracts.policy.max_kl": 1e-3}, stages=["ppo"], from_run=full_run)
    ppo = stage_run(rerun, "ppo")
    history = tracking.client().get_metric_history(ppo.info.run_id, "guard/rollbacks")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 1.0)]  # rolled back at 1, stopped at 2
    assert [m.value for m in tracking.client().get_metric_history(ppo.info.run_id, "guard/passed")] == [0.0, 0.0]
    outputs = lineage.outputs_of(rerun)
    tags = version_tags(outputs["policy_model"])
    assert tags["rlhf.collapse"].startswith("iteration 2: expect_column_mean_to_be_between on column 'kl'")
    assert tags["rlhf.policy_iteration"] == "0" and tags["rlhf.contract"] == "passed"
    policy = load_file(str(tracking.download(outputs["policy_model"]) / "model.safetensors"))
    sft = load_file(str(tracking.download(outputs["sft_model"]) / "model.safetensors"))
    assert all(torch.equal(policy[name], sft[name]) for name in sft)


def test_ppo_on_two_deepspeed_ranks(full_run):
    cfg = load_config("tiny", ["ppo.launch.world_size=2", "ppo.launch.deepspeed=zero2", "ppo.iterations=2",
                               "ppo.rollout_batch_size=8", "ppo.minibatch_size=4"])
    pipeline = run_writers.PipelineRun.start(cfg, ["ppo"], full_run)
    outputs = execute("ppo", cfg, pipeline.run_id, lineage.outputs_of(full_run))
    pipeline.finish("FINISHED")
    run = lineage.stage_runs(pipeline.run_id)[0]
    assert run.data.params["ppo.engine"] == "DeepSpeedEngine" and run.data.params["ppo.world_size"] == "2"
    history = tracking.client().get_metric_history(run.info.run_id, "loss/value_avg")
    assert [m.step for m in history] == [1, 2]  # rank 0 alone logs
    assert run.data.metrics["episode"] == 2 * 8 * 2  # iterations × prompts per rank × ranks
    assert outputs["policy_model"].startswith("models:/rlhf-tiny-policy/")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
def test_a_critic_free_estimator_runs_the_pipeline_with_no_critic(full_run, estimator):
    """critic, ppo and eval through the real flow on the full run's data, SFT and reward model: the
    critic stage is skipped, PPO loads and trains no critic (its checkpoints hold none:
    test_ppo_train.py), and none is registered."""
    from flows.rlhf import rlhf

    def critic_versions():
        return len(tracking.client().search_model_versions("name='rlhf-tiny-critic'"))

    before = critic_versions()
    overrides = {"ppo.advantage_estimator": estimator, "ppo.samples_per_prompt": 4, "ppo.iterations": 3}
    run_id = rlhf(preset="tiny", overrides=overrides, stages=["critic", "ppo", "eval"], from_run=full_run)
    recorded = lineage.recorded_stages(tracking.client().get_run(run_id))
    assert set(recorded) == {"ppo", "eval"} and all(how == "ran" for how, _ in recorded.values())
    assert critic_versions() == before
    ppo = tracking.client().get_run(recorded["ppo"][1])
    assert ppo.data.params["ppo.critic_model"] == "none" and ppo.data.params["ppo.advantage_estimator"] == estimator
    assert "loss/value_avg" not in ppo.data.metrics and np.isfinite(ppo.data.metrics["objective/scores"])
    policy = version_tags(lineage.stage_outputs(recorded["ppo"][1])["policy_model"])
    assert policy["rlhf.input.critic_model"] == "" and policy["rlhf.advantage_estimator"] == estimator
