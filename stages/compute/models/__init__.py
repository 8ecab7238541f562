"""The forward passes the stages share, by architecture: a per-architecture fast path where one is
registered and applies, else the plain path (each model's own transformers forward).

`model.fast_path` (`auto` | `off`) chooses; `loading.load_model` records the setting on the model
(`set_fast_path`), so the reward model, critic, reference, actor and C-Eval scorer all follow it.
A model built elsewhere (tests, benches) takes `auto` unless `set_fast_path` says otherwise.

Adding a model's fast path: one module beside `llama.py` with `forward_applies(base_model)`,
`last_hidden_state(base_model, input_ids, attention_mask, from_position)`,
`decoder_applies(model)` and a decoder class (`prefill()`, `step(token)`), one entry in
`FAST_PATHS`, and an equality test against the plain path (tests/test_ppo_fast_paths.py). A
`StaticDecoder` class beside it (fixed shapes, state in tensors: `llama.StaticDecoder`) lets the
sampling loop replay its decode step as a CUDA graph (`model.cuda_graphs`, recorded by
`set_cuda_graphs`; stages/compute/ppo/static_sampling.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from stages.compute.models import llama, plain
from stages.compute.models.llama import mkl_pack, mkl_packing_pays, onednn_pack  # packed weights: plan.py sizes them
from stages.compute.models.plain import CachedDecoder, position_ids
from stages.compute.models.shapes import bucket

FAST_PATHS: dict[str, ModuleType] = {"llama": llama}  # config.model_type → its fast-path module
FAST_PATH_ATTRIBUTE = "rlhf_fast_path"
CUDA_GRAPHS_ATTRIBUTE = "rlhf_cuda_graphs"


def set_fast_path(model, setting: str) -> None:
    """Record `model.fast_path` on a loaded model (its base model carries it)."""
    if setting not in ("auto", "off"):
        raise ValueError(f"model.fast_path={setting!r}: expected auto or off")
    setattr(model.base_model, FAST_PATH_ATTRIBUTE, setting)


def fast_path(base_model) -> ModuleType | None:
    """The fast-path module registered for this model's architecture, unless its setting is off."""
    if getattr(base_model, FAST_PATH_ATTRIBUTE, "auto") == "off":
        return None
    return FAST_PATHS.get(base_model.config.model_type)


def set_cuda_graphs(model, setting: str) -> None:
    """Record `model.cuda_graphs` on a loaded model (its base model carries it)."""
    if setting not in ("auto", "off"):
        raise ValueError(f"model.cuda_graphs={setting!r}: expected auto or off")
    setattr(model.base_model, CUDA_GRAPHS_ATTRIBUTE, setting)


def static_decoder_class(model, device: torch.device | str):
    """The architecture's `StaticDecoder` where the sampling loop replays its step as a CUDA graph:
    `model.cuda_graphs: auto` (the default for a model built elsewhere), a CUDA device, a fast path
    with a static decoder that applies to this model; else None (the eager decoder)."""
    if getattr(model.base_model, CUDA_GRAPHS_ATTRIBUTE, "auto") == "off" or torch.device(device).type != "cuda":
        return None
    fast = fast_path(model.base_model)
    if fast is None or not fast.decoder_applies(model):
        return None
    return getattr(fast, "StaticDecoder", None)


LENGTH_QUANTUM = 64  # a GPU batch's length pads to a power of two up to this, then to its multiples (`shapes.bucket`)


def last_hidden_state(base_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      from_position: int = 0, bucketed: bool | None = None) -> torch.Tensor:
    """[B, L − from_position, hidden] final hidden states of positions from_position … L − 1 of a
    (left- and/or right-) padded batch, by the fast path where it applies. `bucketed` (None: on a
    CUDA device) runs the fast path on the batch right-padded to a bucket length, so that token
    batches of every length share a few shapes (attention's, the compiled kernels'); the pads are
    masked keys past every real token and never reach a linear layer, so the hidden states are the
    same."""
    fast = fast_path(base_model)
    if fast is not None and fast.forward_applies(base_model):
        length = input_ids.shape[1]
        if bucketed if bucketed is not None else input_ids.device.type == "cuda":
            pads = bucket(length, quantum=LENGTH_QUANTUM) - length
            input_ids, attention_mask = F.pad(input_ids, (0, pads)), F.pad(attention_mask, (0, pads))
        return fast.last_hidden_state(base_model, input_ids, attention_mask, from_position)[:, : length - from_position]
    return plain.last_hidden_state(base_model, input_ids, attention_mask, from_position)


def decoder(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
    """The sampling loop's model steps: `prefill()` gives the logits after each prompt, then
    `step(token)` feeds one token per row and gives the next logits, both [B, vocab]."""
    fast = fast_path(model.base_model)
    if fast is not None and fast.decoder_applies(model):
        return fast.Decoder(model, prompt_ids, prompt_mask, max_new_tokens)
    return CachedDecoder(model, prompt_ids, prompt_mask, max_new_tokens)


__all__ = ["FAST_PATHS", "CachedDecoder", "decoder", "fast_path", "last_hidden_state", "mkl_pack", "mkl_packing_pays",
           "onednn_pack", "position_ids", "set_cuda_graphs", "set_fast_path", "static_decoder_class"]
