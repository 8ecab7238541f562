"""The live collapse guard: the paper's pattern-collapse indicators (§5.1, Figs. 4 and 9: KL to the
SFT policy blowing up, response length and perplexity drifting) enforced while PPO trains, not only
by the gate at the end. The KL is tempered: both policies at the sampling temperature
(`ppo.generation.temperature`), the KL PPO penalises; the perplexities are at T = 1.

At each held-out evaluation the policy contract (data_contracts' check of suite `policy`, handed
in by the stage: the same bands the gate after the stage checks) judges the policy's responses
against the SFT policy's. A pass saves a trainer checkpoint (`<workdir>/passing/iter-N`) and its
probe frame (`probe-N.parquet`). A breach, by `ppo.on_collapse`:
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

The guard's state (`GuardState`: counts, events, which passing point is current) is part of the
stage's lifecycle checkpoint (`state_dict`), so a resumed attempt continues from the decisions
made up to its checkpoint, not from a killed attempt's later ones: a rollback replayed after a
resume is counted, and cuts the lr, once. Passing points stay while the current one or one of the
newest lifecycle checkpoints refers to them; a resume deletes the killed attempt's later ones, and
a fresh attempt (`start`) every one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from stages.leaves.config import PipelineConfig
from stages.leaves.tags import COLLAPSE_GUARD_TAG, COLLAPSE_TAG, POLICY_ITERATION_TAG

NO_COLLAPSE = "none"

# data_contracts' check of a probe frame against a suite: (suite, frame, cfg) → a report with
# `success` and `failures` (each with `describe()`).
ContractCheck = Callable[[str, pd.DataFrame, PipelineConfig], Any]


def policy_probe(frame: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """The policy contract's frame: a held-out evaluation beside the SFT policy's means."""
    return frame.assign(sft_response_tokens_mean=baseline["response_tokens"].mean(),
                        sft_perplexity_mean=baseline["perplexity"].mean())


@dataclass
class GuardState:
    """What a lifecycle checkpoint keeps of the guard's decisions."""

    passing_iteration: int = 0  # the current passing point: `passing/iter-<passing_iteration>`
    rollbacks: int = 0
    breaches: int = 0
    collapse: str = NO_COLLAPSE  # the last breach: "iteration 12: <rule>"
    events: list[dict] = field(default_factory=list)  # {"iteration", "action", "rule"}


class CollapseGuard:
    def __init__(self, cfg: PipelineConfig, baseline: pd.DataFrame, workdir: Path, dist, contract: ContractCheck):
        self.cfg, self.baseline, self.dist, self.contract = cfg, baseline, dist, contract
        self.directory = workdir / "passing"
        self.state, self.stopped = GuardState(), False
        self.pinned: list[int] = []  # the passing iterations the newest lifecycle checkpoints refer to

    # -- passing points ------------------------------------------------------------------------
    def start(self, trainer) -> None:
        """A fresh attempt (no lifecycle checkpoint to resume): a killed attempt's passing points
        are gone, and iteration 0, the SFT policy, is the first."""
        if self.dist.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.dist.barrier()
        self.state, self.stopped, self.pinned = GuardState(), False, []
        self._passed(trainer, policy_probe(self.baseline, self.baseline))

    def passing_folder(self) -> Path:
        """The trainer checkpoint of the current passing point."""
        return self.directory / f"iter-{self.state.passing_iteration:06d}"

    def _probe_file(self, iteration: int) -> Path:
        return self.directory / f"probe-{iteration:06d}.parquet"

    def _passed(self, trainer, probe: pd.DataFrame) -> None:
        trainer.save_checkpoint(self.directory, keep=None)
        self.state.passing_iteration = trainer.iteration
        if self.dist.is_main:
            probe.to_parquet(self._probe_file(trainer.iteration))
        self._prune()

    def _prune(self) -> None:
        """Delete the passing points that neither the current state nor a kept lifecycle checkpoint refers to."""
        if not self.dist.is_main or not self.directory.exists():
            return
        keep = {self.state.passing_iteration, *self.pinned}
        for path in self.directory.iterdir():
            number = path.name.removesuffix(".parquet").rpartition("-")[2]
            if not number.isdigit() or int(number) in keep:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    def passing_probe(self) -> pd.DataFrame:
        return pd.read_parquet(self._probe_file(self.state.passing_iteration))

    # -- in the lifecycle's checkpoints --------------------------------------------------------
    def state_dict(self, checkpoints_kept: int) -> dict:
        """The guard's part of a lifecycle checkpoint. Its passing point stays on disk while one of
        the newest `checkpoints_kept` lifecycle checkpoints may refer to it."""
        self.pinned = [*self.pinned, self.state.passing_iteration][-checkpoints_kept:]
        return {"state": asdict(self.state), "stopped": self.stopped, "pinned": list(self.pinned)}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a lifecycle checkpoint: its decisions, and no passing point that a killed
        attempt saved after it."""
        self.state, self.stopped, self.pinned = GuardState(**saved["state"]), saved["stopped"], list(saved["pinned"])
        self._prune()
        self.dist.barrier()

    # -- the check -----------------------------------------------------------------------------
    def breach(self, probe: pd.DataFrame) -> str | None:
        """The policy contract on one evaluation's probe: None if it passes, else the rules that broke."""
        report = self.contract("policy", probe, self.cfg)
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
                trainer.roll_back_to(self.passing_folder())
                trainer.set_actor_lr(trainer.ppo.actor_lr * ppo.rollback_lr_factor ** self.state.rollbacks)
            self.stopped = action == "stop"
            self.state.events.append({"iteration": it, "action": action, "rule": rule})
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
