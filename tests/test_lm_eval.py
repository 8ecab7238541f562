"""lm-evaluation-harness in the eval stage (`eval.lm_eval_tasks`) on the tiny preset through the
real flow: a local multiple-choice task made here (a task YAML and a jsonl of 8 questions) run on
the full run's SFT model and policy; the metrics, the alignment-tax delta, the report's row and
lm-eval's own files. lm-eval's accuracy and per-choice log-likelihoods are checked against our own
forward pass of each model on the same prompts, so a swapped or mis-loaded model fails. And an
unknown task name: a one-line error naming it and where tasks are looked up."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline_helpers import stage_run
from stages.compute.evaluate import harness
from stages.leaves.config import ConfigError, EvalConfig
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config

TASK = "rlhf_tiny_mc"
QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which animal says moo?", ["cat", "dog", "cow", "duck"], 2),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    ("What is frozen water called?", ["ice", "steam", "sand", "salt"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do you use to write on paper?", ["spoon", "shoe", "pen", "cup"], 2),
    ("Which season is the coldest?", ["summer", "spring", "autumn", "winter"], 3),
]


def prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"  # the YAML's doc_to_text below


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """A task YAML and its data, local files only (`dataset_path: json`); the datasets cache in
    the test's own folder."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {folder / "datasets-cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


@pytest.fixture(scope="module")
def evaluated(full_run, task_folder):
    """The eval stage alone on the full run's models, with the local task (no judges, C-Eval 0-shot:
    the report has C-Eval beside the task)."""
    from flows.rlhf import rlhf

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")  # nothing from the hub: the task's data is local
        env.setenv("HF_HUB_OFFLINE", "1")
        overrides = {"eval.lm_eval_tasks": [TASK], "eval.lm_eval_include_path": str(task_folder),
                     "eval.lm_eval_batch_size": 4, "eval.judges": [], "eval.ceval.shots": [0]}
        return rlhf(preset="tiny", overrides=overrides, stages=["eval"], from_run=full_run)


def test_task_runs_on_both_models_and_lands_in_the_report(evaluated):
    run = stage_run(evaluated, "eval")
    metrics = run.data.metrics
    base = f"eval/lm_eval/{TASK}/acc"
    sft, policy = metrics[f"{base}/sft"], metrics[f"{base}/policy"]
    assert 0.0 <= sft <= 1.0 and 0.0 <= policy <= 1.0
    assert metrics[f"{base}/delta"] == pytest.approx(policy - sft)
    for model, acc in (("sft", sft), ("policy", policy)):  # the standard error of a mean over 8 questions
        assert metrics[f"{base}_stderr/{model}"] == pytest.approx((acc * (1 - acc) / 7) ** 0.5)
    assert "eval/ceval_0shot/overall/delta" in metrics and run.data.tags["rlhf.contract"] == "passed"
    # A headline number: on the pipeline run, as `rlhf runs` and `rlhf compare` show it.
    assert tracking.client().get_run(evaluated).data.metrics[f"{base}/delta"] == pytest.approx(policy - sft)

    report = tracking.download(f"runs:/{run.info.run_id}/report")
    text = (report / "report.md").read_text()
    assert text.index("## C-Eval val") < text.index(f"## lm-evaluation-harness {harness.version()}")
    assert f"| {TASK} | acc | 0 | 8 | {sft:.3f} ± " in text and f"| {policy - sft:+.3f} |" in text
    assert f"<td>{TASK}</td>" in (report / "report.html").read_text()
    assert TASK in tracking.download(lineage.outputs_of(evaluated)["eval_summary"]).read_text()
    for model, acc in (("sft", sft), ("policy", policy)):  # lm-eval's own results file
        results = json.loads((report / "lm_eval" / f"results_{model}.json").read_text())
        assert results["results"][TASK]["acc,none"] == acc and results["lm_eval_version"] == harness.version()


@torch.no_grad()
def _choice_logprobs(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by one unpadded forward: the continuation's tokens are those of
    context + continuation after the context's own (lm-eval's causal encoding)."""
    whole = tokenizer(context + continuation)["input_ids"]
    start = len(tokenizer(context)["input_ids"])
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_accuracy_matches_our_own_scoring_of_each_model(evaluated, full_run):
    """Each model's per-choice log-likelihoods and accuracy, as lm-eval logged them, equal our own
    forward pass of that model (the SFT and the policy give different numbers: a swap fails)."""
    from stages.compute.model_loading import frozen_lm

    run = stage_run(evaluated, "eval")
    report = tracking.download(f"runs:/{run.info.run_id}/report")
    outputs, cfg = lineage.outputs_of(full_run), load_config("tiny")
    ours = {}
    for name, uri in (("sft", outputs["sft_model"]), ("policy", outputs["policy_model"])):
        model, tokenizer = frozen_lm(str(tracking.download(uri)), cfg.model, "cpu")
        ours[name] = [[_choice_logprobs(model, tokenizer, prompt(q), f" {choice}") for choice in choices]
                      for q, choices, _ in QUESTIONS]
        samples = [json.loads(line) for line in (report / "lm_eval" / f"samples_{name}_{TASK}.jsonl").open()]
        samples.sort(key=lambda s: s["doc_id"])
        assert [[arg[0] for arg in s["arguments"]] for s in samples] == [[prompt(q)] * 4 for q, _, _ in QUESTIONS]
        theirs = [resp[0][0] for s in samples for resp in s["resps"]]
        assert theirs == pytest.approx([lp for row in ours[name] for lp in row], abs=1e-3)
        accuracy = sum(max(range(4), key=row.__getitem__) == a for row, (_, _, a) in zip(ours[name], QUESTIONS)) / 8
        assert run.data.metrics[f"eval/lm_eval/{TASK}/acc/{name}"] == accuracy
    assert [lp for row in ours["sft"] for lp in row] != pytest.approx([lp for row in ours["policy"] for lp in row],
                                                                      abs=1e-3)


def test_unknown_task_names_it_and_where_tasks_are_looked_up(task_folder):
    ev = EvalConfig(lm_eval_tasks=[TASK, "no_such_task_anywhere"], lm_eval_include_path=str(task_folder))
    with pytest.raises(ConfigError) as error:
        harness.task_manager(ev)
    message = str(error.value)
    assert "\n" not in message and "no_such_task_anywhere" in message and TASK not in message.split(";")[0]
    assert f"lm-eval {harness.version()}'s tasks" in message and str(task_folder) in message
    # The user's folder alone when it holds every task; lm-eval's own tasks by name.
    assert harness.task_manager(EvalConfig(lm_eval_tasks=[TASK], lm_eval_include_path=str(task_folder))).all_tasks \
        == [TASK]
    assert "arc_easy" in harness.task_manager(EvalConfig(lm_eval_tasks=["arc_easy"])).all_tasks
    with pytest.raises(ConfigError, match="is not a folder"):
        harness.task_manager(EvalConfig(lm_eval_tasks=[TASK], lm_eval_include_path=str(task_folder / "nope")))
