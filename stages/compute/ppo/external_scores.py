"""Where scores r(x, y) come from: PPO's (`ppo.reward`) and the eval stage's `reward_source` judge's:

- `rm`: the trained reward model, read at the last response token (stages/compute/ppo/experience.py);
- `char_fraction:<c>`: a rule, for tests and reward debugging (stages/compute/ppo/experience.py);
- `python:package.module:function`: a rule or verifier, `function(prompts, responses) -> scores`;
- `http://…` / `https://…`: a reward server, one JSON request per batch (the API below).

A text source sees each prompt as the policy saw it (rendered by its chat template, pads
removed) and each response as answer text (decoded without special tokens, stripped: the form of
the data's answers), plus whether it ended with EOS.

The HTTP API (`rlhf serve-reward` serves a registered reward model with it):
    POST {"prompts": [str], "responses": [str], "ended": [bool], "query": [prompt + response]}
    →    {"scores": [float | null]}   ("rewards" is read too: OpenRLHF's remote RM answers with it)
`query` is there for servers written for OpenRLHF's remote reward API. A null score is a score the
model could not give as a finite number (JSON has no NaN): it is read as NaN, so PPO's NaN/Inf
guard skips the iteration exactly as it does when its in-process reward model scores NaN. A request that fails
(connection, timeout, 5xx) is retried `ppo.reward_retries` times with exponential backoff, or after
the seconds a 503's Retry-After asks for;
`ppo.reward_auth_env` names an environment variable whose value goes out as a bearer token
(never logged). The eval stage's judge has the same three settings of its own.
"""

from __future__ import annotations

import http.client
import importlib
import json
import math
import os
import time
import urllib.error
import urllib.request

import torch

from stages.leaves.dist import Dist


class RewardSourceError(RuntimeError):
    """A reward source that cannot be loaded or that answered wrongly: the message says which."""


class RewardServerUnavailable(RewardSourceError):
    """A reward server that did not answer (connection refused or dropped, timeout) or answered 5xx
    through every retry: PPO stops at the iteration boundary with a checkpoint (stages/pipeline/ppo.py)."""


def retry_after(header: str | None, default: float) -> float:
    """Seconds a 503's Retry-After asks for (delay-seconds; an HTTP date or nonsense: `default`),
    at most 60."""
    try:
        return min(max(float(header), 0.0), 60.0) if header is not None else default
    except ValueError:
        return default


def batch_texts(tokenizer, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                response_mask: torch.Tensor) -> tuple[list[str], list[str], list[bool]]:
    """(prompts, responses, ended) of a rollout batch: the prompt's real tokens decoded as they are
    (chat template included), the response's without special tokens and stripped, ended = its last
    token is EOS."""
    prompts, responses, ended = [], [], []
    for sequence, mask, response in zip(sequences, attention_mask, response_mask):
        prompt_ids = sequence[:prompt_width][mask[:prompt_width].bool()]
        response_ids = sequence[prompt_width:][response[: sequence.shape[0] - prompt_width].bool()]
        prompts.append(tokenizer.decode(prompt_ids))
        responses.append(tokenizer.decode(response_ids, skip_special_tokens=True).strip())
        ended.append(bool(len(response_ids)) and int(response_ids[-1]) == tokenizer.eos_token_id)
    return prompts, responses, ended


def _checked(scores, count: int, where: str) -> list[float]:
    if not isinstance(scores, (list, tuple)) or len(scores) != count:
        raise RewardSourceError(f"{where} returned {type(scores).__name__} of length "
                                f"{len(scores) if hasattr(scores, '__len__') else '?'}; wanted {count} numbers")
    try:
        return [float(s) for s in scores]
    except (TypeError, ValueError):
        raise RewardSourceError(f"{where} returned a score that is not a number") from None


def python_function(spec: str, setting: str = "ppo.reward"):
    """`python:package.module:function` → the function (imported now: a typo fails before any
    rollout); errors name the `setting` it came from."""
    target = spec.removeprefix("python:")
    module_name, _, function_name = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise RewardSourceError(f"{setting}={spec}: cannot import {function_name!r} from {module_name!r} ({err})") from None
    if not callable(function):
        raise RewardSourceError(f"{setting}={spec}: {target} is not callable")
    return function


def post_scores(url: str, prompts: list[str], responses: list[str], ended: list[bool], *, timeout_s: float,
                retries: int, auth_env: str | None) -> list[float]:
    """One batch to a reward server (the API in the module docstring)."""
    body = json.dumps({"prompts": prompts, "responses": responses, "ended": ended,
                       "query": [p + r for p, r in zip(prompts, responses)]}).encode()
    headers = {"Content-Type": "application/json"}
    if auth_env and os.environ.get(auth_env):
        headers["Authorization"] = f"Bearer {os.environ[auth_env]}"
    for attempt in range(retries + 1):
        backoff = min(2.0**attempt, 30.0)
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.loads(response.read())
            break
        except urllib.error.HTTPError as err:
            if err.code < 500:  # a client error will not mend by asking again
                raise RewardSourceError(f"reward server {url} answered HTTP {err.code}: {err.read()[:200]!r}") from None
            if attempt == retries:
                raise RewardServerUnavailable(f"reward server {url} answered HTTP {err.code} {retries + 1} times: "
                                              f"{err.read()[:200]!r}") from None
            backoff = retry_after(err.headers.get("Retry-After"), backoff)
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
            if attempt == retries:
                raise RewardServerUnavailable(f"reward server {url} unreachable after {retries + 1} tries: "
                                              f"{err}") from None
        time.sleep(backoff)
    scores = answer.get("scores", answer.get("rewards")) if isinstance(answer, dict) else None
    if isinstance(scores, list):
        scores = [math.nan if s is None else s for s in scores]
    return _checked(scores, len(prompts), f"reward server {url}")


class TextRewardSource:
    """A `python:` or `http(s)://` source: scores(prompts, responses, ended) -> list of floats.
    The function is imported now, so a typo fails before any rollout or judging."""

    def __init__(self, spec: str, *, timeout_s: float, retries: int, auth_env: str | None,
                 setting: str = "ppo.reward"):
        self.spec, self.timeout_s, self.retries, self.auth_env = spec, timeout_s, retries, auth_env
        self.function = python_function(spec, setting) if spec.startswith("python:") else None

    def scores(self, prompts: list[str], responses: list[str], ended: list[bool]) -> list[float]:
        if self.function is not None:
            return _checked(self.function(prompts, responses), len(prompts), self.spec)
        return post_scores(self.spec, prompts, responses, ended, timeout_s=self.timeout_s, retries=self.retries,
                           auth_env=self.auth_env)


def text_scores(ppo, tokenizer, dist: Dist | None = None):
    """PPO's score_fn for a text source (`python:` or `http(s)://`). Each rank sends its own share;
    on several ranks they agree after every request whether one rank's server was unavailable, so
    all stop at the same iteration boundary (one rank stopping alone would leave the others in
    their next collective)."""
    source = TextRewardSource(ppo.reward, timeout_s=ppo.reward_timeout_s, retries=ppo.reward_retries,
                              auth_env=ppo.reward_auth_env)
    dist = dist or Dist()

    def score(sequences, attention_mask, prompt_width, response_mask):
        prompts, responses, ended = batch_texts(tokenizer, sequences, attention_mask, prompt_width, response_mask)
        scores, unavailable = None, None
        try:
            scores = source.scores(prompts, responses, ended)
        except RewardServerUnavailable as err:
            unavailable = err
        failed_ranks = dist.all_reduce_sum([float(unavailable is not None)])[0]
        if failed_ranks:
            raise unavailable or RewardServerUnavailable(f"reward server {ppo.reward}: another rank's request failed")
        return torch.tensor(scores, dtype=torch.float32, device=sequences.device)

    return score
