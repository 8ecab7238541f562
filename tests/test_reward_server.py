"""The reward server (stages/compute/reward/serve.py) as clients meet it: real uvicorn on loopback serving a
tiny reward model made here. Each hostile input gets its 4xx within a second while a well-formed
request from another client scores correctly; concurrent requests share forwards; a full queue
answers 503 with Retry-After; /metrics counts what happened; SIGTERM lets a request in flight
finish and the process exits 0."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from stages.compute.loading import load_tokenizer
from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.ppo.external_scores import RewardSourceError, post_scores
from stages.compute.reward.model import reward_model_from_lm, save_reward_model
from stages.compute.reward.serve import RewardScorer, ScoringQueue, ServerMetrics, make_app, make_server
from stages.leaves.config import REPO_ROOT, RewardServerConfig
from stages.leaves.dist import Dist
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import free_port

TOKEN = "rm-test-token"
TOKEN_ENV = "RLHF_TEST_RM_TOKEN"
LIMITS = RewardServerConfig(max_body_bytes=64 * 1024, max_prompts=8, max_row_tokens=300, header_timeout_s=0.5,
                            body_timeout_s=0.5, max_header_bytes=4096, queue_rows=12)
GOOD = (["User: how do I bake bread?\nAssistant:", "User: hi\nAssistant:"],
        ["Mix flour, water, salt and yeast, then bake.", "Hello there."], [True, False])


@pytest.fixture(scope="module")
def rm_folder(tiny, tmp_path_factory) -> Path:
    """A reward model on the tiny preset's base model, its head seeded; its tokenizer has a chat
    template, as the demo's has (a response is then rendered as given: an empty one is no tokens)."""
    folder, _, _ = tiny
    model_cfg = load_config("tiny").model
    tokenizer = load_tokenizer(folder, model_cfg)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("served-rm")
    save_reward_model(reward_model_from_lm(folder, model_cfg), tokenizer, out, {"role": "test"})
    return out


class Served:
    """A server running in a thread of this process: its URL, scorer and uvicorn server."""

    def __init__(self, folder: Path, limits: RewardServerConfig, token: str | None = TOKEN):
        cfg = load_config("tiny")
        self.scorer = RewardScorer(folder, cfg.model, cfg.reward.max_seq_len, limits)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(make_app(self.scorer, limits, token), "127.0.0.1", self.port, limits)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(rm_folder):
    server = Served(rm_folder, LIMITS)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def _raw(port: int, data: bytes, *, pause_after: int | None = None, timeout: float = 5.0) -> tuple[int | None, bytes, float]:
    """Send raw bytes (all, or the first `pause_after` and then nothing); (status or None when the
    server closed without an answer, the answer's bytes, seconds to the answer or close)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data if pause_after is None else data[:pause_after])
        answer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
            if b"\r\n\r\n" in answer:
                head, _, rest = answer.partition(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head, re.I)
                if length and len(rest) >= int(length.group(1)):
                    break
    elapsed = time.perf_counter() - started
    status = re.match(rb"HTTP/1.1 (\d+)", answer)
    return (int(status.group(1)) if status else None), answer, elapsed


def _request(body: bytes, *, token: str = TOKEN, extra: str = "", length: int | None = None) -> bytes:
    return (f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra}\r\n").encode() + body


def _json(payload) -> bytes:
    return json.dumps(payload).encode()


def _good_rows(n: int) -> dict:
    return {"prompts": [f"User: question {i}?\nAssistant:" for i in range(n)],
            "responses": [f"answer number {i}" for i in range(n)], "ended": [True] * n}


HOSTILE = {
    "body over max_body_bytes (declared)": (_request(b"{}", length=LIMITS.max_body_bytes + 1), None, 413,
                                            "max_body_bytes"),
    "body over max_body_bytes (chunked)": (
        b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
        + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(b"4000\r\n" + b"x" * 0x4000 + b"\r\n" for _ in range(5))
        + b"0\r\n\r\n", None, 413, "max_body_bytes"),
    "a body sent too slowly": (_request(b'{"prompts": [', length=100), len(_request(b"", length=100)) + 5, 408,
                               "body_timeout_s"),
    "too many prompts": (_request(_json(_good_rows(LIMITS.max_prompts + 1))), None, 400, "max_prompts=8"),
    "a row over max_row_tokens": (_request(_json({"prompts": ["word " * 2000], "responses": ["r"]})), None, 400,
                                  "max_row_tokens=300"),
    "a body that is not UTF-8": (_request(b'{"prompts": ["\xff\xfe"], "responses": ["r"]}'), None, 400, "not UTF-8"),
    "a body that is not JSON": (_request(b'{"prompts": [1, 2'), None, 400, "not JSON"),
    "JSON nested deeper than the recursion limit": (_request(b"[" * 50_000), None, 400, "nested deeper"),
    "NaN in the JSON": (_request(b'{"prompts": ["p"], "responses": ["r"], "ended": [NaN]}'), None, 400,
                        "NaN is not a JSON number"),
    "Infinity in the JSON": (_request(b'{"prompts": ["p"], "responses": ["r"], "ended": [-Infinity]}'), None, 400,
                             "-Infinity is not a JSON number"),
    "an empty row (a score at no token)": (_request(_json({"prompts": [""], "responses": [""], "ended": [False]})),
                                           None, 400, "row 0 has no tokens"),
    "a lone surrogate": (_request(b'{"prompts": ["\\ud800"], "responses": ["r"]}'), None, 400, "lone surrogate"),
    "prompts of the wrong type": (_request(_json({"prompts": "p", "responses": "r"})), None, 400,
                                  "must be lists of the same length"),
    "a response that is a number": (_request(_json({"prompts": ["p"], "responses": [3]})), None, 400,
                                    "response 0 is int"),
    "ended that is not booleans": (_request(_json({"prompts": ["p"], "responses": ["r"], "ended": ["yes"]})), None,
                                   400, "'ended' must be a list of booleans"),
    "a body that is a list": (_request(_json([1, 2])), None, 400, "must be a JSON object"),
    "a wrong token": (_request(_json(_good_rows(1)), token="guess"), None, 401, "bearer token"),
    "headers over max_header_bytes": (_request(b"{}", extra="X-Big: " + "a" * 8000 + "\r\n"), None, 400, ""),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_gets_its_4xx_within_a_second_while_another_client_scores(served, name):
    data, pause_after, status, says = HOSTILE[name]
    expected = served.scorer.scores(*GOOD)
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(_raw, served.port, data, pause_after=pause_after)
        good = pool.submit(post_scores, f"{served.url}/score", *GOOD, timeout_s=10, retries=0, auth_env=TOKEN_ENV)
        got_status, answer, elapsed = hostile.result()
        assert good.result() == pytest.approx(expected, abs=1e-5)
    assert got_status == status, answer[:300]
    assert says.encode() in answer, answer[:300]
    assert elapsed < 1.0


@pytest.mark.parametrize("pause_after", [0, 10])
def test_a_client_that_sends_no_headers_in_time_is_disconnected(served, pause_after):
    """Nothing, or half a request line: the server closes the connection at header_timeout_s."""
    status, answer, elapsed = _raw(served.port, _request(_json(_good_rows(1))), pause_after=pause_after)
    assert status is None and answer == b""
    assert LIMITS.header_timeout_s * 0.9 < elapsed < 1.0


def test_concurrent_requests_share_forwards_and_score_as_alone(served):
    """While the model is busy (its lock held), three requests queue; they are scored in one round,
    each row as it is scored alone, and /metrics shows the shared forward."""
    batches = [_good_rows(2), _good_rows(3), {**_good_rows(2), "responses": ["other", "text here"]}]
    alone = [served.scorer.scores(b["prompts"], b["responses"], b["ended"]) for b in batches]
    before = _metric(served.url, "reward_batch_rows_count")
    with ThreadPoolExecutor(3) as pool:
        with served.scorer.lock:
            futures = [pool.submit(post_scores, f"{served.url}/score", b["prompts"], b["responses"], b["ended"],
                                   timeout_s=10, retries=0, auth_env=TOKEN_ENV) for b in batches]
            _wait_for(lambda: _health(served.url)["queue_rows"] == 7)
        got = [f.result() for f in futures]
    for scores, expected in zip(got, alone):
        assert scores == pytest.approx(expected, abs=1e-5)
    # The first request may have been taken alone before the others arrived; the rest share a forward.
    assert _metric(served.url, "reward_batch_rows_count") - before <= 2
    assert _metric(served.url, "reward_batch_rows_bucket", le="4.0") < _metric(served.url, "reward_batch_rows_bucket",
                                                                               le="8.0")


def test_without_a_gpu_auto_scores_on_the_cpu_in_fp32(served):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_on_a_gpu_the_server_scores_as_on_the_cpu covers it")
    assert served.scorer.device == "cpu" and served.scorer.model.score_head.weight.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_server_scores_as_on_the_cpu(rm_folder):
    """`reward_server.device=auto` takes the GPU, in the model's precision (bf16 for `auto`); its
    scores match the CPU server's within bf16's rounding."""
    cfg = load_config("tiny")
    prompts, responses, ended = _good_rows(6).values()
    on_cpu = RewardScorer(rm_folder, cfg.model, cfg.reward.max_seq_len, RewardServerConfig(device="cpu"))
    on_gpu = RewardScorer(rm_folder, cfg.model, cfg.reward.max_seq_len, RewardServerConfig())
    assert on_gpu.device == "cuda" and on_gpu.model.score_head.weight.device.type == "cuda"
    expected = on_cpu.scores(prompts, responses, ended)
    assert on_gpu.scores(prompts, responses, ended) == pytest.approx(expected, rel=3e-2, abs=3e-2)


def test_a_queue_longer_than_one_forward_is_scored_oldest_first_one_forward_at_a_time(served):
    """A round is the oldest request and those behind it that fit one forward (rows × longest row
    within token_budget), not the whole queue: with room for 4 rows of this length, requests of
    2, 2 and 2 rows are scored as 2 + 2, then 2; a request larger than one forward goes alone."""
    two = _good_rows(2)
    rows = [served.scorer.cut(served.scorer.encode(p, r, True)) for p, r in zip(two["prompts"], two["responses"])]
    longest = max(len(ids) for ids in rows)
    limits = RewardServerConfig(token_budget=4 * longest, max_wait_ms=0)
    queue = ScoringQueue(served.scorer, limits, ServerMetrics())
    first, second, third = (queue.submit(list(rows)) for _ in range(3))
    big = queue.submit(rows * 3)
    rounds = []
    while queue.jobs:
        rounds.append(queue._take())
    assert [[len(job.rows) for job in taken] for taken in rounds] == [[2, 2], [2], [6]]
    assert rounds[0][0].future is first and rounds[0][1].future is second and rounds[1][0].future is third
    assert rounds[2][0].future is big


def test_a_full_queue_answers_503_with_retry_after_and_the_client_honours_it(served):
    """queue_rows=12: with 8 rows held in a blocked forward, 5 more are refused with Retry-After;
    post_scores with retries waits that long and scores them once the model is free."""
    url = f"{served.url}/score"
    refused_before = _metric(served.url, "reward_requests_total", code="503")
    with ThreadPoolExecutor(2) as pool:
        with served.scorer.lock:
            first = pool.submit(post_scores, url, *_good_rows(8).values(), timeout_s=10, retries=0, auth_env=TOKEN_ENV)
            _wait_for(lambda: _health(served.url)["queue_rows"] == 8)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, data=_json(_good_rows(5)), method="POST",
                                                              headers={"Authorization": f"Bearer {TOKEN}"}), timeout=5)
            assert refused.value.code == 503 and refused.value.headers["Retry-After"] == str(LIMITS.retry_after_s)
            assert b"queue_rows=12" in refused.value.read()
            with pytest.raises(RewardSourceError, match=r"answered HTTP 503 1 times"):
                post_scores(url, *_good_rows(5).values(), timeout_s=10, retries=0, auth_env=TOKEN_ENV)
            retried = pool.submit(post_scores, url, *_good_rows(5).values(), timeout_s=10, retries=10,
                                  auth_env=TOKEN_ENV)
            _wait_for(lambda: _metric(served.url, "reward_requests_total", code="503") - refused_before == 3)
        assert len(first.result()) == 8 and len(retried.result()) == 5  # refused again while the first is scored


def test_metrics_count_requests_scores_and_latency(served):
    scored = _metric(served.url, "reward_scores_total")
    ok = _metric(served.url, "reward_requests_total", code="200")
    post_scores(f"{served.url}/score", *GOOD, timeout_s=10, retries=0, auth_env=TOKEN_ENV)
    assert _metric(served.url, "reward_scores_total") == scored + 2
    assert _metric(served.url, "reward_requests_total", code="200") == ok + 1
    assert _metric(served.url, "reward_request_seconds_count") >= 1
    assert _metric(served.url, "reward_queue_rows") == 0


def test_sigterm_lets_a_request_in_flight_finish_and_exits_0(rm_folder):
    """`rlhf serve-reward` as a process: a request waiting in the queue (max_wait_ms holds it) when
    SIGTERM comes is still answered, and the process exits 0."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--model", str(rm_folder), "--preset",
                             "tiny", "--port", str(port), "--set", "reward_server.max_wait_ms=5000"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _health(url), timeout=120, process=proc)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post_scores, f"{url}/score", *GOOD, timeout_s=30, retries=0, auth_env=None)
            _wait_for(lambda: _health(url)["queue_rows"] == 2, timeout=60)
            proc.send_signal(signal.SIGTERM)
            assert len(answer.result()) == 2
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_non_finite_score_is_answered_null_and_ppo_skips_the_iteration_as_for_its_own_rm(rm_folder):
    """A served model that scores a row NaN (here: every row ending in EOS, its embedding NaN) answers
    200 with null for that row; PPO's client reads it as NaN, and PPO's guard skips the iteration
    as it does for the in-process RM's NaN, instead of a client error that stops the stage."""
    server = Served(rm_folder, LIMITS)
    try:
        with torch.no_grad():
            server.scorer.model.lm.get_input_embeddings().weight[server.scorer.tokenizer.eos_token_id] = math.nan
        request = urllib.request.Request(f"{server.url}/score", data=_json(dict(zip(("prompts", "responses", "ended"),
                                                                                    GOOD))),
                                         method="POST", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["scores"][0] is None and math.isfinite(answer["scores"][1])  # GOOD's ended: [True, False]
        scores = post_scores(f"{server.url}/score", *GOOD, timeout_s=10, retries=0, auth_env=TOKEN_ENV)
        assert math.isnan(scores[0]) and scores[1] == answer["scores"][1]
        guard = NonFiniteGuard("ppo", 3, Dist())
        assert not guard.check({"scores": torch.tensor(scores)}, "iteration 1", last=False)
        assert (guard.skipped, guard.in_a_row) == (1, 1)
        assert _metric(server.url, "reward_nonfinite_scores_total") == 2
    finally:
        server.stop()


def _encoded(scorer, n: int) -> list[list[int]]:
    batch = _good_rows(n)
    return [scorer.cut(scorer.encode(p, r, e)) for p, r, e in zip(batch["prompts"], batch["responses"], batch["ended"])]


def _wait_taken(queue: ScoringQueue) -> None:
    _wait_for(lambda: not queue.jobs)


def test_cancelled_requests_leave_the_scoring_thread_serving(served):
    """A request whose client went away cancels its future (asyncio.wrap_future does): one being
    scored cannot be cancelled any more (its future is running) and its answer is dropped; one
    still queued is skipped, unscored. The thread lives on, the next request is answered and
    the queue's row count returns to 0."""
    queue = ScoringQueue(served.scorer, RewardServerConfig(max_wait_ms=0, batch_across_requests=False),
                         ServerMetrics())
    queue.start()
    try:
        with served.scorer.lock:  # the model is busy: the first request waits in its forward
            in_flight = queue.submit(_encoded(served.scorer, 2))
            _wait_taken(queue)
            queued = queue.submit(_encoded(served.scorer, 3))
            assert not in_flight.cancel(), "a request being scored cannot be cancelled"
            assert queued.cancel()
        assert len(in_flight.result(timeout=10)) == 2
        after = queue.submit(_encoded(served.scorer, 1))
        assert len(after.result(timeout=10)) == 1
        assert queue.thread.is_alive() and queue.queued_rows == 0
    finally:
        queue.close()


def test_close_while_the_worker_waits_for_company_is_clean(served, monkeypatch):
    """close() empties the queue while the worker waits max_wait_ms for more requests: the worker
    ends without an exception, at once, and the dropped request's future is cancelled."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    queue = ScoringQueue(served.scorer, RewardServerConfig(max_wait_ms=5000), ServerMetrics())
    queue.start()
    waiting = queue.submit(_encoded(served.scorer, 1))
    _wait_for(lambda: queue.thread.is_alive())
    time.sleep(0.2)  # the worker is in its wait for company
    started = time.perf_counter()
    queue.close()
    assert time.perf_counter() - started < 2.0 and not queue.thread.is_alive()
    assert [f"{type(hook.exc_value).__name__}: {hook.exc_value}" for hook in raised] == []
    assert waiting.cancelled() and queue.queued_rows == 0


# -- helpers ---------------------------------------------------------------------------------------

def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        return json.loads(response.read())


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = rf"^{re.escape(name)}" + (rf"\{{{re.escape(wanted)}\}}" if wanted else "") + r" (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def _wait_for(check, timeout: float = 10.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if check():
                return
        except (OSError, http.client.HTTPException):
            pass
        if process is not None and process.poll() is not None:
            pytest.fail(f"the server exited: {process.stdout.read()}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


class _ScriptedServer:
    """A loopback HTTP server that answers the n-th connection with the n-th raw reply, then closes it."""

    def __init__(self, replies: list[bytes]):
        self.replies, self.times = replies, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for reply in self.replies:
            conn, _ = self.sock.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
                while len(body) < length:
                    body += conn.recv(65536)
                self.times.append(time.perf_counter())
                conn.sendall(reply)
        self.sock.close()


SCORED = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n{"scores": [0.5]}'


def test_an_answer_cut_off_mid_body_is_retried():
    """A server killed while it answers: the client's read ends early (http.client.IncompleteRead)
    and the request is sent again."""
    server = _ScriptedServer([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"scores\"", SCORED])
    assert post_scores(server.url, ["p"], ["r"], [True], timeout_s=5, retries=1, auth_env=None) == [0.5]
    assert len(server.times) == 2


@pytest.mark.parametrize("retry_after", [0, 2])
def test_a_503_is_retried_after_the_seconds_its_retry_after_asks_for(retry_after):
    busy = f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {retry_after}\r\nContent-Length: 0\r\n\r\n".encode()
    server = _ScriptedServer([busy, SCORED])
    assert post_scores(server.url, ["p"], ["r"], [True], timeout_s=5, retries=1, auth_env=None) == [0.5]
    waited = server.times[1] - server.times[0]
    assert retry_after <= waited < retry_after + 0.5
