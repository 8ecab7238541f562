"""Per-rank peak host memory of one PPO iteration on 2 CPU DeepSpeed ranks (gloo), per memory mode,
against `rlhf plan`'s prediction for the same configuration.

A mode is a list of config overrides (`MODES`); every mode runs the same PPO stage setup on the
same random Llama (the tiny preset's `random:llama` at the shape of `SHAPE`, ~140M parameters,
bf16 unless `--set model.precision=...`): the stage's own loader (`stages.compute.model_loading.load_models`:
actor, reference, reward model, critic), `PPOTrainer` (its DeepSpeed engines), then one
`PPOTrainer.step` (rollout, experience, PPO epochs) on random prompt ids at the planned lengths.

Each rank measures its own host memory from /proc/self/status: VmHWM (the resident high-water
mark), which writing 5 to /proc/self/clear_refs resets to the current RSS. Per rank:
- baseline: RSS after the imports, before any model loads (what the plan does not count);
- load: VmHWM − baseline while the models load and the engines are built (ZeRO-3 without
  partitioned loading holds every whole fp32 model before DeepSpeed partitions it);
- iteration: VmHWM − baseline during one PPO iteration (the high-water mark reset after setup);
- peak: the larger of the two.
The plan's per-rank number on a CPU is `StagePlan.host_peak / ranks per host` (its peak per device
plus what it offloads to the host, which on a CPU is the same memory).

    python bench/ppo_memory.py                          # every mode, ~10-20 min on 2 loaded cores
    python bench/ppo_memory.py --modes plain,lora --set ppo.generation.max_new_tokens=64
    python bench/ppo_memory.py --small                  # a 2-layer model: a quick check of the bench itself

Printed: each rank's JSON line, then one row per mode: the plan's sharding, predicted GiB per
rank, measured load / iteration / peak GiB per rank (the larger of the two ranks), peak /
predicted, and FLAG where that ratio is outside ±25 %.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1024**3
TOLERANCE = 0.25

# Each mode: the config overrides it adds to the common ones. ZeRO-2 is what a 2-rank stage runs
# on when ppo.launch.deepspeed is unset (stages.orchestration.launch.resolve_deepspeed_config).
ZERO3 = ["ppo.launch.deepspeed=zero3"]
MODES = {
    "plain": [],
    "zero3": ZERO3,
    "zero3-offload": [*ZERO3, "ppo.launch.offload_optimizer=true", "ppo.launch.offload_params=true"],
    "lora": ["model.lora.rank=16"],
    # ZeRO-3 with DeepSpeed's buffers sized for this model (`SMALL_BUCKETS`): its defaults keep every
    # trained weight of a model this small gathered through the step and bucket every gradient, which
    # the partitions' savings do not cover (plan.deepspeed_buffers). {small_buckets}: the config
    # `small_buckets_config` writes.
    "zero3-small-buckets": ["ppo.launch.deepspeed={small_buckets}"],
}
# infra/deepspeed/zero3.json with these zero_optimization keys (elements) instead of DeepSpeed's
# defaults (5e8, 5e7, 1e9, 1e9), so the mode differs from `zero3` in its buffers only.
SMALL_BUCKETS = {"reduce_bucket_size": 5_000_000, "stage3_prefetch_bucket_size": 5_000_000,
                 "stage3_max_live_parameters": 20_000_000, "stage3_max_reuse_distance": 0}

# ~140M parameters (12 layers × 11.3M + a 4k-token embedding): big enough that the model states
# dominate the allocator's and the libraries' own memory, small enough for one iteration on 2 cores.
SHAPE = ["model.random_init.hidden_size=1024", "model.random_init.num_hidden_layers=12",
         "model.random_init.num_attention_heads=16", "model.random_init.num_key_value_heads=4",
         "model.random_init.intermediate_size=2816", "model.bpe_vocab_size=4096"]
SMALL_SHAPE = ["model.random_init.num_hidden_layers=2"]
# One iteration: 8 rollout rows per rank of 32 + 32 tokens, one minibatch, one PPO epoch; PPO-ptx on.
COMMON = ["model.precision=bf16", "ppo.launch.world_size=2", "ppo.rollout_batch_size=8", "ppo.minibatch_size=8",
          "ppo.ppo_epochs=1", "ppo.max_prompt_len=32", "ppo.generation.max_new_tokens=32", "ppo.ptx_batch_size=2",
          "sft.max_seq_len=64", "sft.max_response_len=32", "ppo.iterations=1", "ppo.eos_penalty=false"]


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_high_water_mark() -> None:
    """VmHWM back to the current RSS (Linux ≥ 4.0: proc(5), /proc/pid/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def config(overrides: list[str]):
    from stages.orchestration.config_loading import load_config

    return load_config("tiny", overrides)


def prepare_inputs(cfg, folder: Path) -> dict:
    """The random Llama (cached under $RLHF_HOME/cache) as the SFT policy, and a reward model on it
    with a seeded random head: what the PPO stage's loader reads."""
    import torch

    from stages.compute import loading
    from stages.compute.reward.model import reward_model_from_lm, save_reward_model

    sys.path.insert(0, str(REPO / "bench"))
    from plan_vs_measured import _model_folder  # the bench beside this one: the same model folder

    model_dir = _model_folder(cfg)
    rm_dir = folder / "reward-model"
    if not (rm_dir / "reward_config.json").exists():
        torch.manual_seed(0)
        save_reward_model(reward_model_from_lm(model_dir, cfg.model), loading.load_tokenizer(model_dir, cfg.model),
                          rm_dir, {})
    return {"sft_model_dir": model_dir, "reward_model_dir": str(rm_dir)}


def small_buckets_config(folder: Path) -> Path:
    """The shipped ZeRO-3 config with `SMALL_BUCKETS`, written into `folder`."""
    from stages.orchestration.config_loading import deepspeed_config_path

    ds = json.loads(deepspeed_config_path("zero3").read_text())
    ds["zero_optimization"] = {**ds["zero_optimization"], **SMALL_BUCKETS}
    path = folder / "zero3_small_buckets.json"
    path.write_text(json.dumps(ds, indent=1))
    return path


def start_rank():
    """This process as a DeepSpeed CPU rank over gloo, as `stages.orchestration.launch._rank_main` starts one."""
    import importlib

    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_child(mode: str, overrides: list[str], inputs: dict) -> dict:
    import torch

    from stages.leaves import allocator, precision
    from stages.orchestration import plan
    from stages.leaves.dist import Dist
    from stages.orchestration.launch import resolve_deepspeed_config

    rank, world_size = start_rank()
    cfg = config(overrides)
    dist = Dist(rank=rank, world_size=world_size, deepspeed_config=resolve_deepspeed_config("ppo", cfg.ppo.launch),
                device="cpu", workdir=Path(tempfile.mkdtemp()))
    predicted = plan.plan(cfg, stages=["ppo"], device="cpu").stages[0]
    # What every rank imports before the models load is not what the plan predicts.
    import stages.compute.model_loading
    import stages.compute.ppo.trainer
    if cfg.model.lora.rank:
        import peft  # noqa: F401

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    gc.collect()
    baseline = status_bytes("VmRSS")
    reset_high_water_mark()
    started = time.perf_counter()
    tokenizer, actor, reference, reward_model, critic, score_fn = stages.compute.model_loading.load_models(cfg, inputs, dist)
    vocab, special = len(tokenizer), {tokenizer.eos_token_id, tokenizer.pad_token_id}
    p = cfg.ppo

    def ids(length: int) -> list[int]:
        return [t if t not in special else (t + 1) % vocab for t in torch.randint(0, vocab, (length,), generator=gen).tolist()]

    prompts = [ids(p.max_prompt_len) for _ in range(4 * p.rollout_batch_size)]
    ptx = [(row, list(row)) for row in (ids(cfg.sft.max_seq_len) for _ in range(16))]
    trainer = stages.compute.ppo.trainer.PPOTrainer(
        p, actor=actor, critic=critic, reference=reference, score_fn=score_fn, prompts=prompts, ptx_examples=ptx,
        tokenizer=tokenizer, dist=dist, precision=precision.resolve(cfg.model.precision, "cpu"))
    dist.barrier()
    load = status_bytes("VmHWM") - baseline
    settled = status_bytes("VmRSS") - baseline
    loaded_at = time.perf_counter()
    reset_high_water_mark()
    trainer.step()
    dist.barrier()
    iteration = status_bytes("VmHWM") - baseline
    per_rank = predicted.host_peak // predicted.ranks_per_host
    return {"mode": mode, "rank": rank, "allocator": allocator.in_use(), "sharding": predicted.sharding.describe(),
            "batch": predicted.batch, "params": plan.read_architecture(cfg.model).params(), "baseline": baseline,
            "load": load,
            "after_setup": settled, "iteration": iteration, "peak": max(load, iteration), "predicted": per_rank,
            "predicted_device": predicted.peak, "predicted_phases": predicted.phases,
            "ratio": max(load, iteration) / per_rank, "iteration_ratio": iteration / per_rank,
            "load_seconds": loaded_at - started, "iteration_seconds": time.perf_counter() - loaded_at}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode: str, overrides: list[str], inputs: dict, timeout: int, fixed_mmap_threshold: bool) -> list[dict]:
    """Both ranks of one mode under torchrun; each rank's result."""
    spec = Path(tempfile.mkdtemp()) / "inputs.json"
    spec.write_text(json.dumps(inputs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           __file__, "--rank-child", mode, "--inputs", str(spec), *[a for o in overrides for a in ("--set", o)]]
    from stages.leaves import allocator

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # The ranks run on the allocator a stage's ranks run on (TCMalloc where the machine has it,
    # RLHF_ALLOCATOR to choose), or on glibc's malloc with its mmap threshold fixed.
    if fixed_mmap_threshold:
        env = {**env, allocator.VARIABLE: "system", "MALLOC_MMAP_THRESHOLD_": "131072"}
    else:
        env = allocator.environment(env)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    # Each rank writes its own file: two ranks' lines on one stdout pipe can interleave.
    rows = [json.loads(path.read_text()) for path in spec.parent.glob("rank*.json")]
    if out.returncode or len(rows) != 2:
        log = spec.with_name("ranks.log")
        log.write_text(out.stdout + out.stderr)
        errors = "\n".join(line for line in out.stderr.splitlines() if "Error" in line)
        raise SystemExit(f"{mode}: the ranks failed (exit {out.returncode}; their output: {log})\n{errors}")
    return sorted(rows, key=lambda row: row["rank"])


def table(results: dict[str, list[dict]]) -> str:
    lines = [f"{'mode':<21}{'plan: sharding':<34}{'predicted':>10}{'load':>8}{'iteration':>10}{'peak':>8}"
             f"{'peak/pred':>10}  (GiB per rank, the larger rank)"]
    for mode, rows in results.items():
        worst = max(rows, key=lambda row: row["peak"])
        flag = "" if abs(worst["ratio"] - 1) <= TOLERANCE else "  FLAG: outside ±25 %"
        lines.append(f"{mode:<21}{worst['sharding']:<34}{worst['predicted'] / GiB:>10.2f}"
                     f"{max(r['load'] for r in rows) / GiB:>8.2f}{max(r['iteration'] for r in rows) / GiB:>10.2f}"
                     f"{worst['peak'] / GiB:>8.2f}{worst['ratio']:>10.2f}{flag}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--small", action="store_true", help="a 2-layer model: checks the bench, not the plan")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    parser.add_argument("--fixed-mmap-threshold", action="store_true",
                        help="the ranks on glibc's malloc with its mmap threshold fixed at 128 KiB: freed blocks go "
                             "back to the system, so the peak is the live memory's (bench/plan_vs_measured.py); "
                             "without it they run on the allocator a stage's ranks run on")
    parser.add_argument("--json", default=None, help="also write every rank's result to this file")
    parser.add_argument("--rank-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        row = rank_child(args.rank_child, args.overrides, json.loads(Path(args.inputs).read_text()))
        Path(args.inputs).with_name(f"rank{row['rank']}.json").write_text(json.dumps(row))
        return
    shape = SHAPE + (SMALL_SHAPE if args.small else [])
    base = [*COMMON, *shape]
    folder = Path(tempfile.mkdtemp())
    inputs = prepare_inputs(config([*base, *args.overrides]), folder)
    small_buckets = small_buckets_config(folder)
    results = {}
    for mode in args.modes.split(","):
        overrides = [o.format(small_buckets=small_buckets) for o in MODES[mode]]
        rows = run_mode(mode, [*base, *overrides, *args.overrides], inputs, args.timeout, args.fixed_mmap_threshold)
        for row in rows:
            print(json.dumps(row), flush=True)
        results[mode] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
