"""PPO checkpoints (design §4.7): actor, critic (none with a critic-free advantage estimator), their
optimisers and schedulers, running moments, RNG states (each rank's torch CPU and CUDA
generators), data cursor and iteration — written atomically, verified before loading.

Layout: `<dir>/iter-000010/` holding `manifest.json` (sha256 of every file) and the files; a
checkpoint is written into a temporary folder and renamed into place, so a crash mid-write leaves
no folder that looks complete. Loading takes the newest folder whose manifest verifies.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import safetensors.torch
import torch
from safetensors.torch import load_file

from stages.sources import file_digest

MANIFEST = "manifest.json"


def _engine_states(trainer) -> dict[str, object]:
    """The engines a checkpoint holds: the critic, if the advantage estimator has one, and the actor
    unless frozen."""
    engines = {"critic": trainer.critic} if trainer.critic is not None else {}
    if trainer.train_actor:
        engines["actor"] = trainer.actor
    return engines


class DiskFullError(RuntimeError):
    """A checkpoint could not be written because the disk or the quota is full."""


# Out of space, over the file size limit, over the quota.
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _save_file(path: Path, write) -> None:
    # Through a Python file object: a failed write raises OSError with its errno (torch.save and
    # safetensors.save_file given a path raise errors without one).
    with open(path, "wb") as out:
        write(out)


def save(trainer, directory: Path, keep: int = 2) -> Path:
    """Write a checkpoint of `trainer` at its current iteration (collective under DeepSpeed);
    keep the newest `keep` checkpoints. A full disk raises DiskFullError, the checkpoints before
    this one intact."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"iter-{trainer.iteration:06d}"
    tmp = directory / f".tmp-iter-{trainer.iteration:06d}"
    try:
        _write(trainer, tmp)
    except OSError as err:
        if trainer.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # half written: it only takes space
        if err.errno in DISK_FULL:
            raise DiskFullError(f"cannot write checkpoint {final}: the disk or the quota is full ({err.strerror}: "
                                f"{err.filename or tmp}); the checkpoints before it are kept") from err
        raise
    if trainer.dist.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in sorted(directory.glob("iter-*"))[:-keep]:
            shutil.rmtree(old)
    trainer.dist.barrier()
    return final


def rng_state() -> dict:
    """This process's torch generators: the CPU one, and on a GPU machine every CUDA device's
    (sampling runs on the GPU there: a resumed run without them would draw other tokens)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def load_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    saved = state.get("cuda") or []
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved) != here and saved:
        warnings.warn(f"the checkpoint holds the RNG states of {len(saved)} CUDA devices, this machine has {here}: "
                      f"the resumed run samples other tokens than an uninterrupted one would", stacklevel=2)
    for device, generator in enumerate(saved[:here]):
        torch.cuda.set_rng_state(generator, device)


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank-{rank:05d}.pt"


def _write(trainer, tmp: Path) -> None:
    """The files of a checkpoint, and last its manifest, into folder `tmp`."""
    if trainer.dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    trainer.dist.barrier()
    _rng_file(tmp, trainer.dist.rank).parent.mkdir(exist_ok=True)
    _save_file(_rng_file(tmp, trainer.dist.rank), lambda out: torch.save(rng_state(), out))
    for name, engine in _engine_states(trainer).items():
        if trainer.dist.deepspeed_config is not None:
            engine.save_checkpoint(str(tmp / name), tag="state")  # every rank writes its shards
        elif trainer.dist.is_main:
            weights = {k: v.detach().contiguous().clone() for k, v in engine.weights().items()}  # fp32 masters
            _save_file(tmp / f"{name}.safetensors", lambda out: out.write(safetensors.torch.save(weights)))
            optim = {"optimizer": engine.optimizer.state_dict(), "scheduler": engine.lr_scheduler.state_dict()}
            _save_file(tmp / f"{name}.optim.pt", lambda out: torch.save(optim, out))
    trainer.dist.barrier()
    if trainer.dist.is_main:
        _save_file(tmp / "trainer.pt", lambda out: torch.save(trainer.state(), out))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"iteration": trainer.iteration, "files": {str(p.relative_to(tmp)): file_digest(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def verified(folder: Path) -> bool:
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        return all((folder / name).exists() and file_digest(folder / name) == digest
                   for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest(directory: Path) -> Path | None:
    """The newest checkpoint that verifies (half-written or corrupted ones are skipped)."""
    if not directory.exists():
        return None
    for folder in sorted(directory.glob("iter-*"), reverse=True):
        if verified(folder):
            return folder
    return None


def load(trainer, folder: Path) -> None:
    """Restore `trainer` from a checkpoint folder written by `save`."""
    _load_engines(trainer, folder)
    trainer.load_state(torch.load(folder / "trainer.pt", weights_only=True))
    if _rng_file(folder, trainer.dist.rank).exists():
        load_rng_state(torch.load(_rng_file(folder, trainer.dist.rank), weights_only=True))


def roll_back(trainer, folder: Path) -> None:
    """Restore the models, optimisers, schedulers and running score statistics of a checkpoint, but
    not its progress: iteration, episode, prompt cursor and RNG go on where they are (the collapse
    guard's rollback trains on fresh prompts, and the curves keep one step per iteration run)."""
    _load_engines(trainer, folder)
    trainer.moments.load_state_dict(torch.load(folder / "trainer.pt", weights_only=True)["moments"])


def _load_engines(trainer, folder: Path) -> None:
    for name, engine in _engine_states(trainer).items():
        if trainer.dist.deepspeed_config is not None:
            engine.load_checkpoint(str(folder / name), tag="state")
        else:
            engine.load_weights(load_file(str(folder / f"{name}.safetensors")))
            states = torch.load(folder / f"{name}.optim.pt", weights_only=True)
            engine.optimizer.load_state_dict(states["optimizer"])
            engine.lr_scheduler.load_state_dict(states["scheduler"])
