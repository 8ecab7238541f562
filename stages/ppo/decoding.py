"""Decoders for the sampling loop: `prefill()` gives the logits after each prompt (and, if asked, the
prefill's graph), then `step(token)` feeds one token per row and gives the next logits, both [B, vocab].

`CachedDecoder` is transformers' own forward over a preallocated KV cache: any causal LM.

`LlamaDecoder` is our own decode step for Llama-architecture models (SmolLM2, Llama, the tiny test
models). At batch 8 a decode step is bound by reading the weights, and the profile of transformers'
step on CPU showed matrix products of 8 rows running at half the speed of single rows, plus a third
of the step spent between them (attention kernel set-up, masks, cache bookkeeping). Here:
- the prompt goes through the padding-free body (`stages.unpadded`), which hands over its keys and values;
- q|k|v and gate|up are one matrix product each;
- on CPU the weights are packed once per rollout for the batch size (MKL's packed GEMM);
- attention reads the filled part of the cache only;
- the prefill can keep its autograd graph (`PromptPass`): with one PPO epoch of one minibatch the
  actor's training forward is the rollout's actor, so its prompt part is this very prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import StaticCache
from transformers.models.llama.modeling_llama import rotate_half

from stages.unpadded import last_hidden_state, partitioned, position_ids, rms_norm, unpadded_ok


@dataclass
class PromptPass:
    """The actor's prefill with its autograd graph: the prompt's keys and values of every layer
    (after RoPE, [B, kv_heads, P, head_dim]) and the final hidden state at P − 1, which predicts
    the first response token."""
    keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor  # [B, hidden]


def decoder(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
    """Our Llama decode step where it applies, else transformers' forward. Not under ZeRO-3, whose
    parameters exist only inside their module's own forward."""
    if unpadded_ok(model.base_model) and not any(partitioned(p) for p in model.parameters()):
        return LlamaDecoder(model, prompt_ids, prompt_mask, max_new_tokens)
    return CachedDecoder(model, prompt_ids, prompt_mask, max_new_tokens)


class CachedDecoder:
    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.prompt_ids, self.mask = model, prompt_ids, prompt_mask
        width = prompt_ids.shape[1]
        # Preallocated: a growing cache concatenates every layer's keys and values at every step,
        # which took a sixth of the decode time on CPU.
        self.cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
        self.positions = position_ids(prompt_mask)
        self.cache_position = torch.arange(width, device=prompt_ids.device)

    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs, attention_mask=self.mask, position_ids=self.positions,
                          past_key_values=self.cache, cache_position=self.cache_position, use_cache=True,
                          logits_to_keep=1).logits[:, -1]

    def prefill(self, keep_graph: bool = False) -> tuple[torch.Tensor, PromptPass | None]:
        return self._logits(self.prompt_ids), None  # transformers' forward: no graph kept

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.positions, self.cache_position = self.positions[:, -1:] + 1, self.cache_position[-1:] + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self._logits(token[:, None])


class LlamaDecoder:
    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.base, self.prompt_ids, self.prompt_mask = model.base_model, prompt_ids, prompt_mask
        config = self.base.config
        batch, width = prompt_ids.shape
        layers = self.base.layers[: config.num_hidden_layers]
        self.layers = [DecodeLayer(layer, config, batch) for layer in layers]
        self.lm_head = PackedLinear([model.get_output_embeddings()], batch)
        weight = self.lm_head.weight
        shape = (len(layers), batch, config.num_key_value_heads, width + max_new_tokens, layers[0].self_attn.head_dim)
        self.keys = weight.new_zeros(shape)
        self.values = weight.new_zeros(shape)
        # Additive attention bias over cache slots: −inf on the prompts' left padding.
        self.bias = weight.new_zeros((batch, 1, 1, shape[3]))
        self.bias[:, 0, 0, :width].masked_fill_(prompt_mask == 0, -torch.inf)
        self.positions = position_ids(prompt_mask)[:, -1:]
        self.filled = width

    def prefill(self, keep_graph: bool = False) -> tuple[torch.Tensor, PromptPass | None]:
        """The logits after each prompt, and with keep_graph the prefill's `PromptPass`."""
        keys_values: list = []
        with torch.set_grad_enabled(keep_graph):
            hidden = last_hidden_state(self.base, self.prompt_ids, self.prompt_mask, keys_values=keys_values,
                                       from_position=self.filled - 1)[:, -1]  # left-padded prompts all end at P − 1
        for layer, (k, v) in enumerate(keys_values):
            self.keys[layer, :, :, : self.filled] = k.detach()
            self.values[layer, :, :, : self.filled] = v.detach()
        return self.lm_head(hidden.detach()), PromptPass(keys_values, hidden) if keep_graph else None

    def step(self, token: torch.Tensor) -> torch.Tensor:
        x = self.base.embed_tokens(token)  # [B, hidden]
        self.positions = self.positions + 1
        cos, sin = self.base.rotary_emb(x, position_ids=self.positions)  # [B, 1, head_dim]
        slot = self.filled
        self.filled += 1
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.keys[index], self.values[index], slot, self.bias[..., : self.filled])
        return self.lm_head(rms_norm(self.base.norm, x))


class DecodeLayer:
    """One decoder layer for one new token per row, writing its keys and values into cache slot `slot`."""

    def __init__(self, layer, config, batch: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], batch)
        self.o = PackedLinear([attn.o_proj], batch)
        self.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj], batch)
        self.down = PackedLinear([mlp.down_proj], batch)
        self.attention_norm, self.mlp_norm, self.act = layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling

    def __call__(self, x, cos, sin, keys, values, slot: int, bias):
        batch, heads, kv_heads, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qk, v = self.qkv(rms_norm(self.attention_norm, x)).split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        qk = qk.view(batch, heads + kv_heads, d)
        qk = qk * cos + rotate_half(qk) * sin  # RoPE on queries and keys at once (cos, sin: [B, 1, d])
        q, k = qk.split([heads, kv_heads], dim=1)
        keys[:, :, slot] = k
        values[:, :, slot] = v.view(batch, kv_heads, d)
        # Grouped-query attention: query heads g·j … g·j + g − 1 share key/value head j.
        q = q.view(batch, kv_heads, heads // kv_heads, d)
        scores = q @ keys[:, :, : slot + 1].transpose(-1, -2) * self.scaling + bias  # [B, kv_heads, g, T]
        out = scores.softmax(dim=-1) @ values[:, :, : slot + 1]
        x = x + self.o(out.reshape(batch, heads * d))
        gate, up = self.gate_up(rms_norm(self.mlp_norm, x)).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class PackedLinear:
    """x Wᵀ + b for the given linear layers stacked by output, at a fixed batch size. On CPU in fp32
    the weight is packed for that batch size (MKL's packed GEMM: q at batch 8 read its weight at
    12.9 GB/s against 7.5 for the plain product); any other batch size takes the plain product."""

    def __init__(self, linears: list, batch: int):
        weights = [linear.weight.detach() for linear in linears]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        biases = [linear.bias for linear in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
        self.batch = batch
        self.packed = _mkl_pack(self.weight, batch)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.batch)


def _mkl_pack(weight: torch.Tensor, batch: int) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
    except (AttributeError, RuntimeError):  # a build without the packed-GEMM ops
        return None
