"""`rlhf study` on the tiny preset through the real Prefect flow and MLflow store: one chain, two
PPO arms on its artifacts, the figure and the table with intervals on the study's run; a resumed
study keeps its finished arms."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from pipeline_helpers import version_tags

from stages.leaves import stats
from stages.leaves.config import ConfigError, rlhf_home
from stages.orchestration import study_records as studies
from stages.orchestration import lineage, registry, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import pair_digest, read_jsonl

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
    chain = lineage.outputs_of(runs["chain"].info.run_id)
    for arm, preset in (("ppo-max", "ppo-max"), ("vanilla", "vanilla")):
        policy = version_tags(lineage.outputs_of(runs[arm].info.run_id)["policy_model"])
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
    # arm | seeds | iterations: one seed, two iterations each
    assert "| ppo-max | 1 | 2 |" in table and "| vanilla | 1 | 2 |" in table and " [" in table and "collapse guard" in table
    assert 'src="data:image/png;base64,' in (folder / "study.html").read_text()  # the figure inline
    assert "Figure:" in out and "| ppo-max |" in out
    for arm in ("ppo-max", "vanilla"):  # a finished arm's PPO checkpoints are gone (each is the size of 3 models)
        ppo_folder = rlhf_home() / "runs" / runs[arm].info.run_id / "ppo"
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
    policy = version_tags(lineage.outputs_of(new.info.run_id)["policy_model"])
    assert policy["rlhf.ppo_preset"] == "vanilla" and policy["rlhf.input.critic_model"] == chain["critic_model"]
    assert lineage.recorded_config(new.info.run_id).ppo.actor_lr == 1.0e-3
    study = client.get_run(study_id)
    assert study.info.run_name == "tiny study · ppo-max vs vanilla vs vanilla lr x10"
    assert "| vanilla lr x10 | 1 | 2 |" in tracking.download(f"runs:/{study_id}/study").joinpath("study.md").read_text()
    assert "vanilla lr x10/eval/score_delta" in study.data.metrics


def test_the_study_presets_runs_are_not_named_study_study():
    assert (run_writers.study_title("tiny"), run_writers.study_title("study")) == ("tiny study", "study")


def test_a_gold_study_with_seeds_and_best_of_n_reports_gold_and_per_seed_deltas(prefect_server, hh_file, tmp_path,
                                                                                 capsys):
    """`study.gold`, two seeds and best-of-n on the tiny preset: the gold RM trains on pairs
    disjoint from the proxy's, scores every held-out check and decides the champion; the table
    gives intervals across seeds and each seed's value; the overoptimisation figure is logged."""
    from flows.study import study

    overrides = [*FAST, "study.arms={ppo-max: {}}", "study.gold=true", "study.seeds=[0, 1]",
                 "study.best_of_n=[1, 2, 4]", "data.splits.gold_rm_train=32", "data.splits.gold_rm_eval=16",
                 "eval.ceval.subjects=[law]", "sft.epochs=1", "reward.max_steps=4", "critic.max_steps=2"]
    study_id = study(preset="tiny", overrides=overrides)
    runs = studies.arm_runs(study_id)
    bon = {"best-of-1", "best-of-2", "best-of-4"}
    assert set(runs) == {"chain", "gold", "ppo-max seed 0", "ppo-max seed 1",
                         *(f"{name} seed {s}" for name in bon for s in (0, 1))}
    assert all(run.info.status == "FINISHED" for run in runs.values())
    chain, gold = (lineage.outputs_of(runs[name].info.run_id) for name in ("chain", "gold"))
    assert gold["splits"] == chain["splits"] and gold["reward_model"] != chain["reward_model"]
    gold_tags = version_tags(gold["reward_model"])
    assert gold_tags["rlhf.input.splits"] == chain["splits"]

    client = tracking.client()
    seeds = []
    for seed in (0, 1):
        arm = runs[f"ppo-max seed {seed}"]
        config = lineage.recorded_config(arm.info.run_id)
        assert config.ppo.seed == seed and config.ppo.gold_reward_model == gold["reward_model"]
        assert config.eval.judges[0].name == "gold" and config.eval.judges[0].model == gold["reward_model"]
        stages = lineage.recorded_stages(arm)
        ppo = client.get_run(stages["ppo"][1]).data.metrics
        assert {"eval/gold_score", "eval/gold_score_delta_ci_low"} <= set(ppo)
        assert len(client.get_metric_history(stages["ppo"][1], "eval/gold_score")) == 3  # SFT, iterations 1 and 2
        ev = client.get_run(stages["eval"][1])
        # the gold judge decides, or (a tiny gold RM at chance on its held-out pairs) cannot decide, says so,
        # and the next judge that can decides
        champion = ev.data.tags["rlhf.champion"]
        assert champion.split(" (", 1)[1].startswith("judge gold") or "cannot decide: gold's accuracy" in champion
        seeds.append(ppo["eval/gold_score_delta"])
    for name in bon:
        n = int(name.rsplit("-", 1)[1])
        metrics = runs[f"{name} seed 0"].data.metrics
        assert metrics["eval/kl"] == pytest.approx(math.log(n) - (n - 1) / n)
        assert "eval/gold_score_delta_ci_high" in metrics and "eval/score_delta" in metrics

    summary = client.get_run(study_id).data.metrics
    assert summary["ppo-max seed 1/eval/gold_score_delta"] == pytest.approx(seeds[1])
    low, mean, high = (summary[f"ppo-max/seeds/eval/gold_score_delta{end}"] for end in ("_ci_low", "", "_ci_high"))
    assert mean == pytest.approx(sum(seeds) / 2) and low <= mean <= high
    folder = tracking.download(f"runs:/{study_id}/study")
    assert (folder / "overoptimisation.png").read_bytes()[:4] == b"\x89PNG"
    text = (folder / "study.md").read_text()
    assert "Gold RM (pipeline run" in text and "held-out accuracy" in text and "Proxy RM held-out accuracy" in text
    reward_stages = {name: lineage.recorded_stages(runs[name])["reward"][1] for name in ("chain", "gold")}
    rm_metrics = {name: client.get_run(stage).data.metrics for name, stage in reward_stages.items()}
    # The gold RM scores the proxy's held-out pairs too (pairs it never trains on), each by its identity.
    splits = tracking.download(chain["splits"])
    rm_eval = read_jsonl(splits / "rm_eval.jsonl")[: load_config("tiny").reward.heldout_pairs]
    assert not {r["prompt"] for r in rm_eval} & {r["prompt"] for r in read_jsonl(splits / "gold_rm_train.jsonl")}
    keys = [pair_digest(r["prompt"], r["chosen"], r["rejected"]) for r in rm_eval]
    outcomes = {name: studies.pair_outcome_table(stage) for name, stage in reward_stages.items()}
    assert outcomes["chain"]["pair"].tolist() == keys and set(outcomes["chain"]["split"]) == {"rm_eval"}
    on_proxy_pairs = outcomes["gold"][outcomes["gold"]["split"] == "rm_eval"]
    assert on_proxy_pairs["pair"].tolist() == keys and rm_metrics["gold"]["eval/rm_eval/pairs"] == len(keys)
    gold_accuracy, proxy_accuracy = rm_metrics["gold"]["eval/rm_eval/accuracy"], rm_metrics["chain"]["eval/accuracy"]
    assert on_proxy_pairs["correct"].mean() == pytest.approx(gold_accuracy)
    # Gold only if it ranks more of the same pairs right than the proxy; else the table calls it the second RM.
    assert f"On the same {len(keys)} pairs" in text and f"gold RM accuracy {gold_accuracy:.3f} [" in text
    assert f"proxy {proxy_accuracy:.3f} [" in text and "gold − proxy " in text
    is_gold = gold_accuracy > proxy_accuracy
    assert ("it is the gold standard here" in text, "gold score Δ vs SFT" in text) == (is_gold, is_gold)
    assert ("NOT ahead of the proxy" in text, "second RM score Δ vs SFT" in text) == (not is_gold, not is_gold)
    assert summary["gold/eval/same_pairs/accuracy_delta"] == pytest.approx(gold_accuracy - proxy_accuracy)
    row = next(line for line in text.splitlines() if line.startswith("| ppo-max |"))
    gold_std = rm_metrics["gold"]["eval/score_std"]  # the table's gold deltas are in the gold RM's std
    assert "across 2 seeds" in row and f"{seeds[0] / gold_std:+.3f}" in row and "judge gold net win" in text
    assert "gold Δ − best-of-n's at the arm's KL" in text.replace("second RM Δ", "gold Δ")
    # each judge's accuracy on labelled held-out pairs and the length-controlled numbers beside the raw ones
    assert all(column in text for column in ("judge gold accuracy", "judge gold net win, length-controlled",
                                             "score Δ, length-controlled"))
    assert any(line.startswith("| best-of-4 | 2 | n = 4 |") for line in text.splitlines())
    arms = [name for name in runs if name not in ("chain", "gold")]
    points = studies.overoptimisation_points(studies.collect(study_id, arms, "gold"))
    assert [round(x * x, 6) for x, _, _ in points["best-of-n"]] == [round(math.log(n) - (n - 1) / n, 6)
                                                                    for n in (1, 2, 4)]
    assert points["ppo-max"][0][1:] == (0.0, 0.0) and all(g is not None for _, _, g in points["ppo-max"])

    # `rlhf report`: the same table, made again from the study's runs in MLflow, with its provenance.
    from flows.cli import main

    capsys.readouterr()
    assert main(["report", study_id, "--out", str(tmp_path / "report.md")]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "report.md").read_text() in printed
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line for line in printed.splitlines() if line.startswith("| ")] == rows
    assert client.get_run(study_id).data.tags["rlhf.git_commit"] in printed
    assert "command: `rlhf study --preset tiny --set" in printed and "study.gold=true" in printed
    assert main(["report", runs["chain"].info.run_id]) == 2
    assert "is not a study run" in capsys.readouterr().err


def test_best_of_n_is_a_stage_run_as_ranks_and_skipped_when_it_ran_before(prefect_server):
    """The best-of-n draws run as every stage does: through the launcher (here two CPU ranks under
    torchrun, each drawing for half the prompts, rank 0 showing a progress bar), recorded in MLflow
    with the launch params other stages log, and cached under the stage's key: a second run on the
    same inputs and config reuses the first's stage run."""
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

    from flows.rlhf import rlhf

    chain = rlhf(preset="tiny", stages=["data", "sft", "reward"], overrides={"sft.epochs": 1, "reward.max_steps": 2})
    overrides = {"study.best_of_n": [1, 2], "best_of_n.launch.world_size": 2}
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: False}):  # conftest reruns every stage; this test reads the cache
        first, second = (rlhf(preset="tiny", stages=["best_of_n"], from_run=chain, overrides=overrides) for _ in range(2))
    client = tracking.client()
    (how, stage_run), (again, reused) = (lineage.recorded_stages(client.get_run(run))["best_of_n"] for run in (first, second))
    assert (how, again, reused) == ("ran", "reused", stage_run)

    run = client.get_run(stage_run)
    assert {"precision", "precision.hardware", "allocator"} <= set(run.data.params)  # execute's, as every stage's
    assert run.data.params["best_of_n.world_size"] == "2" and run.data.params["best_of_n.draws"] == "3"
    assert "stage/seconds" in run.data.metrics  # rank 0 of the launched ranks logs it
    chain_outputs = lineage.outputs_of(chain)
    assert run.data.tags["rlhf.input.sft_model"] == chain_outputs["sft_model"]
    assert run.data.tags["rlhf.config_hash"] == registry.get("best_of_n").config_hash(lineage.recorded_config(first))
    ranks_log = (tracking.rlhf_home() / "runs" / first / "best_of_n" / "ranks.log").read_text()
    assert "best_of_n: 100%" in ranks_log  # the draws' progress bar

    drawn = studies.read_draws(lineage.stage_outputs(stage_run)["best_of_n_draws"])
    prompts = load_config("tiny").ppo.heldout_prompts
    assert {name: values.shape for name, values in drawn.items()} == {name: (3, prompts) for name in ("proxy", "gold", "length")}
    assert np.isfinite(drawn["proxy"]).all() and np.isnan(drawn["gold"]).all() and (drawn["length"] > 0).all()
    metrics = studies.best_of_n_metrics(drawn, 2, load_config("tiny"))
    assert metrics["eval/kl"] == pytest.approx(math.log(2) - 0.5) and "eval/gold_score" not in metrics


def _ppo_arm(name: str, final: dict, eval_metrics: dict, registered: int, last: int = 16) -> "studies.ArmResult":
    """A PPO arm's result as `collect` reads it back: held-out checks every 4 iterations, the proxy
    score rising 0.1 per check and the gold score falling 0.05 per check."""
    checks = range(0, last + 1, 4)
    curves = {"eval/score": [(s, 0.1 * s / 4) for s in checks], studies.GOLD_CURVE: [(s, -0.05 * s / 4) for s in checks],
              "eval/kl": [(s, s / 4) for s in checks]}
    return studies.ArmResult(name=name, pipeline_run="p", curves=curves, breaches=[s for s in checks if s > registered],
                             final=final, tags={"rlhf.policy_iteration": str(registered),
                                                "rlhf.final_iteration": str(last)},
                             eval_metrics=eval_metrics, champion="no (…)", arm=studies.base_arm(name))


def _best_of_n(n: int, seed: int, gold: float) -> "studies.ArmResult":
    final = {"eval/kl": studies_kl(n), "eval/score_delta": 0.4 * gold, "eval/gold_score_delta": gold}
    return studies.ArmResult(name=f"best-of-{n} seed {seed}", pipeline_run="b", curves={}, breaches=[], final=final,
                             tags={}, eval_metrics={}, champion="", arm=f"best-of-{n}", best_of_n=n)


def studies_kl(n: int) -> float:
    return math.log(n) - (n - 1) / n


def test_a_row_describes_one_policy_and_names_its_iteration():
    """An arm whose last check breached under `on_collapse: warn`: the row's deltas, KL and judge
    are the final policy's (iteration 16), the registered policy's (iteration 12) stand beside them."""
    final = {"eval/score_delta": 1.2, "eval/gold_score_delta": -0.8, "eval/kl": 9.0}
    registered_only = _ppo_arm("ppo-max", final, {"eval/judge/gold/net_win": 0.25}, registered=12)
    row = studies.table([registered_only], "gold").iloc[0].to_dict()
    assert row["policy"] == "iteration 16 (final; registered: iteration 12)"
    assert row["judge gold net win"] == "–"  # the eval stage judged only the registered policy: not this row's
    assert row["registered policy"] == "iteration 12: proxy Δ +0.300, gold Δ -0.150, KL 3.000, judge gold net win +0.250"

    both = _ppo_arm("ppo-max", final, {"eval/judge/gold/net_win": 0.25, "eval/final/judge/gold/net_win": -0.5,
                                       "eval/final/judge/gold/net_win_ci_low": -0.7,
                                       "eval/final/judge/gold/net_win_ci_high": -0.3}, registered=12)
    row = studies.table([both], "gold").iloc[0].to_dict()
    assert row["judge gold net win"] == "-0.500 [-0.700, -0.300]"
    unbroken = _ppo_arm("vanilla", final, {"eval/judge/gold/net_win": 0.25}, registered=16)
    row = studies.table([unbroken], "gold").iloc[0].to_dict()
    assert (row["policy"], row["judge gold net win"], row["registered policy"]) == ("iteration 16", "+0.250",
                                                                                    "the final policy")


def test_deltas_are_in_each_reward_models_std_and_ppo_meets_best_of_n_at_its_kl():
    """Each RM's Δ in units of its own held-out score std before the proxy − gold gap; every PPO arm
    against the best-of-n curve interpolated at the arm's KL, with its interval across seeds."""
    scales = {"eval/score_delta": 2.0, "eval/gold_score_delta": 0.5}
    bon = [_best_of_n(n, seed, gold) for seed in (0, 1) for n, gold in ((1, 0.0), (4, 0.2), (16, 0.4))]
    # KL 1.2: between best-of-4 (0.636) and best-of-16 (1.835); best-of-n's gold Δ there, in gold σ:
    at = float(np.interp(1.2, [studies_kl(1), studies_kl(4), studies_kl(16)], [0.0, 0.4, 0.8]))
    arms = [_ppo_arm(f"ppo-max seed {seed}", {"eval/score_delta": 1.0, "eval/gold_score_delta": gold,
                                              "eval/gold_score_delta_ci_low": gold - 0.1,
                                              "eval/gold_score_delta_ci_high": gold + 0.1, "eval/kl": 1.2},
                     {}, registered=16) for seed, gold in ((0, 0.6), (1, 0.7), (2, 0.8))]
    frame = studies.table([*arms, *bon], "gold", scales=scales)
    row = frame[frame["arm"] == "ppo-max"].iloc[0].to_dict()
    golds = [1.2, 1.4, 1.6]  # 0.6 / 0.5, ...
    assert row["gold score Δ vs SFT"].startswith(f"{stats.across_runs(golds)} across 3 seeds")
    assert row["proxy − gold Δ"].startswith(str(stats.across_runs([0.5 - g for g in golds])))
    gaps = stats.across_runs([g - at for g in golds])
    assert row["gold Δ − best-of-n's at the arm's KL"] == f"{gaps} across 3 seeds: PPO ahead"
    single = studies.table([arms[0], *bon], "gold", scales=scales)
    assert single.iloc[0]["gold score Δ vs SFT"] == "+1.200 [+1.000, +1.400]"
    points = studies.overoptimisation_points([arms[0], *bon], scales)
    assert points["best-of-n"][-1][1:] == pytest.approx((0.16 / 2.0, 0.4 / 0.5))
    assert points["ppo-max"][-1][1:] == pytest.approx((0.4 / 2.0, -0.2 / 0.5))
    far = _ppo_arm("far", {"eval/gold_score_delta": 0.2, "eval/kl": 6.0}, {}, registered=16)
    row = studies.table([far, *bon], "gold", scales=scales).iloc[0].to_dict()
    assert row["gold Δ − best-of-n's at the arm's KL"] == ("-0.400 [-0.400, -0.400]: PPO behind on one seed (no "
                                                           "interval); KL beyond best-of-n's range [0.00, 1.84], its "
                                                           "nearest n")


def test_the_table_shows_the_judges_accuracy_and_length_controlled_numbers_the_eval_stage_logs():
    metrics = {"eval/judge/gold/net_win": 0.1, "eval/judge/gold/accuracy": 0.555, "eval/judge/gold/accuracy_ci_low": 0.468,
               "eval/judge/gold/accuracy_ci_high": 0.638, "eval/judge/gold/can_judge": 0.0,
               "eval/judge/gold/net_win_lc": 0.05, "eval/judge/gold/net_win_lc_ci_low": -0.1,
               "eval/judge/gold/net_win_lc_ci_high": 0.2, "eval/judge/gold/score_delta_lc": 0.3}
    row = studies.table([_ppo_arm("ppo-max", {"eval/kl": 1.0}, metrics, registered=16)], "gold").iloc[0].to_dict()
    assert row["judge gold accuracy"] == "0.555 [0.468, 0.638]; cannot judge"
    assert row["judge gold net win, length-controlled"] == "+0.050 [-0.100, +0.200]"
    assert row["score Δ, length-controlled"] == "+0.300"


def test_an_arm_breached_at_every_check_is_judged_on_its_final_policy(prefect_server):
    """A KL band of 0 under `on_collapse: warn`: every check after SFT breaches, so the registered
    policy is iteration 0's (SFT itself). The eval stage judges the final policy too, and the
    study's row reads that one, naming its iteration, with the registered one beside it."""
    from flows.study import study

    overrides = [*FAST, "study.arms={ppo-max: {}}", "contracts.policy.max_kl=0", "ppo.on_collapse=warn",
                 "eval.ceval.subjects=[law]", "sft.epochs=1", "reward.max_steps=4", "critic.max_steps=2"]
    study_id = study(preset="tiny", overrides=overrides)
    arm = studies.arm_runs(study_id)["ppo-max"]
    stages, client = lineage.recorded_stages(arm), tracking.client()
    ppo = client.get_run(stages["ppo"][1])
    assert (ppo.data.tags["rlhf.policy_iteration"], ppo.data.tags["rlhf.final_iteration"]) == ("0", "2")
    assert lineage.outputs_of(arm.info.run_id)["final_policy_model"] == f"runs:/{ppo.info.run_id}/final_policy"
    judged = client.get_run(stages["eval"][1]).data.metrics
    assert judged["eval/judge/reward_model/tie_rate"] == 1.0  # the registered policy is SFT: its answers are SFT's
    final = {key: judged[f"eval/final/judge/reward_model/{key}"] for key in ("net_win", "n", "tie_rate")}
    assert final["n"] == judged["eval/judge/reward_model/n"] and final["tie_rate"] < 1.0

    row = next(line for line in tracking.download(f"runs:/{study_id}/study").joinpath("study.md").read_text()
               .splitlines() if line.startswith("| ppo-max |"))
    assert "| iteration 2 (final; registered: iteration 0) |" in row and "| breach at 1, 2 |" in row
    assert f"| {final['net_win']:+.3f} [" in row and "| iteration 0: proxy Δ +0.000" in row
    assert client.get_run(study_id).data.metrics["ppo-max/policy_iteration"] == 2.0


def test_the_controlled_setting_trains_the_proxy_on_the_gold_rms_labels(prefect_server):
    """`study.gold_relabels` (Gao et al. 2022's synthetic setting): data and SFT run first (`base`),
    the gold RM trains from them, and the chain's proxy RM learns the gold RM's labels (chosen and
    rejected swapped where the gold RM disagrees), training and held-out pairs alike."""
    from flows.study import study

    overrides = [*FAST, "study.arms={ppo-max: {}}", "study.gold=true", "study.gold_relabels=true",
                 "data.splits.gold_rm_train=32", "data.splits.gold_rm_eval=16", "eval.ceval.subjects=[law]",
                 "sft.epochs=1", "reward.max_steps=4", "critic.max_steps=2"]
    study_id = study(preset="tiny", overrides=overrides)
    runs = studies.arm_runs(study_id)
    assert set(runs) == {"base", "gold", "chain", "ppo-max"} and all(r.info.status == "FINISHED" for r in runs.values())
    base, gold, chain = (lineage.outputs_of(runs[name].info.run_id) for name in ("base", "gold", "chain"))
    assert gold["sft_model"] == chain["sft_model"] == base["sft_model"] and "reward_model" not in base
    assert lineage.recorded_config(runs["chain"].info.run_id).reward.labels_from == gold["reward_model"]
    reward = tracking.client().get_run(lineage.recorded_stages(runs["chain"])["reward"][1]).data.metrics
    train, heldout = reward["data/relabelled_train_pairs"], reward["data/relabelled_heldout_pairs"]
    assert 0 < train < 96 and 0 <= heldout <= 32  # a gold RM of 4 steps disagrees with some human labels
    policy = version_tags(lineage.outputs_of(runs["ppo-max"].info.run_id)["policy_model"])
    assert policy["rlhf.input.reward_model"] == chain["reward_model"] != gold["reward_model"]
    text = tracking.download(f"runs:/{study_id}/study").joinpath("study.md").read_text()
    assert "Controlled setting (`study.gold_relabels`" in text and f"({train:.0f} training and" in text
    assert "gold score Δ vs SFT" in text  # the gold RM is the truth by construction


def _reward_pipeline_run(name: str, metrics: dict[str, float], outcomes: list[pd.DataFrame] | None) -> str:
    """A pipeline run whose reward stage's run holds `metrics` and (unless None) the per-pair
    outcomes the reward stage logs, in the real MLflow store; its id."""

    from stages.leaves.reward_report import PAIR_OUTCOMES
    from stages.leaves.tags import STAGE_TAG_PREFIX

    client = tracking.client()
    experiment = tracking.experiment_id(client, "same-pairs")
    stage = client.create_run(experiment, run_name=f"{name} · reward")
    for key, value in metrics.items():
        client.log_metric(stage.info.run_id, key, value)
    if outcomes is not None:
        client.log_table(stage.info.run_id, data=pd.concat(outcomes, ignore_index=True), artifact_file=PAIR_OUTCOMES)
    client.set_terminated(stage.info.run_id)
    pipeline = client.create_run(experiment, run_name=name,
                                 tags={f"{STAGE_TAG_PREFIX}reward": f"ran:{stage.info.run_id}"})
    client.set_terminated(pipeline.info.run_id)
    return pipeline.info.run_id


def _rm_metrics(accuracy: float, n: int) -> dict[str, float]:
    return {**stats.wilson(round(accuracy * n), n).metrics("eval/accuracy"), "eval/score_std": 1.0}


def test_the_gold_rm_is_gold_only_when_it_ranks_more_of_the_same_pairs_right():
    """The gold and the proxy RM compared pair by pair on the proxy's held-out pairs, matched by
    pair identity: a gold RM with the higher accuracy on its own easier pairs but fewer of the
    same pairs right is the second RM; one behind on its own pairs but ahead on the same ones is
    gold. The sentence above the table gives both accuracies on the same pairs and the paired
    difference with its interval."""
    from stages.leaves.reward_report import pair_outcomes

    keys = [f"pair-{k}" for k in range(40)]
    proxy_right = np.array([1] * 30 + [0] * 10)  # 0.750 on its 40 held-out pairs
    proxy = [pair_outcomes(list(reversed(keys)), "rm_eval", proxy_right[::-1] - 0.5, np.zeros(40))]
    chain = _reward_pipeline_run("chain", _rm_metrics(0.75, 40), proxy)

    def gold_run(right_on_proxy_pairs: np.ndarray, own_accuracy: float) -> str:
        own = pair_outcomes([f"gold-{k}" for k in range(20)], "gold_rm_eval", np.ones(20), np.zeros(20))
        on_proxy_pairs = pair_outcomes(keys, "rm_eval", right_on_proxy_pairs - 0.5, np.zeros(40))
        return _reward_pipeline_run("gold", _rm_metrics(own_accuracy, 20), [own, on_proxy_pairs])

    weaker = np.array([1] * 20 + [0] * 16 + [1] * 4)  # 24 of 40: right on 4 the proxy misses, wrong on 10 it gets
    models = studies.RewardModels.read(chain, gold_run(weaker, 0.9))
    assert models.label() == "second RM"
    difference = stats.paired_delta(weaker, proxy_right)
    assert difference.estimate == pytest.approx(-0.15)
    text = models.sentence()
    gold_acc, proxy_acc = stats.wilson(24, 40), stats.wilson(30, 40)
    assert (f"On the same 40 pairs (the proxy's held-out pairs, which the gold RM never trains on): gold RM accuracy "
            f"0.600 [{gold_acc.low:.3f}, {gold_acc.high:.3f}], proxy 0.750 [{proxy_acc.low:.3f}, {proxy_acc.high:.3f}], "
            f"gold − proxy {difference} (paired bootstrap over the pairs; only the gold RM right on 4, only the proxy "
            f"on 10") in text
    assert "the gold RM is NOT ahead of the proxy" in text
    frame = studies.table([_ppo_arm("ppo-max", {"eval/gold_score_delta": 0.2, "eval/kl": 1.0}, {}, registered=16)],
                          "gold", scales=models.scales(), gold=models.label())
    assert "second RM score Δ vs SFT" in frame.columns
    assert text in studies.markdown("s", frame, load_config("tiny"), chain, models)
    assert models.same_pairs.metrics()["gold/eval/same_pairs/accuracy_delta"] == pytest.approx(-0.15)

    stronger = np.array([1] * 30 + [1] * 5 + [0] * 5)  # 35 of 40: ahead on the same pairs, behind on its own
    models = studies.RewardModels.read(chain, gold_run(stronger, 0.6))
    assert models.label() == "gold" and "the gold RM is ahead: it is the gold standard here" in models.sentence()
    assert models.same_pairs.gold.estimate == 0.875 and models.same_pairs.proxy.estimate == 0.75

    # A reward stage run without per-pair outcomes: the accuracies on different pairs, said so.
    unpaired = studies.RewardModels.read(chain, _reward_pipeline_run("gold", _rm_metrics(0.9, 20), None))
    assert unpaired.same_pairs is None and unpaired.label() == "gold"
    assert "the comparison is not paired" in unpaired.sentence()
    # The controlled setting: the gold RM is the truth by construction, nothing to compare.
    controlled = studies.RewardModels.read(chain, gold_run(weaker, 0.9), controlled=True)
    assert controlled.same_pairs is None and controlled.label() == "gold"
