"""A reward model from any causal LM: a scalar head read at the last non-pad token, with the LM
head kept for the auxiliary LM loss. Saved as the LM's own safetensors folder plus
`score_head.safetensors` and `reward_config.json` (held-out score statistics)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stages.compute import loading
from stages.compute.losses import next_token_targets
from stages.compute.models import last_hidden_state
from stages.leaves.config import ModelConfig

SCORE_HEAD_FILE = "score_head.safetensors"
REWARD_CONFIG_FILE = "reward_config.json"


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of the last non-pad token of each row, for left and right padding alike."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask * positions).argmax(dim=1)


class RewardModel(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        hidden_size = lm.config.hidden_size
        self.score_head = torch.nn.Linear(hidden_size, 1, dtype=lm.dtype)
        torch.nn.init.normal_(self.score_head.weight, std=1.0 / math.sqrt(hidden_size + 1))
        torch.nn.init.zeros_(self.score_head.bias)
        # Held-out score statistics, stored with the model (PPO starts its running moments here).
        self.score_mean, self.score_std = 0.0, 1.0
        # A critic's: the running score statistics its pre-training ended with (RunningMoments.state_dict()).
        self.running_moments: dict | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lm_labels: torch.Tensor | None = None):
        """(reward of each row, LM part): the LM part is None without `lm_labels` (the first rows'
        labels, -100 elsewhere), else (LM logits [M, vocab] at the M positions of those rows that
        predict a labelled token, those tokens [M])."""
        # Positions count real tokens only, so a left-padded row sees the positions of its
        # right-padded twin (absolute position embeddings included); pads cost no linear layer.
        last_index = last_token_index(attention_mask)
        # Without LM rows only the last tokens are read: the last layer skips positions before them.
        first = 0 if lm_labels is not None else int(last_index.min())
        hidden = last_hidden_state(self.lm.base_model, input_ids, attention_mask, from_position=first)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, last_index - first]
        rewards = self.score_head(last.to(self.score_head.weight.dtype)).squeeze(-1).float()
        if lm_labels is None:
            return rewards, None
        # The LM head on the predicting positions only: the prompts' and the padding's rows of a
        # [rows, length, vocab] matrix would be computed, cast and normalised for nothing.
        positions, targets = next_token_targets(lm_labels)
        predicting = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return rewards, (self.lm.get_output_embeddings()(predicting), targets)


def reward_model_from_lm(model_dir: str, model_cfg: ModelConfig, dtype=None) -> RewardModel:
    lm = loading.load_model(model_dir, model_cfg, dtype)
    lm.config.use_cache = False
    return RewardModel(lm)


def save_reward_model(model: RewardModel, tokenizer, out: Path, extra: dict) -> None:
    """LM (save_pretrained, safetensors) + tokenizer + score head + reward_config.json."""
    model.lm.config.use_cache = True
    model.lm.save_pretrained(out, safe_serialization=True)
    model.lm.config.use_cache = False
    tokenizer.save_pretrained(out)
    head = {name: tensor.detach().cpu().contiguous() for name, tensor in model.score_head.state_dict().items()}
    save_file(head, str(out / SCORE_HEAD_FILE))
    config = {"pooling": "last_non_pad_token", "hidden_size": model.lm.config.hidden_size,
              "score_mean": model.score_mean, "score_std": model.score_std, **extra}
    (out / REWARD_CONFIG_FILE).write_text(json.dumps(config, indent=1))


def load_reward_model(folder: str | Path, model_cfg: ModelConfig, dtype=None) -> RewardModel:
    """A saved reward model, with `score_mean`/`score_std` from its reward_config.json, and for a
    critic the running score statistics its pre-training ended with (`running_moments`). Weights in
    `dtype` (default fp32)."""
    folder = Path(folder)
    model = reward_model_from_lm(str(folder), model_cfg, dtype)
    model.score_head.load_state_dict(load_file(str(folder / SCORE_HEAD_FILE)))
    config = json.loads((folder / REWARD_CONFIG_FILE).read_text())
    model.score_mean, model.score_std = config["score_mean"], config["score_std"]
    model.running_moments = config.get("running_moments")
    return model
