"""Where a reward-model training step's time goes: torch.profiler over the first steps and a later one.

The reward stage's step (`stages.pipeline.reward.forward_pairs`, pairwise loss, the engine's backward
and AdamW step) on a random Llama of the given shape, on batches of random pairs whose lengths
vary as dynamic token batches' do (each batch its own padded width). Prints each step's wall time,
its CUDA kernel launches and, for the first step and the last, the operators that took the most
device time (and host time: a launch-bound step shows its time on the host); with `--out`, a
Chrome trace of each profiled step.

    python3 bench/profile_reward.py --device cuda --shape 1b --steps 6 --out /tmp/profile
    .venv/bin/python bench/profile_reward.py --shape demo --layers 2 --steps 3 --pairs 4     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import SHAPES  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from stages.compute.reward.model import RewardModel  # noqa: E402
from stages.compute.training import adamw, make_engine  # noqa: E402
from stages.leaves.dist import Dist  # noqa: E402
from stages.leaves.rendering import collate  # noqa: E402
from stages.pipeline.reward import forward_pairs  # noqa: E402


def random_batches(steps: int, pairs: int, vocab: int, device: str, seed: int = 0) -> list[dict]:
    """Batches of `pairs` random pairs, chosen rows then rejected rows (`pair_batch`'s layout), each
    batch's lengths drawn anew: every step a new padded width."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(48, 256, (2 * pairs,), generator=generator).tolist()
        rows = [(ids, [-100] * len(ids)) for ids in
                (torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths)]
        out.append({k: v.to(device) for k, v in collate(rows, pad_id=0).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=16, help="pairs per batch (×2 rows of up to 256 tokens)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on a GPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for the Chrome traces")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    device = args.device
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    torch.manual_seed(0)
    model = RewardModel(LlamaForCausalLM(LlamaConfig(**shape))).to(device)
    optimizer = adamw(model, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine = make_engine(model, optimizer, scheduler, micro_batch_size=args.pairs, grad_accum_steps=1,
                         max_grad_norm=1.0, precision=precision, dist=Dist(device=device))
    engine.train()
    batches = random_batches(args.steps, args.pairs, shape["vocab_size"], device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print(f"profile_reward: {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{precision}) on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; {args.pairs} pairs a step")
    for step, batch in enumerate(batches, start=1):
        profiled = step in (1, 2, args.steps)
        with profile(activities=activities) if profiled else _nothing() as prof:
            started = time.perf_counter()
            loss, _, _ = forward_pairs(engine, batch, args.pairs, beta_rm=0.0)
            engine.backward(loss.total)
            engine.step()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        line = f"step {step}: {seconds:.3f} s, width {batch['input_ids'].shape[1]}"
        if profiled:
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                 "cuLaunchKernel", "cuLaunchKernelEx"))
            line += f", {launches} kernel launches" if device == "cuda" else ""
            sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(line)
            print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
            if device == "cuda":
                print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
            if args.out:
                prof.export_chrome_trace(str(args.out / f"reward_step{step}.json"))
        else:
            print(line)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
