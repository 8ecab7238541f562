"""PPO checkpoints, through the shared `stages.checkpoint`: actor, critic (none with
a critic-free advantage estimator), their optimisers and schedulers, running moments, RNG states,
data cursor and iteration, in `<dir>/iter-000010/`."""

from __future__ import annotations

from pathlib import Path

import torch

from stages import checkpoint as shared
from stages.checkpoint import MANIFEST, DiskFullError, discard, latest, load_rng_state, rng_state  # noqa: F401 (PPO's API)

TRAINER_STATE = "trainer.pt"


def _engine_states(trainer) -> dict[str, object]:
    """The engines a checkpoint holds: the critic, if the advantage estimator has one, and the actor
    unless frozen."""
    engines = {"critic": trainer.critic} if trainer.critic is not None else {}
    if trainer.train_actor:
        engines["actor"] = trainer.actor
    return engines


def save(trainer, directory: Path, keep: int = 2) -> Path:
    """Write a checkpoint of `trainer` at its current iteration; keep the newest `keep`."""
    return shared.save(directory, trainer.iteration, _engine_states(trainer), trainer.state(), trainer.dist,
                       keep=keep, unit="iter", state_file=TRAINER_STATE)


def load(trainer, folder: Path) -> None:
    """Restore `trainer` from a checkpoint folder written by `save`."""
    trainer.load_state(shared.load(folder, _engine_states(trainer), trainer.dist, state_file=TRAINER_STATE))


def roll_back(trainer, folder: Path) -> None:
    """Restore the models, optimisers, schedulers and running score statistics of a checkpoint, but
    not its progress: iteration, episode, prompt cursor and RNG go on where they are (the collapse
    guard's rollback trains on fresh prompts, and the curves keep one step per iteration run)."""
    shared.load_engines(folder, _engine_states(trainer), trainer.dist)
    trainer.moments.load_state_dict(torch.load(folder / TRAINER_STATE, weights_only=True)["moments"])
