"""One lifecycle for the stages that train (SFT, reward, critic, PPO), top to bottom in `run`:

1. the attempt: resume from the newest checkpoint in `<stage workdir>/checkpoints` (engines, RNG,
   non-finite guard, the stage's own state) or start fresh; the params of a fresh start, the tag
   `rlhf.resumed_from`, and no (metric, step) that the killed attempt logged logged again;
2. the loop: the stop point (Ctrl-C/SIGTERM stops at a step boundary, with a checkpoint), one step,
   its metrics logged, a checkpoint every `checkpoint_every` steps, tqdm progress, the time taken;
   a checkpoint after the last step (or the stage's early stop), so the end can fail and resume;
3. the end: the held-out evaluation's metrics and `<name>/train_seconds`, the model published
   (`run_writers.StageRun.publish_model`), the contract's probe logged, the checkpoints deleted.

A stage supplies its parts as a `TrainingStage`: built (models, data, engines, the non-finite
guard) in its constructor, `step`, `finish` (the held-out evaluation and what to publish) and its
checkpointed `state`. Our own loop rather than a trainer library's (transformers' Trainer,
Lightning): PPO's iteration is rollouts, a critic, a reference and a collapse guard, which those
trainers do not step, and every stage's checkpoint, MLflow run and stop request work one way here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from stages.compute import checkpoint
from stages.compute.nonfinite import NonFiniteGuard
from stages.leaves import interrupt
from stages.leaves.dist import Dist


@dataclass
class Finish:
    """What a stage hands the lifecycle's end, made on every rank after its last step."""

    metrics: dict[str, float]  # the held-out evaluation (main rank), logged at the last step
    probe_name: str  # the output (and `contracts/<name>.parquet`) holding the contract's probe frame
    probe: Callable[[], pd.DataFrame]  # called after publishing: SFT's probe generates from the saved folder
    save: Callable[[Path], None] | None = None  # writes the model's Hugging Face folder; None: nothing to publish
    pack: Any = None  # the MLflow model around it (stages.compute.mlflow_models)
    inspect: Callable[[Path], None] | None = None  # run on the saved folder before it is logged
    lineage: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # set on the stage's run before publishing
    report: Callable[[Any], None] | None = None  # further logging on the stage's run, last (tables, figures)
    folders: tuple[Path, ...] = ()  # deleted with the checkpoints (PPO's collapse-guard passing point)
    outputs: dict[str, str] = field(default_factory=dict)  # further outputs of the stage (main rank)


class StepInterrupted(Exception):
    """Raised by a stage's `step` that cannot go on (a service it needs is gone): the stage stops at
    the step boundary with a checkpoint and ends with `error`, naming the checkpoint. `metrics`: the
    step trained and is kept (its metrics logged, the checkpoint after it); None: the step undid
    itself (the checkpoint before it, the step reruns on resuming)."""

    def __init__(self, error: Exception, metrics: dict[str, float] | None = None):
        super().__init__(str(error))
        self.error, self.metrics = error, metrics


class TrainingStage:
    """The parts of a training stage. A subclass builds everything in its constructor (before the
    lifecycle resumes a checkpoint over it, so numbers of the untrained model can be taken there)
    and sets the attributes below."""

    name: str  # the stage's name: progress bar, stop message, `<name>/train_seconds`, `<name>_run`
    unit = "step"  # what one `step` is called in the stop message ("iteration", "rollout")
    checkpoint_unit = "step"  # the checkpoint folders' prefix (`iter` for PPO's trainer)
    keep_checkpoints = 1  # the newest checkpoints kept while training
    total: int  # steps to train
    checkpoint_every: int  # 0: a checkpoint only when a stop is asked
    log_every = 1  # metrics logged every N steps, and at the last
    engines: dict  # name → engine, what a checkpoint saves besides `state()`
    guard: NonFiniteGuard
    params: dict  # the MLflow params of a fresh start
    first_metrics: dict[str, float] = {}  # logged at step 0 (the untrained model's numbers)
    progress_metrics: dict[str, str] = {}  # progress bar label → the metric it shows

    def state(self) -> dict:
        """The stage's own state for a checkpoint (the step and the guard's counts are added)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from a checkpoint's state (engines and RNG already restored)."""

    def start_fresh(self) -> None:
        """An attempt with no checkpoint to resume starts here (after the constructor): what a killed
        attempt left outside the checkpoints is to be cleared."""

    def step(self, number: int) -> dict[str, float]:
        """Train step `number` (from 1); its metrics (every rank returns them)."""
        raise NotImplementedError

    def metric_step(self, number: int) -> int:
        """The MLflow step the metrics of step `number` are logged at."""
        return number

    def stopped(self) -> bool:
        """True: stop before `total` (the critic converged, PPO's collapse guard stopped)."""
        return False

    def finish(self) -> Finish:
        raise NotImplementedError


def run(stage: TrainingStage, cfg, tracker, inputs: dict, dist: Dist) -> dict:
    """Train `stage` from its newest checkpoint (or from the start), publish its model and probe;
    its outputs (on the main rank; {} on the others)."""
    directory = dist.workdir / "checkpoints"
    saved: dict[int, Path] = {}  # the checkpoint of each step this attempt holds (or resumed from)

    def save(step: int) -> Path:
        """Checkpoint `step`, once: a stop right after a periodic checkpoint keeps that one."""
        if step not in saved:
            saved[step] = checkpoint.save(directory, step, stage.engines,
                                          checkpoint.stage_state(step, stage.guard, stage.state()), dist,
                                          keep=stage.keep_checkpoints, unit=stage.checkpoint_unit)
        return saved[step]

    # The attempt: fresh, or resumed from the newest checkpoint that verifies.
    resumed_from, step = checkpoint.latest(directory), 0
    if resumed_from is not None:
        state = checkpoint.load(resumed_from, stage.engines, dist)
        stage.guard.load_state_dict(state["guard"])
        stage.load_state(state)
        step = state["step"]
        saved[step] = resumed_from
    else:
        stage.start_fresh()
    if dist.is_main:
        tracker.start_attempt(stage.params, resumed_from)
        tracker.log_metrics(stage.first_metrics, step=0)

    # The loop.
    progress = tqdm(total=stage.total, initial=step, desc=stage.name, disable=not dist.is_main, dynamic_ncols=True)
    started = time.perf_counter()
    while step < stage.total and not stage.stopped():
        interrupt.stop_point(dist, stage.name, f"after {stage.unit} {step} of {stage.total}",
                             save=lambda: f"checkpoint {save(step)}")
        try:
            metrics = stage.step(step + 1)
        except StepInterrupted as stop:
            if stop.metrics is not None:
                step += 1
                if dist.is_main:
                    tracker.log_metrics(stop.metrics, step=stage.metric_step(step))
            raise type(stop.error)(f"stage {stage.name} stopped after {stage.unit} {step}: {stop.error}; checkpoint "
                                   f"{save(step)} (rlhf run --resume continues from it)") from None
        step += 1
        if dist.is_main and (step % stage.log_every == 0 or step == stage.total):
            tracker.log_metrics(metrics, step=stage.metric_step(step))
        if stage.checkpoint_every and step % stage.checkpoint_every == 0:
            save(step)
        progress.update(1)
        progress.set_postfix({label: f"{metrics[name]:.3f}" for label, name in stage.progress_metrics.items()})
    progress.close()
    train_seconds = time.perf_counter() - started
    # The trained state, whatever `checkpoint_every` is: a failure in the end (the held-out
    # evaluation, publishing, the probe) resumes here instead of training again.
    save(step)

    # The end: evaluate, publish, probe; the checkpoints served resuming only.
    end = stage.finish()
    outputs: dict = {}
    if dist.is_main:
        tracker.log_metrics({**end.metrics, f"{stage.name}/train_seconds": train_seconds}, step=stage.metric_step(step))
        tracker.set_tags(end.tags)
        published = {} if end.save is None else tracker.publish_model(
            end.save, cfg=cfg, inputs=inputs, pack=end.pack, inspect=end.inspect, lineage=end.lineage)
        outputs = {**published, f"{stage.name}_run": tracker.run_id,
                   end.probe_name: tracker.log_probe(end.probe(), end.probe_name), **end.outputs}
        if end.report is not None:
            end.report(tracker)
    dist.barrier()
    checkpoint.discard(dist, directory, *end.folders)
    return outputs
