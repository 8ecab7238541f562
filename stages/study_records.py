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
`gold`, trains the gold RM on the chain's gold pairs; best-of-n arms (stages/best_of_n.py) are
runs of their own, tagged `rlhf.arm_kind=best_of_n`.
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

from stages import registry, stats, tracking
from stages.config import PipelineConfig
from stages.evaluate import report
from stages.tags import (ARMS_TAG, ARM_KIND_TAG, BEST_OF_N_TAG, CHAMPION_TAG, CONFIG_HASH_TAG, GIT_COMMIT_TAG,
                         POLICY_ITERATION_TAG, PRESET_TAG, SEED_TAG, STUDY_OVERRIDES_TAG, STUDY_PRESET_TAG)

CHAIN = "chain"  # the arm name of the shared chain's pipeline run
GOLD = "gold"  # the arm name of the gold reward model's pipeline run (`study.gold`)
# An arm's stages make or read the policy; the chain's, every other stage, run once for all arms;
# the gold reward model is the reward stage's model trained on the gold splits.
ARM_STAGES = [s.name for s in registry.STAGES.values() if "policy_model" in (*s.outputs, *s.inputs)]
CHAIN_STAGES = [name for name in registry.names() if name not in ARM_STAGES]
GOLD_STAGES = [s.name for s in registry.STAGES.values() if s.registers == "reward"]
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
    """The gold RM's pipeline run: the reward stage on the gold pairs, registered apart from the proxy."""
    return {"reward.pairs": "gold", "registry_prefix": f"{cfg.registry_prefix}-gold"}


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


def log_best_of_n(study_id: str, cfg: PipelineConfig, name: str, n: int, seed: int, metrics: dict[str, float]) -> str:
    """A best-of-n arm's run, nested under the study's like a PPO arm's pipeline run; its id."""
    mlflow_client = tracking.client()
    study = mlflow_client.get_run(study_id)
    tags = {"mlflow.parentRunId": study_id, tracking.STUDY_TAG: study_id, tracking.ARM_TAG: name,
            ARM_KIND_TAG: BEST_OF_N, BEST_OF_N_TAG: str(n), SEED_TAG: str(seed)}
    run = mlflow_client.create_run(study.info.experiment_id, tags=tags,
                                   run_name=f"{tracking.study_title(cfg.preset)} · {name}")
    now = int(time.time() * 1000)
    mlflow_client.log_batch(run.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
    mlflow_client.set_terminated(run.info.run_id, status="FINISHED")
    return run.info.run_id


def start(cfg: PipelineConfig, preset: str, overrides: list[str], arms: dict[str, dict]) -> str:
    """The study's MLflow run (tagged `rlhf.kind=study`), with its preset, overrides, arms and
    resolved config recorded; its id."""
    mlflow_client = tracking.client()
    exp = tracking.experiment_id(mlflow_client, cfg.experiment)
    tags = {tracking.PIPELINE_TAG: "study", PRESET_TAG: cfg.preset, CONFIG_HASH_TAG: cfg.config_hash(),
            GIT_COMMIT_TAG: tracking.git_commit(), ARMS_TAG: json.dumps(arms),
            STUDY_PRESET_TAG: preset, STUDY_OVERRIDES_TAG: json.dumps(overrides)}
    run = mlflow_client.create_run(exp, tags=tags,
                                   run_name=f"{tracking.study_title(cfg.preset)} · {' vs '.join(arms)}")
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
    if run.data.tags.get(tracking.PIPELINE_TAG) != "study":
        raise ValueError(f"run {study_id} is not a study run (`rlhf study` makes those)")
    tags = run.data.tags
    return (tracking.recorded_config(study_id), tags[STUDY_PRESET_TAG], json.loads(tags[STUDY_OVERRIDES_TAG]),
            json.loads(tags[ARMS_TAG]))


def running(study_id: str) -> None:
    tracking.client().update_run(study_id, status="RUNNING")


def add_arms(study_id: str, new_arms: dict[str, dict]) -> dict[str, dict]:
    """`new_arms` join the study (its `rlhf.arms` tag and its name); all its arms."""
    mlflow_client = tracking.client()
    run = mlflow_client.get_run(study_id)
    arms = {**json.loads(run.data.tags[ARMS_TAG]), **new_arms}
    mlflow_client.set_tag(study_id, ARMS_TAG, json.dumps(arms))
    title = tracking.study_title(run.data.tags.get(PRESET_TAG, ""))
    mlflow_client.update_run(study_id, name=f"{title} · {' vs '.join(arms)}")
    return arms


def arm_runs(study_id: str) -> dict[str, object]:
    """Arm name (and `chain`) → its newest pipeline run in the study."""
    mlflow_client = tracking.client()
    study = mlflow_client.get_run(study_id)
    found = mlflow_client.search_runs([study.info.experiment_id],
                                      filter_string=f"tags.`{tracking.STUDY_TAG}` = '{study_id}'",
                                      order_by=["attributes.start_time DESC"])
    out: dict[str, object] = {}
    for run in found:
        out.setdefault(run.data.tags.get(tracking.ARM_TAG, ""), run)
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
        stages = tracking.recorded_stages(run)
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


def _with_ci(metrics: dict[str, float], name: str) -> str:
    if name not in metrics:
        return "–"
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    value = f"{metrics[name]:+.3f}"
    return value if low is None else f"{value} [{low:+.3f}, {high:+.3f}]"


def _across_seeds(runs: list[ArmResult], values: list[float | None], level: float, single: str) -> str:
    """One run: `single` (its interval over prompts); several: the mean with its Student-t interval
    across the runs, and each run's value."""
    if len(runs) == 1:
        return single
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    interval = stats.across_runs(present, level)
    return f"{interval} across {len(present)} seeds ({', '.join(f'{v:+.3f}' for v in present)})"


def table(results: list[ArmResult], judge: str, level: float = 0.95) -> pd.DataFrame:
    """One row per arm (its seeds together): the last held-out evaluation's paired deltas to SFT on
    the proxy RM and on the gold RM, with their intervals (over prompts for one run, across seeds
    for several, with each seed's value), how far proxy and gold diverge, the guard's verdict, and
    the eval stage's judge (on the registered policy) with its interval. A best-of-n arm's row
    reads its kept answers (no guard, no eval stage)."""
    groups: dict[str, list[ArmResult]] = {}
    for r in results:
        groups.setdefault(r.arm or r.name, []).append(r)
    rows = []
    for arm, runs in groups.items():
        first = runs[0]
        row = {"arm": arm, "seeds": len(runs),
               "iterations": (f"n = {first.best_of_n}" if first.best_of_n is not None else
                              max((s for s, _ in first.curves["eval/score"]), default=0))}
        for metric, column in PPO_FINAL:
            values = [r.final.get(metric) for r in runs]
            if metric.endswith("_delta"):
                row[column] = _across_seeds(runs, values, level, _with_ci(first.final, metric))
            else:
                present = [v for v in values if v is not None]
                row[column] = f"{np.mean(present):.3f}" if present else "–"
        gaps = [r.final["eval/score_delta"] - r.final["eval/gold_score_delta"] for r in runs
                if "eval/gold_score_delta" in r.final and "eval/score_delta" in r.final]
        row["proxy − gold Δ"] = (f"{np.mean(gaps):+.3f}" if len(runs) == 1 or not gaps else
                                 _across_seeds(runs, gaps, level, "")) if gaps else "–"
        if first.best_of_n is not None:
            row["collapse guard"] = row[f"judge {judge} net win"] = row["champion"] = "–"
            rows.append(row)
            continue
        row["collapse guard"] = "; ".join(
            (f"breach at {', '.join(map(str, r.breaches))}; policy of iteration "
             f"{r.tags.get(POLICY_ITERATION_TAG, '?')}" if r.breaches else "no breach") for r in runs)
        net_win = f"eval/judge/{judge}/net_win"
        row[f"judge {judge} net win"] = _across_seeds(runs, [r.eval_metrics.get(net_win) for r in runs], level,
                                                       _with_ci(first.eval_metrics, net_win))
        row["champion"] = ", ".join(r.champion.split(" ", 1)[0] if r.champion else "–" for r in runs)
        rows.append(row)
    return pd.DataFrame(rows)


def overoptimisation_points(results: list[ArmResult]) -> dict[str, list[tuple[float, float, float | None]]]:
    """Gao et al. 2022's Fig. 1 coordinates per arm: (√KL to SFT, proxy score − SFT's, gold score −
    SFT's) at every held-out check of a PPO arm, and for best-of-n one point per n; each the mean
    over the arm's seeds (at each iteration, or n)."""
    cells: dict[str, dict[float, list[tuple[float, float, float | None]]]] = {}
    for r in results:
        if r.best_of_n is not None:
            gold = r.final.get("eval/gold_score_delta")
            cells.setdefault("best-of-n", {}).setdefault(r.best_of_n, []).append(
                (r.final["eval/kl"], r.final["eval/score_delta"], gold))
            continue
        kl, proxy, gold = (dict(r.curves.get(m, [])) for m in ("eval/kl", "eval/score", GOLD_CURVE))
        if 0 not in proxy:
            continue
        for step in sorted(set(kl) & set(proxy)):
            cells.setdefault(r.arm or r.name, {}).setdefault(step, []).append(
                (kl[step], proxy[step] - proxy[0], gold[step] - gold[0] if step in gold and 0 in gold else None))
    out = {}
    for arm, by_step in cells.items():
        points = []
        for _, values in sorted(by_step.items()):
            golds = [g for _, _, g in values if g is not None]
            points.append((math.sqrt(max(np.mean([k for k, _, _ in values]), 0.0)),
                           float(np.mean([p for _, p, _ in values])), float(np.mean(golds)) if golds else None))
        out[arm] = points
    return out


def overoptimisation_figure(results: list[ArmResult], path: Path, title: str) -> None:
    """Gao et al. 2022's Fig. 1 form: proxy (dashed) and gold (solid) RM score gained over SFT
    against √KL to SFT, every arm (PPO at each held-out check, best-of-n at each n) on one plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # deferred: matplotlib, for the figure only
    from matplotlib.figure import Figure  # deferred: as above

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for arm, points in overoptimisation_points(results).items():
        x, proxy, gold = zip(*points)
        (line,) = ax.plot(x, proxy, linestyle="--", marker="o", markersize=3, label=f"{arm}: proxy")
        if all(g is not None for g in gold):
            ax.plot(x, gold, linestyle="-", marker="s", markersize=3, color=line.get_color(), label=f"{arm}: gold")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("√KL to SFT (√nats)")
    ax.set_ylabel("RM score − SFT's")
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: proxy vs gold reward (Gao et al. 2022, Fig. 1)", fontsize=9)
    fig.tight_layout()
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


def gold_accuracy(gold_run: str | None) -> str:
    """The gold RM's held-out accuracy with its interval, from its reward stage's run."""
    if gold_run is None:
        return ""
    stage = tracking.recorded_stages(tracking.client().get_run(gold_run)).get("reward")
    if stage is None:
        return ""
    metrics = tracking.client().get_run(stage[1]).data.metrics
    low, high = metrics.get("eval/accuracy_ci_low"), metrics.get("eval/accuracy_ci_high")
    return (f" Gold RM (pipeline run `{gold_run}`, trained on pairs disjoint from the proxy's): held-out accuracy "
            f"{metrics.get('eval/accuracy', float('nan')):.3f} [{low:.3f}, {high:.3f}].")


def markdown(study_id: str, frame: pd.DataFrame, cfg: PipelineConfig, chain_run: str | None,
             gold_run: str | None = None) -> str:
    columns = list(frame.columns)
    seeds = (f" Arms with several seeds (`study.seeds`): the mean over seeds with its {cfg.statistics.ci_level:.0%} "
             f"Student-t interval across them, and each seed's value." if cfg.study.seeds else "")
    lines = [f"# Study `{study_id}`: {' vs '.join(frame['arm'])}", "",
             f"Preset `{cfg.preset}`; shared chain: pipeline run `{chain_run}`; {cfg.ppo.heldout_prompts} held-out "
             f"prompts per PPO evaluation, {cfg.eval.heldout_prompts} judged in the eval stage. Δ: policy − SFT on the "
             f"same prompts, mean with its {cfg.statistics.ci_level:.0%} paired bootstrap interval.{seeds}"
             f"{gold_accuracy(gold_run)} Best-of-n: KL to SFT is log n − (n−1)/n.", "",
             "![curves](study.png)", "", "![overoptimisation](overoptimisation.png)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _results(study_id: str, cfg: PipelineConfig, arms: list[str]) -> tuple[list[ArmResult], pd.DataFrame, str, str]:
    """(the arms' results, the table, the judge it reads, its markdown), all from MLflow."""
    runs = arm_runs(study_id)
    gold = runs.get(GOLD) if cfg.study.gold else None
    judge = GOLD_JUDGE if gold is not None else cfg.eval.judges[0].name if cfg.eval.judges else "reward_model"
    results = collect(study_id, arms, judge)
    frame = table(results, judge, cfg.statistics.ci_level)
    chain = runs.get(CHAIN)
    text = markdown(study_id, frame, cfg, chain.info.run_id if chain else None, gold.info.run_id if gold else None)
    return results, frame, judge, text


def study_report(study_id: str) -> str:
    """`rlhf report`: a study's table as Markdown, made again from its runs in MLflow, headed by
    the date, this machine, the study's commit and the command that reproduces it."""
    run = tracking.client().get_run(study_id)
    if run.data.tags.get(tracking.PIPELINE_TAG) != "study":
        raise ValueError(f"run {study_id} is not a study run (`rlhf study` makes those)")
    cfg, preset, overrides, _ = reopen(study_id)
    arms = [name for name in reversed(arm_runs(study_id)) if name not in (CHAIN, GOLD)]
    _, _, _, text = _results(study_id, cfg, arms)
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
    results, frame, judge, text = _results(study_id, cfg, arms)
    out.mkdir(parents=True, exist_ok=True)
    figure(results, out / "study.png", tracking.study_title(cfg.preset))
    overoptimisation_figure(results, out / "overoptimisation.png", tracking.study_title(cfg.preset))
    (out / "study.md").write_text(text)
    (out / "study.html").write_text(report.html(text, out))  # MLflow's artifact view shows its figure
    frame.to_csv(out / "study.csv", index=False)
    mlflow_client.log_artifacts(study_id, str(out), "study")
    from mlflow.entities import Metric  # deferred: MLflow, as in stages.tracking

    now = int(time.time() * 1000)
    metrics = [Metric(f"{r.name}/{name}", value, now, 0) for r in results
               for name, value in {**{m: r.final[m] for m, _ in PPO_FINAL if m in r.final},
                                   **{k: v for k, v in r.eval_metrics.items() if k.startswith(f"eval/judge/{judge}/")}
                                   }.items()]
    for arm in dict.fromkeys(r.arm for r in results):  # an arm's seeds together: the interval across them
        runs = [r for r in results if r.arm == arm]
        for name in ("eval/score_delta", "eval/gold_score_delta"):
            values = [r.final[name] for r in runs if name in r.final]
            if len(values) > 1:
                metrics += [Metric(f"{arm}/seeds/{key}", value, now, 0) for key, value in
                            stats.across_runs(values, cfg.statistics.ci_level).metrics(name).items()]
    for start_at in range(0, len(metrics), 500):
        mlflow_client.log_batch(study_id, metrics=metrics[start_at : start_at + 500])
    mlflow_client.set_terminated(study_id, status="FINISHED")
    return text
