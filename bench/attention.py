"""The padding-free forward's attention with gradients on a CPU: SDPA's fused kernel against the
explicit products (the path `stages.compute.models.llama.attention` takes in bf16), forward + backward,
interleaved in one run.

Shapes of the demo model's PPO training step at peer_trl's settings: batch 8, 176 positions,
9 query heads sharing 3 key/value heads of 64, an additive causal mask; bf16 (`model.precision`
bf16) and fp32. Prints per precision the milliseconds of each and SDPA / explicit, turn by turn
and the median, and the largest difference of their outputs and gradients.

    .venv/bin/python bench/attention.py
    .venv/bin/python bench/attention.py --batch 16 --length 256 --turns 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from stages.compute.models.llama import explicit_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=176)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10, help="forward + backward passes per turn")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, kv, length, d = args.batch, args.heads, args.kv_heads, args.length, args.head_dim
    scale = d ** -0.5
    print(f"CPU, {torch.get_num_threads()} threads; q [{b}, {h}, {length}, {d}], k and v [{b}, {kv}, {length}, {d}], causal mask")
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(b, heads, length, d, dtype=dtype, requires_grad=True) for heads in (h, kv, kv))
        mask = torch.zeros(b, 1, length, length, dtype=dtype).masked_fill_(
            ~torch.ones(length, length, dtype=torch.bool).tril(), -torch.inf)
        grad = torch.randn(b, h, length, d, dtype=dtype)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        def explicit():
            return explicit_attention(q, k, v, mask, scale)

        outputs = {}
        for name, run in (("sdpa", sdpa), ("explicit", explicit)):
            out = run()
            outputs[name] = (out, *torch.autograd.grad(out, (q, k, v), grad))
        difference = max((a.float() - c.float()).abs().max().item() for a, c in zip(outputs["sdpa"], outputs["explicit"]))
        ms: dict[str, list[float]] = {"sdpa": [], "explicit": []}
        for turn in range(args.turns):
            order = (("sdpa", sdpa), ("explicit", explicit)) if turn % 2 == 0 else (("explicit", explicit), ("sdpa", sdpa))
            for name, run in order:
                started = time.perf_counter()
                for _ in range(args.repeats):
                    torch.autograd.grad(run(), (q, k, v), grad)
                ms[name].append((time.perf_counter() - started) / args.repeats * 1e3)
        ratios = [s / e for s, e in zip(ms["sdpa"], ms["explicit"])]
        print(f"{str(dtype).removeprefix('torch.')}: SDPA {statistics.median(ms['sdpa']):.2f} ms, explicit "
              f"{statistics.median(ms['explicit']):.2f} ms (medians of {args.turns} turns; forward + backward)")
        print(f"  SDPA / explicit by turn: {' '.join(f'×{r:.2f}' for r in ratios)}; median ×{statistics.median(ratios):.2f}")
        print(f"  largest |difference| of output and gradients: {difference:.3g}")


if __name__ == "__main__":
    main()
