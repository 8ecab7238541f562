"""Shared by the eval tests: the tiny random model (the `tiny` preset's, tokenizer trained on HH
text) and an OpenAI-compatible chat server on loopback that judges by a fixed rule."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stages.compute import loading
from stages.orchestration.config_loading import load_config

SECRET = "sk-test-0123456789abcdef-never-logged"


@functools.cache
def tiny_lm():
    """(model, tokenizer) of the tiny preset; the BPE tokenizer learns on 400 HH dialogues."""
    cfg = load_config("tiny")
    _, records = loading.read_records(cfg.data.pairs, cfg.data)
    texts = [r["chosen"] for r in records[:400]]
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: texts)
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
    model = loading.load_model(model_dir, cfg.model).eval()
    loading.align_pad_token(model, tokenizer)
    return model, tokenizer


_RESPONSES = re.compile(r"\[Response A\]\n(.*)\n\n\[Response B\]\n(.*)\n\nExplain", re.S)


class JudgeServer:
    """`POST /v1/chat/completions` preferring the shorter response (`[[C]]` on equal lengths).
    Markers in a response script faults, on the first request of each conversation: `RATE`
    answers 429, `SLOW` sleeps past the client's timeout, `CRASH` answers 500, `GARBLE` replies
    without a verdict (the retry gets one); `STALL` always sleeps, `NEVER` never gives a verdict
    and `FIRST` always says `[[A]]` (a position-biased judge). With `verdicts=False` it never gives a
    verdict to anything: a judge too weak to follow the format."""

    def __init__(self, key: str = SECRET, slow_s: float = 1.5, verdicts: bool = True):
        self.key, self.slow_s, self.verdicts = key, slow_s, verdicts
        self.calls = 0
        self.statuses: Counter = Counter()
        self.seen: Counter = Counter()  # requests per conversation
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = server.answer(self.path, self.headers.get("Authorization"), body)
                if status is None:  # the client gave up waiting
                    return
                with server.lock:
                    server.statuses[status] += 1
                payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}
                                     if status == 200 else {"error": reply}).encode()
                try:
                    self.send_response(status)
                    if status == 429:
                        self.send_header("Retry-After", "0")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, path: str, auth: str | None, body: dict) -> tuple[int | None, str]:
        with self.lock:
            self.calls += 1
            first = body["messages"][0]["content"]
            self.seen[first] += 1
            attempt = self.seen[first]
        if path != "/v1/chat/completions":
            return 404, "no such endpoint"
        if auth != f"Bearer {self.key}":
            return 401, f"Incorrect API key provided: {auth}"
        a, b = _RESPONSES.search(first).groups()
        retry = len(body["messages"]) > 1
        if "RATE" in a + b and attempt == 1:
            return 429, "rate limited"
        if "CRASH" in a + b and attempt == 1:
            return 500, "internal error"
        if "STALL" in a + b or ("SLOW" in a + b and attempt == 1):
            with self.lock:
                self.statuses["timeout"] += 1
            time.sleep(self.slow_s)
            return None, ""
        if not self.verdicts or "NEVER" in a + b or ("GARBLE" in a + b and not retry):
            return 200, "Both responses have merit."
        if "FIRST" in a + b:
            return 200, "Response A reads better.\n[[A]]"
        verdict = "C" if len(a) == len(b) else "A" if len(a) < len(b) else "B"
        return 200, f"The shorter one is better.\n[[{verdict}]]"
