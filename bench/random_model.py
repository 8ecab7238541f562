"""A randomly initialised Llama with a real model's tokenizer: for benches on a machine that has the
tokenizer but not the weights (a GPU machine without network), or at a size no preset has.

The folder it writes loads like any model folder (`--set model.name_or_path=<out>`): config.json
(the `--like` model's, with the sizes given here replaced), safetensors weights drawn with
`--seed`, the tokenizer and chat template. Random weights rarely sample EOS, so every response runs
to the length cap: fine for speed (both sides of a bench generate the same lengths), not for quality.
Not for training benches past their first steps: at SmolLM2-135M's shape (30 layers, init std 0.02)
some 256-token rows give non-finite gradients from a finite loss (in fp32 and bf16, with
transformers' own forward too), so PPO on it stops within an iteration, ours and TRL's alike; the
reward-model bench only times its steps. Shorter rows fared better: `peer_trl.py` with 32-token
prompts and 128 new tokens ran its iterations on both sides at SmolLM2's shape (CPU) and at ~1.07B
(an H200).

    .venv/bin/python bench/random_model.py --like <SmolLM2 folder> --out /tmp/smollm2-random
    .venv/bin/python bench/random_model.py --like <SmolLM2 folder> --out /tmp/llama-1b \\
        --hidden-size 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate-size 8192   # ~1.07B
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", required=True, help="a model folder with config.json and the tokenizer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--layers", type=int, dest="num_hidden_layers")
    parser.add_argument("--heads", type=int, dest="num_attention_heads")
    parser.add_argument("--kv-heads", type=int, dest="num_key_value_heads")
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    like, out = Path(args.like), Path(args.out)
    config = AutoConfig.from_pretrained(like)
    sizes = {k: v for k, v in vars(args).items()
             if k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size") and v is not None}
    for key, value in sizes.items():
        setattr(config, key, value)
    if "hidden_size" in sizes or "num_attention_heads" in sizes:
        config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, out / name)
    parameters = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "parameters": parameters, **sizes}))


if __name__ == "__main__":
    main()
