"""One PPO iteration of a large random Llama on one device, its peak memory against `rlhf plan`.

Cases (each a list of config overrides on the `gpu` preset, one PPO-max iteration: 16 prompts of
128 tokens, 64 new tokens, minibatch 8):
- `8b-lora`: Llama-3-8B's shape (infra/architectures/llama-3-8b.json), a LoRA actor (rank 16) and
  critic, checkpointing; the reference is the actor with its adapters off, the reward model frozen
  in bf16; DeepSpeed ZeRO-2 on one rank, as the preset runs PPO.
- `full-fit`: the largest Llama whose full fine-tune (every weight trained) fits one device per
  the plan with checkpointing, ZeRO-3 and the optimizer and parameters offloaded to the host
  (`largest_full_finetune`: the shipped architectures and Llama-3-8B's width at fewer layers, the
  offloaded states within --host-memory).

The models are the stage's own (`stages.compute.model_loading.load_models`: the trained ones in fp32, which
DeepSpeed's bf16 mode casts, the frozen ones in bf16), with random weights made on the device in
place of a folder's (`loading.load_model` and `load_reward_model` replaced in this process: no
16 GB files to write and read). Measured on a GPU: torch.cuda.max_memory_allocated, reset after
the baseline, for the loading and the engines ("load") and again for the iteration; on a CPU
(`--tiny`): the host's VmHWM as bench/ppo_memory.py reads it. The plan's number: the stage's peak
per device (per rank on a CPU: plus what it offloads to the same host).

    python3 bench/gpu_ppo_fit.py --case 8b-lora                 # on one 80 GB GPU
    python3 bench/gpu_ppo_fit.py --case full-fit --memory 80 --host-memory 120
    .venv/bin/python bench/gpu_ppo_fit.py --tiny --case 8b-lora # a 2-layer shape on the CPU: checks the script

Printed: the case, the architecture and Ψ, the plan's per-device table for PPO, then one line
`ppo_fit CASE: plan X GiB, load Y GiB, iteration Z GiB, peak/plan R` (FLAG outside ±25 %).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1024**3
TOLERANCE = 0.25
ITERATION = ["ppo.iterations=1", "ppo.ppo_epochs=1", "ppo.rollout_batch_size=16", "ppo.minibatch_size=8",
             "ppo.max_prompt_len=128", "ppo.generation.max_new_tokens=64", "ppo.eos_penalty=false",
             "model.gradient_checkpointing=true"]
CASES = {
    "8b-lora": ("llama-3-8b", ["model.lora.rank=16"]),
    "full-fit": (None, ["ppo.launch.deepspeed=zero3", "ppo.launch.offload_optimizer=true",
                        "ppo.launch.offload_params=true"]),
}
# --tiny: the same code on a shape a CPU runs in seconds (its numbers check the script, not the plan).
TINY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 512}
TINY_ITERATION = ["ppo.rollout_batch_size=4", "ppo.minibatch_size=4", "ppo.max_prompt_len=16",
                  "ppo.generation.max_new_tokens=8", "sft.max_seq_len=32", "sft.max_response_len=16"]


def architecture_values(name: str) -> dict:
    from stages.orchestration import plan

    return json.loads(plan.architecture_file(name).read_text())


def candidates() -> list[tuple[str, dict]]:
    """Llama shapes from the largest down: the shipped architectures, then Llama-3-8B's width with
    fewer layers."""
    from stages.orchestration import plan

    shapes = [(name, architecture_values(name)) for name in plan.FIT_ARCHITECTURES]
    eight = architecture_values("llama-3-8b")
    shapes += [(f"llama-3-8b, {layers} layers", {**eight, "num_hidden_layers": layers})
               for layers in range(eight["num_hidden_layers"] - 2, 0, -2)]
    return sorted(shapes, key=lambda item: -plan.Architecture.from_config(item[1], item[0]).params())


def largest_full_finetune(cfg, memory_gib: float, host_gib: float) -> tuple[str, dict]:
    """The largest of `candidates` whose PPO stage the plan fits in `memory_gib` per device with
    its offloaded states within `host_gib`."""
    from stages.orchestration import plan

    for name, values in candidates():
        sp = plan.plan_stage(cfg, "ppo", plan.Architecture.from_config(values, name), "cuda")
        if sp.peak <= memory_gib * GiB and sum(r.offloaded for r in sp.roles) <= host_gib * GiB:
            return name, values
    raise SystemExit(f"no candidate fits {memory_gib} GiB per device and {host_gib} GiB of host memory")


def start_single_rank(device: str) -> None:
    """This process as DeepSpeed's only rank (the preset's PPO runs as one DeepSpeed rank)."""
    import importlib
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if device == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")


def random_weights_in_place_of_folders(values: dict, device: str) -> SimpleNamespace:
    """`loading.load_model` and `load_reward_model` make random models of shape `values` on
    `device` (what the stage's loader then does with them is its own); returns the tokenizer stub
    (PPO reads its EOS and pad ids)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.compute import loading, model_loading
    from stages.compute.models import set_cuda_graphs, set_fast_path
    from stages.compute.reward.model import RewardModel

    config = AutoConfig.for_model(**{**values, "model_type": values.get("model_type", "llama")})

    def load_model(model_dir, cfg, dtype=None):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        set_fast_path(model, cfg.fast_path)
        set_cuda_graphs(model, cfg.cuda_graphs)
        return model

    def load_reward_model(folder, cfg, dtype=None):
        with torch.device(device):
            return RewardModel(load_model(folder, cfg, dtype))

    loading.load_model = load_model
    model_loading.load_reward_model = load_reward_model
    vocab = values["vocab_size"]
    tokenizer = SimpleNamespace(eos_token_id=vocab - 1, pad_token_id=vocab - 2)
    loading.load_tokenizer = lambda folder, cfg: tokenizer
    return tokenizer


class Peak:
    """Peak memory since the last `reset`: the device's allocator on a GPU, VmHWM on a CPU."""

    def __init__(self, device: str):
        import torch

        self.device, self.torch = device, torch
        self.base = 0 if device != "cpu" else self.status("VmRSS")

    @staticmethod
    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    def reset(self) -> None:
        if self.device == "cpu":
            Path("/proc/self/clear_refs").write_text("5")
        else:
            self.torch.cuda.reset_peak_memory_stats()

    def read(self) -> int:
        if self.device == "cpu":
            return self.status("VmHWM") - self.base
        return self.torch.cuda.max_memory_allocated()


def run_case(case: str, tiny: bool, overrides: list[str], memory_gib: float, host_gib: float) -> dict:
    import torch

    from stages.compute import model_loading
    from stages.orchestration import plan
    from stages.leaves import precision
    from stages.orchestration.config_loading import load_config
    from stages.leaves.dist import Dist
    from stages.compute.ppo.trainer import PPOTrainer

    device = "cpu" if tiny else "cuda"
    name, extra = CASES[case]
    cfg = load_config("gpu", [*ITERATION, *extra, *(TINY_ITERATION if tiny else []), *overrides])
    if tiny:
        if name is None:  # what a GPU run would pick, then the tiny shape in its place
            print(f"ppo_fit {case}: on {memory_gib:g} GiB: {largest_full_finetune(cfg, memory_gib, host_gib)[0]}")
        name, values = "tiny Llama", {**architecture_values("llama-3-8b"), **TINY_SHAPE}
    elif name is None:
        name, values = largest_full_finetune(cfg, memory_gib, host_gib)
    else:
        values = architecture_values(name)
    arch = plan.Architecture.from_config(values, name)
    predicted = plan.plan_stage(cfg, "ppo", arch, device)
    print(f"ppo_fit {case}: {name}, Ψ = {arch.params() / 1e9:.2f} B, {predicted.sharding.describe()}, "
          f"{predicted.precision}; {predicted.batch}", flush=True)
    print(plan.Plan(arch, [predicted], {device: int(memory_gib * GiB)}).table(), flush=True)
    start_single_rank(device)
    from stages.orchestration.launch import resolve_deepspeed_config

    dist = Dist(rank=0, world_size=1, deepspeed_config=resolve_deepspeed_config("ppo", cfg.ppo.launch), device=device)
    tokenizer = random_weights_in_place_of_folders(values, device)
    torch.manual_seed(0)
    peak = Peak(device)
    peak.reset()
    started = time.perf_counter()
    tokenizer, actor, reference, reward_model, critic, score_fn = model_loading.load_models(
        cfg, {"sft_model_dir": "random", "reward_model_dir": "random"}, dist)
    p = cfg.ppo
    prompts = torch.randint(0, values["vocab_size"] - 2, (4 * p.rollout_batch_size, p.max_prompt_len)).tolist()
    ptx = [(row, list(row)) for row in torch.randint(0, values["vocab_size"] - 2, (8, cfg.sft.max_seq_len)).tolist()]
    trainer = PPOTrainer(p, actor=actor, critic=critic, reference=reference, score_fn=score_fn, prompts=prompts,
                         ptx_examples=ptx, tokenizer=tokenizer, dist=dist,
                         precision=precision.resolve(cfg.model.precision, device))
    load, loaded = peak.read(), time.perf_counter()
    peak.reset()
    trainer.step()
    iteration = peak.read()
    expected = predicted.peak + (sum(r.offloaded for r in predicted.roles) if device == "cpu" else 0)
    ratio = max(load, iteration) / expected
    flag = "" if abs(ratio - 1) <= TOLERANCE else "  FLAG: outside ±25 %"
    print(f"ppo_fit {case}: plan {expected / GiB:.2f} GiB, load {load / GiB:.2f} GiB, iteration "
          f"{iteration / GiB:.2f} GiB, peak/plan {ratio:.2f}; load {loaded - started:.0f} s, iteration "
          f"{time.perf_counter() - loaded:.0f} s{flag}", flush=True)
    return {"case": case, "architecture": name, "params": arch.params(), "plan": expected, "load": load,
            "iteration": iteration, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer shape on the CPU: checks the script")
    parser.add_argument("--memory", type=float, default=80.0, help="GiB per device the full-fit case plans for")
    parser.add_argument("--host-memory", type=float, default=120.0, help="GiB of host memory for offloaded states")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    print("RESULT " + json.dumps(run_case(args.case, args.tiny, args.overrides, args.memory, args.host_memory)))


if __name__ == "__main__":
    main()
