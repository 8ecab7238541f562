"""The training-stage lifecycle (stages/runtime/lifecycle.py) on a toy training stage that only this module
defines: SIGKILLed mid-run in a process of its own, then resumed from its checkpoint in the same
MLflow run, it logs every step exactly once (the real MLflow store), with an uninterrupted run's
numbers, its non-finite guard's count carried over, and its checkpoints gone at the end. A failure
in the end phase resumes without training again; a resume on other hardware records both
machines; metrics queued in a tracking outage survive a crash after the checkpoint.

Run as a script (`python tests/test_lifecycle.py <pipeline run id>`) it is the toy stage's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline_helpers import MlflowServer

from stages.compute import checkpoint
from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.training import adamw, cosine_with_warmup, make_engine
from stages.leaves import allocator, precision
from stages.leaves.dist import Dist
from stages.orchestration import lineage, registry, run_writers, tracking, tracking_queue
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute
from stages.orchestration.registry import Stage
from stages.runtime import lifecycle

TOY = Stage("toy", "test_lifecycle", config=("data",), outputs=("toy_probe",), resumes=True, gpu=False,
            deployed=False)
STEPS, CHECKPOINT_EVERY, STEP_SECONDS = 12, 4, 0.3
NAN_AT = 2  # the step whose loss is NaN: the guard skips it


class ToyTraining(lifecycle.TrainingStage):
    """Least squares: a linear map fitted by AdamW to a fixed random one, on a fresh random batch
    each step (torch's generator: a resumed run draws the batches an uninterrupted one would)."""

    name, progress_metrics = "toy", {"loss": "toy/loss"}

    def __init__(self, dist):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = adamw(model, lr=0.05, betas=(0.9, 0.95), weight_decay=0.0)
        self.engine = make_engine(model, optimizer, cosine_with_warmup(optimizer, 0, STEPS), micro_batch_size=16,
                                  grad_accum_steps=1, max_grad_norm=1.0, precision="fp32", dist=dist)
        self.engines, self.guard = {"model": self.engine}, NonFiniteGuard("toy", 3, dist)
        self.total, self.checkpoint_every = STEPS, CHECKPOINT_EVERY
        self.params = {"toy.steps": STEPS}
        self.target = torch.randn(8, 1)
        self.losses: list[float] = []

    def step(self, number: int) -> dict[str, float]:
        x = torch.randn(16, 8)
        loss = ((self.engine(x) - x @ self.target) ** 2).mean() * (float("nan") if number == NAN_AT else 1.0)
        if self.guard.check({"loss": loss}, f"step {number}"):
            self.engine.backward(loss)
            self.engine.step()
        time.sleep(STEP_SECONDS)  # time to SIGKILL it between two checkpoints
        return {"toy/loss": loss.item(), "train/skipped_steps": self.guard.skipped}

    def finish(self) -> lifecycle.Finish:
        weights = self.engine.module.weight.detach().flatten().tolist()
        return lifecycle.Finish({"toy/weight_0": weights[0]}, "toy_probe", probe=lambda: pd.DataFrame({"weight": weights}))


def run(cfg, tracker, inputs: dict, dist) -> dict:
    return lifecycle.run(ToyTraining(dist), cfg, tracker, inputs, dist)


@pytest.fixture
def toy_stage():
    yield registry.register(TOY)
    registry.unregister(TOY.name)


def history(run_id: str, name: str) -> dict[int, list[float]]:
    """Every value logged for metric `name`, by step."""
    steps: dict[int, list[float]] = {}
    for metric in tracking.client().get_metric_history(run_id, name):
        steps.setdefault(metric.step, []).append(metric.value)
    return steps


def logged_once(run_id: str, name: str) -> dict[int, float]:
    """Metric `name` by step, checked to have one value at each step 1..STEPS."""
    steps = history(run_id, name)
    assert sorted(steps) == list(range(1, STEPS + 1)), name  # none lost
    assert all(len(values) == 1 for values in steps.values()), name  # none twice
    return {step: values[0] for step, values in steps.items()}


def killed_after_step(run_id: str, step: int, log: Path, timeout: float = 300) -> None:
    """Start this module as the toy stage's process for pipeline run `run_id` (its output in `log`);
    SIGKILL it once its MLflow run holds step `step` of `toy/loss`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, run_id], start_new_session=True, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            stage = [r for r in lineage.stage_runs(run_id) if r.data.tags.get("rlhf.stage") == TOY.name]
            if stage and step in history(stage[0].info.run_id, "toy/loss"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the toy stage ended before the kill: {log.read_text()[-3000:]}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: the MLflow run stays RUNNING
        proc.wait()


def test_a_toy_stage_killed_mid_run_resumes_with_every_step_logged_once(toy_stage, tmp_path):
    cfg = load_config("tiny")
    pipeline = run_writers.PipelineRun.start(cfg, [TOY.name])
    killed_after_step(pipeline.run_id, CHECKPOINT_EVERY + 1, tmp_path / "killed.log")
    checkpoints = pipeline.workdir / TOY.name / "checkpoints"
    resume_from = checkpoint.latest(checkpoints)
    (killed,) = lineage.stage_runs(pipeline.run_id)
    logged_before = max(history(killed.info.run_id, "toy/loss"))
    assert resume_from.name == f"step-{CHECKPOINT_EVERY:06d}" and logged_before > CHECKPOINT_EVERY  # some steps twice

    run_writers.PipelineRun.reopen(cfg, pipeline.run_id)
    outputs = execute(TOY.name, cfg, pipeline.run_id, {})
    (attempt,) = lineage.stage_runs(pipeline.run_id)  # the killed attempt's run, continued
    assert attempt.info.status == "FINISHED" and attempt.data.tags["rlhf.resumed_from"] == resume_from.name
    assert outputs["toy_run"] == attempt.info.run_id and attempt.data.params["toy.steps"] == str(STEPS)
    assert outputs["toy_probe"].endswith("contracts/toy_probe.parquet")
    assert not checkpoints.exists()  # the stage ended: its checkpoints served resuming only

    whole = run_writers.PipelineRun.start(cfg, [TOY.name])
    execute(TOY.name, cfg, whole.run_id, {})
    (uninterrupted,) = lineage.stage_runs(whole.run_id)
    for name in ("toy/loss", "train/skipped_steps"):
        got, want = logged_once(attempt.info.run_id, name), logged_once(uninterrupted.info.run_id, name)
        assert got == pytest.approx(want, nan_ok=True), name  # the numbers of an uninterrupted run
    assert logged_once(attempt.info.run_id, "train/skipped_steps")[STEPS] == 1.0  # the guard's count survived the kill
    assert (attempt.data.metrics["toy/weight_0"]
            == pytest.approx(uninterrupted.data.metrics["toy/weight_0"]))  # so did the trained weights


class EndFails(ToyTraining):
    """The toy stage, checkpointed only on a stop, whose end fails when `fail` (the tracking server
    gone while it publishes); `trained`: the steps this attempt trained."""

    def __init__(self, dist, fail: bool):
        super().__init__(dist)
        self.checkpoint_every, self.fail, self.trained = 0, fail, []

    def step(self, number: int) -> dict[str, float]:
        self.trained.append(number)
        return super().step(number)

    def finish(self) -> lifecycle.Finish:
        if self.fail:
            raise tracking_queue.TrackingUnavailable("the tracking server went away while the model was published")
        return super().finish()


def test_a_failure_in_the_end_resumes_from_the_last_step_without_training_again(toy_stage):
    cfg = load_config("tiny")
    pipeline = run_writers.PipelineRun.start(cfg, [TOY.name])
    tracker = pipeline.stage(TOY.name, resumes=True)
    dist = Dist(workdir=tracker.workdir)
    with pytest.raises(tracking_queue.TrackingUnavailable):
        lifecycle.run(EndFails(dist, fail=True), cfg, tracker, {}, dist)
    tracker.finish("FAILED")
    found = checkpoint.latest(dist.workdir / "checkpoints")
    assert found is not None and found.name == f"step-{STEPS:06d}"

    resumed = pipeline.stage(TOY.name, resumes=True)
    stage = EndFails(dist, fail=False)
    outputs = lifecycle.run(stage, cfg, resumed, {}, dist)
    assert resumed.run_id == tracker.run_id and stage.trained == []  # nothing trained twice
    assert outputs["toy_probe"].endswith("contracts/toy_probe.parquet")
    assert not (dist.workdir / "checkpoints").exists()


def test_a_stage_resumed_on_other_hardware_records_both_machines_and_finishes(toy_stage):
    cfg = load_config("tiny")
    pipeline = run_writers.PipelineRun.start(cfg, [TOY.name])
    killed = pipeline.stage(TOY.name, resumes=True)
    elsewhere = {"precision.hardware": "NVIDIA H100 80GB HBM3: native bf16", "allocator": "another allocator"}
    killed.log_params(elsewhere)
    killed.finish("KILLED")

    execute(TOY.name, cfg, pipeline.run_id, {})
    (attempt,) = lineage.stage_runs(pipeline.run_id)
    assert attempt.info.run_id == killed.run_id and attempt.info.status == "FINISHED"
    here = {"precision.hardware": precision.describe("cpu"), "allocator": allocator.in_use()}
    params = attempt.data.params
    for key, value in elsewhere.items():
        assert params[key] == value, key  # the killed attempt's machine
    for key, value in here.items():
        assert params[f"{key}.attempt_2"] == value, key  # and the resumed one's


class OutageThenCrash(ToyTraining):
    """The toy stage whose tracking server goes down at step 2, for good, and whose process dies
    after step CHECKPOINT_EVERY + 2: its checkpoint is past steps whose metrics are still queued."""

    def __init__(self, dist, server: MlflowServer):
        super().__init__(dist)
        self.server = server

    def step(self, number: int) -> dict[str, float]:
        if number == 2:
            self.server.stop()
        if number == CHECKPOINT_EVERY + 3:
            raise SystemExit("killed")
        return super().step(number)


def test_metrics_queued_in_a_tracking_outage_survive_a_crash_after_the_checkpoint(toy_stage, tmp_path, monkeypatch):
    server = MlflowServer(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    try:
        server.start()
        cfg = load_config("tiny")
        pipeline = run_writers.PipelineRun.start(cfg, [TOY.name])
        tracker = pipeline.stage(TOY.name, resumes=True)
        dist = Dist(workdir=tracker.workdir)
        with pytest.raises(SystemExit):
            lifecycle.run(OutageThenCrash(dist, server), cfg, tracker, {}, dist)
        assert checkpoint.latest(dist.workdir / "checkpoints").name == f"step-{CHECKPOINT_EVERY:06d}"

        server.start()  # back; the dead attempt's queue died with its process
        tracker.client.set_terminated(tracker.run_id, status="KILLED")
        resumed = pipeline.stage(TOY.name, resumes=True)
        lifecycle.run(ToyTraining(dist), cfg, resumed, {}, dist)
        resumed.finish("FINISHED")
        logged_once(resumed.run_id, "toy/loss")  # steps 2..4 were queued when the process died
    finally:
        server.stop()


if __name__ == "__main__":
    registry.register(TOY)
    execute(TOY.name, load_config("tiny"), sys.argv[1], {})
