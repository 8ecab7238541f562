"""A study: PPO arms on one shared chain, and what it found — the MLflow side (no Prefect here;
flows/study.py runs it).

The study's MLflow run is the parent of its pipeline runs: the chain (data → SFT → reward →
critic) and one run per arm (PPO and evaluation from the chain's artifacts), tagged `rlhf.study`
and `rlhf.arm`. At the end the study run gets the figure (the paper's Figs. 4 and 9: per arm the
held-out reward, KL to SFT, response length and perplexity over the iterations, the collapse
guard's breaches marked), the table of final numbers with their confidence intervals, and each
arm's headline numbers as metrics `<arm>/<name>` so MLflow's compare view lines them up.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from stages import tracking
from stages.config import PipelineConfig
from stages.evaluate import report

CHAIN = "chain"  # the arm name of the shared chain's pipeline run
CHAIN_STAGES = ["data", "sft", "reward", "critic"]
ARM_STAGES = ["ppo", "eval"]
CURVES = {"eval/score": "held-out RM score", "eval/kl": "tempered KL to SFT (nats per response)",
          "eval/response_length": "response length (tokens)", "eval/perplexity": "perplexity (T = 1)"}
# The table's numbers: (metric of the PPO stage run's last held-out evaluation, column).
PPO_FINAL = [("eval/score_delta", "score Δ vs SFT"), ("eval/kl", "KL"), ("eval/response_length_delta", "length Δ"),
             ("eval/perplexity_delta", "perplexity Δ"), ("eval/eos_rate_delta", "EOS rate Δ"),
             ("eval/distinct_2", "distinct-2"), ("eval/score_length_corr", "corr(score, length)")]


def start(cfg: PipelineConfig, preset: str, overrides: list[str], arms: dict[str, dict]) -> str:
    """The study's MLflow run (tagged `rlhf.kind=study`), with its preset, overrides, arms and
    resolved config recorded; its id."""
    mlflow_client = tracking.client()
    exp = tracking.experiment_id(mlflow_client, cfg.experiment)
    tags = {tracking.PIPELINE_TAG: "study", "rlhf.preset": cfg.preset, "rlhf.config_hash": cfg.config_hash(),
            "rlhf.git_commit": tracking.git_commit(), "rlhf.arms": json.dumps(arms),
            "rlhf.study_preset": preset, "rlhf.study_overrides": json.dumps(overrides)}
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
    return (tracking.recorded_config(study_id), tags["rlhf.study_preset"], json.loads(tags["rlhf.study_overrides"]),
            json.loads(tags["rlhf.arms"]))


def running(study_id: str) -> None:
    tracking.client().update_run(study_id, status="RUNNING")


def add_arms(study_id: str, new_arms: dict[str, dict]) -> dict[str, dict]:
    """`new_arms` join the study (its `rlhf.arms` tag and its name); all its arms."""
    mlflow_client = tracking.client()
    run = mlflow_client.get_run(study_id)
    arms = {**json.loads(run.data.tags["rlhf.arms"]), **new_arms}
    mlflow_client.set_tag(study_id, "rlhf.arms", json.dumps(arms))
    title = tracking.study_title(run.data.tags.get("rlhf.preset", ""))
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
    final: dict[str, float]  # the PPO stage's metrics (last values)
    tags: dict[str, str]  # the PPO stage's tags (rlhf.collapse, rlhf.policy_iteration)
    eval_metrics: dict[str, float]
    champion: str


def collect(study_id: str, arms: list[str], judge: str) -> list[ArmResult]:
    """Each finished arm's curves and final numbers, read back from MLflow."""
    mlflow_client = tracking.client()
    runs = arm_runs(study_id)
    results = []
    for arm in arms:
        run = runs.get(arm)
        if run is None or run.info.status != "FINISHED":
            continue
        stages = tracking.recorded_stages(run)
        ppo = mlflow_client.get_run(stages["ppo"][1])
        curves = {name: [(m.step, m.value) for m in sorted(mlflow_client.get_metric_history(ppo.info.run_id, name),
                                                            key=lambda m: m.step)] for name in CURVES}
        passed = mlflow_client.get_metric_history(ppo.info.run_id, "guard/passed")
        ev = mlflow_client.get_run(stages["eval"][1]) if "eval" in stages else None
        results.append(ArmResult(
            name=arm, pipeline_run=run.info.run_id, curves=curves,
            breaches=sorted(m.step for m in passed if m.value == 0.0), final=ppo.data.metrics, tags=ppo.data.tags,
            eval_metrics=ev.data.metrics if ev else {}, champion=ev.data.tags.get("rlhf.champion", "") if ev else ""))
    return results


def _with_ci(metrics: dict[str, float], name: str) -> str:
    if name not in metrics:
        return "–"
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    value = f"{metrics[name]:+.3f}"
    return value if low is None else f"{value} [{low:+.3f}, {high:+.3f}]"


def table(results: list[ArmResult], judge: str) -> pd.DataFrame:
    """One row per arm: the last held-out evaluation's paired deltas to SFT with their intervals,
    the guard's verdict, and the eval stage's judge (on the registered policy) with its interval."""
    rows = []
    for r in results:
        row = {"arm": r.name, "iterations": max((s for s, _ in r.curves["eval/score"]), default=0)}
        for metric, column in PPO_FINAL:
            row[column] = _with_ci(r.final, metric) if metric.endswith("_delta") else (
                f"{r.final[metric]:.3f}" if metric in r.final else "–")
        row["collapse guard"] = (f"breach at {', '.join(map(str, r.breaches))}; policy of iteration "
                                 f"{r.tags.get('rlhf.policy_iteration', '?')}" if r.breaches else "no breach")
        row[f"judge {judge} net win"] = _with_ci(r.eval_metrics, f"eval/judge/{judge}/net_win")
        row["RM score Δ (eval stage)"] = _with_ci(r.eval_metrics, f"eval/judge/{judge}/score_delta")
        row["champion"] = r.champion.split(" ", 1)[0] if r.champion else "–"
        rows.append(row)
    return pd.DataFrame(rows)


def figure(results: list[ArmResult], path: Path, title: str) -> None:
    """The paper's Fig. 4/9 layout: one panel per collapse indicator, one line per arm over the
    iterations, the guard's breaches marked ×."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # deferred: matplotlib only for the figure
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(CURVES))
    for ax, (metric, label) in zip(axes, CURVES.items()):
        for r in results:
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


def markdown(study_id: str, frame: pd.DataFrame, cfg: PipelineConfig, chain_run: str | None) -> str:
    columns = list(frame.columns)
    lines = [f"# Study `{study_id}`: {' vs '.join(frame['arm'])}", "",
             f"Preset `{cfg.preset}`; shared chain: pipeline run `{chain_run}`; {cfg.ppo.heldout_prompts} held-out "
             f"prompts per PPO evaluation, {cfg.eval.heldout_prompts} judged in the eval stage. Δ: policy − SFT on the "
             f"same prompts, mean with its {cfg.statistics.ci_level:.0%} paired bootstrap interval.", "",
             "![curves](study.png)", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def finish(study_id: str, cfg: PipelineConfig, arms: list[str], out: Path) -> str:
    """The study's figure, table and headline metrics on its run; returns the markdown."""
    mlflow_client = tracking.client()
    judge = cfg.eval.judges[0].name if cfg.eval.judges else "reward_model"
    results = collect(study_id, arms, judge)
    frame = table(results, judge)
    out.mkdir(parents=True, exist_ok=True)
    figure(results, out / "study.png", tracking.study_title(cfg.preset))
    chain = arm_runs(study_id).get(CHAIN)
    text = markdown(study_id, frame, cfg, chain.info.run_id if chain else None)
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
    for start_at in range(0, len(metrics), 500):
        mlflow_client.log_batch(study_id, metrics=metrics[start_at : start_at + 500])
    mlflow_client.set_terminated(study_id, status="FINISHED")
    return text
