"""Decode speed against the memory-bandwidth bound: the eager decode step against the static one.

A decode step reads every weight once and the filled part of the KV cache, so tokens/s is bounded
by bandwidth / bytes per step × batch. This bench prints, per batch size, the decode tokens/s of
the eager loop (`model.cuda_graphs: off`) and of the static-buffer step (`stages/compute/ppo/static_sampling.py`:
on a GPU captured as a CUDA graph and replayed, on a CPU run uncaptured), each as a fraction of
that bound, the bandwidth measured in the same run (a device-to-device copy on a GPU, a 512 MiB
tensor copy on a CPU; bytes read and written counted), and their ratio. The two run interleaved,
`--repeats` times each, on a random Llama of the given shape, greedy with EOS never sampled, so
every row decodes `--new-tokens` tokens; the greedy tokens of the two are compared.

Decode time is a rollout's time less a prefill-only rollout's (one new token) on the same prompts.
Bytes per step: every parameter once (a tied embedding once) plus the keys and values of the
filled slots, averaged over the steps; the static step reads every slot of its cache, which is
its cost, not part of the bound.

    .venv/bin/python bench/roofline.py --shape demo --batches 16 --new-tokens 32           # CPU, fp32
    python3 bench/roofline.py --device cuda --shape 1b --batches 16 64 256 --new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stages.compute.models import set_cuda_graphs  # noqa: E402
from stages.compute.models.llama import StaticDecoder  # noqa: E402
from stages.compute.ppo import static_sampling  # noqa: E402
from stages.compute.ppo.generation import generate  # noqa: E402

# SmolLM2-135M (the demo model's shape) and the ~1.07B Llama of bench/random_model.py.
SHAPES = {
    "demo": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True),
}


def measured_bandwidth(device: str) -> float:
    """Bytes/s of the best of a few copies of a large tensor, read and write counted."""
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from flops import bandwidth

        return bandwidth()
    source = torch.ones(2**28, device=device)  # 1 GiB
    target = torch.empty_like(source)
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = max(best, 2 * source.nbytes / (start.elapsed_time(end) / 1e3))
    return best


def bytes_per_step(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters(): a tied weight once
    head_dim = config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    mean_filled = prompt_len + new_tokens / 2
    kv = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim * mean_filled * element
    return weights + kv


def rollout(model, prompts, new_tokens: int, static: bool, device: str):
    settings = dict(eos_id=-1, pad_id=0, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                    repetition_penalty=1.0, do_sample=False, device=device)
    if not static:
        return generate(model, prompts, **settings)
    with torch.inference_mode():
        return static_sampling.sample(StaticDecoder, model, prompts, graph=device == "cuda", **settings)


def timed(model, prompts, new_tokens: int, static: bool, device: str) -> tuple[float, torch.Tensor]:
    def once(tokens: int):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = rollout(model, prompts, tokens, static, device)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, out

    prefill, _ = once(1)
    total, out = once(new_tokens)
    return max(total - prefill, 1e-9), out.sequences[:, out.prompt_width :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                        help="default: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="the shape with fewer layers (a quick run)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()
    set_cuda_graphs(model, "off")  # `generate` is the eager loop; the static one is called by name
    bandwidth = measured_bandwidth(device)
    parameters = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    static_name = "graph" if device == "cuda" else "static"
    layers = f", {args.layers} layers" if args.layers else ""
    print(f"roofline: {args.shape}{layers} ({parameters / 1e6:.0f}M parameters, {precision}) on {name}; measured copy "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s; prompts {args.prompt_len} + {args.new_tokens} new tokens")
    for batch in args.batches:
        prompts = torch.randint(3, model.config.vocab_size, (batch, args.prompt_len)).tolist()
        bound = bandwidth / bytes_per_step(model, batch, args.prompt_len, args.new_tokens) * batch  # tokens/s
        seconds = {False: [], True: []}
        tokens = {}
        for static in (False, True):  # warm-up: allocations, a graph's capture
            timed(model, prompts, args.new_tokens, static, device)
        for _ in range(args.repeats):
            for static in (False, True):
                elapsed, tokens[static] = timed(model, prompts, args.new_tokens, static, device)
                seconds[static].append(elapsed)
        decoded = batch * (args.new_tokens - 1)
        rate = {static: decoded / statistics.median(values) for static, values in seconds.items()}
        same = torch.equal(tokens[False], tokens[True])
        print(f"batch {batch}: eager {rate[False]:,.0f} tokens/s ({rate[False] / bound:.1%} of the bound "
              f"{bound:,.0f}), {static_name} {rate[True]:,.0f} tokens/s ({rate[True] / bound:.1%}); "
              f"{static_name} / eager ×{rate[True] / rate[False]:.2f} (per repeat: "
              f"{', '.join(f'×{e / s:.2f}' for e, s in zip(seconds[False], seconds[True]))}); "
              f"greedy tokens identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
