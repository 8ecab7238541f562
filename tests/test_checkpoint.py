"""Training checkpoints (stages/compute/checkpoint.py): a checkpoint number saved again, as the lifecycle
does when a stop comes right after a periodic checkpoint, keeps a copy that verifies at every
moment of the save: a process killed at any of its renames resumes from that number."""

from __future__ import annotations

import os

import pytest
import torch

from stages.compute import checkpoint
from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.training import adamw, cosine_with_warmup, make_engine
from stages.leaves.dist import Dist


class Killed(BaseException):
    """The process dies here (SIGKILL, a second Ctrl-C): nothing after it runs."""


def engine():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = adamw(model, lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    return make_engine(model, optimizer, cosine_with_warmup(optimizer, 0, 10), micro_batch_size=1,
                       grad_accum_steps=1, max_grad_norm=1.0, precision="fp32", dist=Dist())


@pytest.mark.parametrize("killed_at_rename", [1, 2])
def test_a_kill_while_a_checkpoint_number_is_saved_again_keeps_one_that_verifies(tmp_path, monkeypatch,
                                                                                  killed_at_rename):
    directory, dist, guard, trained = tmp_path / "checkpoints", Dist(), NonFiniteGuard("sft", 3, Dist()), engine()
    for step in (2, 4):  # periodic checkpoints, one kept (SFT, reward, critic)
        checkpoint.save(directory, step, {"model": trained}, checkpoint.stage_state(step, guard, {}), dist, keep=1)
    renames, rename = [], os.rename

    def killed_at_a_rename(src, dst):
        renames.append((src, dst))
        if len(renames) == killed_at_rename:
            raise Killed
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_at_a_rename)
    with pytest.raises(Killed):
        checkpoint.save(directory, 4, {"model": trained}, checkpoint.stage_state(4, guard, {}), dist, keep=1)
    monkeypatch.setattr(os, "rename", rename)

    found = checkpoint.latest(directory)  # what a resumed attempt starts from
    assert found is not None and found.name == "step-000004", sorted(p.name for p in directory.iterdir())
    resumed = engine()
    assert checkpoint.load(found, {"model": resumed}, dist)["step"] == 4
    assert all(torch.equal(resumed.weights()[k], v) for k, v in trained.weights().items())
