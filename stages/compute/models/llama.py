"""Llama-architecture fast paths (SmolLM2, Llama, the tiny test models), chosen by
`stages.compute.models` under `model.fast_path: auto`.

`last_hidden_state`: a decoder forward whose linear layers skip the padding. Rollout batches are
padded twice: prompts on the left to the longest prompt, responses on the right after their EOS,
and a linear layer costs the same for a pad as for a token. Here every linear layer runs on the
real tokens only, gathered into one [N, hidden] matrix; only attention, which needs the [batch,
length] layout, scatters them back. The result is the same hidden states as the model's own forward
(tests compare them), with zeros at pad positions.

`Decoder`: our own decode step for the sampling loop. At small batch a decode step is bound by
reading the weights: q|k|v and gate|up are one matrix product each; on a CPU the weights are
packed once per rollout for the batch size (`PackedLinear`: bf16 in oneDNN's blocked layout, fp32
for MKL's packed GEMM on Intel CPUs); attention reads the filled part of the cache only; the prompt goes through the padding-free body,
which hands over its keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from stages.compute.models import fused
from stages.compute.models.embedding import embed
from stages.compute.models.plain import partitioned, position_ids
from stages.leaves.precision import cpu_vendor


def forward_applies(base_model) -> bool:
    """Whether the padding-free forward computes what the model's own would: not in training with
    gradient checkpointing (transformers checkpoints its layers in training only) or attention dropout."""
    return not (base_model.training and (getattr(base_model, "gradient_checkpointing", False)
                                         or base_model.config.attention_dropout > 0))


def decoder_applies(model) -> bool:
    """The decode step reads whole weights outside their modules: not under ZeRO-3, whose weights
    exist whole only inside their module's own forward."""
    return forward_applies(model.base_model) and not any(partitioned(p) for p in model.parameters())


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A LlamaRMSNorm module's output; in fp32 (no autocast) from torch's one-kernel form, the same
    numbers in one kernel forward and backward instead of the module's five operations; in bf16
    under autograd (CPU or GPU) from a compiled kernel of the module's formula (`fused`)."""
    if partitioned(norm.weight):
        return norm(x)
    if x.dtype == norm.weight.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    if x.dtype == norm.weight.dtype and fused.applies(x):
        return fused.fused(fused.rms_norm, x, norm.weight, norm.variance_epsilon)
    return norm(x)


def mlp(module, x: torch.Tensor) -> torch.Tensor:
    """A LlamaMLP's output, down(act(gate(x)) · up(x)); SiLU · up from a compiled kernel where `fused` applies."""
    if getattr(module.config, "hidden_act", None) in ("silu", "swish") and fused.applies(x):
        return module.down_proj(fused.fused(fused.swiglu, module.gate_proj(x), module.up_proj(x)))
    return module(x)


def last_hidden_state(base_model, input_ids: torch.Tensor, attention_mask: torch.Tensor, from_position: int = 0,
                      keys_values: list | None = None) -> torch.Tensor:
    """[B, L − from_position, hidden] final hidden states of positions from_position … L − 1 of a
    (left- and/or right-) padded batch. The last layer runs its queries, attention output and MLP
    on those positions only (keys and values on all). `keys_values`, a list, receives each layer's
    (keys, values) after RoPE, [B, kv_heads, L, head_dim] (the decoder's prefill)."""
    positions = position_ids(attention_mask)
    batch, length = input_ids.shape
    width = length
    index = attention_mask.reshape(-1).nonzero().squeeze(1)  # flat [B, L] positions of real tokens
    x = embed(base_model.embed_tokens, input_ids.reshape(-1)[index])  # [N, hidden]
    cos, sin = signed(*base_model.rotary_emb(x, position_ids=positions))
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, width, head_dim]: one rotation for all heads
    # Causal over real keys; a pad query attends to itself only, so no softmax row is all masked
    # (that row would be NaN, and its NaN gradient would reach real keys).
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=x.device)
    allowed = ((causal & attention_mask.bool()[:, None, :]) | diagonal)[:, None]
    # Additive rather than boolean: SDPA's CPU kernel is faster with it (bench/ppo_step.py).
    mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, -torch.inf)
    # The last layer's rows: real tokens at positions ≥ from_position, laid out as [B, L − from_position].
    skipped = from_position
    column = index % width
    kept = (column >= skipped).nonzero().squeeze(1)  # rows of x
    kept_index = ((index // width) * (length - from_position) + column - skipped).index_select(0, kept)

    def padded(t: torch.Tensor, head_dim: int, flat: torch.Tensor, width: int) -> torch.Tensor:
        """[n, heads·d] at flat positions of a [B, width] layout → [B, heads, width, d]."""
        full = t.new_zeros(batch * width, t.shape[-1]).index_copy_(0, flat, t)  # in place: no copy of the zeros
        return full.view(batch, width, -1, head_dim).transpose(1, 2)

    layers = base_model.layers[: base_model.config.num_hidden_layers]
    expanded_masks: dict = {}  # the explicit products' form of the mask, made once for all layers
    for number, layer in enumerate(layers, start=1):
        attn = layer.self_attn
        h = rms_norm(layer.input_layernorm, x)
        query_index, queries = index, width
        fewer_queries = number == len(layers) and from_position > 0  # the kept rows' queries only
        # The separate products there, and under ZeRO-3, whose weights are whole only inside their
        # module's own forward (packed_qkv reads them outside).
        if fewer_queries or partitioned(attn.q_proj.weight):
            k, v = (padded(proj(h), attn.head_dim, index, width) for proj in (attn.k_proj, attn.v_proj))
            if fewer_queries:
                x, h = x.index_select(0, kept), h.index_select(0, kept)
                query_index, queries = kept_index, length - from_position
            q = padded(attn.q_proj(h), attn.head_dim, query_index, queries)
        else:
            q, k, v = padded(packed_qkv(attn, h), attn.head_dim, index, width).split(
                [attn.q_proj.out_features // attn.head_dim, *[attn.k_proj.out_features // attn.head_dim] * 2], dim=1)
        k = rotate(k, cos, sin)
        if keys_values is not None:
            keys_values.append((k, v))
        q = rotate(q, cos[..., -queries:, :], sin[..., -queries:, :])
        out = attention(q, k, v, mask[..., -queries:, :].to(q.dtype), attn.scaling, expanded_masks)
        # index_select, not [index]: the latter's backward is an index_put with accumulation, far slower
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch * queries, -1).index_select(0, query_index))
        x = x + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
    x = rms_norm(base_model.norm, x)
    queries = length - from_position
    return x.new_zeros(batch * queries, x.shape[-1]).index_copy_(0, kept_index, x).view(batch, queries, -1)


def packed_qkv(attn, h: torch.Tensor) -> torch.Tensor:
    """[N, (heads + 2 · kv_heads) · d]: the queries, keys and values of h as one product with the
    three weights stacked (copied each forward: ~1 MB a layer at SmolLM2's size) — one matrix product
    forward and one for h's gradient instead of three each, and the backward's three h gradients
    not added up."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None if attn.q_proj.bias is None else torch.cat([proj.bias for proj in projections])
    return F.linear(h, torch.cat([proj.weight for proj in projections]), bias)


def signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin as `rotate` takes them: the sign of rotate_half folded into sin."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE, x·cos + rotate_half(x)·sin: rotate_half(x) = (−x₂, x₁) is x rolled by half a head
    times (−1, 1), so with that sign in sin (`signed`) the same numbers take four operations
    instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              expanded_masks: dict | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v over grouped-query heads: q [B, heads, Lq, d], k and v
    [B, kv_heads, L, d], mask [B, 1, Lq, L] additive. SDPA's fused kernel, except in bf16 on a CPU
    with gradients: there the explicit products, whose backward ran ×2 faster than SDPA's, which in
    fp32 was the faster one (bench/attention.py measures both); and on a GPU, `expanded_attention`.
    `expanded_masks`: `explicit_attention`'s cache of its form of the mask, shared by a forward's layers."""
    if q.device.type == "cuda":
        return expanded_attention(q, k, v, mask, scale)
    if not (q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and q.requires_grad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return explicit_attention(q, k, v, mask, scale, expanded_masks)


# SDPA's kernels other than cuDNN's, the memory-efficient one first where it applies.
NOT_CUDNN = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` with the keys and values repeated for every query head, by SDPA's kernels other
    than cuDNN's. On a GPU, grouped-query heads with a mask leave SDPA only cuDNN's kernel (the
    memory-efficient one takes no `enable_gqa`), and cuDNN builds a plan for every new shape, which
    dynamic token batches have at most steps of an epoch. With the heads expanded, as transformers' own SDPA path does, the memory-efficient kernel
    takes the mask and has no per-shape cost."""
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(NOT_CUDNN):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                              attn_mask=mask, scale=scale)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       expanded_masks: dict | None = None) -> torch.Tensor:
    """`attention` as matrix products and a softmax. Query heads g·j … g·j + g − 1 share key/value
    head j (SDPA's enable_gqa): they are stacked as the rows of one product with that head's keys and
    values, which are then never copied per query head. The product adds the mask and the scale
    itself (baddbmm: mask + scale · q kᵀ), one pass over the scores fewer than adding the mask after
    it; for that the mask is repeated to the product's [B · kv_heads, g · Lq, L] layout, once per
    forward where `expanded_masks` (a dict kept across its layers) is given."""
    batch, heads, queries, d = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    cache = {} if expanded_masks is None else expanded_masks
    key = (queries, keys, kv_heads, group)
    if key not in cache:
        cache[key] = mask.repeat(1, kv_heads, group, 1).view(batch * kv_heads, group * queries, keys)
    scores = torch.baddbmm(cache[key], q.reshape(batch * kv_heads, group * queries, d),
                           k.reshape(batch * kv_heads, keys, d).transpose(1, 2), alpha=scale)
    return (scores.softmax(dim=-1) @ v.reshape(batch * kv_heads, keys, d)).view(batch, heads, queries, d)


class Decoder:
    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self._allocate(model, *prompt_ids.shape, max_new_tokens)
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        # Additive attention bias over cache slots: −inf on the prompts' left padding.
        self.bias[:, 0, 0, : self.width].masked_fill_(prompt_mask == 0, -torch.inf)
        self.positions = position_ids(prompt_mask)[:, -1:]
        self.filled = self.width

    def _allocate(self, model, batch: int, width: int, max_new_tokens: int, packed: bool = True) -> None:
        self.base, self.width = model.base_model, width
        config = self.base.config
        layers = self.base.layers[: config.num_hidden_layers]
        packed_batch = batch if packed else None
        self.layers = [DecodeLayer(layer, config, packed_batch) for layer in layers]
        self.lm_head = PackedLinear([model.get_output_embeddings()], packed_batch)
        weight = self.lm_head.weight
        shape = (len(layers), batch, config.num_key_value_heads, width + max_new_tokens, layers[0].self_attn.head_dim)
        self.keys = weight.new_zeros(shape)
        self.values = weight.new_zeros(shape)
        self.bias = weight.new_zeros((batch, 1, 1, shape[3]))

    def prefill(self) -> torch.Tensor:
        """The logits after each prompt."""
        keys_values: list = []
        hidden = last_hidden_state(self.base, self.prompt_ids, self.prompt_mask, keys_values=keys_values,
                                   from_position=self.width - 1)[:, -1]  # left-padded prompts all end at P − 1
        for layer, (k, v) in enumerate(keys_values):
            self.keys[layer, :, :, : self.width] = k
            self.values[layer, :, :, : self.width] = v
        return self.lm_head(hidden)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        x = self.base.embed_tokens(token)  # [B, hidden]
        self.positions = self.positions + 1
        cos, sin = signed(*self.base.rotary_emb(x, position_ids=self.positions))  # [B, 1, head_dim]
        slot = self.filled
        self.filled += 1
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.keys[index], self.values[index], slot, self.bias[..., : self.filled])
        return self.lm_head(rms_norm(self.base.norm, x))


class StaticDecoder(Decoder):
    """`Decoder` whose step has fixed shapes and keeps its state in tensors, so that a CUDA graph
    can replay it (stages/compute/ppo/static_sampling.py): the cache slot and the positions are tensors
    updated in place, and attention reads every slot of the cache, the slots not yet written
    masked by the bias. Every step then runs the same kernels on the same buffers. Allocated once
    for a (batch, prompt width, new tokens) shape; `start` loads the next prompts of that shape,
    `refresh` the actor's weights after a training step."""

    def __init__(self, model, batch: int, width: int, max_new_tokens: int):
        self._allocate(model, batch, width, max_new_tokens, packed=False)  # plain weights: `refresh` copies into them
        self.positions = self.bias.new_zeros((batch, 1), dtype=torch.long)
        self.slot = self.bias.new_zeros(1, dtype=torch.long)

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Load prompts [batch, width] and give the logits after each (the prefill, eager)."""
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.bias.fill_(-torch.inf)
        self.bias[:, 0, 0, : self.width].masked_fill_(prompt_mask != 0, 0.0)
        self.positions.copy_(position_ids(prompt_mask)[:, -1:])
        self.slot.fill_(self.width)
        return self.prefill()

    def refresh(self) -> None:
        """Copy the actor's current weights into the stacked copies, in place (the graph reads their
        addresses)."""
        for linear in [self.lm_head, *(p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]:
            linear.refresh()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        x = self.base.embed_tokens(token)  # [B, hidden]
        self.positions.add_(1)
        cos, sin = signed(*self.base.rotary_emb(x, position_ids=self.positions))  # [B, 1, head_dim]
        self.bias.index_fill_(-1, self.slot, 0.0)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.keys[index], self.values[index], self.slot, self.bias)
        self.slot.add_(1)
        return self.lm_head(rms_norm(self.base.norm, x))


class DecodeLayer:
    """One decoder layer for one new token per row, writing its keys and values into cache slot `slot`:
    an int (attention reads slots up to it), or a one-element tensor (`StaticDecoder`: attention
    reads the whole cache, the bias masking the slots not yet written)."""

    def __init__(self, layer, config, batch: int | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], batch)
        self.o = PackedLinear([attn.o_proj], batch)
        self.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj], batch)
        self.down = PackedLinear([mlp.down_proj], batch)
        self.attention_norm, self.mlp_norm, self.act = layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling

    def __call__(self, x, cos, sin, keys, values, slot: int | torch.Tensor, bias):
        batch, heads, kv_heads, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qk, v = self.qkv(rms_norm(self.attention_norm, x)).split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        qk = qk.view(batch, heads + kv_heads, d)
        qk = rotate(qk, cos, sin)  # RoPE on queries and keys at once (cos, sin: [B, 1, d])
        q, k = qk.split([heads, kv_heads], dim=1)
        if isinstance(slot, int):
            keys[:, :, slot] = k
            values[:, :, slot] = v.view(batch, kv_heads, d)
            keys, values = keys[:, :, : slot + 1], values[:, :, : slot + 1]
        else:
            keys.index_copy_(2, slot, k[:, :, None])
            values.index_copy_(2, slot, v.view(batch, kv_heads, 1, d))
        # Grouped-query attention: query heads g·j … g·j + g − 1 share key/value head j.
        q = q.view(batch, kv_heads, heads // kv_heads, d)
        scores = (q @ keys.transpose(-1, -2)).mul_(self.scaling).add_(bias)  # [B, kv_heads, g, T]
        out = scores.softmax(dim=-1) @ values
        x = x + self.o(out.reshape(batch, heads * d))
        gate, up = self.gate_up(rms_norm(self.mlp_norm, x)).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


class PackedLinear:
    """x Wᵀ + b for the given linear layers stacked by output, at a fixed batch size. On a CPU the
    weight is packed once for that batch size, which a small batch then reads faster than the plain
    product does (which re-lays the weight out at every call): bf16 weights in oneDNN's blocked
    layout (the same numbers), fp32 weights for MKL's packed GEMM where that pays
    (`mkl_packing_pays`). Elsewhere, or with no batch size given, the plain product.
    bench/packed_linear.py times each."""

    def __init__(self, linears: list, batch: int | None):
        self.linears = linears
        weights = [linear.weight.detach() for linear in linears]
        self.weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        biases = [linear.bias for linear in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
        self.batch = batch
        self.packed = None if batch is None else pack(self.weight, batch)

    def refresh(self) -> None:
        """The layers' current weights into this one's, in place (plain weights: a packed copy is laid
        out for its batch size when made)."""
        if len(self.linears) > 1:
            torch.cat([linear.weight.detach() for linear in self.linears], out=self.weight)
        if self.bias is not None:
            torch.cat([b.detach() if b is not None else linear.weight.new_zeros(linear.weight.shape[0])
                       for b, linear in zip((linear.bias for linear in self.linears), self.linears)], out=self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.packed.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.batch)


def pack(weight: torch.Tensor, batch: int) -> torch.Tensor | None:
    """The weight packed for `batch` rows (`PackedLinear`), or None where it stays plain."""
    if weight.dtype == torch.bfloat16:
        return onednn_pack(weight, batch)
    return mkl_pack(weight, batch) if mkl_packing_pays() else None


def mkl_packing_pays() -> bool:
    """Whether the decoder packs fp32 weights for MKL: on Intel CPUs only. MKL's packed GEMM won on an
    Intel Xeon and lost to the plain product on an AMD EPYC (MKL is tuned for Intel's CPUs), and the
    padded copies cost memory everywhere (bench/packed_linear.py measures both on the machine at hand)."""
    return cpu_vendor() == "GenuineIntel"


def onednn_pack(weight: torch.Tensor, batch: int) -> torch.Tensor | None:
    """A bf16 weight in oneDNN's blocked layout for `batch` rows, or None where oneDNN cannot."""
    if (weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    except (AttributeError, RuntimeError):  # a build without oneDNN's linear ops
        return None


def mkl_pack(weight: torch.Tensor, batch: int) -> torch.Tensor | None:
    """An fp32 weight packed for MKL's GEMM on `batch` rows, or None where MKL cannot."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
    except (AttributeError, RuntimeError):  # a build without the packed-GEMM ops
        return None
