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

from stages.compute.models import last_hidden_state
from stages.compute.ppo.generation import generate
from stages.compute.reward.model import RewardModel
from stages.leaves.logprobs import token_logprobs


@dataclass
class Experience:
    sequences: torch.Tensor  # [B, P+R]
    attention_mask: torch.Tensor  # [B, P+R]: prompt tokens and response tokens up to EOS
    prompt_width: int
    response_mask: torch.Tensor  # [B, R] float, 1 on response tokens (EOS included)
    ended_with_eos: torch.Tensor  # [B] bool
    logprobs: torch.Tensor  # log π_old(a_j | s_j)
    ref_logprobs: torch.Tensor  # log π_SFT(a_j | s_j)
    values: torch.Tensor | None  # V_old(s_j); None without a critic
    scores: torch.Tensor  # [B] raw score r(x, y)
    # log π_old and log π_SFT at T = 1, the models' own distributions: their perplexities (the
    # paper's collapse indicator). The same tensors as logprobs / ref_logprobs when T = 1.
    model_logprobs: torch.Tensor | None = None
    ref_model_logprobs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    groups: torch.Tensor | None = None  # [B] long: rows with one index are samples of one prompt (adjacent rows)
    seconds: dict[str, float] | None = None  # wall time of each rollout phase, for time/* metrics and bench/

    def rows(self, index: torch.Tensor) -> "Experience":
        """A minibatch: the same fields for a subset of rows."""
        return Experience(**{k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Logits predicting each response token: the last layer and the LM head run on response
    positions only (position P − 1 predicts the first response token)."""
    hidden = last_hidden_state(model.base_model, sequences, attention_mask, from_position=prompt_width - 1)[:, :-1]
    # Contiguous: on the strided slice a linear layer broadcasts its weight to a batched product,
    # a copy of the [vocab, hidden] weight per row.
    return model.get_output_embeddings()(hidden.contiguous())


def token_values(critic: RewardModel, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """V(s_j) for every response token: the reward model's scalar head applied per token."""
    hidden = last_hidden_state(critic.lm.base_model, sequences, attention_mask, from_position=prompt_width - 1)
    head = critic.score_head
    return head(hidden[:, :-1].to(head.weight.dtype)).squeeze(-1).float()


@torch.no_grad()
def make_experience(actor, reference, critic: RewardModel | None, score_fn, prompts: list[list[int]], *, eos_id: int,
                    pad_id: int, generation: dict, device: str = "cpu") -> Experience:
    """Roll out the actor on `prompts` and record log π_old, log π_SFT, V_old and r(x, y).
    `score_fn(sequences, attention_mask, prompt_width, response_mask)` returns [B] scores.
    critic None: no values (a critic-free advantage estimator)."""
    lap = Laps(device)
    rollout = generate(actor, prompts, eos_id=eos_id, pad_id=pad_id, device=device, **generation)
    lap("generate")  # log π_old comes with the samples: no second forward of the actor
    sequences, attention_mask, width = rollout.sequences, rollout.attention_mask, rollout.prompt_width
    response_mask = rollout.response_mask
    temperature, response = generation["temperature"], sequences[:, width:]
    if reference is actor:
        ref_logprobs, ref_model_logprobs = rollout.logprobs, rollout.model_logprobs
    else:
        ref_logits = response_logits(reference, sequences, attention_mask, width)
        ref_logprobs = token_logprobs(ref_logits, response, temperature) * response_mask
        ref_model_logprobs = (token_logprobs(ref_logits, response, 1.0) * response_mask
                              if temperature != 1.0 else ref_logprobs)
        del ref_logits
    lap("ref_logprobs")
    values = None
    if critic is not None:
        values = token_values(critic, sequences, attention_mask, width) * response_mask
        lap("values")
    scores = score_fn(sequences, attention_mask, width, response_mask).float()
    lap("scores")
    return Experience(sequences, attention_mask, width, response_mask, rollout.ended_with_eos, rollout.logprobs,
                      ref_logprobs, values, scores, model_logprobs=rollout.model_logprobs,
                      ref_model_logprobs=ref_model_logprobs, seconds=lap.seconds)


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
