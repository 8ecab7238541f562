"""The plain path: each model's own transformers forward, for any causal LM (and for every model
under `model.fast_path: off`)."""

from __future__ import annotations

import torch
from transformers import StaticCache


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, as generation uses them for left-padded prompts."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def partitioned(parameter: torch.Tensor) -> bool:
    """A ZeRO-3 shard: the whole weight exists only inside its module's own forward."""
    return hasattr(parameter, "ds_id")


def last_hidden_state(base_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      from_position: int = 0) -> torch.Tensor:
    """[B, L − from_position, hidden] final hidden states of positions from_position … L − 1."""
    return base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                      use_cache=False).last_hidden_state[:, from_position:]


class CachedDecoder:
    """Transformers' own forward over a preallocated KV cache: any causal LM."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.prompt_ids, self.mask = model, prompt_ids, prompt_mask
        width = prompt_ids.shape[1]
        # Preallocated: a growing cache would concatenate every layer's keys and values at every step.
        self.cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
        self.positions = position_ids(prompt_mask)
        self.cache_position = torch.arange(width, device=prompt_ids.device)

    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs, attention_mask=self.mask, position_ids=self.positions,
                          past_key_values=self.cache, cache_position=self.cache_position, use_cache=True,
                          logits_to_keep=1).logits[:, -1]

    def prefill(self) -> torch.Tensor:
        return self._logits(self.prompt_ids)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.positions, self.cache_position = self.positions[:, -1:] + 1, self.cache_position[-1:] + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self._logits(token[:, None])
