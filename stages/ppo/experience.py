"""Experience: sample responses from the actor and score them with the four models.

Layout of a rollout batch: `sequences` = [prompt, left-padded to width P | response, R tokens,
padded after the first EOS]. Per-token arrays are [B, R]: position j is the j-th response token
a_j, its log-probabilities under π_old and π_SFT, and V(s_j), the critic's value of the state
before a_j (read at sequence position P + j − 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stages.reward.model import RewardModel


@dataclass
class Experience:
    sequences: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]: prompt tokens and response tokens up to EOS
    prompt_width: int
    response_mask: torch.Tensor  # [B, R] float, 1 on response tokens (EOS included)
    ended_with_eos: torch.Tensor  # [B] bool
    logprobs: torch.Tensor  # log π_old(a_j | s_j)
    ref_logprobs: torch.Tensor  # log π_SFT(a_j | s_j)
    values: torch.Tensor  # V_old(s_j)
    scores: torch.Tensor  # [B] raw score r(x, y)
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    seconds: dict[str, float] | None = None  # wall time of each rollout phase, for time/* metrics and bench/

    def rows(self, index: torch.Tensor) -> "Experience":
        """A minibatch: the same fields for a subset of rows."""
        picked = {k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Experience(**picked)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, as generation uses them for left-padded prompts."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Logits predicting each response token: the LM head runs on response positions only."""
    hidden = model.base_model(input_ids=sequences, attention_mask=attention_mask,
                              position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[:, prompt_width - 1 : -1])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(a_j | s_j) under the sampling distribution (logits / temperature)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_values(critic: RewardModel, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """V(s_j) for every response token: the reward model's scalar head applied per token."""
    hidden = critic.lm.base_model(input_ids=sequences, attention_mask=attention_mask,
                                  position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    head = critic.score_head
    return head(hidden[:, prompt_width - 1 : -1].to(head.weight.dtype)).squeeze(-1).float()


def left_pad(prompts: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, repetition_penalty: float, do_sample: bool = True, device: str = "cpu"):
    """(sequences, attention_mask, prompt width, response mask, ended_with_eos); stops at EOS."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    was_training = actor.training
    actor.eval()
    sequences = actor.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature if do_sample else None, top_p=top_p if do_sample else None,
        top_k=top_k if do_sample else None, repetition_penalty=repetition_penalty,
        eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True,
    )
    actor.train(was_training)
    width = prompt_ids.shape[1]
    response = sequences[:, width:]
    if response.shape[1] == 0:  # nothing generated at all: one pad column to keep shapes valid
        response = torch.full((len(prompts), 1), pad_id, dtype=torch.long, device=device)
    is_eos = response == eos_id
    ended = is_eos.any(dim=1)
    last = torch.where(ended, is_eos.float().argmax(dim=1), torch.full_like(ended, response.shape[1] - 1, dtype=torch.long))
    response_mask = torch.arange(response.shape[1], device=device)[None, :] <= last[:, None]
    response = torch.where(response_mask, response, torch.full_like(response, pad_id))
    sequences = torch.cat([prompt_ids, response], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return sequences, attention_mask, width, response_mask.float(), ended


@torch.no_grad()
def make_experience(actor, reference, critic: RewardModel, score_fn, prompts: list[list[int]], *, eos_id: int,
                    pad_id: int, generation: dict, device: str = "cpu") -> Experience:
    """Roll out the actor on `prompts` and record log π_old, log π_SFT, V_old and r(x, y).
    `score_fn(sequences, attention_mask, prompt_width, response_mask)` returns [B] scores."""
    lap = Laps(device)
    sequences, attention_mask, width, response_mask, ended = generate(
        actor, prompts, eos_id=eos_id, pad_id=pad_id, device=device, **generation)
    lap("generate")
    tokens = sequences[:, width:]
    temperature = generation["temperature"]
    logprobs = token_logprobs(response_logits(actor, sequences, attention_mask, width), tokens, temperature)
    lap("logprobs")
    ref_logprobs = logprobs if reference is actor else token_logprobs(
        response_logits(reference, sequences, attention_mask, width), tokens, temperature)
    lap("ref_logprobs")
    values = token_values(critic, sequences, attention_mask, width)
    lap("values")
    scores = score_fn(sequences, attention_mask, width, response_mask).float()
    lap("scores")
    return Experience(sequences, attention_mask, width, response_mask, ended, logprobs * response_mask,
                      ref_logprobs * response_mask, values * response_mask, scores, seconds=lap.seconds)


class Laps:
    """Wall seconds of consecutive phases, by name. Waits for the GPU at each lap: kernels run
    asynchronously, and a phase would else be charged for the previous one's."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase], self.last = now - self.last, now


def reward_model_scores(reward_model: RewardModel):
    """score_fn reading r(x, y) at the last response token (EOS when there is one)."""

    def score(sequences, attention_mask, prompt_width, response_mask):
        rewards, _ = reward_model(input_ids=sequences, attention_mask=attention_mask)
        return rewards

    return score


def rule_scores(tokenizer, rule: str):
    """A rule-based score_fn beside the RM, for tests and reward debugging:
    `char_fraction:<c>` — the share of characters of the response equal to c."""
    name, _, arg = rule.partition(":")
    if name != "char_fraction" or len(arg) != 1:
        raise ValueError(f"unknown rule reward '{rule}'; known: char_fraction:<one character>")

    def score(sequences, attention_mask, prompt_width, response_mask):
        texts = tokenizer.batch_decode(sequences[:, prompt_width:], skip_special_tokens=True)  # post-EOS: pads
        return torch.tensor([t.count(arg) / max(len(t), 1) for t in texts], device=sequences.device)

    return score
