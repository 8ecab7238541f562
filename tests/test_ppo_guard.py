"""The live collapse guard (stages/runtime/collapse_guard.py) on a real PPO trainer (tiny model, rule reward)
and the real policy contract: a pass saves the passing point, a breach stops, rolls back (weights
of the last pass, actor lr scaled, progress kept) or warns. Its state is part of PPO's lifecycle
checkpoint: killed and resumed (the real lifecycle and MLflow store), a run makes each decision
once. The guard through the whole stage: tests/test_ppo_stage.py."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from ppo_helpers import RULE, make_trainer

from data_contracts.gate import validate
from stages.leaves.dist import Dist
from stages.orchestration import run_writers
from stages.orchestration.config_loading import load_config
from stages.pipeline.ppo import PPOTraining
from stages.runtime import lifecycle
from stages.runtime.collapse_guard import CollapseGuard

BANDS = ["contracts.policy.max_kl=1.0"]  # a held-out mean KL to SFT above 1 nat is a breach


def evaluation(kl: float, rows: int = 8) -> pd.DataFrame:
    """A held-out evaluation's frame, as stages.pipeline.ppo.evaluate returns it."""
    return pd.DataFrame({"row": range(rows), "response_tokens": [10] * rows, "ended_with_eos": [True] * rows,
                         "kl": [kl] * rows, "perplexity": [5.0] * rows, "score": [0.1] * rows,
                         "distinct_2": [1.0] * rows})


def guarded(tiny, tmp_path, *overrides):
    trainer = make_trainer(tiny, *overrides)
    cfg = load_config("tiny", [f"ppo.reward={RULE}", *overrides, *BANDS])
    guard = CollapseGuard(cfg, evaluation(kl=0.0), tmp_path, Dist(), validate)
    guard.start(trainer)
    return trainer, guard


def actor_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.actor.weights().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def test_rollback_restores_the_last_passing_weights_scales_the_lr_and_then_stops(tiny, tmp_path):
    trainer, guard = guarded(tiny, tmp_path, "ppo.on_collapse=rollback", "ppo.max_rollbacks=1",
                             "ppo.rollback_lr_factor=0.5", "ppo.iterations=10")
    trainer.step()
    assert guard.check(trainer, evaluation(kl=0.5))["guard/passed"] == 1.0  # iteration 1 passes
    passed = actor_weights(trainer)
    moments = trainer.moments.state_dict()
    trainer.step()
    assert not same(actor_weights(trainer), passed)
    lr = trainer.actor.lr_scheduler.get_last_lr()[0]

    metrics = guard.check(trainer, evaluation(kl=3.0))  # iteration 2 breaks max_kl
    assert metrics == {"guard/passed": 0.0, "guard/breaches": 1.0, "guard/rollbacks": 1.0, "guard/policy_iteration": 1.0}
    assert same(actor_weights(trainer), passed) and trainer.moments.state_dict() == moments
    assert trainer.iteration == 2  # progress goes on: fresh prompts, one curve step per iteration
    assert trainer.actor.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * lr)
    trainer.step()
    assert trainer.actor.lr_scheduler.get_last_lr()[0] == pytest.approx(0.5 * lr)  # the schedule keeps the factor
    assert not guard.stopped

    guard.check(trainer, evaluation(kl=3.0))  # iteration 3 breaks again: out of rollbacks
    assert guard.stopped
    tags = guard.tags()
    assert tags["rlhf.policy_iteration"] == "1" and tags["rlhf.collapse_guard"] == "rollback"
    assert tags["rlhf.collapse"].startswith("iteration 3: expect_column_mean_to_be_between on column 'kl'")
    assert [e["action"] for e in guard.state.events] == ["rollback", "stop"]
    # A resumed stage reads the guard's state back from its lifecycle checkpoint.
    again = CollapseGuard(guard.cfg, evaluation(kl=0.0), tmp_path, Dist(), validate)
    again.load_state_dict(guard.state_dict(checkpoints_kept=3))
    assert again.state == guard.state and again.stopped
    assert again.passing_probe()["kl"].tolist() == [0.5] * 8


def test_stop_ends_at_the_first_breach_and_warn_goes_on(tiny, tmp_path):
    trainer, guard = guarded(tiny, tmp_path / "stop", "ppo.on_collapse=stop")
    trainer.step()
    weights = actor_weights(trainer)
    assert guard.check(trainer, evaluation(kl=3.0))["guard/rollbacks"] == 0.0
    assert guard.stopped and guard.tags()["rlhf.policy_iteration"] == "0" and same(actor_weights(trainer), weights)

    trainer, guard = guarded(tiny, tmp_path / "warn", "ppo.on_collapse=warn")
    trainer.step()
    weights = actor_weights(trainer)
    assert guard.check(trainer, evaluation(kl=3.0))["guard/passed"] == 0.0
    assert not guard.stopped and same(actor_weights(trainer), weights)
    assert guard.tags()["rlhf.collapse"].startswith("iteration 1: ") and guard.tags()["rlhf.policy_iteration"] == "0"
    assert guard.check(trainer, evaluation(kl=0.2))["guard/policy_iteration"] == 1.0  # it recovered: a new pass


def test_each_rollback_sets_the_actor_lr_to_the_configured_lr_times_the_factor_per_rollback(tiny, tmp_path):
    """A pass between two rollbacks saves a checkpoint that holds the cut lr; restoring it must not
    cut again on top: after k rollbacks the actor lr is actor_lr · factor^k, not factor^(1+2+…+k)."""
    trainer, guard = guarded(tiny, tmp_path, "ppo.on_collapse=rollback", "ppo.max_rollbacks=3",
                             "ppo.rollback_lr_factor=0.5", "ppo.iterations=10")
    actor_lr, factor = trainer.ppo.actor_lr, trainer.ppo.rollback_lr_factor
    for rollbacks in (1, 2, 3):
        trainer.step()
        assert guard.check(trainer, evaluation(kl=0.5))["guard/passed"] == 1.0  # a passing point with the lr so far
        trainer.step()
        assert guard.check(trainer, evaluation(kl=3.0))["guard/rollbacks"] == rollbacks
        expected = actor_lr * factor**rollbacks
        assert [group["lr"] for group in trainer.actor.optimizer.param_groups] == pytest.approx(
            [expected] * len(trainer.actor.optimizer.param_groups)), rollbacks
        scheduler = trainer.actor.lr_scheduler
        assert scheduler.base_lrs == pytest.approx([expected] * len(scheduler.base_lrs))
    trainer.step()
    assert trainer.actor.lr_scheduler.get_last_lr()[0] == pytest.approx(actor_lr * factor**3)
    assert not guard.stopped and [e["action"] for e in guard.state.events] == ["rollback"] * 3


class Killed(BaseException):
    """The process dies here (OOM kill, preemption): nothing after it runs."""


class ScheduledPPO(PPOTraining):
    """PPO's training stage, with its checkpointed state, fresh start and collapse guard, on the
    tiny trainer. Its held-out evaluation is a frame with a KL of 3 nats (a breach) at the
    iterations in `breach_at`, else 0.5; the process dies after iteration `killed_after`."""

    def __init__(self, tiny, workdir, overrides: list[str], breach_at: set[int], killed_after: int | None = None):
        self.trainer = make_trainer(tiny, *overrides)
        self.cfg = load_config("tiny", [f"ppo.reward={RULE}", *overrides, *BANDS])
        self.ppo, self.params = self.cfg.ppo, {}
        self.total, self.checkpoint_every = self.ppo.iterations, self.ppo.checkpoint_every
        self.engines, self.guard = self.trainer.checkpointed_engines(), self.trainer.guard
        self.collapse_guard = CollapseGuard(self.cfg, evaluation(kl=0.0), workdir, Dist(), validate)
        self.breach_at, self.killed_after, self.base_lr = breach_at, killed_after, {}
        self.sft_weights = actor_weights(self.trainer)

    def step(self, number: int) -> dict[str, float]:
        metrics = self.trainer.step()
        metrics.update(self.collapse_guard.check(self.trainer, evaluation(kl=3.0 if number in self.breach_at else 0.5)))
        self.base_lr[number] = self.trainer.actor.lr_scheduler.base_lrs[0]
        if number == self.killed_after:
            raise Killed
        return metrics

    def finish(self) -> lifecycle.Finish:  # what to publish: not this test's
        guard = self.collapse_guard
        return lifecycle.Finish({}, "policy_probe", probe=guard.passing_probe, tags=guard.tags(), folders=(guard.directory,))


ROLLBACK = ["ppo.on_collapse=rollback", "ppo.max_rollbacks=2", "ppo.rollback_lr_factor=0.5", "ppo.eval_every=1",
            "ppo.iterations=6"]


def killed_then_resumed(tiny, overrides: list[str], first: dict, second: dict) -> tuple[ScheduledPPO, ScheduledPPO]:
    """Attempt `first` killed, then attempt `second` in the same stage run (the real lifecycle and MLflow store)."""
    cfg = load_config("tiny", [f"ppo.reward={RULE}", *overrides])
    pipeline = run_writers.PipelineRun.start(cfg, ["ppo"])
    attempts = []
    for schedule in (first, second):
        tracker = pipeline.stage("ppo", resumes=True)
        dist = Dist(workdir=tracker.workdir)
        attempts.append(ScheduledPPO(tiny, dist.workdir, overrides, **schedule))
        try:
            lifecycle.run(attempts[-1], cfg, tracker, {}, dist)
        except Killed:
            tracker.finish("KILLED")
    return attempts[0], attempts[1]


def test_a_rollback_replayed_after_a_resume_counts_once_and_cuts_the_lr_once(tiny):
    """Killed after iteration 3's rollback, resumed from iteration 2's checkpoint: iteration 3
    breaches and rolls back again, which is the run's first rollback, not its second."""
    overrides = [*ROLLBACK, "ppo.checkpoint_every=2"]
    killed, resumed = killed_then_resumed(tiny, overrides, dict(breach_at={3}, killed_after=3), dict(breach_at={3}))
    actor_lr = resumed.trainer.ppo.actor_lr  # the tiny trainer's (ppo_helpers)
    assert killed.base_lr[3] == pytest.approx(actor_lr * 0.5)
    state = resumed.collapse_guard.state
    assert [(e["iteration"], e["action"]) for e in state.events] == [(3, "rollback")]
    assert (state.rollbacks, state.breaches) == (1, 1)
    assert [resumed.base_lr[n] for n in (3, 4, 5, 6)] == pytest.approx([actor_lr * 0.5] * 4)  # f^1, not f^2


def test_a_fresh_attempt_rolls_back_to_its_own_passing_point_not_a_killed_attempts(tiny):
    """No lifecycle checkpoint (checkpoint_every > iterations): the resume starts fresh, and so
    does the guard; a breach at iteration 1 restores the SFT policy, not the killed attempt's
    iteration-4 weights."""
    overrides = [*ROLLBACK, "ppo.checkpoint_every=100"]
    killed, fresh = killed_then_resumed(tiny, overrides, dict(breach_at=set(), killed_after=4),
                                        dict(breach_at={1}, killed_after=1))
    assert killed.collapse_guard.state.passing_iteration == 4
    assert fresh.trainer.iteration == 1 and fresh.collapse_guard.state.passing_iteration == 0
    assert fresh.collapse_guard.state.rollbacks == 1
    assert same(actor_weights(fresh.trainer), fresh.sft_weights)  # iteration 0: the SFT policy
