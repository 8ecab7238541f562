"""A study: PPO arms on one shared chain, and what it found — the MLflow side (no Prefect here;
flows/study.py runs it).

The study's MLflow run is the parent of its pipeline runs: the chain (data → SFT → reward →
critic) and one run per arm (PPO and evaluation from the chain's artifacts), tagged `rlhf.study`
and `rlhf.arm`. At the end the study run gets the figure (the paper's Figs. 4 and 9: per arm the
held-out reward, KL to SFT, response length and perplexity over the iterations, the collapse
guard's breaches marked), the overoptimisation figure (Gao et al. 2022, Fig. 1: proxy and gold RM
score against √KL to SFT, every arm), the table of final numbers with their confidence intervals
(across seeds where an arm has several), and each arm's headline numbers as metrics
`<arm>/<name>` so MLflow's compare view lines them up. With `study.gold` a second pipeline run,
`gold`, trains the gold RM on the chain's gold pairs and scores the proxy's held-out pairs with it,
so the two RMs compare pair by pair (`SamePairs`); best-of-n arms are runs of their own, tagged
`rlhf.arm_kind=best_of_n`, their numbers read from the best-of-n stage's draws (stages/pipeline/best_of_n.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.entities import Metric

from stages.compute.evaluate import report
from stages.leaves import stats
from stages.leaves.config import PipelineConfig
from stages.leaves.reward_report import PAIR_OUTCOMES
from stages.orchestration import lineage, registry, run_writers, tracking
from stages.leaves.tags import (ARMS_TAG, ARM_KIND_TAG, ARM_TAG, BEST_OF_N_TAG, CHAMPION_TAG, CONFIG_HASH_TAG,
                                GIT_COMMIT_TAG, FINAL_ITERATION_TAG, PIPELINE_TAG, POLICY_ITERATION_TAG, PRESET_TAG, SEED_TAG,
                                STUDY_OVERRIDES_TAG, STUDY_PRESET_TAG, STUDY_TAG)

CHAIN = "chain"  # the arm name of the shared chain's pipeline run
GOLD = "gold"  # the arm name of the gold reward model's pipeline run (`study.gold`)
# An arm's stages make or read the policy; the chain's, every other stage, run once for all arms;
# the gold reward model is the reward stage's model trained on the gold splits.
ARM_STAGES = [s.name for s in registry.STAGES.values() if s.in_pipeline and "policy_model" in (*s.outputs, *s.inputs)]
CHAIN_STAGES = [name for name in registry.pipeline_names() if name not in ARM_STAGES]
GOLD_STAGES = [s.name for s in registry.STAGES.values() if s.registers == "reward"]
# `study.gold_relabels`: the chain's stages before the reward model (data, SFT) run first, so the
# gold RM trains from them and relabels the proxy's pairs; the rest of the chain follows.
BASE = "base"
BASE_STAGES = CHAIN_STAGES[: CHAIN_STAGES.index(GOLD_STAGES[0])]
RELABELLED_CHAIN_STAGES = [name for name in CHAIN_STAGES if name not in BASE_STAGES]
GOLD_JUDGE = "gold"  # the gold RM's name as a judge: eval/judge/gold/...
BEST_OF_N = "best_of_n"  # the `rlhf.arm_kind` tag of a best-of-n arm's run
CURVES = {"eval/score": "held-out RM score", "eval/kl": "tempered KL to SFT (nats per response)",
          "eval/response_length": "response length (tokens)", "eval/perplexity": "perplexity (T = 1)"}
GOLD_CURVE = "eval/gold_score"
# The table's numbers: (metric of the PPO stage run's last held-out evaluation, column).
PPO_FINAL = [("eval/score_delta", "proxy score Δ vs SFT"), ("eval/gold_score_delta", "gold score Δ vs SFT"),
             ("eval/kl", "KL"), ("eval/response_length_delta", "length Δ"),
             ("eval/perplexity_delta", "perplexity Δ"), ("eval/eos_rate_delta", "EOS rate Δ"),
             ("eval/distinct_2", "distinct-2"), ("eval/score_length_corr", "corr(score, length)")]


def gold_run_overrides(cfg: PipelineConfig) -> dict[str, object]:
    """The gold RM's pipeline run: the reward stage on the gold pairs (`study.gold_reward_steps` steps),
    registered apart from the proxy."""
    steps = {"reward.max_steps": cfg.study.gold_reward_steps} if cfg.study.gold_reward_steps else {}
    return {"reward.pairs": "gold", "registry_prefix": f"{cfg.registry_prefix}-gold", **steps}


def gold_arm_overrides(cfg: PipelineConfig, gold_model: str) -> dict[str, object]:
    """What every PPO arm gets when the study has a gold RM: it scores each held-out check, and it
    is the eval stage's first judge (the champion's), before the configured ones."""
    judges = [{"kind": "reward_model", "name": GOLD_JUDGE, "model": gold_model},
              *(judge.model_dump(mode="json") for judge in cfg.eval.judges if judge.name != GOLD_JUDGE)]
    return {"ppo.gold_reward_model": gold_model, "eval.judges": judges}


def seeded(name: str, arm: dict, seeds: list[int]) -> dict[str, dict]:
    """An arm's runs: one per seed of `study.seeds` (`<arm> seed <s>`, ppo.seed = s), or itself."""
    return {f"{name} seed {seed}": {**arm, "ppo.seed": seed} for seed in seeds} if seeds else {name: arm}


def best_of_n_names(cfg: PipelineConfig) -> dict[str, tuple[int, int]]:
    """Best-of-n arm name → (n, seed of its draws): `best-of-<n>` (with seeds `best-of-<n> seed <s>`)."""
    seeds = cfg.study.seeds or [cfg.ppo.seed]
    return {f"best-of-{n}" + (f" seed {seed}" if cfg.study.seeds else ""): (n, seed)
            for seed in seeds for n in cfg.study.best_of_n}


def analytic_kl(n: int) -> float:
    """KL(best-of-n ‖ SFT) = log n − (n − 1)/n nats (Gao et al. 2022, eq. 1)."""
    return math.log(n) - (n - 1) / n


def read_draws(uri: str) -> dict[str, np.ndarray]:
    """The best-of-n stage's output `best_of_n_draws`: per score (proxy, gold: NaN without a gold
    RM, length) a [draws, prompts] array, draw 0 the SFT baseline."""
    with tracking.fetched(uri) as path, np.load(path) as saved:
        return {name: saved[name] for name in saved.files}


def best_of_n_metrics(drawn: dict[str, np.ndarray], n: int, cfg: PipelineConfig) -> dict[str, float]:
    """Best-of-n's numbers under the names of PPO's last held-out check (eval/score, eval/kl,
    eval/score_delta with its paired interval, ...), so a study's table and figure read both alike."""
    options = {"level": cfg.statistics.ci_level, "resamples": cfg.statistics.bootstrap_resamples,
               "seed": cfg.statistics.seed}
    candidates = drawn["proxy"][1 : n + 1]
    kept = candidates.argmax(axis=0) + 1
    columns = np.arange(candidates.shape[1])
    metrics = {"eval/kl": analytic_kl(n), "eval/best_of_n": float(n)}
    for name, metric in (("proxy", "score"), ("gold", "gold_score"), ("length", "response_length")):
        if np.isnan(drawn[name]).all():
            continue
        chosen, baseline = drawn[name][kept, columns], drawn[name][0]
        metrics[f"eval/{metric}"] = float(chosen.mean())
        metrics[f"eval/sft_{metric}"] = float(baseline.mean())
        metrics.update(stats.paired_delta(chosen, baseline, **options).metrics(f"eval/{metric}_delta"))
    return metrics


def log_best_of_n(study_id: str, cfg: PipelineConfig, name: str, n: int, seed: int, metrics: dict[str, float]) -> str:
    """A best-of-n arm's run, nested under the study's like a PPO arm's pipeline run; its id."""
    mlflow_client = tracking.client()
    study = mlflow_client.get_run(study_id)
    tags = {"mlflow.parentRunId": study_id, STUDY_TAG: study_id, ARM_TAG: name,
            ARM_KIND_TAG: BEST_OF_N, BEST_OF_N_TAG: str(n), SEED_TAG: str(seed)}
    run = mlflow_client.create_run(study.info.experiment_id, tags=tags,
                                   run_name=f"{run_writers.study_title(cfg.preset)} · {name}")
    now = int(time.time() * 1000)
    mlflow_client.log_batch(run.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
    mlflow_client.set_terminated(run.info.run_id, status="FINISHED")
    return run.info.run_id


def start(cfg: PipelineConfig, preset: str, overrides: list[str], arms: dict[str, dict]) -> str:
    """The study's MLflow run (tagged `rlhf.kind=study`), with its preset, overrides, arms and
    resolved config recorded; its id."""
    mlflow_client = tracking.client()
    exp = tracking.experiment_id(mlflow_client, cfg.experiment)
    tags = {PIPELINE_TAG: "study", PRESET_TAG: cfg.preset, CONFIG_HASH_TAG: cfg.config_hash(),
            GIT_COMMIT_TAG: tracking.git_commit(), ARMS_TAG: json.dumps(arms),
            STUDY_PRESET_TAG: preset, STUDY_OVERRIDES_TAG: json.dumps(overrides)}
    run = mlflow_client.create_run(exp, tags=tags,
                                   run_name=f"{run_writers.study_title(cfg.preset)} · {' vs '.join(arms)}")
    try:
        tracking.log_params(mlflow_client, run.info.run_id, cfg.model_dump(mode="json"))
        mlflow_client.log_dict(run.info.run_id, cfg.model_dump(mode="json"), tracking.CONFIG_ARTIFACT)
    except BaseException:
        mlflow_client.set_terminated(run.info.run_id, status="FAILED")
        raise
    return run.info.run_id


def reopen(study_id: str) -> tuple[PipelineConfig, str, list[str], dict[str, dict]]:
    """A stopped study, to go on with: (its config, preset, overrides, arms) as it started. It is
    marked running again (`running`) once the caller has checked what it adds."""
    mlflow_client = tracking.client()
    run = mlflow_client.get_run(study_id)
    if run.data.tags.get(PIPELINE_TAG) != "study":
        raise ValueError(f"run {study_id} is not a study run (`rlhf study` makes those)")
    tags = run.data.tags
    return (lineage.recorded_config(study_id), tags[STUDY_PRESET_TAG], json.loads(tags[STUDY_OVERRIDES_TAG]),
            json.loads(tags[ARMS_TAG]))


def running(study_id: str) -> None:
    tracking.client().update_run(study_id, status="RUNNING")


def add_arms(study_id: str, new_arms: dict[str, dict]) -> dict[str, dict]:
    """`new_arms` join the study (its `rlhf.arms` tag and its name); all its arms."""
    mlflow_client = tracking.client()
    run = mlflow_client.get_run(study_id)
    arms = {**json.loads(run.data.tags[ARMS_TAG]), **new_arms}
    mlflow_client.set_tag(study_id, ARMS_TAG, json.dumps(arms))
    title = run_writers.study_title(run.data.tags.get(PRESET_TAG, ""))
    mlflow_client.update_run(study_id, name=f"{title} · {' vs '.join(arms)}")
    return arms


def arm_runs(study_id: str) -> dict[str, object]:
    """Arm name (and `chain`) → its newest pipeline run in the study."""
    mlflow_client = tracking.client()
    study = mlflow_client.get_run(study_id)
    found = mlflow_client.search_runs([study.info.experiment_id],
                                      filter_string=f"tags.`{STUDY_TAG}` = '{study_id}'",
                                      order_by=["attributes.start_time DESC"])
    out: dict[str, object] = {}
    for run in found:
        out.setdefault(run.data.tags.get(ARM_TAG, ""), run)
    return out


@dataclass
class ArmResult:
    name: str
    pipeline_run: str
    curves: dict[str, list[tuple[int, float]]]  # metric → (iteration, value), iteration 0 = the SFT policy
    breaches: list[int]  # iterations whose held-out evaluation broke the policy contract's bands
    final: dict[str, float]  # the PPO stage's metrics (last values); a best-of-n arm's run's metrics
    tags: dict[str, str]  # the PPO stage's tags (rlhf.collapse, rlhf.policy_iteration)
    eval_metrics: dict[str, float]
    champion: str
    arm: str = ""  # the arm without its seed: the table's row
    best_of_n: int | None = None  # n of a best-of-n arm; None: a PPO arm


def base_arm(name: str) -> str:
    return name.rsplit(" seed ", 1)[0]


def collect(study_id: str, arms: list[str], judge: str) -> list[ArmResult]:
    """Each finished arm's curves and final numbers, read back from MLflow (`arms`: run names,
    one per seed)."""
    mlflow_client = tracking.client()
    runs = arm_runs(study_id)
    results = []
    for arm in arms:
        run = runs.get(arm)
        if run is None or run.info.status != "FINISHED":
            continue
        if run.data.tags.get(ARM_KIND_TAG) == BEST_OF_N:
            results.append(ArmResult(name=arm, pipeline_run=run.info.run_id, curves={}, breaches=[],
                                     final=run.data.metrics, tags=run.data.tags, eval_metrics={}, champion="",
                                     arm=base_arm(arm), best_of_n=int(run.data.tags[BEST_OF_N_TAG])))
            continue
        stages = lineage.recorded_stages(run)
        ppo = mlflow_client.get_run(stages["ppo"][1])
        curves = {name: [(m.step, m.value) for m in sorted(mlflow_client.get_metric_history(ppo.info.run_id, name),
                                                            key=lambda m: m.step)] for name in [*CURVES, GOLD_CURVE]}
        passed = mlflow_client.get_metric_history(ppo.info.run_id, "guard/passed")
        ev = mlflow_client.get_run(stages["eval"][1]) if "eval" in stages else None
        results.append(ArmResult(
            name=arm, pipeline_run=run.info.run_id, curves=curves,
            breaches=sorted(m.step for m in passed if m.value == 0.0), final=ppo.data.metrics, tags=ppo.data.tags,
            eval_metrics=ev.data.metrics if ev else {}, champion=ev.data.tags.get(CHAMPION_TAG, "") if ev else "",
            arm=base_arm(arm)))
    return results


DELTAS = ("eval/score_delta", "eval/gold_score_delta")  # the two RMs' deltas, each in units of its RM's std


def scaled(metrics: dict[str, float], scales: dict[str, float]) -> dict[str, float]:
    """`metrics` with each RM's score delta (and its interval) in units of that RM's held-out score
    std (`scales`: delta metric → std). Each RM's scale is its own training's (the pairwise loss
    fixes neither shift nor scale): raw deltas of two RMs are not comparable, σ units are."""
    out = dict(metrics)
    for name, std in scales.items():
        for key in (name, f"{name}_ci_low", f"{name}_ci_high"):
            if key in out and std and math.isfinite(std) and std > 0:
                out[key] = out[key] / std
    return out


def _with_ci(metrics: dict[str, float], name: str) -> str:
    if name not in metrics:
        return "–"
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    value = f"{metrics[name]:+.3f}"
    return value if low is None else f"{value} [{low:+.3f}, {high:+.3f}]"


def _across_seeds(runs: list, values: list[float | None], level: float, single: str) -> str:
    """One run: `single` (its interval over prompts); several: the mean with its Student-t interval
    across the runs, and each run's value."""
    if len(runs) == 1:
        return single
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    interval = stats.across_runs(present, level)
    return f"{interval} across {len(present)} seeds ({', '.join(f'{v:+.3f}' for v in present)})"


def final_iteration(r: ArmResult) -> int:
    """The iteration of the PPO stage's last held-out check: the policy its last numbers describe."""
    tagged = r.tags.get(FINAL_ITERATION_TAG)
    return int(tagged) if tagged else max((s for s, _ in r.curves.get("eval/score", [])), default=0)


def registered_iteration(r: ArmResult) -> int:
    return int(r.tags.get(POLICY_ITERATION_TAG, final_iteration(r)))


def final_judged(r: ArmResult) -> dict[str, float]:
    """The eval stage's numbers on the final policy, under the registered policy's names: the
    registered policy's own when it is the final one, `eval/final/*` when a later breach kept the
    final policy from the registry, else none (an eval stage that judged only the registered one)."""
    if registered_iteration(r) == final_iteration(r):
        return r.eval_metrics
    return {key.replace("eval/final/", "eval/", 1): value for key, value in r.eval_metrics.items()
            if key.startswith("eval/final/")}


def registered_policy(r: ArmResult, judge: str, scales: dict[str, float], gold: str = "gold") -> str:
    """The registered (last passing) policy's numbers when it is not the final one: its held-out
    check's proxy and gold deltas (σ units), KL, and the eval stage's judge on it."""
    at = registered_iteration(r)
    if at == final_iteration(r):
        return "the final policy"
    parts = []
    for curve, label, delta in (("eval/score", "proxy Δ", DELTAS[0]), (GOLD_CURVE, f"{gold} Δ", DELTAS[1])):
        values = dict(r.curves.get(curve, []))
        if at in values and 0 in values:
            parts.append(f"{label} {scaled({delta: values[at] - values[0]}, scales)[delta]:+.3f}")
    kl = dict(r.curves.get("eval/kl", []))
    if at in kl:
        parts.append(f"KL {kl[at]:.3f}")
    net_win = f"eval/judge/{judge}/net_win"
    if net_win in r.eval_metrics:
        parts.append(f"judge {judge} net win {_with_ci(r.eval_metrics, net_win)}")
    return f"iteration {at}: {', '.join(parts)}" if parts else f"iteration {at}"


def best_of_n_curve(results: list[ArmResult], metric: str, scales: dict[str, float]) -> list[tuple[float, float]]:
    """Best-of-n's (KL, `metric`) per n, each the mean over its seeds, in order of KL."""
    by_n: dict[int, list[tuple[float, float]]] = {}
    for r in (r for r in results if r.best_of_n is not None):
        final = scaled(r.final, scales)
        if metric in final and "eval/kl" in final:
            by_n.setdefault(r.best_of_n, []).append((final["eval/kl"], final[metric]))
    return sorted((float(np.mean([k for k, _ in v])), float(np.mean([m for _, m in v]))) for v in by_n.values())


def versus_best_of_n(runs: list[ArmResult], curve: list[tuple[float, float]], metric: str,
                     scales: dict[str, float], level: float) -> str:
    """A PPO arm against best-of-n at the arm's KL: each seed's `metric` minus best-of-n's,
    interpolated linearly in KL between its n (outside their range: its nearest n, said so),
    the mean with its interval across seeds, and which is ahead."""
    if not curve:
        return "–"
    kls, values = zip(*curve)
    gaps, outside = [], False
    for r in runs:
        final = scaled(r.final, scales)
        if metric in final and "eval/kl" in final:
            outside |= not kls[0] <= final["eval/kl"] <= kls[-1]
            gaps.append(final[metric] - float(np.interp(final["eval/kl"], kls, values)))
    if not gaps:
        return "–"
    interval = stats.across_runs(gaps, level)
    ahead = (f"PPO {'ahead' if interval.estimate > 0 else 'behind'} on one seed (no interval)" if len(gaps) == 1
             else "PPO ahead" if interval.low > 0 else "best-of-n ahead" if interval.high < 0 else
             "neither ahead (the interval holds 0)")
    beyond = f"; KL beyond best-of-n's range [{kls[0]:.2f}, {kls[-1]:.2f}], its nearest n" if outside else ""
    spread = f" across {len(gaps)} seeds" if len(gaps) > 1 else ""
    return f"{interval}{spread}: {ahead}{beyond}"


def _judge_columns(row: dict, runs: list[ArmResult], judge: str, level: float) -> None:
    """The eval stage's judge on the final policy (net win, and the length-controlled net win and
    score delta where the eval stage logs them) and the judge's own held-out accuracy."""
    judged = [final_judged(r) for r in runs]
    for name, column in ((f"eval/judge/{judge}/net_win", f"judge {judge} net win"),
                         (f"eval/judge/{judge}/net_win_lc", f"judge {judge} net win, length-controlled"),
                         (f"eval/judge/{judge}/score_delta_lc", "score Δ, length-controlled")):
        if column.endswith("net win") or any(name in m for m in judged):
            row[column] = _across_seeds(runs, [m.get(name) for m in judged], level, _with_ci(judged[0], name))
    accuracy = f"eval/judge/{judge}/accuracy"
    if any(accuracy in r.eval_metrics for r in runs):
        first = runs[0].eval_metrics
        low, high = first.get(f"{accuracy}_ci_low"), first.get(f"{accuracy}_ci_high")
        can = first.get(f"eval/judge/{judge}/can_judge")
        row[f"judge {judge} accuracy"] = (f"{first[accuracy]:.3f}" + (f" [{low:.3f}, {high:.3f}]" if low is not None
                                                                     else "") +
                                          ("" if can is None else "; can judge" if can else "; cannot judge"))


def table(results: list[ArmResult], judge: str, level: float = 0.95, scales: dict[str, float] | None = None,
          gold: str = "gold") -> pd.DataFrame:
    """One row per arm (its seeds together), every number of one policy, the one the row names:
    the final policy's held-out deltas to SFT on the proxy RM and on the gold RM (each in units of
    its RM's held-out score std, `scales`; raw without), with their intervals (over prompts for one
    run, across seeds for several, with each seed's value), how far proxy and gold diverge, the
    comparison with best-of-n at the arm's KL, the guard's verdict, the eval stage's judge on the
    final policy, and the registered policy's numbers beside them when a breach kept the final one
    from the registry. A best-of-n arm's row reads its kept answers (no guard, no eval stage).
    `gold`: the label of the second RM's columns (it is not called gold unless it beats the proxy)."""
    scales = scales or {}
    groups: dict[str, list[ArmResult]] = {}
    for r in results:
        groups.setdefault(r.arm or r.name, []).append(r)
    primary = DELTAS[1] if any(DELTAS[1] in r.final for r in results) else DELTAS[0]
    curve = best_of_n_curve(results, primary, scales)
    versus = f"{gold if primary == DELTAS[1] else 'proxy'} Δ − best-of-n's at the arm's KL"
    rows = []
    for arm, runs in groups.items():
        first = runs[0]
        finals = [scaled(r.final, scales) for r in runs]
        row = {"arm": arm, "seeds": len(runs),
               "iterations": (f"n = {first.best_of_n}" if first.best_of_n is not None else
                              max((s for s, _ in first.curves["eval/score"]), default=0))}
        row["policy"] = "–" if first.best_of_n is not None else "; ".join(
            f"iteration {final_iteration(r)}" + ("" if registered_iteration(r) == final_iteration(r) else
                                                 f" (final; registered: iteration {registered_iteration(r)})")
            for r in runs)
        for metric, column in PPO_FINAL:
            column = column.replace("gold", gold)
            values = [f.get(metric) for f in finals]
            if metric.endswith("_delta"):
                row[column] = _across_seeds(runs, values, level, _with_ci(finals[0], metric))
            else:
                present = [v for v in values if v is not None]
                row[column] = f"{np.mean(present):.3f}" if present else "–"
        gaps = [f[DELTAS[0]] - f[DELTAS[1]] for f in finals if DELTAS[0] in f and DELTAS[1] in f]
        row[f"proxy − {gold} Δ"] = (f"{np.mean(gaps):+.3f}" if len(runs) == 1 or not gaps else
                                    _across_seeds(runs, gaps, level, "")) if gaps else "–"
        if first.best_of_n is not None:
            row["collapse guard"] = row["registered policy"] = row[f"judge {judge} net win"] = row["champion"] = "–"
            if curve:
                row[versus] = "–"
            rows.append(row)
            continue
        if curve:  # a study with best-of-n arms
            row[versus] = versus_best_of_n(runs, curve, primary, scales, level)
        row["collapse guard"] = "; ".join(
            f"breach at {', '.join(map(str, r.breaches))}" if r.breaches else "no breach" for r in runs)
        row["registered policy"] = "; ".join(registered_policy(r, judge, scales, gold) for r in runs)
        _judge_columns(row, runs, judge, level)
        row["champion"] = ", ".join(r.champion.split(" ", 1)[0] if r.champion else "–" for r in runs)
        rows.append(row)
    return pd.DataFrame(rows)


def overoptimisation_points(results: list[ArmResult], scales: dict[str, float] | None = None
                            ) -> dict[str, list[tuple[float, float, float | None]]]:
    """Gao et al. 2022's Fig. 1 coordinates per arm: (√KL to SFT, proxy score − SFT's, gold score −
    SFT's), each score in units of its RM's held-out std (`scales`; raw without), at every held-out
    check of a PPO arm, and for best-of-n one point per n; each the mean over the arm's seeds (at
    each iteration, or n)."""
    scales = scales or {}
    cells: dict[str, dict[float, list[tuple[float, float, float | None]]]] = {}
    for r in results:
        if r.best_of_n is not None:
            final = scaled(r.final, scales)
            cells.setdefault("best-of-n", {}).setdefault(r.best_of_n, []).append(
                (final["eval/kl"], final[DELTAS[0]], final.get(DELTAS[1])))
            continue
        kl, proxy, gold = (dict(r.curves.get(m, [])) for m in ("eval/kl", "eval/score", GOLD_CURVE))
        if 0 not in proxy:
            continue
        for step in sorted(set(kl) & set(proxy)):
            point = scaled({DELTAS[0]: proxy[step] - proxy[0],
                            **({DELTAS[1]: gold[step] - gold[0]} if step in gold and 0 in gold else {})}, scales)
            cells.setdefault(r.arm or r.name, {}).setdefault(step, []).append(
                (kl[step], point[DELTAS[0]], point.get(DELTAS[1])))
    out = {}
    for arm, by_step in cells.items():
        points = []
        for _, values in sorted(by_step.items()):
            golds = [g for _, _, g in values if g is not None]
            points.append((math.sqrt(max(np.mean([k for k, _, _ in values]), 0.0)),
                           float(np.mean([p for _, p, _ in values])), float(np.mean(golds)) if golds else None))
        out[arm] = points
    return out


KL_REFERENCES = ("KL references differ: PPO's is the tempered policy's against SFT's at the sampling temperature "
                 "over the whole vocabulary (eval/kl), best-of-n's is log n − (n−1)/n against the SFT sampler "
                 "itself (temperature and top-p).")


def overoptimisation_figure(results: list[ArmResult], path: Path, title: str,
                            scales: dict[str, float] | None = None) -> None:
    """Gao et al. 2022's Fig. 1 form: proxy (dashed) and gold (solid) RM score gained over SFT, each
    in units of its RM's held-out score std, against √KL to SFT, every arm (PPO at each held-out
    check, best-of-n at each n) on one plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # deferred: matplotlib, for the figure only
    from matplotlib.figure import Figure  # deferred: as above

    fig = Figure(figsize=(6.4, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for arm, points in overoptimisation_points(results, scales).items():
        x, proxy, gold = zip(*points)
        (line,) = ax.plot(x, proxy, linestyle="--", marker="o", markersize=3, label=f"{arm}: proxy")
        if all(g is not None for g in gold):
            ax.plot(x, gold, linestyle="-", marker="s", markersize=3, color=line.get_color(), label=f"{arm}: gold")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("√KL to SFT (√nats)")
    ax.set_ylabel("RM score − SFT's (each RM's held-out std)" if scales else "RM score − SFT's (raw)")
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: proxy vs gold reward (Gao et al. 2022, Fig. 1)", fontsize=9)
    fig.text(0.01, 0.01, KL_REFERENCES, fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)


def figure(results: list[ArmResult], path: Path, title: str) -> None:
    """The paper's Fig. 4/9 layout: one panel per collapse indicator, one line per PPO arm over the
    iterations, the guard's breaches marked ×."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # deferred: matplotlib only for the figure
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(CURVES))
    for ax, (metric, label) in zip(axes, CURVES.items()):
        for r in (r for r in results if r.best_of_n is None):
            points = r.curves[metric]
            if not points:
                continue
            steps, values = zip(*points)
            (line,) = ax.plot(steps, values, marker="o", markersize=3, label=r.name)
            marked = [(s, v) for s, v in points if s in r.breaches]
            if marked:
                ax.scatter(*zip(*marked), marker="x", s=60, color=line.get_color(), zorder=3)
        ax.set_xlabel("PPO iteration (0: SFT)")
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title} (× the collapse guard's breaches)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


@dataclass(frozen=True)
class SamePairs:
    """The gold and the proxy RM on the same held-out pairs (the proxy's, which the gold RM never
    trains on), matched by pair identity: each one's accuracy with its Wilson interval, gold −
    proxy with its paired bootstrap interval over the pairs, and the pairs only one ranks right."""

    proxy: stats.Interval
    gold: stats.Interval
    difference: stats.Interval
    gold_only: int  # pairs the gold RM ranks right and the proxy wrong
    proxy_only: int

    @classmethod
    def compare(cls, proxy: pd.DataFrame, gold: pd.DataFrame, level: float) -> "SamePairs | None":
        """From the two reward stages' per-pair outcomes (PAIR_OUTCOMES: the proxy's on its held-out
        pairs, the gold RM's on its own and on the proxy's); None when they share no pair. A pair's
        identity holds its prompt, and no prompt is in two splits: the pairs both scored are the
        proxy's held-out pairs."""
        both = proxy.drop_duplicates("pair").merge(gold.drop_duplicates("pair"), on="pair",
                                                   suffixes=("_proxy", "_gold"))
        if both.empty:
            return None
        right_proxy, right_gold = (both[f"correct_{rm}"].to_numpy(dtype=int) for rm in ("proxy", "gold"))
        n = len(both)
        return cls(stats.wilson(int(right_proxy.sum()), n, level), stats.wilson(int(right_gold.sum()), n, level),
                   stats.paired_delta(right_gold, right_proxy, level),
                   int(np.sum(right_gold > right_proxy)), int(np.sum(right_proxy > right_gold)))

    def metrics(self) -> dict[str, float]:
        """The study run's metrics: `<run>/eval/same_pairs/accuracy` of both RMs' pipeline runs
        (`chain`, `gold`), and `gold/eval/same_pairs/accuracy_delta` (gold − proxy) with its interval."""
        prefix = "eval/same_pairs/accuracy"
        return {f"{CHAIN}/{prefix}": self.proxy.estimate, f"{GOLD}/{prefix}": self.gold.estimate,
                **self.difference.metrics(f"{GOLD}/{prefix}_delta")}

    def sentence(self) -> str:
        def accuracy(interval: stats.Interval) -> str:
            return f"{interval.estimate:.3f} [{interval.low:.3f}, {interval.high:.3f}]"

        noise = "" if self.difference.excludes_zero() else "; the interval holds 0"
        return (f"On the same {self.difference.n} pairs (the proxy's held-out pairs, which the gold RM never trains "
                f"on): gold RM accuracy {accuracy(self.gold)}, proxy {accuracy(self.proxy)}, gold − proxy "
                f"{self.difference} (paired bootstrap over the pairs; only the gold RM right on {self.gold_only}, only "
                f"the proxy on {self.proxy_only}{noise})")


def pair_outcome_table(stage_run_id: str) -> pd.DataFrame | None:
    """A reward stage run's per-pair outcomes (PAIR_OUTCOMES), or None where it logged none."""
    folder, _ = PAIR_OUTCOMES.rsplit("/", 1)
    if PAIR_OUTCOMES not in {a.path for a in tracking.client().list_artifacts(stage_run_id, folder)}:
        return None
    # A digest is text, never a number pandas may read one as.
    return pd.read_json(tracking.download(f"runs:/{stage_run_id}/{PAIR_OUTCOMES}"), orient="split",
                        dtype={"pair": str, "split": str})


@dataclass
class RewardModels:
    """The study's two reward models as the table reads them: each one's held-out accuracy (with
    its interval) and score std, from its reward stage's run, and the two on the same pairs."""

    proxy: dict[str, float]
    gold: dict[str, float]  # {} without a gold RM
    gold_run: str | None = None
    controlled: bool = False  # `study.gold_relabels`: the proxy learned the gold RM's labels
    same_pairs: SamePairs | None = None  # None: no gold RM, the controlled setting, or no per-pair outcomes

    @classmethod
    def read(cls, chain_run: str | None, gold_run: str | None, controlled: bool = False,
             level: float = 0.95) -> "RewardModels":
        def reward_stage(run_id: str | None) -> str | None:
            stage = lineage.recorded_stages(tracking.client().get_run(run_id)).get("reward") if run_id else None
            return stage[1] if stage else None

        proxy_stage, gold_stage = reward_stage(chain_run), reward_stage(gold_run)
        proxy, gold = ({} if stage is None else tracking.client().get_run(stage).data.metrics
                       for stage in (proxy_stage, gold_stage))
        same_pairs = None
        if proxy_stage and gold_stage and not controlled:  # controlled: the gold RM is the truth, nothing to compare
            tables = [pair_outcome_table(stage) for stage in (proxy_stage, gold_stage)]
            same_pairs = SamePairs.compare(*tables, level) if all(t is not None for t in tables) else None
        return cls(proxy, gold, gold_run, controlled, same_pairs)

    def scales(self) -> dict[str, float]:
        """Delta metric → its RM's held-out score std, for both RMs or neither (a table in σ units
        for one and raw for the other would mix scales again)."""
        proxy, gold = self.proxy.get("eval/score_std"), self.gold.get("eval/score_std")
        if not proxy or (self.gold and not gold):
            return {}
        return {DELTAS[0]: proxy, **({DELTAS[1]: gold} if gold else {})}

    def gold_stronger(self) -> bool:
        """Whether the gold RM is gold: the truth by construction in the controlled setting, else only
        when it ranks more of the same held-out pairs right than the proxy does (gold − proxy > 0);
        without per-pair outcomes, when its held-out accuracy on its own pairs exceeds the proxy's."""
        if not self.gold:
            return False
        if self.controlled:
            return True
        if self.same_pairs is not None:
            return self.same_pairs.difference.estimate > 0
        return self.gold.get("eval/accuracy", 0.0) > self.proxy.get("eval/accuracy", 1.0)

    def label(self) -> str:
        return "gold" if not self.gold or self.gold_stronger() else "second RM"

    def sentence(self) -> str:
        """What the table says about its RMs: both accuracies (on the same pairs where both RMs
        logged them), whether the gold RM is gold, the units."""
        def accuracy(metrics: dict[str, float]) -> str:
            low, high = metrics.get("eval/accuracy_ci_low", math.nan), metrics.get("eval/accuracy_ci_high", math.nan)
            return f"{metrics.get('eval/accuracy', math.nan):.3f} [{low:.3f}, {high:.3f}]"

        units = (" Score deltas are in units of each RM's held-out score std (proxy "
                 f"{self.proxy['eval/score_std']:.4g}" + (f", gold {self.gold['eval/score_std']:.4g}" if self.gold else "")
                 + "), so the two RMs' deltas compare." if self.scales() else
                 " Score deltas are raw (an RM's held-out score std is missing): the two RMs' deltas do not compare.")
        if not self.gold:
            return f" Proxy RM held-out accuracy {accuracy(self.proxy)}." + units
        if self.controlled:
            swapped = (f"{self.proxy.get('data/relabelled_train_pairs', math.nan):.0f} training and "
                       f"{self.proxy.get('data/relabelled_heldout_pairs', math.nan):.0f} held-out pairs swapped")
            return (f" Controlled setting (`study.gold_relabels`, Gao et al. 2022): the gold RM (pipeline run "
                    f"`{self.gold_run}`, held-out accuracy {accuracy(self.gold)} on human labels) labelled the "
                    f"proxy's pairs ({swapped}), so it is the truth here; the proxy RM's held-out accuracy "
                    f"{accuracy(self.proxy)} is its agreement with the gold RM." + units)
        own = (f" Proxy RM held-out accuracy {accuracy(self.proxy)}. Gold RM (pipeline run `{self.gold_run}`, trained "
               f"on pairs disjoint from the proxy's): held-out accuracy {accuracy(self.gold)}")
        second = ("it is no gold standard, and the table calls it the second RM; its verdicts are one more RM's "
                  "opinion, not the truth the proxy is measured against")
        if self.same_pairs is not None:
            verdict = ("the gold RM is ahead: it is the gold standard here" if self.gold_stronger() else
                       f"the gold RM is NOT ahead of the proxy: {second}")
            return f"{own} on its own pairs. {self.same_pairs.sentence()}: {verdict}." + units
        verdict = ("above the proxy's: it is the gold standard here" if self.gold_stronger() else
                   f"NOT above the proxy's: {second}")
        return (f"{own}, {verdict}. The two accuracies are on different pairs (a reward stage run logged no per-pair "
                f"outcomes on the proxy's held-out pairs): the comparison is not paired." + units)


def markdown(study_id: str, frame: pd.DataFrame, cfg: PipelineConfig, chain_run: str | None,
             models: RewardModels | None = None) -> str:
    columns = list(frame.columns)
    seeds = (f" Arms with several seeds (`study.seeds`): the mean over seeds with its {cfg.statistics.ci_level:.0%} "
             f"Student-t interval across them, and each seed's value." if cfg.study.seeds else "")
    versus = next((c for c in columns if c.endswith("best-of-n's at the arm's KL")), None)
    best_of_n = (f" `{versus}`: the arm's delta minus best-of-n's interpolated linearly in KL at the arm's KL, with "
                 f"its interval across the arm's seeds. {KL_REFERENCES}" if versus else "")
    lines = [f"# Study `{study_id}`: {' vs '.join(frame['arm'])}", "",
             f"Preset `{cfg.preset}`; shared chain: pipeline run `{chain_run}`; {cfg.ppo.heldout_prompts} held-out "
             f"prompts per PPO evaluation, {cfg.eval.heldout_prompts} judged in the eval stage. Every number of a row "
             f"describes the policy its `policy` column names (the final one); the registered (last passing) policy's "
             f"numbers stand beside them when a breach kept the final one from the registry. Δ: policy − SFT on the "
             f"same prompts, mean with its {cfg.statistics.ci_level:.0%} paired bootstrap interval.{seeds}"
             f"{models.sentence() if models else ''} Best-of-n: KL to SFT is log n − (n−1)/n.{best_of_n}", "",
             "![curves](study.png)", "", "![overoptimisation](overoptimisation.png)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    if versus:  # the ending: one line per PPO arm, which is ahead at equal KL
        lines += ["", f"Against best-of-n at the arm's KL ({versus.split(' − ', 1)[0]}):", ""]
        lines += [f"- {arm}: {cell}" for arm, cell in zip(frame["arm"], frame[versus]) if cell != "–"]
    return "\n".join(lines) + "\n"


def _results(study_id: str, cfg: PipelineConfig, arms: list[str]
             ) -> tuple[list[ArmResult], pd.DataFrame, str, str, "RewardModels"]:
    """(the arms' results, the table, the judge it reads, its markdown, the RMs), all from MLflow."""
    runs = arm_runs(study_id)
    gold = runs.get(GOLD) if cfg.study.gold else None
    chain = runs.get(CHAIN)
    judge = GOLD_JUDGE if gold is not None else cfg.eval.judges[0].name if cfg.eval.judges else "reward_model"
    models = RewardModels.read(chain.info.run_id if chain else None, gold.info.run_id if gold else None,
                               cfg.study.gold_relabels, cfg.statistics.ci_level)
    results = collect(study_id, arms, judge)
    frame = table(results, judge, cfg.statistics.ci_level, models.scales(), models.label())
    text = markdown(study_id, frame, cfg, chain.info.run_id if chain else None, models)
    return results, frame, judge, text, models


def study_report(study_id: str) -> str:
    """`rlhf report`: a study's table as Markdown, made again from its runs in MLflow, headed by
    the date, this machine, the study's commit and the command that reproduces it."""
    run = tracking.client().get_run(study_id)
    if run.data.tags.get(PIPELINE_TAG) != "study":
        raise ValueError(f"run {study_id} is not a study run (`rlhf study` makes those)")
    cfg, preset, overrides, _ = reopen(study_id)
    arms = [name for name in reversed(arm_runs(study_id)) if name not in (CHAIN, GOLD, BASE)]
    _, _, _, text, _ = _results(study_id, cfg, arms)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    command = " ".join(["rlhf study --preset", shlex.quote(preset), *(f"--set {shlex.quote(o)}" for o in overrides)])
    header = [f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu}, "
              f"{os.cpu_count()} CPUs ({platform.system()} {platform.machine()}); commit "
              f"`{run.data.tags.get(GIT_COMMIT_TAG, 'unknown')}`; command: `{command}`.", ""]
    title, rest = text.split("\n", 1)
    return "\n".join([title, "", *header]) + rest


def finish(study_id: str, cfg: PipelineConfig, arms: list[str], out: Path) -> str:
    """The study's figure, table and headline metrics on its run; returns the markdown."""
    mlflow_client = tracking.client()
    results, frame, judge, text, models = _results(study_id, cfg, arms)
    scales = models.scales()
    out.mkdir(parents=True, exist_ok=True)
    figure(results, out / "study.png", run_writers.study_title(cfg.preset))
    overoptimisation_figure(results, out / "overoptimisation.png", run_writers.study_title(cfg.preset), scales)
    (out / "study.md").write_text(text)
    (out / "study.html").write_text(report.html(text, out))  # MLflow's artifact view shows its figure
    frame.to_csv(out / "study.csv", index=False)
    mlflow_client.log_artifacts(study_id, str(out), "study")
    from mlflow.entities import Metric  # deferred: MLflow, as in stages.orchestration.tracking

    now = int(time.time() * 1000)
    # Each arm's final policy: its last held-out check (raw, and each RM's delta in its std units as
    # `<delta>_std_units`) and the eval stage's judge on that same policy.
    metrics = [Metric(f"{r.name}/{name}", value, now, 0) for r in results
               for name, value in {**{m: r.final[m] for m, _ in PPO_FINAL if m in r.final},
                                   **{f"{m}_std_units": v for m, v in scaled(r.final, scales).items()
                                      if m in scales},
                                   **{k: v for k, v in final_judged(r).items() if k.startswith(f"eval/judge/{judge}/")},
                                   **({"policy_iteration": float(final_iteration(r))} if r.best_of_n is None else {})
                                   }.items()]
    for arm in dict.fromkeys(r.arm for r in results):  # an arm's seeds together: the interval across them
        runs = [r for r in results if r.arm == arm]
        for name in ("eval/score_delta", "eval/gold_score_delta"):
            values = [r.final[name] for r in runs if name in r.final]
            if len(values) > 1:
                metrics += [Metric(f"{arm}/seeds/{key}", value, now, 0) for key, value in
                            stats.across_runs(values, cfg.statistics.ci_level).metrics(name).items()]
    if models.same_pairs is not None:  # the gold and the proxy RM on the same held-out pairs
        metrics += [Metric(key, value, now, 0) for key, value in models.same_pairs.metrics().items()]
    for start_at in range(0, len(metrics), 500):
        mlflow_client.log_batch(study_id, metrics=metrics[start_at : start_at + 500])
    mlflow_client.set_terminated(study_id, status="FINISHED")
    return text
