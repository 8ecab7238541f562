"""`rlhf serve-reward`: a trained reward model behind the reward-server API of
stages/compute/ppo/external_scores.py, on loopback by default, so PPO (`ppo.reward=http://…`), another
pipeline or a person can score text with it.

Each (prompt, response) is tokenised as PPO's rollout holds it: the prompt text as given (it is
already rendered by the policy's chat template), the response as the SFT and RM stages render it,
EOS appended when `ended` says the response finished; the score is read at the last token.

The HTTP side is FastAPI on uvicorn (the stack Prefect and MLflow already run on): POST (any path)
scores a batch, GET /health, GET /metrics (Prometheus text, prometheus_client). What is our own is
the scoring worker, because neither uvicorn nor MLflow's scoring server (one `predict` per
request) batches across requests: requests are queued, and one thread takes the oldest and those
behind it that fit one forward of `token_budget` padded tokens (waiting `max_wait_ms` for company),
cutting a request too large for one forward the way the reward stage cuts its pairs
(stages/leaves/pair_batching.py), and runs one forward at a time. A request that
would overfill the queue is answered 503 with Retry-After. Every limit a client can hit is in
`RewardServerConfig` (stages/leaves/config.py), with the 4xx it gets; uvicorn itself has no deadline for a
request's headers, so the h11 protocol here adds one (`_HeaderDeadlineProtocol`).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import math
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from uvicorn.protocols.http.h11_impl import H11Protocol

from stages.compute import loading
from stages.compute.reward.model import load_reward_model
from stages.leaves import precision
from stages.leaves.config import ModelConfig, RewardServerConfig
from stages.leaves.pair_batching import row_batches
from stages.leaves.rendering import collate, render_response


class RewardScorer:
    """A reward model and its tokenizer, scoring (prompt, response, ended) triples in token-budget
    batches (`reward_server.token_budget`, `max_batch_rows`)."""

    def __init__(self, folder: Path, model_cfg: ModelConfig, max_seq_len: int,
                 batching: RewardServerConfig | None = None):
        self.max_seq_len, self.batching = max_seq_len, batching or RewardServerConfig()
        self.device = self.batching.device
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        weights = precision.dtype(precision.resolve(model_cfg.precision, self.device)) if self.device == "cuda" else None
        self.tokenizer = loading.load_tokenizer(str(folder), model_cfg)
        self.model = load_reward_model(folder, model_cfg, weights).to(self.device).eval()
        self.lock = threading.Lock()  # one forward at a time: torch already uses every core
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer's settings are not safe to share across threads

    def encode(self, prompt: str, response: str, ended: bool) -> list[int]:
        """All the tokens of a row (`cut` keeps the last max_seq_len of them)."""
        with self.tokenizer_lock:
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids += self.tokenizer(render_response(self.tokenizer, response), add_special_tokens=False)["input_ids"]
        return ids + ([self.tokenizer.eos_token_id] if ended else [])

    def cut(self, ids: list[int]) -> list[int]:
        return ids[-self.max_seq_len :]  # a long prompt loses its oldest tokens, as in training

    @torch.no_grad()
    def score_encoded(self, encoded: list[list[int]]) -> tuple[list[float], list[int]]:
        """(scores in the order given, rows of each forward) of rows already cut to max_seq_len."""
        scores: list[float] = [math.nan] * len(encoded)
        batch_rows: list[int] = []
        for batch in row_batches([len(ids) for ids in encoded], self.batching.token_budget,
                                 self.batching.max_batch_rows):
            padded = collate([(encoded[i], encoded[i]) for i in batch], self.tokenizer.pad_token_id)
            with self.lock:
                rewards, _ = self.model(input_ids=padded["input_ids"].to(self.device),
                                        attention_mask=padded["attention_mask"].to(self.device))
            for i, reward in zip(batch, rewards.tolist()):
                scores[i] = reward
            batch_rows.append(len(batch))
        return scores, batch_rows

    def scores(self, prompts: list[str], responses: list[str], ended: list[bool]) -> list[float]:
        encoded = [self.cut(self.encode(p, r, e)) for p, r, e in zip(prompts, responses, ended)]
        return self.score_encoded(encoded)[0]


# -- the scoring worker ---------------------------------------------------------------------------

@dataclass
class _Job:
    rows: list[list[int]]
    future: Future = field(default_factory=Future)


class ScoringQueue:
    """Requests' rows waiting for the one scoring thread. `submit` refuses (returns None) what would
    take the queue past `queue_rows`, unless the queue is empty (a request within max_prompts is
    always taken by an idle server); the thread takes the oldest request and those behind it that
    fit one forward with it (after waiting up to `max_wait_ms` for them), and scores them
    together."""

    def __init__(self, scorer: RewardScorer, limits: RewardServerConfig, metrics: ServerMetrics):
        self.scorer, self.limits, self.metrics = scorer, limits, metrics
        self.jobs: collections.deque[_Job] = collections.deque()
        self.queued_rows = 0
        self.closed = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="reward-scoring", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop the thread after its forward in progress. Called once uvicorn has drained the requests
        in flight: what is still queued belongs to requests cut at graceful_shutdown_s, dropped."""
        with self.changed:
            self.closed = True
            while self.jobs:
                self.queued_rows -= len(self.jobs[0].rows)
                self.jobs.popleft().future.cancel()
            self.metrics.queue_rows.set(self.queued_rows)
            self.changed.notify_all()
        self.thread.join()

    def submit(self, rows: list[list[int]]) -> Future | None:
        with self.changed:
            if self.closed or (self.queued_rows and self.queued_rows + len(rows) > self.limits.queue_rows):
                return None
            job = _Job(rows)
            self.jobs.append(job)
            self.queued_rows += len(rows)
            self.metrics.queue_rows.set(self.queued_rows)
            self.changed.notify_all()
            return job.future

    def _fits(self, jobs) -> bool:
        """Whether these requests' rows fit one forward: `max_batch_rows` rows, rows × longest row
        within `token_budget`."""
        rows = [len(ids) for job in jobs for ids in job.rows]
        return len(rows) <= self.limits.max_batch_rows and len(rows) * max(rows, default=0) <= self.limits.token_budget

    def _take(self) -> list[_Job] | None:
        """The next round: the oldest request and the requests queued behind it that fit one forward
        with it (waiting up to max_wait_ms for them). A round is one forward, not the whole queue, so
        the oldest requests are answered first instead of all waiting for the last; a request larger
        than one forward goes alone, in token-budget batches."""
        with self.changed:
            self.changed.wait_for(lambda: self.jobs or self.closed)
            if not self.jobs:
                return None
            deadline = time.monotonic() + self.limits.max_wait_ms / 1000
            while self.limits.batch_across_requests and not self.closed and self._fits(self.jobs):
                if not self.changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    break
            if not self.jobs:  # close() emptied the queue during the wait
                return None
            taken = [self.jobs.popleft()]
            while self.limits.batch_across_requests and self.jobs and self._fits([*taken, self.jobs[0]]):
                taken.append(self.jobs.popleft())
            return taken

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            try:
                # A future cancelled while queued (its client went away) is not scored; the others
                # turn running, so a cancel() from now on fails and the answer is delivered or dropped.
                self._score([job for job in taken if job.future.set_running_or_notify_cancel()])
            finally:
                with self.changed:
                    self.queued_rows -= sum(len(job.rows) for job in taken)
                    self.metrics.queue_rows.set(self.queued_rows)

    def _score(self, jobs: list[_Job]) -> None:
        """Score these requests' rows in one round and answer each request's future."""
        rows = [ids for job in jobs for ids in job.rows]
        if not rows:
            return
        try:
            scores, batch_rows = self.scorer.score_encoded(rows)
        except Exception as err:  # a broken model fails these requests (500), not the server
            for job in jobs:
                _answer(job.future, exception=err)
            return
        for size in batch_rows:
            self.metrics.batch_rows.observe(size)
        start = 0
        for job in jobs:
            _answer(job.future, result=scores[start : start + len(job.rows)])
            start += len(job.rows)


def _answer(future: Future, result=None, exception: BaseException | None = None) -> None:
    """Set a running future's outcome. A future that its awaiting side settled already is left as
    it is: the error would end the scoring thread, and every later request would wait for ever."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


# -- metrics --------------------------------------------------------------------------------------

class ServerMetrics:
    """The Prometheus series of one server, in a registry of its own (several servers in one process
    do not share counts)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("reward_requests", "Scoring requests answered, by HTTP status", ["code"],
                                registry=self.registry)
        self.scores = Counter("reward_scores", "Scores returned", registry=self.registry)
        self.nonfinite = Counter("reward_nonfinite_scores", "Scores returned null: the model's score was NaN or Inf",
                                 registry=self.registry)
        self.queue_rows = Gauge("reward_queue_rows", "Rows waiting for the scoring worker", registry=self.registry)
        self.batch_rows = Histogram("reward_batch_rows", "Rows per model forward", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.latency = Histogram("reward_request_seconds", "Time from a scoring request's headers to its answer",
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    def text(self) -> bytes:
        return generate_latest(self.registry)


# -- the request -----------------------------------------------------------------------------------

class ClientError(Exception):
    """A request the server will not score: its HTTP status and a message naming the rule broken."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(body: bytes, limits: RewardServerConfig) -> tuple[list[str], list[str], list[bool]]:
    """(prompts, responses, ended) of a request body, or ClientError(400) naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ClientError(400, f"the body is not UTF-8 (byte {err.start})") from None
    try:
        payload = json.loads(text, parse_constant=_no_constants)
    except ValueError as err:
        raise ClientError(400, f"the body is not JSON: {err}") from None
    except RecursionError:
        raise ClientError(400, "the body's JSON is nested deeper than Python's recursion limit") from None
    if not isinstance(payload, dict):
        raise ClientError(400, "the body must be a JSON object")
    prompts, responses = payload.get("prompts"), payload.get("responses")
    if not (isinstance(prompts, list) and isinstance(responses, list) and len(prompts) == len(responses)):
        raise ClientError(400, "'prompts' and 'responses' must be lists of the same length")
    if len(prompts) > limits.max_prompts:
        raise ClientError(400, f"{len(prompts)} prompts: more than reward_server.max_prompts={limits.max_prompts}")
    for name, texts in (("prompt", prompts), ("response", responses)):
        for row, value in enumerate(texts):
            if not isinstance(value, str):
                raise ClientError(400, f"{name} {row} is {type(value).__name__}: every prompt and response must be "
                                       f"a string")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ClientError(400, f"{name} {row} is not valid Unicode (a lone surrogate)") from None
    ended = payload.get("ended", [True] * len(prompts))
    if not (isinstance(ended, list) and len(ended) == len(prompts) and all(isinstance(e, bool) for e in ended)):
        raise ClientError(400, "'ended' must be a list of booleans, one per response")
    return prompts, responses, ended


def encode_rows(scorer: RewardScorer, prompts: list[str], responses: list[str], ended: list[bool],
                limits: RewardServerConfig) -> list[list[int]]:
    """Each row's tokens cut to max_seq_len, or ClientError(400) for a row over max_row_tokens or
    an empty one (a score read at no token is not a number)."""
    rows = []
    for row, (prompt, response, end) in enumerate(zip(prompts, responses, ended)):
        ids = scorer.encode(prompt, response, end)
        if len(ids) > limits.max_row_tokens:
            raise ClientError(400, f"row {row} has {len(ids)} tokens: more than reward_server.max_row_tokens="
                                   f"{limits.max_row_tokens}")
        if not ids:
            raise ClientError(400, f"row {row} has no tokens (empty prompt and response, not ended): nothing to score")
        rows.append(scorer.cut(ids))
    return rows


async def read_body(request, limits: RewardServerConfig) -> bytes:
    """The body, within max_body_bytes (413) and body_timeout_s (408)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ClientError(400, f"Content-Length {declared[:40]!r} is not a number")
        if int(declared) > limits.max_body_bytes:
            raise ClientError(413, f"a body of {declared} bytes: more than reward_server.max_body_bytes="
                                   f"{limits.max_body_bytes}")
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise ClientError(413, f"the body is more than reward_server.max_body_bytes="
                                           f"{limits.max_body_bytes} bytes")
    except TimeoutError:
        raise ClientError(408, f"the body took more than reward_server.body_timeout_s={limits.body_timeout_s}s") \
            from None
    return bytes(body)


def make_app(scorer: RewardScorer, limits: RewardServerConfig, token: str | None = None):
    """The FastAPI app: POST (any path) scores a batch; GET /health; GET /metrics.
    `token`: scoring requests must carry `Authorization: Bearer <token>`."""
    metrics = ServerMetrics()
    queue = ScoringQueue(scorer, limits, metrics)
    served = {"requests": 0}

    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        await run_in_threadpool(queue.close)

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.queue, app.state.metrics = queue, metrics

    @app.get("/health")
    async def health():
        return {"status": "ok", "batches": served["requests"], "queue_rows": queue.queued_rows}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/{path:path}")
    async def score(request: Request, path: str):
        started = time.perf_counter()
        try:
            if token is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                             f"Bearer {token}".encode()):
                raise ClientError(401, "missing or wrong bearer token")
            prompts, responses, ended = parse_body(await read_body(request, limits), limits)
            rows = await run_in_threadpool(encode_rows, scorer, prompts, responses, ended, limits)
            future = queue.submit(rows) if rows else None
            if rows and future is None:
                raise ClientError(503, f"busy: more than reward_server.queue_rows={limits.queue_rows} rows queued",
                                  {"Retry-After": str(limits.retry_after_s)})
            scores = await asyncio.wrap_future(future) if rows else []
            # A score that is not finite is null (JSON has no NaN): the model's fault, not the
            # request's; PPO reads it as NaN and its guard skips the iteration, as for its own RM.
            finite = [s if math.isfinite(s) else None for s in scores]
            metrics.nonfinite.inc(finite.count(None))
            answer = JSONResponse({"scores": finite})
            served["requests"] += 1
            metrics.scores.inc(len(scores))
        except ClientError as err:
            # A refused body may be unread: the connection cannot carry another request.
            headers = {**err.headers, **({"Connection": "close"} if err.status in (408, 413) else {})}
            answer = JSONResponse({"error": err.message}, status_code=err.status, headers=headers)
        except Exception as err:  # the model failed on rows that passed every check: the server's fault
            answer = JSONResponse({"error": f"scoring failed: {type(err).__name__}: {err}"}, status_code=500)
        metrics.requests.labels(str(answer.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - started)
        return answer

    return app


# -- uvicorn ---------------------------------------------------------------------------------------

def _header_deadline_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline for a request's headers: counted from the connection
    and from each response; a connection that has not started a new request by then is closed
    (uvicorn alone waits for ever on a client that sends nothing or trickles its headers in)."""
    class _HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self.loop.call_later(header_timeout_s, self._header_deadline, self.cycle)

        def _header_deadline(self, cycle_then) -> None:
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.timeout_keep_alive_handler()  # closes the connection as an idle keep-alive one

    return _HeaderDeadlineProtocol


def make_server(app, host: str, port: int, limits: RewardServerConfig):
    """A uvicorn server for the app with the limits' timeouts; `.run()` serves until SIGTERM/Ctrl-C
    (then lets requests in flight finish, within graceful_shutdown_s)."""
    config = uvicorn.Config(app, host=host, port=port, http=_header_deadline_protocol(limits.header_timeout_s),
                            timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections,
                            h11_max_incomplete_event_size=limits.max_header_bytes,
                            timeout_graceful_shutdown=limits.graceful_shutdown_s, lifespan="on", log_level="warning",
                            access_log=False)
    return uvicorn.Server(config)


def token_from_env(name: str | None) -> str | None:
    return os.environ.get(name) if name else None
