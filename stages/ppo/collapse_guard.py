"""The live collapse guard: the paper's pattern-collapse indicators (§5.1, Figs. 4 and 9: KL to the
SFT policy blowing up, response length and perplexity drifting) enforced while PPO trains, not only
by the gate at the end. The KL is tempered: both policies at the sampling temperature
(`ppo.generation.temperature`), the KL PPO penalises; the perplexities are at T = 1.

At each held-out evaluation the policy contract (data_contracts, suite `policy`: the same bands the
gate after the stage checks) judges the policy's responses against the SFT policy's. A pass saves
a checkpoint (`<workdir>/passing/`, the newest only) and its probe frame. A breach, by
`ppo.on_collapse`:
- stop: the stage ends;
- rollback: the last passing checkpoint is restored (models, optimisers, running score
  statistics; the iteration count and prompt stream go on) and the actor lr is set to
  `ppo.actor_lr · ppo.rollback_lr_factor^k` after the k-th rollback (an absolute value: the restored
  checkpoint may hold an lr an earlier rollback already cut); after `ppo.max_rollbacks` rollbacks
  the next breach stops;
- warn: training goes on.
In every case the policy the stage registers is the last one that passed (iteration 0 is the SFT
policy itself, the baseline the bands are measured from), tagged `rlhf.collapse` with the
iteration and rule that broke. The decisions are metrics (`guard/*`) and tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from stages import checkpoint
from stages.config import PipelineConfig
from stages.tags import COLLAPSE_GUARD_TAG, COLLAPSE_TAG, POLICY_ITERATION_TAG

NO_COLLAPSE = "none"


def policy_probe(frame: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """The policy contract's frame: a held-out evaluation beside the SFT policy's means."""
    return frame.assign(sft_response_tokens_mean=baseline["response_tokens"].mean(),
                        sft_perplexity_mean=baseline["perplexity"].mean())


@dataclass
class GuardState:
    """What survives a crash with the checkpoints: `<workdir>/passing/guard.json`."""

    passing_iteration: int = 0
    rollbacks: int = 0
    breaches: int = 0
    collapse: str = NO_COLLAPSE  # the last breach: "iteration 12: <rule>"
    events: list[dict] = field(default_factory=list)  # {"iteration", "action", "rule"}


class CollapseGuard:
    def __init__(self, cfg: PipelineConfig, baseline: pd.DataFrame, workdir: Path, dist):
        self.cfg, self.baseline, self.dist = cfg, baseline, dist
        self.directory = workdir / "passing"
        self.state_file, self.probe_file = self.directory / "guard.json", self.directory / "probe.parquet"
        self.state = GuardState(**json.loads(self.state_file.read_text())) if self.state_file.exists() else GuardState()
        self.stopped = False

    # -- passing points ------------------------------------------------------------------------
    def start(self, trainer) -> None:
        """Iteration 0, the SFT policy: the first passing point (unless a resumed run has one)."""
        if checkpoint.latest(self.directory) is None:
            self._passed(trainer, policy_probe(self.baseline, self.baseline))

    def _passed(self, trainer, probe: pd.DataFrame) -> None:
        checkpoint.save_trainer(trainer, self.directory, keep=1)
        self.state.passing_iteration = trainer.iteration
        if self.dist.is_main:
            probe.to_parquet(self.probe_file)
        self._save_state()

    def passing_probe(self) -> pd.DataFrame:
        return pd.read_parquet(self.probe_file)

    def _save_state(self) -> None:
        if self.dist.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.state_file.write_text(json.dumps(self.state.__dict__, indent=1))

    # -- the check -----------------------------------------------------------------------------
    def breach(self, probe: pd.DataFrame) -> str | None:
        """The policy contract on one evaluation's probe: None if it passes, else the rules that broke."""
        from data_contracts.gate import validate  # deferred: Great Expectations loads at the first check

        report = validate("policy", probe, self.cfg)
        return None if report.success else " | ".join(f.describe() for f in report.failures)

    def check(self, trainer, frame: pd.DataFrame) -> dict[str, float]:
        """Judge the evaluation `frame` (each response's score, length, KL, perplexity, EOS) and act
        on it; returns the guard's metrics for this iteration."""
        ppo, it = self.cfg.ppo, trainer.iteration
        probe = policy_probe(frame, self.baseline)
        rule = self.breach(probe)
        if rule is None:
            self._passed(trainer, probe)
        else:
            self.state.breaches += 1
            self.state.collapse = f"iteration {it}: {rule}"
            action = ppo.on_collapse
            if action == "rollback" and (self.state.rollbacks >= ppo.max_rollbacks or it >= ppo.iterations):
                action = "stop"  # out of rollbacks, or no iteration left to train on
            if action == "rollback":
                self.state.rollbacks += 1
                checkpoint.roll_back(trainer, checkpoint.latest(self.directory))
                set_actor_lr(trainer, trainer.ppo.actor_lr * ppo.rollback_lr_factor ** self.state.rollbacks)
            self.stopped = action == "stop"
            self.state.events.append({"iteration": it, "action": action, "rule": rule})
            self._save_state()
            then = {"stop": f"stop; the policy is iteration {self.state.passing_iteration}'s",
                    "rollback": f"rollback {self.state.rollbacks} of {ppo.max_rollbacks} to iteration "
                                f"{self.state.passing_iteration}'s weights, actor lr ×"
                                f"{ppo.rollback_lr_factor ** self.state.rollbacks:g}",
                    "warn": "warn; training goes on"}[action]
            print(f"ppo: collapse guard at iteration {it}: {rule}; {then}", flush=True)
        return {"guard/passed": float(rule is None), "guard/breaches": float(self.state.breaches),
                "guard/rollbacks": float(self.state.rollbacks),
                "guard/policy_iteration": float(self.state.passing_iteration)}

    def tags(self) -> dict[str, str]:
        return {COLLAPSE_TAG: self.state.collapse, POLICY_ITERATION_TAG: str(self.state.passing_iteration),
                COLLAPSE_GUARD_TAG: self.cfg.ppo.on_collapse}


def set_actor_lr(trainer, base_lr: float) -> None:
    """The actor's lr schedule with peak `base_lr`, at the point of the schedule it has reached. The
    scheduler state just restored holds the base lr of the checkpoint, which an earlier rollback may
    have cut already: the new one replaces it rather than scaling it."""
    scheduler = trainer.actor.lr_scheduler
    for group, lr, restored_base in zip(trainer.actor.optimizer.param_groups, scheduler.get_last_lr(),
                                        scheduler.base_lrs):
        group["lr"] = lr * base_lr / restored_base
    scheduler.base_lrs = [base_lr] * len(scheduler.base_lrs)
