"""A decoder forward whose linear layers skip the padding.

Rollout batches are padded twice: prompts on the left to the longest prompt, responses on the
right after their EOS. On the demo's PPO batches a quarter of all positions are padding, and the
linear layers (all but attention) cost the same for a pad as for a token. Here every linear layer
runs on the real tokens only, gathered into one [N, hidden] matrix; only attention, which needs
the [batch, length] layout, scatters them back, and its score matrices are small beside the
linear layers at these lengths. The result is the same hidden states as the model's own forward
(tests compare them), with zeros at pad positions.

Llama-architecture decoders only (SmolLM2, Llama, the tiny test models); any other model, and
a model with gradient checkpointing or attention dropout, takes its own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, as generation uses them for left-padded prompts."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def unpadded_ok(base_model) -> bool:
    config = base_model.config
    return (config.model_type == "llama" and not getattr(base_model, "gradient_checkpointing", False)
            and not (base_model.training and config.attention_dropout > 0))


def partitioned(parameter: torch.Tensor) -> bool:
    """A ZeRO-3 shard: the whole weight exists only inside its module's own forward."""
    return hasattr(parameter, "ds_id")


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A LlamaRMSNorm module's output; in fp32 (no autocast) from torch's one-kernel form, the same
    numbers at a sixth less time forward and backward than the module's five operations."""
    if (x.dtype == norm.weight.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type)
            and not partitioned(norm.weight)):
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    return norm(x)


def last_hidden_state(base_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      keys_values: list | None = None, from_position: int = 0, prefix: list | None = None) -> torch.Tensor:
    """[B, L − from_position, hidden] final hidden states of positions from_position … L − 1 of a
    (left- and/or right-) padded batch. The last layer runs its queries, attention output and MLP
    on those positions only (keys and values on all): a caller that reads the responses of a PPO
    batch, or one token per row, skips ~3 % of the forward. `keys_values`, a list, receives each
    layer's (keys, values) after RoPE, [B, kv_heads, width, head_dim] (a prefill). `prefix`, such a
    list from a prefill of positions 0 … S − 1 (with its graph, if any), stands in for those
    positions: the layers run on positions S … L − 1 only (from_position ≥ S)."""
    positions = position_ids(attention_mask)
    start = 0 if prefix is None else prefix[0][0].shape[2]
    if from_position < start:
        raise ValueError(f"from_position {from_position} lies inside the {start} prefix positions")
    if not unpadded_ok(base_model):
        if prefix is not None:
            raise ValueError("a prefix of keys and values needs the padding-free Llama forward")
        return base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          use_cache=False).last_hidden_state[:, from_position:]
    batch, length = input_ids.shape
    width = length - start  # the positions that run here
    index = attention_mask[:, start:].reshape(-1).nonzero().squeeze(1)  # flat [B, width] positions of real tokens
    x = base_model.embed_tokens(input_ids[:, start:].reshape(-1)[index])  # [N, hidden]
    cos, sin = base_model.rotary_emb(x, position_ids=positions[:, start:])
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, width, head_dim]: one rotation for all heads
    # Causal over real keys; a pad query attends to itself only, so no softmax row is all masked
    # (that row would be NaN, and its NaN gradient would reach real keys).
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=x.device)
    allowed = ((causal & attention_mask.bool()[:, None, :]) | diagonal)[:, None]
    # Additive rather than boolean: SDPA's CPU kernel took a fifth less time with it.
    mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, -torch.inf)
    # The last layer's rows: real tokens at positions ≥ from_position, laid out as [B, L − from_position].
    skipped = from_position - start
    column = index % width
    kept = (column >= skipped).nonzero().squeeze(1)  # rows of x
    kept_index = ((index // width) * (length - from_position) + column - skipped).index_select(0, kept)

    def padded(t: torch.Tensor, head_dim: int, flat: torch.Tensor, width: int) -> torch.Tensor:
        """[n, heads·d] at flat positions of a [B, width] layout → [B, heads, width, d]."""
        full = t.new_zeros(batch * width, t.shape[-1]).index_copy_(0, flat, t)  # in place: no copy of the zeros
        return full.view(batch, width, -1, head_dim).transpose(1, 2)

    layers = base_model.layers[: base_model.config.num_hidden_layers]
    for number, layer in enumerate(layers, start=1):
        attn = layer.self_attn
        h = rms_norm(layer.input_layernorm, x)
        k, v = (padded(proj(h), attn.head_dim, index, width) for proj in (attn.k_proj, attn.v_proj))
        k = k * cos + rotate_half(k) * sin
        if keys_values is not None:
            keys_values.append((k, v))
        if prefix is not None:
            k, v = torch.cat([prefix[number - 1][0], k], dim=2), torch.cat([prefix[number - 1][1], v], dim=2)
        query_index, queries = index, width
        if number == len(layers) and from_position > start:
            x, h = x.index_select(0, kept), h.index_select(0, kept)
            query_index, queries = kept_index, length - from_position
        q = padded(attn.q_proj(h), attn.head_dim, query_index, queries)
        q = q * cos[..., -queries:, :] + rotate_half(q) * sin[..., -queries:, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., -queries:, :].to(q.dtype),
                                             scale=attn.scaling, enable_gqa=True)
        # index_select, not [index]: the latter's backward (index_put with accumulation) took 5× longer
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch * queries, -1).index_select(0, query_index))
        x = x + layer.mlp(rms_norm(layer.post_attention_layernorm, x))
    x = rms_norm(base_model.norm, x)
    queries = length - from_position
    return x.new_zeros(batch * queries, x.shape[-1]).index_copy_(0, kept_index, x).view(batch, queries, -1)
