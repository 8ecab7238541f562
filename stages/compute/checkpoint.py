"""Training checkpoints, the one format of every stage that trains (SFT, reward, critic, PPO and
the PPO collapse guard's passing points): engines (weights, optimisers, schedulers), the stage's own
state (step, non-finite guard counts, data position, counters), and each rank's RNG states (torch
CPU and CUDA generators) — written atomically, verified before loading.

Layout: `<dir>/<unit>-000010/` (`iter-` for PPO and the critic, `step-` for SFT and reward)
holding `manifest.json` (sha256 of every file) and the files; a checkpoint is written into a
temporary folder and renamed into place, so a crash mid-write leaves no folder that looks complete.
Loading takes the newest folder whose manifest verifies.

Our own code rather than `accelerate`'s `save_state` or DeepSpeed's alone: one format for plain and
DeepSpeed engines, with the manifest check and the full-disk error that a resumed stage relies on.
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

from stages.compute.loading import file_sha256


MANIFEST = "manifest.json"
STATE = "state.pt"  # the stage's own state


class DiskFullError(RuntimeError):
    """A checkpoint could not be written because the disk or the quota is full."""


# Out of space, over the file size limit, over the quota.
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# A write that failed with less than this free on its filesystem failed for want of space.
FULL_BELOW_BYTES = 64 * 2**20


def _save_file(path: Path, write) -> None:
    # Through a Python file object: a failed write raises OSError with its errno (torch.save and
    # safetensors.save_file given a path raise errors without one).
    with open(path, "wb") as out:
        write(out)


def save(directory: Path, number: int, engines: dict, state: dict, dist, keep: int | None = 2,
         unit: str = "step") -> Path:
    """Write checkpoint `<unit>-<number>` of `engines` (name → engine) and `state` (collective under
    DeepSpeed); keep the newest `keep` checkpoints (None: every one, the caller prunes). A full
    disk raises DiskFullError, the checkpoints before this one intact."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{unit}-{number:06d}"
    tmp = directory / f".tmp-{unit}-{number:06d}"

    def full(why: str) -> DiskFullError:
        return DiskFullError(f"cannot write checkpoint {final}: the disk or the quota is full ({why}); the "
                             f"checkpoints before it are kept")

    if dist.deepspeed_config is None and dist.is_main:  # DeepSpeed's ranks write their own shards
        needed, free = checkpoint_bytes(engines, state), shutil.disk_usage(directory).free
        if needed > free:
            raise full(f"it needs about {needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free in {directory}")
    try:
        _write(tmp, number, engines, state, dist)
    except (OSError, RuntimeError) as err:
        free_at_failure = shutil.disk_usage(directory).free
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # half written: it only takes space
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            raise full(f"{err.strerror}: {err.filename or tmp}") from err
        # torch.save reports a failed write as RuntimeError ("unexpected pos"), without the errno
        # (the disk may also have filled after the check above: another process writing).
        if isinstance(err, RuntimeError) and free_at_failure < FULL_BELOW_BYTES:
            raise full(f"{err}; {free_at_failure / 2**20:.1f} MiB were free when the write failed") from err
        raise
    if dist.is_main:
        _replace(tmp, final)
        for old in sorted(directory.glob(f"{unit}-*"))[:-keep] if keep is not None else ():
            shutil.rmtree(old)
    dist.barrier()
    return final


def _replace(tmp: Path, final: Path) -> None:
    """Put the written folder `tmp` in place of `final`. A checkpoint number saved again (a stop
    right after a periodic checkpoint) keeps a copy that verifies at every moment: the old folder is
    renamed aside, the new one renamed into place, and only then the old one deleted; a kill in
    between leaves `final` or the `.old-` folder, which `repair` puts back."""
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def repair(directory: Path) -> None:
    """Put back a checkpoint that a kill left renamed aside (`.old-<name>`) with nothing in its place."""
    for aside in directory.glob(".old-*"):
        final = aside.with_name(aside.name.removeprefix(".old-"))
        if verified(final):
            shutil.rmtree(aside, ignore_errors=True)
        elif verified(aside):
            shutil.rmtree(final, ignore_errors=True)
            os.rename(aside, final)


def checkpoint_bytes(engines: dict, state: dict) -> int:
    """About what a checkpoint of plain (non-DeepSpeed) engines takes on disk: every tensor of their
    weights, optimiser states and of `state`."""
    def tensor_bytes(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(tensor_bytes(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    return tensor_bytes(state) + sum(tensor_bytes(engine.weights()) + tensor_bytes(engine.optimizer.state_dict())
                                     for engine in engines.values())


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


def _write(tmp: Path, number: int, engines: dict, state: dict, dist) -> None:
    """The files of a checkpoint, and last its manifest, into folder `tmp`."""
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _rng_file(tmp, dist.rank).parent.mkdir(exist_ok=True)
    _save_file(_rng_file(tmp, dist.rank), lambda out: torch.save(rng_state(), out))
    for name, engine in engines.items():
        if dist.deepspeed_config is not None:
            engine.save_checkpoint(str(tmp / name), tag="state")  # every rank writes its shards
        elif dist.is_main:
            weights = {k: v.detach().contiguous().clone() for k, v in engine.weights().items()}  # fp32 masters
            _save_file(tmp / f"{name}.safetensors", lambda out: out.write(safetensors.torch.save(weights)))
            optim = {"optimizer": engine.optimizer.state_dict(), "scheduler": engine.lr_scheduler.state_dict()}
            _save_file(tmp / f"{name}.optim.pt", lambda out: torch.save(optim, out))
    dist.barrier()
    if dist.is_main:
        _save_file(tmp / STATE, lambda out: torch.save(state, out))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"number": number, "files": {str(p.relative_to(tmp)): file_sha256(p) for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def verified(folder: Path) -> bool:
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        return all((folder / name).exists() and file_sha256(folder / name) == digest
                   for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest(directory: Path) -> Path | None:
    """The newest checkpoint that verifies (half-written or corrupted ones are skipped)."""
    if not directory.exists():
        return None
    repair(directory)
    for folder in sorted((p for p in directory.iterdir() if not p.name.startswith(".")), reverse=True):
        if verified(folder):
            return folder
    return None


def load(folder: Path, engines: dict, dist) -> dict:
    """Restore `engines` and this rank's RNG from a checkpoint folder written by `save`; the
    stage's own state."""
    load_engines(folder, engines, dist)
    state = read_state(folder)
    if _rng_file(folder, dist.rank).exists():
        load_rng_state(torch.load(_rng_file(folder, dist.rank), weights_only=True))
    return state


def read_state(folder: Path) -> dict:
    """The state file of a checkpoint folder: the stage's own state (see `stage_state`)."""
    return torch.load(folder / STATE, weights_only=True)


def load_engines(folder: Path, engines: dict, dist) -> None:
    for name, engine in engines.items():
        if dist.deepspeed_config is not None:
            engine.load_checkpoint(str(folder / name), tag="state")
        else:
            engine.load_weights(load_file(str(folder / f"{name}.safetensors")))
            states = torch.load(folder / f"{name}.optim.pt", weights_only=True)
            engine.optimizer.load_state_dict(states["optimizer"])
            engine.lr_scheduler.load_state_dict(states["scheduler"])


def discard(dist, *folders: Path) -> None:
    """A stage's checkpoint folders, deleted by the main rank once its model is published: they
    served resuming (and PPO's guard rolling back) only."""
    if dist.is_main:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def stage_state(step: int, guard, state: dict) -> dict:
    """What a checkpoint's state file holds: the steps (or iterations) done, the non-finite guard's
    counts, and the stage's own state."""
    return {"step": step, "guard": guard.state_dict(), **state}

