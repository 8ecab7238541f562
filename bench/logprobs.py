"""log π(a | s) and H(π(· | s)) from a [tokens, vocabulary] logits matrix: the whole-matrix fp32
formulas against `stages.leaves.logprobs` (chunks of rows, its own backward), interleaved in one run.

The PPO training step's shape at peer_trl's settings: 8 responses of 48 tokens (384 rows), SmolLM2's
49,152-token vocabulary, bf16 logits, T = 0.7. Per turn: forward + backward of log π (the policy
loss's gradient) and a forward alone (the reference's log-probabilities). Prints the milliseconds,
whole / chunked by turn and their median, and the largest differences of the results.

    .venv/bin/python bench/logprobs.py
    .venv/bin/python bench/logprobs.py --rows 1536 --vocab 32000 --turns 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stages.leaves.logprobs import logprobs_and_entropy


def whole_matrix(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_pi.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab) * 3).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, args.vocab, (args.rows,))
    weights = torch.randn(args.rows)
    forms = {"whole": whole_matrix, "chunked": logprobs_and_entropy}
    results = {}
    for name, form in forms.items():
        logprobs, entropy = form(logits, tokens, args.temperature)
        results[name] = (logprobs.detach(), entropy.detach(), torch.autograd.grad((logprobs * weights).sum(), logits)[0])
    differences = [(w.float() - c.float()).abs().max().item() for w, c in zip(results["whole"], results["chunked"])]
    print(f"CPU, {torch.get_num_threads()} threads; logits [{args.rows}, {args.vocab}] bf16, T = {args.temperature}")
    ms: dict[tuple[str, str], list[float]] = {}
    for turn in range(args.turns):
        for name in (forms if turn % 2 == 0 else reversed(list(forms))):
            form = forms[name]
            started = time.perf_counter()
            for _ in range(args.repeats):
                torch.autograd.grad((form(logits, tokens, args.temperature)[0] * weights).sum(), logits)
            middle = time.perf_counter()
            with torch.no_grad():
                for _ in range(args.repeats):
                    form(logits, tokens, args.temperature)
            ms.setdefault((name, "forward + backward"), []).append((middle - started) / args.repeats * 1e3)
            ms.setdefault((name, "forward"), []).append((time.perf_counter() - middle) / args.repeats * 1e3)
    for part in ("forward + backward", "forward"):
        whole, ours = ms[("whole", part)], ms[("chunked", part)]
        ratios = [w / c for w, c in zip(whole, ours)]
        print(f"{part}: whole {statistics.median(whole):.1f} ms, chunked {statistics.median(ours):.1f} ms; "
              f"whole / chunked by turn {' '.join(f'×{r:.2f}' for r in ratios)}, median ×{statistics.median(ratios):.2f}")
    print(f"largest |difference|: log π {differences[0]:.2g}, entropy {differences[1]:.2g}, "
          f"gradient {differences[2]:.2g} (bf16, largest |gradient| {results['whole'][2].float().abs().max().item():.3g})")


if __name__ == "__main__":
    main()
