"""`rlhf runs` and `rlhf compare` on recorded pipeline runs: the headline numbers a finished run
logged on its MLflow parent run, under either naming of its metrics."""

import pytest

from stages.orchestration import run_writers, runs, tracking
from stages.orchestration.config_loading import load_config

# A finished run of the data and eval stages as the tracking store holds it: its stage runs'
# metrics, and the headline numbers it logged on itself.
DATA_METRICS = {"data/rows": 128.0, "data/dropped": 2.0}
EVAL_METRICS = {"eval/judge/reward_model/net_win": 0.25, "eval/judge/reward_model/net_win_ci_low": -0.125,
                "eval/judge/reward_model/net_win_ci_high": 0.625, "eval/judge/reward_model/n": 8.0}
PARENT_METRICS = {  # the names each scheme gives the same numbers
    "stage named once": {"data/rows": 128.0, "data/dropped": 2.0, "eval/judge/reward_model/net_win": 0.25,
                         "eval/judge/reward_model/n": 8.0},
    "stage named twice": {"data/data/rows": 128.0, "data/data/dropped": 2.0,
                          "eval/eval/judge/reward_model/net_win": 0.25, "eval/eval/judge/reward_model/n": 8.0},
}


def _recorded_run(parent_metrics: dict[str, float]) -> str:
    mlflow_client = tracking.client()
    pipeline = run_writers.PipelineRun.start(load_config("tiny"), ["data", "eval"])
    for stage, metrics in (("data", DATA_METRICS), ("eval", EVAL_METRICS)):
        stage_run = pipeline.stage(stage)
        for name, value in metrics.items():
            mlflow_client.log_metric(stage_run.run_id, name, value, step=0)
        stage_run.finish("FINISHED", {})
        pipeline.record_stage(stage, stage_run.run_id, "ran")
    pipeline.log_metrics(parent_metrics)
    pipeline.finish("FINISHED")
    return pipeline.run_id


def test_parent_metric_names_name_the_stage_once():
    assert runs.parent_metric_name("data", "data/rows") == "data/rows"
    assert runs.parent_metric_name("eval", "eval/judge/reward_model/net_win") == "eval/judge/reward_model/net_win"
    assert runs.parent_metric_name("sft", "eval/perplexity") == "sft/eval/perplexity"
    assert runs.parent_metric_name("ppo", "eval/score") == "ppo/eval/score"


@pytest.mark.parametrize("scheme", sorted(PARENT_METRICS))
def test_runs_and_compare_read_the_headline_a_recorded_run_logged_under_either_name(scheme, tmp_path):
    run_id = _recorded_run(PARENT_METRICS[scheme])
    parent = tracking.client().get_run(run_id)
    assert runs.logged_headline(parent.data.metrics) == {
        "data": {"data/rows": (None, 128.0), "data/dropped": (None, 2.0)},
        "eval": {"eval/judge/reward_model/n": (None, 8.0), "eval/judge/reward_model/net_win": (None, 0.25)}}

    listed = runs.format_runs([parent])
    assert "data/rows 128  data/dropped 2" in listed and "data/data/" not in listed, listed
    assert "eval/judge/reward_model/net_win 0.25 [-0.125, 0.625]" in listed and "eval/eval/" not in listed, listed
    table = runs.compare(run_id, run_id, tmp_path / "curves.png")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in table.splitlines() if line.startswith(("data ", "eval "))}
    assert rows[("data", "data/rows")] == ["128", "128"]
    assert rows[("eval", "eval/judge/reward_model/net_win")] == ["0.25", "[-0.125,", "0.625]", "0.25", "[-0.125,", "0.625]"]
