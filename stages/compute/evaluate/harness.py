"""Benchmarks beyond C-Eval through lm-evaluation-harness (`eval.lm_eval_tasks`): any of lm-eval's
tasks, or the user's own task YAMLs (`eval.lm_eval_include_path`), on the same loaded SFT model
and policy the C-Eval scorer reads. lm-eval is imported only when tasks are configured: its import
and its task index take seconds."""

from __future__ import annotations

import functools
import json
import re
from importlib import metadata
from pathlib import Path

from stages.leaves.config import ConfigError, EvalConfig


def version() -> str:
    return metadata.version("lm-eval")


@functools.cache
def _builtin_tasks():
    """lm-eval's own task index (about 15,000 YAMLs, seconds to read): read once per process, as
    the installed package's tasks do not change while it runs."""
    from lm_eval.tasks import TaskManager  # deferred, as all of lm_eval here: seconds to load

    return TaskManager()


def _known(manager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def task_manager(ev: EvalConfig):
    """The lm-eval TaskManager that knows every task in `ev.lm_eval_tasks`, or a ConfigError naming
    the unknown ones and where they were looked for (called before any model loads). The user's
    folder is indexed alone first: when it holds every task, lm-eval's own index is never read."""
    from lm_eval.tasks import TaskManager  # deferred: lm_eval

    names, folder = list(ev.lm_eval_tasks), ev.lm_eval_include_path
    own = None
    if folder is not None:
        if not Path(folder).is_dir():
            raise ConfigError(f"eval.lm_eval_include_path: {folder} is not a folder")
        own = TaskManager(include_path=folder, include_defaults=False)
        if all(_known(own, name) for name in names):
            return own
    builtin = _builtin_tasks()
    unknown = [n for n in names if not (_known(builtin, n) or (own is not None and _known(own, n)))]
    if unknown:
        where = f"lm-eval {version()}'s tasks" + (f" and {folder}" if folder else "")
        raise ConfigError(f"eval.lm_eval_tasks: unknown task(s) {', '.join(unknown)}; looked up in {where} "
                          f"(eval.lm_eval_include_path: a folder of task YAMLs)")
    if own is None or not any(_known(own, name) for name in names):
        return builtin
    return TaskManager(include_path=folder)  # some from each: one index of both, the user's folder last (it wins)


def evaluate(model, tokenizer, manager, ev: EvalConfig) -> dict:
    """lm-eval's results for `ev.lm_eval_tasks` on an already loaded model (lm-eval's HFLM wraps it
    as it is: the same weights, precision and device as C-Eval), with the per-example `samples`."""
    from lm_eval import simple_evaluate  # deferred: lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=ev.lm_eval_batch_size)
    return simple_evaluate(model=lm, tasks=list(ev.lm_eval_tasks), task_manager=manager,
                           num_fewshot=ev.lm_eval_num_fewshot, limit=ev.lm_eval_limit, log_samples=True)


def scores(results: dict) -> list[dict]:
    """One row per (task or group, metric) of lm-eval's results: `task`, `metric` (lm-eval's
    "acc,none" → "acc"; a filter other than "none" is kept: "exact_match_strict-match"), `value`,
    `stderr` (None where lm-eval gives none or "N/A"), `shots` and `samples` (None for a group)."""
    rows = []
    for task, entry in results["results"].items():
        for key, value in entry.items():
            if "," not in key or "_stderr," in key or not _number(value):
                continue
            name, filtered = key.split(",", 1)
            stderr = entry.get(f"{name}_stderr,{filtered}")
            rows.append({"task": task, "metric": name if filtered == "none" else f"{name}_{filtered}",
                         "value": float(value), "stderr": float(stderr) if _number(stderr) else None,
                         "shots": results.get("n-shot", {}).get(task),
                         "samples": results.get("n-samples", {}).get(task, {}).get("effective")})
    return rows


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_name(part: str) -> str:
    """A task or metric name as one level of an MLflow metric name (letters, digits, _ - . space :;
    a "/" would add a level) and of a file name."""
    return re.sub(r"[^\w.\- :]", "_", part)


def write(results: dict, folder: Path, model: str) -> None:
    """lm-eval's own files, as its CLI writes them: `results_<model>.json` (without the samples) and
    `samples_<model>_<task>.jsonl`, one line per example with the model's responses."""
    from lm_eval.utils import handle_non_serializable  # deferred: lm_eval

    folder.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples", {})
    aggregated = {key: value for key, value in results.items() if key != "samples"}
    (folder / f"results_{model}.json").write_text(
        json.dumps(aggregated, indent=2, default=handle_non_serializable, ensure_ascii=False))
    for task, rows in samples.items():
        with open(folder / f"samples_{model}_{metric_name(task)}.jsonl", "w") as out:
            for row in rows:
                out.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
