"""Run a training stage in-process, or as DeepSpeed ranks under torchrun (CPU or GPU).

`run_stage` is what the flow calls. With `launch.world_size > 1` or a DeepSpeed config it writes
a launch spec (config, inputs, MLflow run ids) into the stage's work folder, starts
`torchrun -m stages.orchestration.launch SPEC`, and reads back the outputs that rank 0 wrote. Rank 0 alone
talks to MLflow; every rank runs the same stage function with its own `Dist`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from stages.leaves import allocator
from stages.leaves.config import ConfigError, PipelineConfig
from stages.leaves.dist import Dist
from stages.leaves.interrupt import RanksRunning, StageInterrupted
from stages.orchestration import registry, run_writers, tracking, tracking_queue
from stages.orchestration.config_loading import DEEPSPEED_DIR, deepspeed_config_path

class StageLaunchError(RuntimeError):
    """The ranks of a stage failed; the message holds the tail of their output."""


def resolve_deepspeed_config(stage: str, launch) -> dict:
    """The stage's DeepSpeed config: the file `launch.deepspeed` names (default zero2), with the
    offload switches (`launch.offload_optimizer`, `launch.offload_params`) as its own keys. bf16
    follows model.precision (`stages.compute.training.make_engine` sets it); fp16 is not supported."""
    config = json.loads(deepspeed_config_path(launch.deepspeed or "zero2").read_text())
    zero = config.setdefault("zero_optimization", {})
    if launch.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if launch.offload_params:
        if zero.get("stage") != 3:
            raise ConfigError(f"{stage}.launch.offload_params offloads ZeRO-3's parameter partitions and "
                              f"{stage}.launch.deepspeed={launch.deepspeed} is ZeRO-{zero.get('stage', 0)}: "
                              f"set {stage}.launch.deepspeed=zero3 or {stage}.launch.offload_params=false")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hostfile_slots(name: str) -> tuple[Path, dict[str, int]]:
    """A DeepSpeed hostfile (a path, or a name in infra/deepspeed) and its `<host> slots=<n>`
    lines as {host: n}."""
    path = Path(name) if Path(name).exists() else DEEPSPEED_DIR / name
    if not path.exists():
        raise ConfigError(f"hostfile {name} does not exist (neither a path nor a file in {DEEPSPEED_DIR})")
    slots = {}
    for line in path.read_text().splitlines():
        host, _, count = line.split("#", 1)[0].strip().partition(" slots=")
        if host:
            slots[host] = int(count or 1)
    return path, slots


TORCHRUN_LOGS = "torchrun"


def rank_command(stage: str, launch, spec_path: Path) -> tuple[list[str], int]:
    """The command that starts the ranks of a stage, and how many of them run on this host."""
    if launch.hostfile is None:  # its log folder in the stage's (by default a temp folder it leaves behind)
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={launch.world_size}",
                f"--master_port={free_port()}", f"--log-dir={spec_path.parent / TORCHRUN_LOGS}", "-m", "stages.orchestration.launch",
                str(spec_path)], launch.world_size
    path, slots = hostfile_slots(launch.hostfile)
    if sum(slots.values()) != launch.world_size:
        raise ConfigError(f"{stage}.launch.world_size is {launch.world_size} but hostfile {path} has "
                          f"{sum(slots.values())} slots: set them equal")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={path}", f"--master_port={free_port()}"]
    if len(slots) == 1:  # one host launches locally: no ssh
        cmd += ["--no_ssh_check", "--master_addr=127.0.0.1"]
    return cmd + ["--no_local_rank", "--module", "stages.orchestration.launch", str(spec_path)], max(slots.values())


def execute(stage: str, cfg: PipelineConfig, pipeline_run_id: str, inputs: dict) -> dict:
    """Run one stage as a child MLflow run of the pipeline run; returns its outputs."""
    from stages.leaves import precision  # deferred: imports torch, which the flow needs not to launch ranks

    spec = registry.get(stage)
    missing = [name for name in spec.inputs if name not in inputs and name not in spec.optional_inputs]
    if missing:
        raise ValueError(f"stage '{stage}' needs {', '.join(missing)} from an earlier stage: run that stage too, "
                         f"or pass from_run=<pipeline run id> (or 'latest')")
    pipeline = run_writers.PipelineRun(tracking.client(), pipeline_run_id, cfg)
    tracker = pipeline.stage(stage, resumes=spec.resumes)
    try:
        device = stage_device(cfg, stage)
        tracker.log_attempt_params({"precision": precision.resolve(cfg.model.precision, device),
                                    "precision.hardware": precision.describe(device),
                                    "allocator": allocator.in_use()})
        outputs = run_stage(stage, cfg, tracker, inputs)
    except StageInterrupted:
        tracker.finish("KILLED")
        raise
    except BaseException as err:
        if not isinstance(err, tracking_queue.TrackingUnavailable):  # else there is nowhere to record it
            tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED", outputs)
    return outputs


def in_process(cfg: PipelineConfig, stage: str) -> bool:
    launch = getattr(getattr(cfg, stage, None), "launch", None)
    return launch is None or (launch.world_size == 1 and launch.deepspeed is None and launch.hostfile is None)


def stage_device(cfg: PipelineConfig, stage: str) -> str:
    """Where a stage computes: its ranks use the GPU when there is one (`_rank_main`); in-process, the CPU."""
    import torch  # deferred: as precision in execute

    return "cuda" if not in_process(cfg, stage) and torch.cuda.is_available() else "cpu"


def run_stage(stage: str, cfg: PipelineConfig, tracker, inputs: dict) -> dict:
    """Run one stage in-process, or as ranks when its launch config asks; returns its outputs."""
    # What `prepare` copies from a tracking server or a bucket (the stage's models, its splits) is
    # the stage's while it runs, in its folder; gone after, however it ends (a killed attempt's
    # copies: when the resumed one starts).
    downloads = tracker.workdir / "downloads"
    shutil.rmtree(downloads, ignore_errors=True)
    try:
        return _run_stage(stage, cfg, tracker, inputs, downloads)
    finally:
        shutil.rmtree(downloads, ignore_errors=True)


def _run_stage(stage: str, cfg: PipelineConfig, tracker, inputs: dict, downloads: Path) -> dict:
    module = registry.get(stage).load()
    if hasattr(module, "prepare"):
        inputs = {**inputs, **module.prepare(cfg, inputs, downloads)}
    if in_process(cfg, stage):
        return module.run(cfg, tracker, inputs, Dist(workdir=tracker.workdir))
    launch = getattr(cfg, stage).launch
    resolve_deepspeed_config(stage, launch)  # a config error before any rank starts
    spec_path = tracker.workdir / "launch.json"
    out_path = tracker.workdir / "outputs.json"
    out_path.unlink(missing_ok=True)
    for stale in tracker.workdir.glob("error-rank*.txt"):
        stale.unlink()
    spec = {
        "stage": stage,
        "config": cfg.model_dump(mode="json"),
        "inputs": inputs,
        "run_id": tracker.run_id,
        "pipeline_run_id": tracker.pipeline_run_id,
        "workdir": str(tracker.workdir),
        "outputs": str(out_path),
    }
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd, local_ranks = rank_command(stage, launch, spec_path)
    threads = launch.threads_per_rank or max(1, (os.cpu_count() or 1) // local_ranks)
    env = allocator.environment({**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    log_path = tracker.workdir / "ranks.log"
    with open(log_path, "w") as log, RanksRunning(tracker.workdir) as ranks:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    # Its folders hold nothing ours: the ranks write to ranks.log, their errors to error-rank*.txt.
    shutil.rmtree(tracker.workdir / TORCHRUN_LOGS, ignore_errors=True)
    if proc.returncode != 0 or not out_path.exists():
        errors = [f"rank {p.stem.removeprefix('error-rank')}: {p.read_text()}"
                  for p in sorted(tracker.workdir.glob("error-rank*.txt"))]
        stopped = [p.read_text().split("\n", 1)[1] for p in sorted(tracker.workdir.glob("error-rank*.txt"))
                   if p.read_text().startswith(f"{StageInterrupted.__name__}\n")]
        if ranks.stopped() and stopped:
            raise StageInterrupted(stage, stopped[0].removeprefix(f"stage {stage} stopped on request "))
        detail = "\n".join(errors) or "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise StageLaunchError(f"stage '{stage}' failed on {launch.world_size} ranks (exit {proc.returncode}); "
                               f"log: {log_path}\n{detail}")
    return json.loads(out_path.read_text())


def _rank_main(spec_path: str) -> None:
    """Entry point of one rank (`python -m stages.orchestration.launch SPEC` under torchrun or the deepspeed launcher)."""
    import torch  # deferred: only a rank's process needs it

    spec = json.loads(Path(spec_path).read_text())
    cfg = PipelineConfig.model_validate(spec["config"])
    launch = getattr(cfg, spec["stage"]).launch
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    on_gpu = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # torch 2.13 deprecates a collective DeepSpeed's ZeRO calls every step.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    import deepspeed  # deferred: DS_ACCELERATOR above must be set before it loads

    if not on_gpu:
        # DeepSpeed's CPU backend JIT-compiles (g++, on a fresh machine) a shared-memory all-reduce
        # that only inference all-reduce uses; training collectives go via gloo.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    ds_config = resolve_deepspeed_config(spec["stage"], launch)
    dist = Dist(rank=rank, world_size=world_size, deepspeed_config=ds_config, device=device,
                workdir=Path(spec["workdir"]))
    tracker = None
    if dist.is_main:
        tracker = run_writers.StageRun(tracking.client(), spec["run_id"], spec["stage"], Path(spec["workdir"]),
                                    spec["pipeline_run_id"], cfg.orchestration.tracking_patience_s)
    started = time.perf_counter()
    try:
        outputs = registry.get(spec["stage"]).load().run(cfg, tracker, spec["inputs"], dist)
    except StageInterrupted as err:
        Path(spec["workdir"], f"error-rank{rank}.txt").write_text(f"{type(err).__name__}\n{err}")
        raise
    except Exception as err:
        # The first line of the stage's error, per rank, for the launcher's message.
        Path(spec["workdir"], f"error-rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        raise
    if dist.is_main:
        # The stage's wall time on its ranks and, on a GPU, rank 0's peak allocated memory: what
        # `rlhf plan` predicts per device.
        usage = {"stage/seconds": time.perf_counter() - started}
        if on_gpu:
            usage["stage/peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        tracker.log_metrics(usage, step=0)
        tracker.flush()  # metrics still buffered after an outage of the tracking server
        tmp = Path(spec["outputs"] + ".tmp")
        tmp.write_text(json.dumps(outputs))
        os.replace(tmp, spec["outputs"])
    dist.barrier()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
