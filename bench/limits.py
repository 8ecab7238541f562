"""This machine's measured limits, and how close our PPO iteration comes to them.

1. Peak matmul throughput: the best FLOP/s of square fp32 (and bf16) matmuls over a few sizes.
2. Memory bandwidth: the best bytes/s of copying a 512 MiB tensor (read + write counted).
3. Our PPO iteration at bench/peer_trl.py's settings: model FLOPs per phase (generation,
   experience forwards, training) counted from the model's shapes and the real tokens of each
   rollout (`flops.phase_flops`), divided by the phase's wall time, as a share of the matmul
   peak: MFU. Decoding one token reads every weight once, so generation is bound by memory, not
   FLOPs: its decode steps' bandwidth (weights read per step / step time / measured bandwidth)
   is printed too.

    .venv/bin/python bench/limits.py                 # ~4 minutes on 2 cores
    .venv/bin/python bench/limits.py --iterations 2 --threads 1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import Shapes, bandwidth, matmul_peak, phase_flops  # noqa: E402
from peer_trl import arguments, our_trainer, prepare  # noqa: E402

from stages.compute.ppo.generation import generate  # noqa: E402


def main() -> None:
    parser = arguments(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        common, model_dir, reward_dir = prepare(args, Path(tmp))
        trainer = our_trainer({**common, "inputs": {"sft_model_dir": model_dir, "reward_model_dir": str(reward_dir)}})
        shapes = Shapes(trainer.actor.module.config)
        totals = {"generate": [0.0, 0.0], "experience": [0.0, 0.0], "train": [0.0, 0.0]}  # FLOPs, seconds
        decode_bytes = decode_seconds = 0.0
        for iteration in range(args.warmup + args.iterations):
            metrics = trainer.step()
            if iteration < args.warmup:
                continue
            exp = trainer.last_experience
            flops = phase_flops(shapes, exp, critic=trainer.critic is not None)
            for phase, seconds in (("generate", metrics["time/generate"]),
                                   ("experience", sum(metrics.get(f"time/{p}", 0.0) for p in ("ref_logprobs", "values", "scores"))),
                                   ("train", metrics["time/train"])):
                totals[phase][0] += flops[phase]
                totals[phase][1] += seconds
            steps = exp.response_mask.shape[1]
            # Decode time = generation − a prefill alone (one new token) on the same prompts.
            prompts = [row[mask.bool()].tolist() for row, mask in zip(exp.sequences[:, : exp.prompt_width],
                                                                      exp.attention_mask[:, : exp.prompt_width])]
            started = time.perf_counter()
            generate(trainer.actor.module, prompts, eos_id=trainer.eos_id, pad_id=trainer.pad_id,
                     **{**trainer.ppo.generation.model_dump(), "max_new_tokens": 1})
            decode_seconds += metrics["time/generate"] - (time.perf_counter() - started)
            decode_bytes += shapes.weight_bytes * (steps - 1)
    # Measured right after the PPO iterations, so that both see the machine in the same state.
    fp32, bf16, bytes_per_s = matmul_peak(torch.float32), matmul_peak(torch.bfloat16), bandwidth()
    print(f"{args.threads} threads: matmul peak fp32 {fp32 / 1e9:.1f} GFLOP/s, bf16 {bf16 / 1e9:.1f} GFLOP/s; "
          f"copy bandwidth {bytes_per_s / 1e9:.1f} GB/s")
    print(f"our PPO iteration (batch {args.batch_size}, ≤{args.response_length} new tokens, {args.iterations} iterations "
          f"after {args.warmup} warm-up):")
    print(f"{'phase':<12}{'GFLOP':>10}{'seconds':>10}{'GFLOP/s':>10}{'MFU':>8}")
    for phase, (flops, seconds) in totals.items():
        print(f"{phase:<12}{flops / 1e9:>10.1f}{seconds:>10.2f}{flops / seconds / 1e9:>10.1f}{flops / seconds / fp32:>8.1%}")
    flops, seconds = sum(f for f, _ in totals.values()), sum(s for _, s in totals.values())
    print(f"{'all':<12}{flops / 1e9:>10.1f}{seconds:>10.2f}{flops / seconds / 1e9:>10.1f}{flops / seconds / fp32:>8.1%}")
    print(f"generation's decode steps: {decode_bytes / decode_seconds / 1e9:.1f} GB/s of weights read, "
          f"{decode_bytes / decode_seconds / bytes_per_s:.0%} of the copy bandwidth")


if __name__ == "__main__":
    main()
