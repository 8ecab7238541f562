"""`rlhf serve-reward`: a trained reward model behind the reward-server API of
stages/reward_sources.py, on loopback by default, so PPO (`ppo.reward=http://…`), another
pipeline or a person can score text with it.

Each (prompt, response) is tokenised as PPO's rollout holds it: the prompt text as given (it is
already rendered by the policy's chat template), the response as the SFT and RM stages render it,
EOS appended when `ended` says the response finished; the score is read at the last token.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from stages import sources
from stages.config import ModelConfig
from stages.data import render_response
from stages.reward.model import load_reward_model
from stages.training import collate


class RewardScorer:
    """A reward model and its tokenizer, scoring (prompt, response, ended) triples in batches."""

    def __init__(self, folder: Path, model_cfg: ModelConfig, max_seq_len: int, batch_size: int = 8):
        self.tokenizer = sources.load_tokenizer(str(folder), model_cfg)
        self.model = load_reward_model(folder, model_cfg).eval()
        self.max_seq_len, self.batch_size = max_seq_len, batch_size
        self.lock = threading.Lock()  # one forward at a time: torch already uses every core

    def encode(self, prompt: str, response: str, ended: bool) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids += self.tokenizer(render_response(self.tokenizer, response), add_special_tokens=False)["input_ids"]
        ids += [self.tokenizer.eos_token_id] if ended else []
        return ids[-self.max_seq_len :]  # a long prompt loses its oldest tokens, as in training

    @torch.no_grad()
    def scores(self, prompts: list[str], responses: list[str], ended: list[bool]) -> list[float]:
        encoded = [self.encode(p, r, e) for p, r, e in zip(prompts, responses, ended)]
        out: list[float] = []
        with self.lock:
            for start in range(0, len(encoded), self.batch_size):
                rows = [(ids, ids) for ids in encoded[start : start + self.batch_size]]
                batch = collate(rows, self.tokenizer.pad_token_id)
                rewards, _ = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                out += rewards.tolist()
        return out


def _request_error(body) -> str | None:
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    prompts, responses = body.get("prompts"), body.get("responses")
    if not (isinstance(prompts, list) and isinstance(responses, list) and len(prompts) == len(responses)):
        return "'prompts' and 'responses' must be lists of the same length"
    if not all(isinstance(t, str) for t in prompts + responses):
        return "every prompt and response must be a string"
    ended = body.get("ended", [True] * len(prompts))
    if not (isinstance(ended, list) and len(ended) == len(prompts) and all(isinstance(e, bool) for e in ended)):
        return "'ended' must be a list of booleans, one per response"
    return None


def make_server(scorer: RewardScorer, host: str, port: int, token: str | None = None) -> ThreadingHTTPServer:
    """POST (any path) scores a batch; GET /health says ok and how many batches it scored.
    `token`: requests must carry `Authorization: Bearer <token>`."""
    served = {"batches": 0}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok", "batches": served["batches"]})
            else:
                self._reply(404, {"error": "POST a batch to any path; GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if token is not None and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                self._reply(401, {"error": "missing or wrong bearer token"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except (ValueError, json.JSONDecodeError):
                self._reply(400, {"error": "the body is not JSON"})
                return
            error = _request_error(body)
            if error:
                self._reply(400, {"error": error})
                return
            ended = body.get("ended", [True] * len(body["prompts"]))
            scores = scorer.scores(body["prompts"], body["responses"], ended)
            served["batches"] += 1
            self._reply(200, {"scores": scores})

        def log_message(self, format: str, *args) -> None:  # one quiet line per request, no bodies
            pass

    return ThreadingHTTPServer((host, port), Handler)


def token_from_env(name: str | None) -> str | None:
    return os.environ.get(name) if name else None
