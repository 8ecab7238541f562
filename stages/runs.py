"""Pipeline runs as a user looks at them: the stages of each (ran, reused from an earlier run,
failed), their headline metrics, and two runs side by side: metrics, the parameters in which
they differ, and their PPO curves in one figure."""

from __future__ import annotations

import datetime
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from stages import registry, tracking

# PPO's key curves (per iteration), drawn for both runs of a comparison.
PPO_CURVES = ("objective/scores", "objective/kl", "eval/score", "policy/response_length")


@dataclass
class StageView:
    stage: str
    # its own stage run's status (FINISHED, FAILED, RUNNING, KILLED); `reused` or `deployed`
    # (tracking.STAGE_TAG_PREFIX); `not run`; or `inherited` (a stage of the run it started from)
    status: str
    run: object | None  # the MLflow stage run that holds its outputs and metrics

    def headline(self) -> dict[str, float]:
        metrics = self.run.data.metrics if self.run else {}
        patterns = registry.STAGES[self.stage].headline if self.stage in registry.STAGES else ()
        return {name: metrics[name] for pattern in patterns for name in sorted(fnmatch.filter(metrics, pattern))}

    def before_after(self) -> dict[str, tuple[float | None, float]]:
        """Each headline metric's value at step 0, when it was logged again later, and its last."""
        mlflow_client = tracking.client()
        out = {}
        for name, last in self.headline().items():
            history = sorted(mlflow_client.get_metric_history(self.run.info.run_id, name), key=lambda m: m.step)
            first = history[0].value if len(history) > 1 and history[0].step == 0 else None
            out[name] = (first, last)
        return out


def stage_views(pipeline_run, inherited: bool = False) -> list[StageView]:
    """The stages of a pipeline run in order, each with the stage run that holds it: its own
    child run, the earlier run it reused or the run its deployment made; with `inherited`, also
    the stages of the runs it started from (`from_run`, recursively) that it did not run itself."""
    mlflow_client = tracking.client()
    recorded = tracking.recorded_stages(pipeline_run)
    children = tracking.stage_runs(pipeline_run.info.run_id)  # newest first
    views = []
    for stage in filter(None, pipeline_run.data.tags.get("rlhf.stages", "").split(",")):
        if stage in recorded:
            how, run_id = recorded[stage]
            run = mlflow_client.get_run(run_id)
            views.append(StageView(stage, run.info.status if how == "ran" else how, run))
        else:
            run = next((r for r in children if r.data.tags.get("rlhf.stage") == stage), None)
            views.append(StageView(stage, run.info.status if run else "not run", run))
    from_run = pipeline_run.data.tags.get("rlhf.from_run")
    if inherited and from_run:
        own = {view.stage for view in views}
        views += [StageView(view.stage, "inherited", view.run)
                  for view in stage_views(mlflow_client.get_run(from_run), inherited=True) if view.stage not in own]
    order = registry.names()
    return sorted(views, key=lambda view: order.index(view.stage) if view.stage in order else len(order))


def _number(value: float) -> str:
    return f"{value:.4g}"


def _with_interval(view: StageView, name: str, value: float) -> str:
    """A headline value, and its confidence interval where the stage logged one (`<name>_ci_low/high`)."""
    metrics = view.run.data.metrics
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    return _number(value) + (f" [{_number(low)}, {_number(high)}]" if low is not None and high is not None else "")


def _cell(value: str, width: int = 48) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


def format_runs(runs: list) -> str:
    """One block per pipeline run: id, name, status, start, origin; a line per stage."""
    blocks = []
    for run in runs:
        tags = run.data.tags
        started = datetime.datetime.fromtimestamp(run.info.start_time / 1000).strftime("%Y-%m-%d %H:%M")
        origin = f"  from {tags['rlhf.from_run']}" if "rlhf.from_run" in tags else ""
        lines = [f"{run.info.run_id}  {run.info.run_name}  {run.info.status}  {started}  "
                 f"preset {tags.get('rlhf.preset', '?')}{origin}"]
        for view in stage_views(run):
            metrics = "  ".join(_cells(view, {}))
            run_id = view.run.info.run_id if view.run else "-"
            lines.append(f"  {view.stage:<7} {view.status:<9} {run_id:<32}  {metrics}".rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "no pipeline runs"


def _params(pipeline_run, views: list[StageView]) -> dict[str, str]:
    """The parent's parameters (the resolved config) and those its stage runs logged (effective
    PPO switches, engines, input versions)."""
    params = dict(pipeline_run.data.params)
    for view in views:
        if view.run is not None:
            params.update(view.run.data.params)
    return params


def compare(run_a: str, run_b: str, png: Path) -> str:
    """The headline table of two pipeline runs (metrics per stage, then the parameters that
    differ); writes their PPO curves to `png`."""
    mlflow_client = tracking.client()
    runs = [mlflow_client.get_run(run_a), mlflow_client.get_run(run_b)]
    views = [{view.stage: view for view in stage_views(run, inherited=True)} for run in runs]
    names = [f"{run.info.run_name} ({run.info.run_id[:8]})" for run in runs]
    rows = [("", "", *names)]
    for stage in registry.STAGES.values():
        own = [views[k].get(stage.name) for k in range(2)]
        values = [view.headline() if view is not None else {} for view in own]
        for name in dict.fromkeys(n for v in values for n in v):  # the patterns' matches, in order, once
            rows.append((stage.name, name, *(_with_interval(view, name, v[name]) if name in v else "-"
                                             for view, v in zip(own, values))))
    params = [_params(run, list(v.values())) for run, v in zip(runs, views)]
    differ = sorted(key for key in set(params[0]) | set(params[1]) if params[0].get(key) != params[1].get(key))
    rows.append(("", "", "", ""))
    rows += [("param", key, _cell(params[0].get(key, "-")), _cell(params[1].get(key, "-"))) for key in differ]
    widths = [max(len(str(row[col])) for row in rows) for col in range(4)]
    table = "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    labels = [f"{name}, {p['ppo.preset']}" if "ppo.preset" in p else name for name, p in zip(names, params)]
    _plot_ppo_curves([v.get("ppo") for v in views], labels, png)
    return table


def _plot_ppo_curves(ppo_views: list[StageView | None], names: list[str], png: Path) -> None:
    import matplotlib  # deferred: matplotlib only for `rlhf compare`

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend
    from matplotlib.ticker import MaxNLocator

    mlflow_client = tracking.client()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, metric in zip(axes.flat, PPO_CURVES):
        for view, name in zip(ppo_views, names):
            if view is None or view.run is None:
                continue
            history = sorted(mlflow_client.get_metric_history(view.run.info.run_id, metric), key=lambda m: m.step)
            ax.plot([m.step for m in history], [m.value for m in history], marker="o", markersize=3, label=name)
        ax.set_title(metric)
        ax.set_xlabel("PPO iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("PPO: " + " vs ".join(names))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def ending(pipeline_run_id: str) -> tuple[str, dict[str, float]]:
    """What a finished pipeline run says of itself: a line per stage with its headline numbers
    (before → after where a stage measured both), a plain verdict on the policy, and where the
    report is; and those numbers as metrics for the parent run (`<stage>/<metric>`, and
    `<stage>/<metric>/before`), so MLflow's run list and compare view show them."""
    run = tracking.client().get_run(pipeline_run_id)
    lines, metrics = [f"Pipeline run {pipeline_run_id} finished: {run.info.run_name}"], {}
    views = [view for view in stage_views(run) if view.run is not None]
    for view in views:
        lines.append(f"  {view.stage:<7} {view.status:<9} " + ("  ".join(_cells(view, metrics)) or "-"))
    lines += _verdict({view.stage: view for view in views})
    return "\n".join(lines), metrics


def _cells(view: StageView, metrics: dict[str, float]) -> list[str]:
    """`name value` per headline metric, `name before → after` where the stage measured both;
    the values go into `metrics` as `<stage>/<name>` and `<stage>/<name>/before`."""
    cells = []
    for name, (before, after) in view.before_after().items():
        metrics[f"{view.stage}/{name}"] = after
        if before is None:
            cells.append(f"{name} {_with_interval(view, name, after)}")
        else:
            metrics[f"{view.stage}/{name}/before"] = before
            cells.append(f"{name} {_number(before)} → {_with_interval(view, name, after)}")
    return cells


def _verdict(views: dict[str, StageView]) -> list[str]:
    evaluation = views.get("eval")
    if evaluation is None or "policy" not in evaluation.run.data.params.get("eval.policy_model", "policy"):
        return []
    tags, metrics = evaluation.run.data.tags, evaluation.run.data.metrics
    judges = sorted({name.split("/")[2] for name in metrics if name.startswith("eval/judge/")})
    if not judges:
        return []
    judge = judges[0] if "rlhf.champion" not in tags else next((j for j in judges if f"judge {j}:" in tags["rlhf.champion"]), judges[0])
    n = int(metrics[f"eval/judge/{judge}/n"])
    counts = " / ".join(f"{verdict} {round(metrics[f'eval/judge/{judge}/{verdict}_rate'] * n)}"
                        for verdict in ("win", "tie", "lose"))
    beat = tags.get("rlhf.champion", "").startswith("yes")
    lines = [f"Verdict: the policy {'beat' if beat else 'did not beat'} the SFT model ({judge} judge on {n} held-out "
             f"prompts: {counts}; {tags.get('rlhf.champion', '')})."]
    if n < 64:
        lines.append(f"  {n} prompts cannot separate a small improvement from noise; a run this small is not "
                     f"expected to improve the model measurably (use more eval.heldout_prompts and PPO iterations).")
    outputs = json.loads(tags.get(tracking.OUTPUTS_TAG, "{}"))
    if "eval_report" in outputs:
        lines.append(f"Report: {outputs['eval_report']} (in MLflow: run {evaluation.run.info.run_id}, report/report.html "
                     f"shows it with its charts)")
    return lines
