"""The evaluation report: win/tie/lose per split and judge, the C-Eval table with the SFT → policy
delta (the alignment tax) and a flag on any k-shot score where questions got fewer than k
exemplars, the lm-eval tasks' table with the same delta, bar charts like the paper's Figs. 10–11,
and the markdown text."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stages.compute.evaluate.ceval import CATEGORIES
from stages.compute.evaluate.harness import metric_name
from stages.leaves import stats
from stages.leaves.config import StatisticsConfig
from stages.leaves.stats import Interval

COLORS = {"win": "#4c72b0", "tie": "#b0b0b0", "lose": "#dd8452", "invalid": "#c44e52"}


def slug(name: str) -> str:
    return name.lower().replace(" ", "_")


def ceval_table(accuracies: dict[tuple[int, str], dict]) -> pd.DataFrame:
    """Rows (shots, scope, name) with a column per model and, with both, `delta` = policy − SFT.
    accuracies: (shots, model) → `ceval.accuracy(...)`."""
    rows: dict[tuple, dict] = {}
    for (shots, model), acc in accuracies.items():
        for scope in ("overall", "category", "subject"):
            for name, value in acc[scope].items():
                rows.setdefault((shots, scope, name), {})[model] = value
    table = pd.DataFrame([{"shots": k[0], "scope": k[1], "name": k[2], **v} for k, v in rows.items()])
    models = [m for m in ("sft", "policy") if m in table.columns]
    table = table[["shots", "scope", "name", *models]]
    if len(models) == 2:
        table["delta"] = table["policy"] - table["sft"]
    return table


def exemplar_shortfall(answers: pd.DataFrame) -> pd.DataFrame:
    """Per k-shot score (k > 0) and model: questions, `exemplars_dropped` (how many got fewer than
    k exemplars to fit the prompt cap) and the fewest any got. A score with drops is not a k-shot
    score, and the report says so."""
    few_shot = answers[answers["shots"] > 0]
    short = few_shot["exemplars"] < few_shot["shots"]
    return (few_shot.assign(short=short).groupby(["shots", "model"])
            .agg(questions=("short", "size"), exemplars_dropped=("short", "sum"), fewest=("exemplars", "min"))
            .reset_index())


def ceval_metrics(table: pd.DataFrame, shortfall: pd.DataFrame) -> dict[str, float]:
    """eval/ceval_<k>shot/overall/<model>, .../<category>/<model>, .../subject/<name>/<model>, and
    eval/ceval_<k>shot/exemplars_dropped/<model> for k > 0 (questions with fewer than k exemplars)."""
    metrics = {}
    for row in table.to_dict(orient="records"):
        where = "overall" if row["scope"] == "overall" else slug(row["name"]) if row["scope"] == "category" \
            else f"subject/{row['name']}"
        for column in ("sft", "policy", "delta"):
            if pd.notna(row.get(column)):
                metrics[f"eval/ceval_{row['shots']}shot/{where}/{column}"] = row[column]
    for row in shortfall.itertuples():
        metrics[f"eval/ceval_{row.shots}shot/exemplars_dropped/{row.model}"] = float(row.exemplars_dropped)
    return metrics


def lm_eval_table(scores: dict[str, list[dict]]) -> pd.DataFrame:
    """Rows (task, metric) with each model's value and standard error and, with both models,
    `delta` = policy − SFT. scores: model → `harness.scores(results)`."""
    rows: dict[tuple, dict] = {}
    for model, model_scores in scores.items():
        for s in model_scores:
            row = rows.setdefault((s["task"], s["metric"]), {"task": s["task"], "metric": s["metric"],
                                                             "shots": s["shots"], "samples": s["samples"]})
            row[model], row[f"{model}_stderr"] = s["value"], s["stderr"]
    models = [m for m in ("sft", "policy") if m in scores]
    columns = ["task", "metric", "shots", "samples", *models, *(f"{m}_stderr" for m in models)]
    table = pd.DataFrame(list(rows.values())).reindex(columns=columns)
    if len(models) == 2:
        table.insert(columns.index("policy") + 1, "delta", table["policy"] - table["sft"])
    return table


def lm_eval_metrics(table: pd.DataFrame) -> dict[str, float]:
    """eval/lm_eval/<task>/<metric>/{sft,policy,delta} and eval/lm_eval/<task>/<metric>_stderr/<model>
    where lm-eval gives a standard error."""
    metrics = {}
    for row in table.to_dict(orient="records"):
        where = f"eval/lm_eval/{metric_name(row['task'])}/{metric_name(row['metric'])}"
        for column in ("sft", "policy", "delta"):
            if pd.notna(row.get(column)):
                metrics[f"{where}/{column}"] = row[column]
            if pd.notna(row.get(f"{column}_stderr")):
                metrics[f"{where}_stderr/{column}"] = row[f"{column}_stderr"]
    return metrics


def _lm_eval_markdown(table: pd.DataFrame) -> str:
    """The lm-eval table with a standard error beside each value ("0.375 ± 0.183")."""
    shown = table.copy()
    for model in ("sft", "policy"):
        if model in shown:
            shown[model] = [("–" if pd.isna(v) else f"{v:.3f}" + ("" if pd.isna(e) else f" ± {e:.3f}"))
                            for v, e in zip(shown[model], shown[f"{model}_stderr"])]
            shown = shown.drop(columns=f"{model}_stderr")
    shown["shots"] = shown["shots"].map(lambda v: "–" if pd.isna(v) else str(int(v)))
    shown["samples"] = shown["samples"].map(lambda v: "–" if pd.isna(v) else str(int(v)))
    return _markdown_table(shown, floats="{:+.3f}")  # the one float column left is the delta


def _flag_lines(shortfall: pd.DataFrame) -> list[str]:
    """A markdown warning per k-shot score where a question got fewer than k exemplars."""
    flags = [f"- ⚠ {r.shots}-shot {r.model}: {r.exemplars_dropped} of {r.questions} questions got fewer than "
             f"{r.shots} exemplars (fewest {r.fewest}) to fit the prompt cap (`eval.ceval.max_seq_len`, by "
             f"default the model's context); not a full {r.shots}-shot score."
             for r in shortfall.itertuples() if r.exemplars_dropped]
    return [*flags, ""] if flags else []


def ceval_chart(table: pd.DataFrame, path: Path) -> None:
    """Accuracy per category and overall, SFT beside the policy, one panel per shot count (Fig. 11)."""
    shots = sorted(table["shots"].unique())
    models = [m for m in ("sft", "policy") if m in table.columns]
    figure = Figure(figsize=(4.5 * len(shots), 3.6), dpi=100)
    FigureCanvasAgg(figure)
    for axes, k in zip(figure.subplots(1, len(shots), squeeze=False)[0], shots):
        part = table[(table["shots"] == k) & (table["scope"] != "subject")].set_index("name")
        names = [n for n in (*CATEGORIES, "all") if n in part.index]
        width = 0.8 / len(models)
        for i, model in enumerate(models):
            axes.bar([x + i * width for x in range(len(names))], part.loc[names, model], width,
                     label={"sft": "SFT", "policy": "policy"}[model])
        axes.axhline(0.25, color="black", linewidth=0.8, linestyle=":")  # chance
        axes.set_xticks([x + width * (len(models) - 1) / 2 for x in range(len(names))],
                        [n.replace("Social Science", "Social\nScience").replace("all", "Average") for n in names])
        axes.set_ylim(0, 1)
        axes.set_ylabel("accuracy")
        axes.set_title(f"C-Eval val, {k}-shot")
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def _length_diff(judged: pd.DataFrame) -> pd.Series | None:
    """Per pair: policy − SFT response tokens; None where the pairs carry no lengths."""
    if not {"policy_tokens", "sft_tokens"} <= set(judged.columns) or judged[["policy_tokens", "sft_tokens"]].isna().any().any():
        return None
    return judged["policy_tokens"].astype(float) - judged["sft_tokens"].astype(float)


def judge_intervals(judged: pd.DataFrame, statistics: StatisticsConfig) -> dict[str, Interval]:
    """One judge's pairs: `net_win`, (win − lose) / n with its interval, and for a score judge
    `score_delta`, the mean paired r(x, y_policy) − r(x, y_SFT) with its interval; where the pairs
    carry their lengths, each also length-controlled (`net_win_lc`, `score_delta_lc`: the
    intercept of the per-prompt value regressed on policy − SFT tokens, `stats.length_controlled`)."""
    options = {"level": statistics.ci_level, "resamples": statistics.bootstrap_resamples, "seed": statistics.seed}
    intervals = {"net_win": stats.net_win(judged["verdict"], **options)}
    length_diff = _length_diff(judged)
    if length_diff is not None and len(judged):
        intervals["net_win_lc"] = stats.length_controlled(judged["verdict"].map(stats.VERDICT_VALUE), length_diff,
                                                          **options)
    scored = judged.dropna(subset=["score_policy", "score_sft"]) if "score_policy" in judged else judged.iloc[:0]
    if len(scored):
        intervals["score_delta"] = stats.paired_delta(scored["score_policy"], scored["score_sft"], **options)
        scored_diff = _length_diff(scored)
        if scored_diff is not None:
            intervals["score_delta_lc"] = stats.length_controlled(scored["score_policy"] - scored["score_sft"],
                                                                  scored_diff, **options)
    return intervals


def length_corr(judged: pd.DataFrame) -> float | None:
    """How much a judge goes by length: for a score judge Pearson's r of its scores and the answers'
    lengths (both models' answers), for a chat judge of its verdicts (+1/0/−1) and policy − SFT
    tokens; None where the pairs carry no lengths."""
    length_diff = _length_diff(judged)
    if length_diff is None or not len(judged):
        return None
    scored = judged.dropna(subset=["score_policy", "score_sft"]) if "score_policy" in judged else judged.iloc[:0]
    if len(scored):
        return stats.correlation(pd.concat([scored["score_policy"], scored["score_sft"]]),
                                 pd.concat([scored["policy_tokens"], scored["sft_tokens"]]).astype(float))
    return stats.correlation(judged["verdict"].map(stats.VERDICT_VALUE), length_diff)


def judge_table(judged: pd.DataFrame, statistics: StatisticsConfig, qualities: dict | None = None) -> pd.DataFrame:
    """Per (split, judge): its accuracy on labelled held-out pairs (`qualities`: judge → JudgeQuality)
    and whether it can judge, win/tie/lose/invalid counts, the net win with its confidence
    interval, for score judges the mean paired score delta with its interval, each also
    length-controlled, and the judge's length correlation."""
    rows = []
    for (split, judge), group in judged.groupby(["split", "judge"], sort=False):
        counts = group["verdict"].value_counts()
        row = {"split": split, "judge": judge}
        if qualities and judge in qualities:
            row.update({"accuracy": qualities[judge].accuracy_text(), "can judge": "yes" if qualities[judge].can_judge
                        else "no"})
        row.update({**{v: int(counts.get(v, 0)) for v in ("win", "tie", "lose", "invalid")}, "n": len(group)})
        for name, interval in judge_intervals(group, statistics).items():
            row.update({name: interval.estimate,
                        f"{name} {interval.level:.0%} CI": f"[{interval.low:+.3f}, {interval.high:+.3f}]"})
        corr = length_corr(group)
        if corr is not None:
            row["length_corr"] = corr
        rows.append(row)
    return pd.DataFrame(rows)


def judge_chart(table: pd.DataFrame, path: Path) -> None:
    """Stacked horizontal bars, policy vs SFT: win / tie / lose (and invalid) per judge (Fig. 10)."""
    figure = Figure(figsize=(7, 1.0 + 0.5 * len(table)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    labels = [f"{r.split} · {r.judge}" for r in table.itertuples()]
    left = pd.Series(0.0, index=table.index)
    for verdict in ("win", "tie", "lose", "invalid"):
        share = table[verdict] / table["n"]
        axes.barh(labels, share, left=left, color=COLORS[verdict], label=verdict)
        for y, (x, s) in enumerate(zip(left, share)):
            if s >= 0.08:
                axes.text(x + s / 2, y, f"{s:.0%}", ha="center", va="center", fontsize=8, color="white")
        left += share
    axes.set_xlim(0, 1)
    axes.invert_yaxis()
    axes.set_xlabel("share of judged pairs (policy vs SFT)")
    axes.legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    figure.tight_layout()
    figure.savefig(path)


def _markdown_table(frame: pd.DataFrame, floats: str = "{:.3f}") -> str:
    def cell(value) -> str:
        return floats.format(value) if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def markdown(*, run_id: str, models: dict[str, str], ceval: pd.DataFrame | None, shortfall: pd.DataFrame | None,
             judges: pd.DataFrame | None, champion: str, questions_per_s: float,
             lm_eval: pd.DataFrame | None = None, lm_eval_version: str = "") -> str:
    """The full report (report.md in the eval run); `shortfall`: `exemplar_shortfall(answers)`;
    `lm_eval`: `lm_eval_table(...)` of the `eval.lm_eval_tasks`."""
    lines = [f"# Evaluation, MLflow run `{run_id}`", ""]
    lines += [f"- {name}: `{uri}`" for name, uri in models.items()] + [f"- champion: {champion}", ""]
    if judges is not None:
        lines += ["## Policy vs SFT, judged in both orders (a changed mind is a tie)", "",
                  "net win = (win − lose) / n; score delta = mean paired r(x, y_policy) − r(x, y_SFT); CI: percentile "
                  "bootstrap over the prompts, paired (stages/leaves/stats.py). _lc: length-controlled, the intercept of "
                  "the per-prompt value regressed on policy − SFT response tokens (the difference at equal "
                  "lengths); length_corr: the judge's correlation of score (a chat judge's verdict) and length. "
                  "accuracy: the judge's on labelled held-out pairs (chosen vs rejected) with its Wilson "
                  "interval; a judge whose interval reaches 0.5 cannot judge (eval.judge_accuracy_gate).", "",
                  _markdown_table(judges), "",
                  "![win/tie/lose](judges.png)", ""]
    if ceval is not None:
        summary = ceval[ceval["scope"] != "subject"].drop(columns="scope")
        lines += ["## C-Eval val, official C-Eval protocol (accuracy; delta = policy − SFT, the alignment tax "
                  "when negative)", "", *_flag_lines(shortfall), _markdown_table(summary), "",
                  "![C-Eval](ceval.png)", "",
                  f"{questions_per_s:.1f} questions/s scored.", "", "### Per subject", "",
                  _markdown_table(ceval[ceval["scope"] == "subject"].drop(columns="scope")), ""]
    if lm_eval is not None:
        lines += [f"## lm-evaluation-harness {lm_eval_version} (delta = policy − SFT, the alignment tax when "
                  "negative)", "", "Each task's own prompt, metric and standard error (± is lm-eval's); not on "
                  "the C-Eval protocol above. lm-eval's files: `lm_eval/`.", "", _lm_eval_markdown(lm_eval), ""]
    return "\n".join(lines)


def html(markdown_text: str, folder: Path) -> str:
    """The report as one self-contained page (report.html): MLflow's artifact view renders a
    markdown file's tables but no image with a relative path, and renders HTML with the charts
    inlined as data URIs."""
    import markdown as markdown_lib  # deferred: only for the HTML report

    def inline(match: re.Match) -> str:
        data = base64.b64encode((folder / match.group(2)).read_bytes()).decode()
        return f"![{match.group(1)}](data:image/png;base64,{data})"

    body = markdown_lib.markdown(re.sub(r"!\[([^\]]*)\]\(([\w.-]+\.png)\)", inline, markdown_text), extensions=["tables"])
    style = ("body{font-family:sans-serif;max-width:70em;margin:1em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}img{max-width:100%}")
    return f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><style>{style}</style></head><body>\n{body}\n</body></html>\n"


def summary(*, run_id: str, report_uri: str, ceval: pd.DataFrame | None, shortfall: pd.DataFrame | None,
            judges: pd.DataFrame | None, champion: str, lm_eval: pd.DataFrame | None = None) -> str:
    """The short version the flow publishes as a Prefect artifact, linking to the full report."""
    lines = [f"# Evaluation: champion {champion}", "", f"Full report: [{report_uri}]({report_uri}) (MLflow run `{run_id}`).", ""]
    if judges is not None:
        lines += [_markdown_table(judges), ""]
    if ceval is not None:
        lines += ["C-Eval val, official C-Eval protocol (overall accuracy):", "", *_flag_lines(shortfall),
                  _markdown_table(ceval[ceval["scope"] == "overall"].drop(columns=["scope", "name"])), ""]
    if lm_eval is not None:
        lines += ["lm-evaluation-harness:", "", _lm_eval_markdown(lm_eval), ""]
    return "\n".join(lines)
