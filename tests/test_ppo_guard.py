"""The live collapse guard (stages/ppo/collapse_guard.py) on a real PPO trainer (tiny model, rule reward)
and the real policy contract: a pass saves the passing point, a breach stops, rolls back (weights
of the last pass, actor lr scaled, progress kept) or warns. The guard through the whole stage:
tests/test_ppo_stage.py."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from ppo_helpers import RULE, make_trainer

from stages.config import load_config
from stages.dist import Dist
from stages.ppo.collapse_guard import CollapseGuard

BANDS = ["contracts.policy.max_kl=1.0"]  # a held-out mean KL to SFT above 1 nat is a breach


def evaluation(kl: float, rows: int = 8) -> pd.DataFrame:
    """A held-out evaluation's frame, as stages.ppo.stage.evaluate returns it."""
    return pd.DataFrame({"row": range(rows), "response_tokens": [10] * rows, "ended_with_eos": [True] * rows,
                         "kl": [kl] * rows, "perplexity": [5.0] * rows, "score": [0.1] * rows,
                         "distinct_2": [1.0] * rows})


def guarded(tiny, tmp_path, *overrides):
    trainer = make_trainer(tiny, *overrides)
    cfg = load_config("tiny", [f"ppo.reward={RULE}", *overrides, *BANDS])
    guard = CollapseGuard(cfg, evaluation(kl=0.0), tmp_path, Dist())
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
    # A resumed stage reads the guard's state back.
    again = CollapseGuard(guard.cfg, evaluation(kl=0.0), tmp_path, Dist())
    assert again.state == guard.state and again.passing_probe()["kl"].tolist() == [0.5] * 8


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
