"""Do the fast decoder's packed weights win on this CPU?

The Llama decode step (stages/compute/models/llama.py `PackedLinear`) multiplies a batch of one token per
row by each weight; it packs the weights once per rollout for the batch size: bf16 weights in
oneDNN's blocked layout, fp32 weights for MKL's packed GEMM on an Intel CPU (`mkl_packing_pays`:
Intel only, since on an AMD EPYC packing lost). The packed copies cost memory (MKL pads each
matrix: `plan.packed_weight_bytes`), so they must pay in speed. This times one decode step's linear
layers (every layer's q·k·v, o, gate·up, down and the LM head, at the model's shapes) four ways,
interleaved in turns, and prints the medians, the packed/plain time ratios and the bytes held:

- plain fp32: `F.linear` on the fp32 weights (what the decoder takes in fp32 on other CPUs);
- packed fp32: `torch.ops.mkl._mkl_linear` on the packed weights (in fp32 on Intel CPUs);
- plain bf16: `F.linear` on bf16 weights;
- packed bf16: `torch.ops.mkldnn._linear_pointwise` on oneDNN-packed weights (what the decoder takes in bf16).

    .venv/bin/python bench/packed_linear.py [--preset demo] [--batch 8 16] [--turns 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.compute.models.llama import mkl_pack, onednn_pack  # noqa: E402
from stages.leaves import precision  # noqa: E402
from stages.orchestration import plan  # noqa: E402
from stages.orchestration.config_loading import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 16], help="rows decoded at once")
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5, help="decode steps timed per turn")
    args = parser.parse_args()
    arch = plan.read_architecture(load_config(args.preset).model)
    shapes = plan.decode_linear_shapes(arch)
    print(f"{precision.cpu_name()} ({precision.cpu_vendor()}); native bf16 flags: {', '.join(precision.cpu_bf16_flags()) or 'none'}; "
          f"MKL: {torch.backends.mkl.is_available()}; {torch.get_num_threads()} threads; {arch.source}")
    torch.manual_seed(0)
    weights = [torch.randn(*shape) * 0.02 for shape in shapes]
    weights_bf16 = [w.bfloat16() for w in weights]
    for batch in args.batch:
        packed = [mkl_pack(w, batch) for w in weights]
        if any(p is None for p in packed):
            raise SystemExit("this torch build has no MKL packed GEMM")
        packed_bf16 = [onednn_pack(w, batch) for w in weights_bf16]
        if any(p is None for p in packed_bf16):
            raise SystemExit("this CPU or torch build has no oneDNN bf16")
        xs = [torch.randn(batch, w.shape[1]) for w in weights]
        xs_bf16 = [x.bfloat16() for x in xs]
        ways = {
            "plain fp32": lambda: [F.linear(x, w) for w, x in zip(weights, xs)],
            "packed fp32": lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, batch) for w, p, x in zip(weights, packed, xs)],
            "plain bf16": lambda: [F.linear(x, w) for w, x in zip(weights_bf16, xs_bf16)],
            "packed bf16": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                    for p, x in zip(packed_bf16, xs_bf16)],
        }
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for turn in range(args.turns):  # interleaved, the order reversed every other turn
            for name in list(ways)[:: 1 if turn % 2 else -1]:
                started = time.perf_counter()
                for _ in range(args.reps):
                    ways[name]()
                seconds[name].append((time.perf_counter() - started) / args.reps)
        ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
        ratios = [p / f for p, f in zip(seconds["packed fp32"], seconds["plain fp32"])]
        ratios_bf16 = [p / f for p, f in zip(seconds["packed bf16"], seconds["plain bf16"])]
        packed_gib = sum(p.numel() * p.element_size() for p in packed) / 2**30
        weight_gib = sum(w.numel() * 4 for w in weights) / 2**30
        print(f"batch {batch}: one decode step's linears, median ms: "
              + ", ".join(f"{name} {value:.1f}" for name, value in ms.items())
              + f"; packed / plain fp32 time ×{statistics.median(ratios):.2f} (turns {min(ratios):.2f}–{max(ratios):.2f})"
              f"; packed / plain bf16 time ×{statistics.median(ratios_bf16):.2f} (turns {min(ratios_bf16):.2f}–{max(ratios_bf16):.2f})"
              f"; packed copies {packed_gib:.2f} GiB beside {weight_gib:.2f} GiB of fp32 weights")


if __name__ == "__main__":
    main()
