"""Pipeline runs as a user looks at them: the stages of each (ran, reused from an earlier run,
failed), their headline metrics, and two runs side by side: metrics, the parameters in which
they differ, and their PPO curves in one figure."""

from __future__ import annotations

import ast
import datetime
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from stages.leaves.tags import CHAMPION_JUDGE_TAG, CHAMPION_TAG, FROM_RUN_TAG, OUTPUTS_TAG, PRESET_TAG, STAGES_TAG, STAGE_TAG
from stages.orchestration import lineage, registry, tracking

# PPO's key curves (per iteration), drawn for both runs of a comparison.
PPO_CURVES = ("objective/scores", "objective/kl", "eval/score", "policy/response_length")


def parent_metric_name(stage: str, metric: str) -> str:
    """The name under which a pipeline run logs a headline metric of one of its stages: the stage
    run's own name when it already starts with `<stage>/` (`data/rows`, `eval/judge/<judge>/net_win`,
    `critic/final_value_loss`), else `<stage>/<metric>` (`sft/eval/perplexity`, `ppo/eval/score`).
    The value at step 0 of a metric measured before and after training is `<that name>/before`."""
    return metric if metric.startswith(f"{stage}/") else f"{stage}/{metric}"


def logged_headline(parent_metrics: dict[str, float]) -> dict[str, dict[str, tuple[float | None, float]]]:
    """Stage → {headline metric: (before or None, last)} as a finished pipeline run logged them
    (`parent_metric_name`). Runs recorded when every name was `<stage>/<metric>` (`data/data/rows`)
    read the same."""
    out = {}
    for stage in registry.STAGES.values():
        found = {}
        for key, value in parent_metrics.items():
            if key.endswith("/before") or not key.startswith(f"{stage.name}/"):
                continue
            # the stage run's name under this scheme (`data/rows`), else under the one that always prefixed it
            for name in (key, key.removeprefix(f"{stage.name}/")):
                if any(fnmatch.fnmatchcase(name, pattern) for pattern in stage.headline):
                    found[name] = (parent_metrics.get(f"{key}/before"), value)
                    break
        if found:
            out[stage.name] = {name: found[name] for pattern in stage.headline
                               for name in sorted(fnmatch.filter(found, pattern))}
    return out


@dataclass
class StageView:
    stage: str
    # its own stage run's status (FINISHED, FAILED, RUNNING, KILLED); `reused` or `deployed`
    # (stages.leaves.tags.STAGE_TAG_PREFIX); `not run`; or `inherited` (a stage of the run it started from)
    status: str
    run: object | None  # the MLflow stage run that holds its outputs and metrics
    # The headline numbers the pipeline run logged for this stage when it finished (`logged_headline`):
    # read from there, a listing of many runs needs no metric history of each stage run.
    logged: dict[str, tuple[float | None, float]] | None = None

    def headline(self) -> dict[str, float]:
        if self.logged is not None:
            return {name: last for name, (_, last) in self.logged.items()}
        metrics = self.run.data.metrics if self.run else {}
        patterns = registry.STAGES[self.stage].headline if self.stage in registry.STAGES else ()
        return {name: metrics[name] for pattern in patterns for name in sorted(fnmatch.filter(metrics, pattern))}

    def before_after(self) -> dict[str, tuple[float | None, float]]:
        """Each headline metric's value at step 0, when it was logged again later, and its last."""
        if self.logged is not None:
            return dict(self.logged)
        mlflow_client = tracking.client()
        out = {}
        for name, last in self.headline().items():
            history = sorted(mlflow_client.get_metric_history(self.run.info.run_id, name), key=lambda m: m.step)
            first = history[0].value if len(history) > 1 and history[0].step == 0 else None
            out[name] = (first, last)
        return out


def stage_views(pipeline_run, inherited: bool = False, logged: bool = True) -> list[StageView]:
    """The stages of a pipeline run in order, each with the stage run that holds it: its own
    child run, the earlier run it reused or the run its deployment made; with `inherited`, also
    the stages of the runs it started from (`from_run`, recursively) that it did not run itself.
    With `logged`, each carries the headline numbers its pipeline run logged, where it did."""
    mlflow_client = tracking.client()
    recorded = lineage.recorded_stages(pipeline_run)
    children = lineage.stage_runs(pipeline_run.info.run_id)  # newest first
    headlines = logged_headline(pipeline_run.data.metrics) if logged else {}
    views = []
    for stage in filter(None, pipeline_run.data.tags.get(STAGES_TAG, "").split(",")):
        if stage in recorded:
            how, run_id = recorded[stage]
            run = mlflow_client.get_run(run_id)
            views.append(StageView(stage, run.info.status if how == "ran" else how, run, headlines.get(stage)))
        else:
            run = next((r for r in children if r.data.tags.get(STAGE_TAG) == stage), None)
            views.append(StageView(stage, run.info.status if run else "not run", run, headlines.get(stage) if run else None))
    from_run = pipeline_run.data.tags.get(FROM_RUN_TAG)
    if inherited and from_run:
        own = {view.stage for view in views}
        views += [StageView(view.stage, "inherited", view.run, view.logged)
                  for view in stage_views(mlflow_client.get_run(from_run), inherited=True, logged=logged)
                  if view.stage not in own]
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
        origin = f"  from {tags[FROM_RUN_TAG]}" if FROM_RUN_TAG in tags else ""
        lines = [f"{run.info.run_id}  {run.info.run_name}  {run.info.status}  {started}  "
                 f"preset {tags.get(PRESET_TAG, '?')}{origin}"]
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


@dataclass
class Ending:
    """What a finished pipeline run says of itself: a line per stage with its headline numbers
    (before → after where a stage measured both), a plain verdict on the policy and where the
    report is; and those numbers as metrics of the parent run (`parent_metric_name`), so MLflow's
    run list and compare view show them."""

    title: str
    stages: list[tuple[str, str, str]]  # stage, status, its headline numbers
    verdict: list[str]
    metrics: dict[str, float]

    @property
    def text(self) -> str:
        """As `rlhf run` prints it."""
        return "\n".join([self.title, *(f"  {stage:<7} {status:<9} {cells}" for stage, status, cells in self.stages),
                          *self.verdict])

    @property
    def markdown(self) -> str:
        """The pipeline run's MLflow description (`mlflow.note.content`): the verdict first, then
        the headline table, the same words as `text`."""
        verdict = [line.strip() for line in self.verdict if not line.startswith("Report: ")]
        report = [line for line in self.verdict if line.startswith("Report: ")]
        rows = [f"| {stage} | {status} | " + cells.replace("|", "\\|") + " |" for stage, status, cells in self.stages]
        table = "\n".join(["| stage | status | headline |", "|---|---|---|", *rows])
        return "\n\n".join([f"**{self.title}**", *verdict, table, *report])


def ending(pipeline_run_id: str) -> Ending:
    """The ending of a finished pipeline run, from its stage runs."""
    run = tracking.client().get_run(pipeline_run_id)
    metrics: dict[str, float] = {}
    views = [view for view in stage_views(run, logged=False) if view.run is not None]
    rows = [(view.stage, view.status, "  ".join(_cells(view, metrics)) or "-") for view in views]
    return Ending(f"Pipeline run {pipeline_run_id} finished: {run.info.run_name}", rows,
                  _verdict({view.stage: view for view in views}), metrics)


def _cells(view: StageView, metrics: dict[str, float]) -> list[str]:
    """`name value` per headline metric, `name before → after` where the stage measured both;
    the values go into `metrics` under `parent_metric_name`, and `…/before`."""
    cells = []
    for name, (before, after) in view.before_after().items():
        metrics[parent_metric_name(view.stage, name)] = after
        if before is None:
            cells.append(f"{name} {_with_interval(view, name, after)}")
        else:
            metrics[f"{parent_metric_name(view.stage, name)}/before"] = before
            cells.append(f"{name} {_number(before)} → {_with_interval(view, name, after)}")
    return cells


def _judges_with_the_trained_against_rm(judges_param: str) -> set[str]:
    """Names of the `reward_model` judges that read the run's own reward model (no `model` of their
    own), from the eval run's `eval.judges` param (a logged Python literal)."""
    judges = ast.literal_eval(judges_param)
    return {j["name"] for j in judges if j.get("kind") == "reward_model" and not j.get("model")}


def _interval_text(metrics: dict[str, float], name: str) -> str | None:
    """`+0.479 [+0.292, +0.646]` of a metric logged with its `_ci_low`/`_ci_high`; None where it is not."""
    if not all(key in metrics for key in (name, f"{name}_ci_low", f"{name}_ci_high")):
        return None
    return f"{metrics[name]:+.3f} [{metrics[f'{name}_ci_low']:+.3f}, {metrics[f'{name}_ci_high']:+.3f}]"


def _accuracy_text(metrics: dict[str, float], judge: str) -> str | None:
    """`0.594 [0.423, 0.745] on 32 held-out pairs` (stages/compute/evaluate/quality.py's words)."""
    prefix = f"eval/judge/{judge}/accuracy"
    if not all(key in metrics for key in (prefix, f"{prefix}_ci_low", f"{prefix}_ci_high", f"{prefix}_pairs")):
        return None
    return (f"{metrics[prefix]:.3f} [{metrics[f'{prefix}_ci_low']:.3f}, {metrics[f'{prefix}_ci_high']:.3f}] on "
            f"{int(metrics[f'{prefix}_pairs'])} held-out pairs")


def _cannot_decide(metrics: dict[str, float], judge: str) -> str:
    accuracy = _accuracy_text(metrics, judge)
    if accuracy is None:
        return f"cannot decide: {judge} has no held-out accuracy"
    below = metrics[f"eval/judge/{judge}/accuracy_ci_high"] < 0.5
    return f"cannot decide: {judge}'s accuracy {accuracy} {'lies below' if below else 'includes'} chance"


def _judge_numbers(metrics: dict[str, float], judge: str) -> str:
    """The judge's accuracy, its net win and score delta each beside its length-controlled value,
    and its length correlation; the length-controlled value first where |corr(score, length)| > 0.3
    (a judge that goes by length scores a policy that only changed its length)."""
    prefix = f"eval/judge/{judge}/"
    accuracy = _accuracy_text(metrics, judge)
    parts = [f"accuracy {accuracy}" if accuracy else "no held-out accuracy"]
    corr = metrics.get(f"{prefix}length_corr")
    by_length = corr is not None and abs(corr) > 0.3
    for name, label in (("net_win", "net win"), ("score_delta", "score Δ")):
        raw, controlled = _interval_text(metrics, prefix + name), _interval_text(metrics, f"{prefix}{name}_lc")
        if raw is None:
            continue
        if controlled is None:
            parts.append(f"{label} {raw}")
        elif by_length:
            parts.append(f"length-controlled {label} {controlled} (raw {raw})")
        else:
            parts.append(f"{label} {raw} (length-controlled {controlled})")
    if corr is not None:
        parts.append(f"corr(score, length) {corr:+.2f}" + (", so the length-controlled number leads" if by_length else ""))
    return f"  {judge} judge: " + "; ".join(parts) + "."


def _verdict(views: dict[str, StageView]) -> list[str]:
    evaluation = views.get("eval")
    if evaluation is None or "policy" not in evaluation.run.data.params.get("eval.policy_model", "policy"):
        return []
    tags, metrics = evaluation.run.data.tags, evaluation.run.data.metrics
    judges = sorted({name.split("/")[2] for name in metrics if name.startswith("eval/judge/")})
    if not judges:
        return []
    champion = tags.get(CHAMPION_TAG, "")
    judge = tags.get(CHAMPION_JUDGE_TAG) or next((j for j in judges if f"judge {j}:" in champion), judges[0])
    n = int(metrics[f"eval/judge/{judge}/n"])
    counts = " / ".join(f"{verdict} {round(metrics[f'eval/judge/{judge}/{verdict}_rate'] * n)}"
                        for verdict in ("win", "tie", "lose"))
    beat, undecided = champion.startswith("yes"), champion.startswith("no (cannot decide: ")
    if undecided:
        lines = [f"Verdict: {_cannot_decide(metrics, judge)} ({judge} judge on {n} held-out prompts: {counts}; a judge "
                 f"at chance gives no win or loss, and the policy is not the champion)."]
    else:
        lines = [f"Verdict: the policy {'beat' if beat else 'did not beat'} the SFT model ({judge} judge on {n} "
                 f"held-out prompts: {counts}; {champion})."]
    lines.append(_judge_numbers(metrics, judge))
    if n < 64 and not beat and not undecided:
        lines.append(f"  {n} prompts cannot separate a small improvement from noise; a run this small is not "
                     f"expected to improve the model measurably (use more eval.heldout_prompts and PPO iterations).")
    if beat and _judges_with_the_trained_against_rm(evaluation.run.data.params.get("eval.judges", "[]")) & {judge}:
        lines.append(f"  The {judge} judge is the reward model the policy was trained against: a policy can win on "
                     f"it by exploiting it (shorter answers, for one). A judge apart from it, a gold RM "
                     f"(study.gold) or a stronger model, shows whether the model got better: docs/guide/studies.md.")
    outputs = json.loads(tags.get(OUTPUTS_TAG, "{}"))
    if "eval_report" in outputs:
        lines.append(f"Report: {outputs['eval_report']} (in MLflow: run {evaluation.run.info.run_id}, report/report.html "
                     f"shows it with its charts)")
    return lines
