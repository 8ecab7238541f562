"""Model FLOPs of our PPO iteration, and this machine's matmul peak and copy bandwidth: the
measures behind the MFU that bench/limits.py (per phase) and bench/peer_trl.py (per iteration) print."""

from __future__ import annotations

import time

import torch


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048, 3072), repeats: int = 5, device: str = "cpu") -> float:
    """The best FLOP/s of square matmuls in `dtype` on `device` (on a GPU, at 4096–8192, where its
    tensor cores run full)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        sizes = (4096, 8192)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        a @ b  # warm-up: thread pool, allocator, kernel choice
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            a @ b
            if cuda:
                torch.cuda.synchronize()
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


def phase_flops(shapes: Shapes, exp, *, critic: bool) -> dict[str, float]:
    """Model FLOPs of one PPO iteration's phases from its experience: real tokens only (padding is
    waste, not useful work). Generation: prefill over the prompts, then one position per row and
    step, LM head on one position per row and step. Experience: π_SFT (body + LM head on response
    positions), the reward model, and the critic (if any). Training: actor and critic (if any)
    forward + backward (3 × forward), the actor's LM head on response positions."""
    prompt = exp.attention_mask[:, : exp.prompt_width].sum(1).tolist()
    response = exp.response_mask.sum(1).long().tolist()
    full = [p + r for p, r in zip(prompt, response)]
    steps = exp.response_mask.shape[1]
    decode = sum(shapes.decode_step([p + j for p in prompt]) for j in range(steps - 1))
    trained = shapes.body(full) + shapes.head(sum(response)) + critic * shapes.body(full)  # actor, critic
    return {"generate": shapes.body(prompt) + shapes.head(len(prompt)) + decode,
            "experience": (2 + critic) * shapes.body(full) + shapes.head(sum(response)),
            "train": 3 * trained}
