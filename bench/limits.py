"""This machine's measured limits, and how close our PPO iteration comes to them.

1. Peak matmul throughput: the best FLOP/s of square fp32 (and bf16) matmuls over a few sizes.
2. Memory bandwidth: the best bytes/s of copying a 512 MiB tensor (read + write counted).
3. Our PPO iteration at bench/peer_trl.py's settings: model FLOPs per phase counted from the
   model's shapes and the real tokens of each rollout (no padding counted: padded work is waste,
   not useful FLOPs), divided by the phase's wall time, as a share of the matmul peak: MFU.
   - training: actor and critic forward + backward (3 × forward FLOPs) over prompt + response,
     the actor's LM head on response positions only; where the trainer keeps the prefill's graph
     (one epoch of one minibatch), the actor's forward over the prompts is the prefill, counted
     in generation;
   - generation: prefill over the prompts and one position per row and step, LM head on one
     position per row and step. Decoding one token reads every weight once, so generation is
     bound by memory, not FLOPs: its bandwidth utilisation (weights read per step / step time /
     measured bandwidth) is printed beside its MFU.
   - experience forwards: reference (body + LM head on response positions) and reward model (body).

    .venv/bin/python bench/limits.py                 # ~4 minutes on 2 cores
    .venv/bin/python bench/limits.py --iterations 2 --threads 1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_trl import arguments, our_trainer, prepare  # noqa: E402

from stages.ppo.generation import generate  # noqa: E402


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048, 3072), repeats: int = 5) -> float:
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: thread pool, allocator
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - started))
    return best


def bandwidth(mib: int = 512, repeats: int = 5) -> float:
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = max(best, 2 * source.nbytes / (time.perf_counter() - started))
    return best


class Shapes:
    """FLOPs of a Llama-style decoder from its config: 2 per multiply-add."""

    def __init__(self, config):
        d, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        kv = config.num_key_value_heads * (d // config.num_attention_heads)
        self.d, self.layers, self.vocab = d, layers, config.vocab_size
        self.body_params = layers * (2 * d * d + 2 * d * kv + 3 * d * inter)  # q, o; k, v; gate, up, down
        self.weight_bytes = (self.body_params + self.vocab * d) * 4  # fp32, LM head included

    def body(self, lengths: list[int]) -> float:
        """Forward of rows of these lengths: linear layers, plus causal attention (QKᵀ and AV)."""
        return sum(2 * self.body_params * n + self.layers * 4 * self.d * n * (n + 1) / 2 for n in lengths)

    def head(self, positions: int) -> float:
        return 2 * self.d * self.vocab * positions

    def decode_step(self, contexts: list[int]) -> float:
        """One new token per row, attending to `contexts` earlier tokens."""
        return sum(2 * self.body_params + self.layers * 4 * self.d * (c + 1) for c in contexts) + self.head(len(contexts))


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
            prompt = exp.attention_mask[:, : exp.prompt_width].sum(1).tolist()
            response = exp.response_mask.sum(1).long().tolist()
            full = [p + r for p, r in zip(prompt, response)]
            steps = exp.response_mask.shape[1]
            decode = sum(shapes.decode_step([p + j for p in prompt]) for j in range(steps - 1))
            totals["generate"][0] += shapes.body(prompt) + shapes.head(len(prompt)) + decode
            totals["generate"][1] += metrics["time/generate"]
            critic_forwards = 1 if "time/values" in metrics else 0  # 0: V_old comes from the training forward
            totals["experience"][0] += (2 + critic_forwards) * shapes.body(full) + shapes.head(sum(response))  # π_SFT, RM
            totals["experience"][1] += sum(metrics.get(f"time/{p}", 0.0) for p in ("ref_logprobs", "values", "scores"))
            prefill = shapes.body(prompt) if trainer.prompt_pass_in_training else 0.0  # already run, with its graph
            totals["train"][0] += 3 * (shapes.body(full) + shapes.head(sum(response)) + shapes.body(full)) - prefill
            totals["train"][1] += metrics["time/train"]
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
