"""Faults injected into real runs of the tiny PPO stage: a SIGKILL at a random moment and
a resume (of the SFT, reward and critic stages too), a tracking server that goes away (and comes back, or not), a disk that fills up while a
checkpoint is written. Every run keeps its metric history whole: each step logged exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pipeline_helpers import TRL_NAMES, MlflowServer, stage_run

from stages.compute import checkpoint
from stages.leaves.config import rlhf_home
from stages.orchestration import lineage, run_writers, tracking, tracking_queue
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute


def runs_dir() -> Path:
    return rlhf_home() / "runs"


def new_checkpoint(before: set[Path], name: str, timeout: float = 300, stage: str = "ppo") -> Path:
    """The checkpoints folder of the pipeline run (not in `before`) in which checkpoint `name` of
    `stage`, or a later one, appeared. Polled every 10 ms: a stage keeps only its newest checkpoint
    or two, and the tiny SFT's steps take ~40 ms on a quiet machine, so checkpoint 2 lives ~80 ms."""
    prefix, number = name.rsplit("-", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for folder in set(runs_dir().iterdir()) - before:
            for found in (folder / stage / "checkpoints").glob(f"{prefix}-*"):
                if int(found.name.rsplit("-", 1)[1]) >= int(number) and (found / checkpoint.MANIFEST).exists():
                    return folder / stage / "checkpoints"
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint {name} or later appeared in {timeout} s")


def steps(run_id: str, name: str) -> list[int]:
    return sorted(m.step for m in tracking.client().get_metric_history(run_id, name))


def assert_every_step_once(run_id: str, iterations: int) -> None:
    for name in TRL_NAMES:
        assert steps(run_id, name) == list(range(1, iterations + 1)), name  # none lost, none twice


def killed_at_random(args: list[str], checkpoints_of: str, first: str, step_s: float, seed: int) -> Path:
    """Start `rlhf run ARGS` in its own session with its own ephemeral Prefect; SIGKILL it anywhere
    in the 2.5 steps after checkpoint `first` (or a later one) of stage `checkpoints_of` appeared;
    its checkpoints folder."""
    before = set(runs_dir().iterdir())
    # RLHF_SUPERVISED=1: this process does the work itself. Unset, `rlhf run` would run it in a child
    # of its own session (flows/supervise.py `supervise`), which the SIGKILL of this group does not reach:
    # the child's watcher ends it once it sees its supervisor gone (it polls every 0.2 s), time enough
    # for a tiny stage to write one more checkpoint after the test had read the newest (resumed from
    # step-000004, expected step-000002).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}, "RLHF_SUPERVISED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        checkpoints = new_checkpoint(before, first, stage=checkpoints_of)
        time.sleep(random.Random(seed).uniform(0.0, 2.5) * step_s)
        assert proc.poll() is None, "the run ended before the kill"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return checkpoints


def killed_and_resumed(full_run: str, stage: str, overrides: list[str], first: str, step_s: float, seed: int):
    """`stage` of the tiny pipeline rerun on `full_run`'s outputs, SIGKILLed at random after its
    checkpoint `first` (`killed_at_random`), then resumed in-process (`rlhf(resume=…)`): the one
    MLflow run of both attempts (checked FINISHED and tagged with the checkpoint it resumed from)
    and the checkpoints folder."""
    from flows.rlhf import rlhf

    args = ["--preset", "tiny", "--stages", stage, "--from-run", full_run, *(a for o in overrides for a in ("--set", o))]
    checkpoints = killed_at_random(args, stage, first, step_s, seed)
    killed = checkpoints.parents[1].name
    resume_from = checkpoint.latest(checkpoints).name
    assert resume_from.startswith(first.rsplit("-", 1)[0])

    assert rlhf(preset="tiny", overrides=overrides, stages=[stage], resume=killed) == killed
    (attempt,) = [run for run in lineage.stage_runs(killed) if run.data.tags["rlhf.stage"] == stage]  # one run
    assert attempt.info.status == "FINISHED" and attempt.data.tags["rlhf.resumed_from"] == resume_from
    return attempt, checkpoints


def assert_an_uninterrupted_runs_numbers(attempt, full_run: str, stage: str, overrides: list[str], names) -> None:
    """The steps logged before the kill, and those after the resume (computed again from the
    checkpoint, the steps up to the kill included), are those of the same stage run without a kill."""
    from flows.rlhf import rlhf

    whole = stage_run(rlhf(preset="tiny", overrides=overrides, stages=[stage], from_run=full_run), stage)
    client = tracking.client()
    for name in names:
        got, want = ({m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
                     for run in (attempt, whole))
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), name


def test_a_ppo_run_killed_at_a_random_moment_resumes_with_every_step_logged_once(full_run):
    iterations, overrides = 6, ["ppo.iterations=6", "ppo.checkpoint_every=2", "ppo.eval_every=3"]
    iteration_s = stage_run(full_run, "ppo").data.metrics["ppo/train_seconds"] / load_config("tiny").ppo.iterations
    attempt, _ = killed_and_resumed(full_run, "ppo", overrides, "iter-000002", iteration_s, seed=8)
    assert_every_step_once(attempt.info.run_id, iterations)
    assert steps(attempt.info.run_id, "eval/kl") == [0, 3, 6]  # 0: the SFT policy; 6: the final evaluation
    assert_an_uninterrupted_runs_numbers(attempt, full_run, "ppo", overrides, (
        "objective/scores", "objective/kl", "loss/value_avg", "loss/policy_avg", "episode", "eval/score"))


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_a_killed_sft_or_reward_stage_resumes_with_every_step_logged_once(full_run, stage):
    overrides = [f"{stage}.checkpoint_every=2", "sft.epochs=1"]
    earlier = stage_run(full_run, stage)
    total = len(steps(earlier.info.run_id, "train/loss"))
    step_s = earlier.data.metrics[f"{stage}/train_seconds"] / total
    attempt, checkpoints = killed_and_resumed(full_run, stage, overrides, "step-000002", step_s, seed=len(stage))
    assert not checkpoints.exists()  # the model is published: the checkpoints are gone
    for name in ("train/loss", "train/lr", "train/grad_norm", "train/epoch"):
        assert steps(attempt.info.run_id, name) == list(range(1, total + 1)), name  # none lost, none twice
    # Every step's numbers are an uninterrupted run's, and so is the model it published.
    assert_an_uninterrupted_runs_numbers(attempt, full_run, stage, overrides, (
        "train/loss", "train/lr", "train/grad_norm", "eval/loss" if stage == "sft" else "eval/accuracy"))


def test_a_killed_critic_stage_resumes_with_every_rollout_logged_once(full_run):
    overrides = ["critic.checkpoint_every=1"]
    tiny = load_config("tiny").critic
    steps_per_rollout = -(-tiny.rollout_batch_size // tiny.minibatch_size)
    earlier = stage_run(full_run, "critic")
    rollouts = int(earlier.data.metrics["critic/rollouts"])
    assert rollouts >= 3  # the tiny critic runs to its step cap: a kill after rollout 1 leaves some to resume
    rollout_s = earlier.data.metrics["critic/train_seconds"] / rollouts
    attempt, checkpoints = killed_and_resumed(full_run, "critic", overrides, "iter-000001", rollout_s, seed=5)
    assert not checkpoints.exists()  # the critic is published: the checkpoints are gone
    logged = [steps_per_rollout * k for k in range(1, rollouts + 1)]
    for name in ("critic/value_avg", "critic/explained_variance", "objective/scores", "time/rollout"):
        assert steps(attempt.info.run_id, name) == logged, name  # none lost, none twice
    # Every rollout's numbers are an uninterrupted run's, and so is the held-out check of the critic.
    assert_an_uninterrupted_runs_numbers(attempt, full_run, "critic", overrides, (
        "critic/value_avg", "critic/explained_variance", "objective/scores", "reward/running_mean",
        "critic/heldout_value_loss"))


@pytest.fixture
def mlflow_server(full_run, rlhf_home, monkeypatch):
    server = MlflowServer(rlhf_home)
    server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    yield server
    server.stop()


def in_background(fn) -> threading.Thread:
    """Run fn in a thread; its exception, if any, is raised by join_checked."""
    def target():
        try:
            fn()
        except BaseException as err:
            thread.error = err

    thread = threading.Thread(target=target, daemon=True)
    thread.error = None
    thread.start()
    return thread


def join_checked(thread: threading.Thread) -> None:
    thread.join()
    if thread.error is not None:
        raise thread.error


def test_ppo_trains_through_a_tracking_server_outage_and_logs_every_step_once(mlflow_server, full_run):
    from flows.rlhf import rlhf

    iterations, overrides = 6, ["ppo.iterations=6", "ppo.checkpoint_every=1", "ppo.eval_every=3"]
    before, seen = set(runs_dir().iterdir()), {}

    def outage():
        checkpoints = new_checkpoint(before, "iter-000001")
        mlflow_server.stop()
        down, seen["at_stop"] = time.monotonic(), checkpoint.latest(checkpoints).name
        # Down for a few seconds, and until training has gone on (a newer checkpoint).
        while time.monotonic() - down < 60 and (time.monotonic() - down < 5 or
                                                 checkpoint.latest(checkpoints).name == seen["at_stop"]):
            time.sleep(0.2)
        seen["at_restart"] = checkpoint.latest(checkpoints).name
        mlflow_server.start()

    thread = in_background(outage)
    try:
        pipeline = rlhf(preset="tiny", overrides=overrides, stages=["ppo"], from_run=full_run)
    finally:
        join_checked(thread)
    assert seen["at_restart"] > seen["at_stop"], "training stopped while the tracking server was down"
    run = stage_run(pipeline, "ppo")
    assert run.info.status == "FINISHED"
    assert_every_step_once(run.info.run_id, iterations)
    assert steps(run.info.run_id, "eval/kl") == [0, 3, 6]
    samples = {f.path for f in tracking.client().list_artifacts(run.info.run_id, "samples")}
    assert {"samples/iteration_00003.json", "samples/scores_00003.png", "samples/iteration_00006.json"} <= samples


def test_a_tracking_server_down_for_longer_than_the_patience_fails_the_stage_clearly(mlflow_server, full_run):
    from flows.rlhf import rlhf

    overrides = ["ppo.iterations=40", "ppo.checkpoint_every=1", "orchestration.tracking_patience_s=5"]
    before, found = set(runs_dir().iterdir()), {}

    def outage():  # for good
        found["checkpoints"] = new_checkpoint(before, "iter-000001")
        mlflow_server.stop()

    thread = in_background(outage)
    try:
        with pytest.raises(tracking_queue.TrackingUnavailable) as err:
            rlhf(preset="tiny", overrides=overrides, stages=["ppo"], from_run=full_run)
    finally:
        join_checked(thread)
    message = str(err.value)
    assert f"MLflow tracking server {mlflow_server.uri} unreachable" in message
    assert "longer than orchestration.tracking_patience_s=5;" in message
    assert checkpoint.latest(found["checkpoints"]) is not None  # kept, for --resume


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) → a folder on a tmpfs of `size` bytes (unmounted afterwards)."""
    mounted = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_disk_that_fills_inside_torch_save_is_a_disk_full_error(small_tmpfs):
    """torch.save reports a failed write as RuntimeError without an errno (a study's disk filled
    while the optimiser states were written): still a DiskFullError, with nothing half written."""
    import torch

    from stages.compute import checkpoint as shared
    from stages.leaves.dist import Dist
    from stages.compute.training import adamw, cosine_with_warmup, make_engine

    model = torch.nn.Linear(256, 256)
    optimizer = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    engine = make_engine(model, optimizer, cosine_with_warmup(optimizer, 0, 10), micro_batch_size=1,
                         grad_accum_steps=1, max_grad_norm=1.0, precision="fp32", dist=Dist())
    engine.backward(model(torch.randn(4, 256)).square().mean())
    engine.step()  # Adam's moments exist now
    needed = shared.checkpoint_bytes({"model": engine}, {"step": 1})
    # Room for the tensors, not for the files' headers and the RNG states: the size check passes,
    # the last big file (the optimiser states, through torch.save) runs out of space.
    folder = small_tmpfs((needed // 4096 + 1) * 4096)
    with pytest.raises(shared.DiskFullError, match=r"cannot write checkpoint .*step-000001: the disk or the quota is "
                                                   r"full \(.*unexpected pos.*MiB were free when the write failed\)"):
        shared.save(folder, 1, {"model": engine}, {"step": 1}, Dist())
    assert list(folder.iterdir()) == []  # no half-written folder
    # A disk without room for the tensors: refused before anything is written.
    too_small = small_tmpfs(needed // 2)
    with pytest.raises(shared.DiskFullError, match=r"it needs about 0\.00 GiB"):
        shared.save(too_small, 1, {"model": engine}, {"step": 1}, Dist())
    assert list(too_small.iterdir()) == []


def test_a_full_disk_while_checkpointing_fails_clearly_and_keeps_the_previous_checkpoint(full_run, tiny, tmp_path):
    from ppo_helpers import greedy_one_minibatch_trainer

    cfg = load_config("tiny", ["ppo.iterations=6", "ppo.checkpoint_every=2"])
    pipeline = run_writers.PipelineRun.start(cfg, ["ppo"], full_run)
    checkpoints = pipeline.workdir / "ppo" / "checkpoints"
    checkpoints.mkdir(parents=True)
    # A disk with room for one and a half checkpoints: the checkpoint of iteration 2 fits, that of
    # iteration 4 does not. The stage's are the size of a trainer's on the same tiny actor and
    # critic after a step (its Adam moments made).
    trainer = greedy_one_minibatch_trainer(tiny)
    trainer.step()
    size = folder_bytes(trainer.save_checkpoint(tmp_path)) * 3 // 2
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(checkpoints)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        with pytest.raises(checkpoint.DiskFullError) as err:
            execute("ppo", cfg, pipeline.run_id, lineage.outputs_of(full_run))
        assert f"cannot write checkpoint {checkpoints / 'iter-000004'}: the disk or the quota is full" in str(err.value)
        assert checkpoint.latest(checkpoints) == checkpoints / "iter-000002"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["iter-000002"]  # no half-written folder left
    finally:
        subprocess.run(["umount", str(checkpoints)], check=True)
    pipeline.finish("FAILED")
    assert lineage.stage_runs(pipeline.run_id)[0].info.status == "FAILED"
