"""NaN/Inf guard for the training loops: a step whose loss (or, in PPO, whose scores) holds a
non-finite value is skipped and counted; after `max_consecutive` skipped steps in a row the stage
stops with a NonFiniteError naming the step and the tensor. A finite loss whose gradient is not
finite is the engine's to skip (`stages.compute.training.PlainEngine.step`, DeepSpeed's optimisers), so no
weight moves on a non-finite gradient either way."""

from __future__ import annotations

import sys

import torch

from stages.leaves.dist import Dist


class NonFiniteError(RuntimeError):
    """Too many steps in a row had NaN/Inf; the message names the stage, the step and the tensor."""


class NonFiniteGuard:
    def __init__(self, stage: str, max_consecutive: int, dist: Dist):
        self.stage, self.max_consecutive, self.dist = stage, max_consecutive, dist
        self.skipped = 0  # steps skipped in all (kept in checkpoints)
        self.in_a_row = 0

    def state_dict(self) -> dict[str, int]:  # for checkpoints
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]

    def check(self, tensors: dict[str, torch.Tensor], step: str, *, last: bool = True) -> bool:
        """True when every tensor is finite on every rank; False: skip this step. Call it before
        backward. Ranks decide together (one all-reduce), else one rank would step and wait in a
        collective that the others never enter. last=False: a later check decides whether the
        step trains (PPO checks its scores, then each minibatch's losses), so passing this one
        does not end a run of skipped steps."""
        bad = [float(not torch.isfinite(t.detach()).all()) for t in tensors.values()]
        bad = self.dist.all_reduce_sum(bad) if self.dist.distributed else bad
        names = [name for name, flag in zip(tensors, bad) if flag]
        if not names:
            self.in_a_row = 0 if last else self.in_a_row
            return True
        self.skipped += 1
        self.in_a_row += 1
        what = f"{self.stage}: NaN/Inf in {', '.join(names)} at {step}"
        if self.in_a_row >= self.max_consecutive:
            raise NonFiniteError(f"{what}; {self.in_a_row} steps in a row skipped, stopping "
                                 f"(max_nonfinite_steps = {self.max_consecutive})")
        if self.dist.is_main:
            print(f"{what}: step skipped ({self.in_a_row} in a row, {self.skipped} in all)", file=sys.stderr)
        return False
