"""The padding-free forward + backward in bf16 on a CPU with its fused kernels (`stages.compute.models.fused`:
compiled RMSNorm and SwiGLU) against the same forward on eager operations, interleaved in one run.

A Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 query heads sharing 3 key/value heads,
MLP 1536), random bf16 weights, a reward-model-like batch: `--rows` rows right-padded to
`--length` with real lengths spread down to 2/3 of it. Each turn runs `--repeats` forward +
backward passes of each form, the order alternating from turn to turn. Prints the milliseconds of
each (medians), eager / fused turn by turn and their median, and the largest difference of the
hidden states (both are bf16; they differ in the order of fp32 sums and skipped roundings).

    .venv/bin/python bench/fused.py
    .venv/bin/python bench/fused.py --rows 16 --length 176 --turns 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the stages of this checkout
from stages.compute.models import fused, last_hidden_state  # noqa: E402
from stages.leaves import precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=219)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="forward + backward passes per turn and form")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    lengths = torch.linspace(args.length, args.length * 2 // 3, args.rows).long()
    ids = torch.randint(3, config.vocab_size, (args.rows, args.length))
    mask = (torch.arange(args.length)[None] < lengths[:, None]).long()
    weights = torch.randn(args.rows, args.length, config.hidden_size, dtype=torch.bfloat16) * mask[..., None]
    parameters = list(model.parameters())
    print(f"CPU ({precision.describe('cpu')}), {torch.get_num_threads()} threads; SmolLM2-135M's shape, "
          f"{args.layers} layers, bf16; {args.rows} rows × {args.length} positions, {int(mask.sum())} real tokens")

    def run(on: bool) -> torch.Tensor:
        fused.enabled = on
        hidden = last_hidden_state(model.base_model, ids, mask)
        torch.autograd.grad((hidden * weights).float().sum(), parameters)
        return hidden.detach()

    started = time.perf_counter()
    compiled = run(True)  # compiles (or loads torch's cached kernels)
    print(f"first fused pass (compiling or loading the kernels): {time.perf_counter() - started:.1f} s"
          + (f"; compiling FAILED: {fused._failed[0][:200]}" if fused._failed else ""))
    eager = run(False)
    difference = (compiled.float() - eager.float()).abs().max().item()
    ms: dict[str, list[float]] = {"eager": [], "fused": []}
    for turn in range(args.turns):
        for name in (("eager", "fused") if turn % 2 == 0 else ("fused", "eager")):
            started = time.perf_counter()
            for _ in range(args.repeats):
                run(name == "fused")
            ms[name].append((time.perf_counter() - started) / args.repeats * 1e3)
    ratios = [e / f for e, f in zip(ms["eager"], ms["fused"])]
    print(f"forward + backward: eager {statistics.median(ms['eager']):.0f} ms, fused {statistics.median(ms['fused']):.0f} ms "
          f"(medians of {args.turns} turns)")
    print(f"eager / fused by turn: {' '.join(f'×{r:.2f}' for r in ratios)}; median ×{statistics.median(ratios):.2f}")
    print(f"largest |difference| of the hidden states: {difference:.3g} "
          f"(largest |hidden state| {eager.float().abs().max().item():.3g})")


if __name__ == "__main__":
    main()
