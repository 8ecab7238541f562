"""log π(a | s) of the taken tokens and the entropy of π(· | s), from logits, in chunks of rows.

PPO reads both from a [tokens, vocabulary] logits matrix (49,152 columns for SmolLM2); the
next-token NLL of SFT, of the reward model's LM term and of PPO-ptx reads log p alone. Taken whole,
in fp32, every step — the cast, the division by the temperature, the log-softmax, the exp
for the entropy, and as many in the backward — passes over a fresh matrix too large for any cache,
and autograd keeps fp32 copies of it for the backward. Here each chunk of rows goes through all the
steps while it is in cache, and the backward recomputes the softmax from the logits kept as they
came (bf16 under `model.precision` bf16) and one log-normaliser per row. The same fp32 arithmetic
per element; bench/logprobs.py compares the two forms.

Temperature T: π(· | s) = softmax(z / T), the distribution PPO's ratio is taken under (the
sampling distribution without top-k/top-p, `stages.compute.ppo.generation`).
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 20  # fp32 elements of one chunk on a CPU (4 MiB): a few such arrays fit in L2/L3 cache
# On a GPU a chunk costs ~10 kernel launches whatever its size, and a small one keeps the host busy
# launching while the GPU idles (a reward-model step on an H200 spent more host time here than in any
# layer); chunks of 64 Mi elements (256 MiB fp32) bound the temporary arrays instead.
DEVICE_CHUNK_ELEMENTS = 1 << 26


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(a | s), H(π(· | s))) in fp32, shaped like `tokens`, from logits [..., vocab];
    differentiable in both."""
    logprobs, entropy = _by_rows(logits, tokens, temperature, with_entropy=True)
    return logprobs.view(tokens.shape), entropy.view(tokens.shape)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(a | s) under logits / temperature, in fp32, shaped like `tokens`; differentiable (no entropy
    computed)."""
    return _by_rows(logits, tokens, temperature, with_entropy=False)[0].view(tokens.shape)


def _by_rows(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    """`_LogprobsAndEntropy` over logits flattened to [rows, vocab]: (log π, entropy or an empty tensor), flat."""
    return _LogprobsAndEntropy.apply(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), float(temperature),
                                     with_entropy)


def _chunks(rows: int, vocab: int, device: torch.device):
    step = max(1, (CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS) // vocab)
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        rows, vocab = logits.shape
        logprobs, log_normaliser = (logits.new_empty(rows, dtype=torch.float32) for _ in range(2))
        entropy = logits.new_empty(rows if with_entropy else 0, dtype=torch.float32)
        for part in _chunks(rows, vocab, logits.device):
            z = _scaled(logits[part], temperature)
            lse = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse[:, None])
            logprobs[part] = log_p.gather(1, tokens[part, None]).squeeze(1)
            if with_entropy:
                entropy[part] = -(log_p.exp() * log_p).sum(-1)
            log_normaliser[part] = lse
        ctx.save_for_backward(logits, tokens, log_normaliser, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, tokens, log_normaliser, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for part in _chunks(*logits.shape, logits.device):
            log_p = _scaled(logits[part], temperature).sub_(log_normaliser[part, None])
            p = log_p.exp()
            if grad_logprobs is not None:  # ∂ log p_a / ∂z = 1[a] − p
                g = p * -grad_logprobs[part, None]
                g.scatter_add_(1, tokens[part, None], grad_logprobs[part, None])
            else:
                g = torch.zeros_like(p)
            if grad_entropy is not None:  # ∂H / ∂z_i = −p_i (log p_i + H)
                g.sub_(p * (log_p + entropy[part, None]) * grad_entropy[part, None])
            grad[part] = g if temperature == 1.0 else g.div_(temperature)
        return grad, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T as a fresh fp32 tensor (the callers work on it in place); at T = 1 no division pass."""
    z = logits.to(torch.float32, copy=True)
    return z if temperature == 1.0 else z.div_(temperature)
