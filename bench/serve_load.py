"""The reward server under load: K concurrent clients on loopback (K = 1, 4, 16, 64 by default),
each sending batches of real HH prompts and answers for a bounded time, to `rlhf serve-reward`
micro-batching across requests against the same server scoring one request at a time
(`reward_server.batch_across_requests=false`), in the same run.

The model is the preset's base model (demo: SmolLM2-135M-Instruct, de-quantised from its GGUF by
our loader) with a seeded, untrained scalar head: throughput does not depend on what the head
learnt. The rows are the preset's pairs file (HH-RLHF harmless-base test) read by the data stage's
loader: each prompt rendered by the model's chat template, each answer the chosen or rejected one.

Both servers are `rlhf serve-reward` processes with the preset's settings and the same overrides
(`--set`), started once and idle while the other is measured; for each K the two take turns (the
order alternating from K to K), so a slow phase of a shared machine hits both alike. A client
sends a request, waits for its answer, and sends the next; a 503 counts as shed and the client
waits the Retry-After it was given, as PPO's client does. Errors are anything else: a connection
that failed or hung past --timeout, a status other than 200 and 503, an answer without one score
per row. When the time is up no new request starts; those in flight are waited for (and counted).

Each server first answers one request unmeasured (the first forward builds kernels and allocates
buffers); its RSS after that is "idle". Printed: the CPU and load average before and after; per K
and server requests/s, scores/s, p50 and p99 latency of answered requests, 503s and errors, and
the server's RSS idle and at its peak; per K batched / one-at-a-time scores/s.

    .venv/bin/python bench/serve_load.py                        # demo preset, 10 s per K and server
    .venv/bin/python bench/serve_load.py --seconds 30 --clients 1 16 --rows 8
    .venv/bin/python bench/serve_load.py --preset tiny --seconds 5
    .venv/bin/python bench/serve_load.py --threads 1           # where other jobs load the cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from turns import load_average

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64], help="the K to run")
    parser.add_argument("--seconds", type=float, default=10.0, help="load time per K and server")
    parser.add_argument("--rows", type=int, default=8, help="(prompt, answer) rows per request")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each server (OMP_NUM_THREADS; default: torch's, one per core); 1 where "
                             "other jobs load the cores (waiting threads of a parallel region stall it)")
    parser.add_argument("--timeout", type=float, default=120.0, help="a request unanswered this long is an error")
    parser.add_argument("--set", dest="overrides", action="append",
                        default=["reward.max_seq_len=64", "reward.max_response_len=32"],
                        metavar="KEY=VALUE", help="config overrides for both servers (default: reward.max_seq_len=64 "
                                                   "and reward.max_response_len=32, the end of an HH dialogue and "
                                                   "its answer, so a run fits a few minutes of 2 cores)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        reward_dir, rows = prepare(args, Path(tmp))
        print(f"{cpu_name()}; server threads {args.threads or 'torch default'}; {load_average()}")
        servers = {"batched": start_server(reward_dir, args, batched=True),
                   "one-at-a-time": start_server(reward_dir, args, batched=False)}
        try:
            for server in servers.values():
                server.wait_ready()
                print(f"{server.name}: first request {server.warm_up(rows[: args.rows]):.1f}s (kernels built, "
                      f"buffers allocated: not measured)", flush=True)
            idle = {name: server.rss() for name, server in servers.items()}
            results = []
            for turn, clients in enumerate(args.clients):
                order = list(servers) if turn % 2 == 0 else list(servers)[::-1]
                for name in order:
                    result = load(servers[name], clients, rows, args, seed=turn)
                    results.append({"server": name, "clients": clients, "idle_rss": idle[name], **result})
                    print(row_text(results[-1]), flush=True)
        finally:
            for server in servers.values():
                server.stop()
        print(f"\n{load_average()}")
        print(table(results))


def prepare(args, tmp: Path) -> tuple[Path, list[tuple[str, str]]]:
    """The reward model folder (base model + seeded head) and the (prompt, answer) rows."""
    import torch

    from stages.compute import loading
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs, make_splits, split_texts
    from stages.leaves.rendering import render_prompt
    from stages.compute.reward.model import reward_model_from_lm, save_reward_model

    cfg = load_config(args.preset, args.overrides)
    _, pairs, _ = load_pairs(cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(make_splits(pairs, cfg)))
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
    reward_dir = tmp / "reward"
    torch.manual_seed(cfg.reward.seed)
    save_reward_model(reward_model_from_lm(model_dir, cfg.model), tokenizer, reward_dir,
                      {"role": "benchmark: base model with an untrained head"})
    rows = [(render_prompt(tokenizer, p["messages"]), p[answer]) for p in pairs for answer in ("chosen", "rejected")]
    print(f"{len(rows)} rows from {cfg.data.pairs}; model {cfg.model.name_or_path}; {args.rows} rows per request")
    return reward_dir, rows


class Server:
    """An `rlhf serve-reward` process on loopback."""

    def __init__(self, name: str, proc: subprocess.Popen, port: int):
        self.name, self.proc, self.url = name, proc, f"http://127.0.0.1:{port}"
        self.process = psutil.Process(proc.pid)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the {self.name} server did not start: {self.proc.stdout.read()}")
                time.sleep(0.5)

    def warm_up(self, batch: list[tuple[str, str]]) -> float:
        started = time.perf_counter()
        body = json.dumps({"prompts": [p for p, _ in batch], "responses": [a for _, a in batch]}).encode()
        request = urllib.request.Request(f"{self.url}/score", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
        return time.perf_counter() - started

    def rss(self) -> int:
        return self.process.memory_info().rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(reward_dir: Path, args, batched: bool) -> Server:
    from stages.orchestration.launch import free_port

    port = free_port()
    sets = [*args.overrides, f"reward_server.batch_across_requests={str(batched).lower()}"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--model", str(reward_dir),
                             "--preset", args.preset, "--port", str(port), *(a for s in sets for a in ("--set", s))],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                           **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return Server("batched" if batched else "one-at-a-time", proc, port)


def load(server: Server, clients: int, rows: list[tuple[str, str]], args, seed: int) -> dict:
    """K clients for args.seconds: answered requests' latencies, scores, 503s, errors, peak RSS."""
    stop_at = time.perf_counter() + args.seconds
    latencies: list[float] = []
    counts = {"scores": 0, "shed": 0, "errors": 0}
    errors: list[str] = []
    lock = threading.Lock()
    peak = [server.rss()]
    done = threading.Event()

    def client(number: int) -> None:
        rng = random.Random(f"{seed}:{number}")
        while time.perf_counter() < stop_at:
            batch = rng.sample(rows, args.rows)
            body = json.dumps({"prompts": [p for p, _ in batch], "responses": [a for _, a in batch],
                               "ended": [True] * len(batch)}).encode()
            request = urllib.request.Request(f"{server.url}/score", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=args.timeout) as response:
                    scores = json.loads(response.read())["scores"]
                if len(scores) != len(batch):
                    raise ValueError(f"{len(scores)} scores for {len(batch)} rows")
                with lock:
                    latencies.append(time.perf_counter() - started)
                    counts["scores"] += len(scores)
            except urllib.error.HTTPError as err:
                if err.code != 503:
                    with lock:
                        counts["errors"] += 1
                        errors.append(f"HTTP {err.code}")
                    continue
                with lock:
                    counts["shed"] += 1
                time.sleep(min(float(err.headers.get("Retry-After", 1)), max(0.0, stop_at - time.perf_counter())))
            except Exception as err:  # a failed or hung connection, a wrong answer
                with lock:
                    counts["errors"] += 1
                    errors.append(f"{type(err).__name__}: {err}")

    def watch_rss() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], server.rss())

    watcher = threading.Thread(target=watch_rss, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=args.seconds + args.timeout + 10)
    elapsed = time.perf_counter() - started
    hung = sum(thread.is_alive() for thread in threads)
    done.set()
    watcher.join()
    ordered = sorted(latencies)
    return {"requests_s": len(latencies) / elapsed, "scores_s": counts["scores"] / elapsed,
            "p50": statistics.median(ordered) if ordered else float("nan"),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan"),
            "answered": len(latencies), "shed": counts["shed"], "errors": counts["errors"] + hung,
            "error_kinds": sorted(set(errors))[:3], "peak_rss": peak[0], "seconds": elapsed}


def row_text(r: dict) -> str:
    return (f"K={r['clients']:<3} {r['server']:<14} {r['requests_s']:7.2f} req/s {r['scores_s']:8.2f} scores/s "
            f"p50 {r['p50']:6.2f}s p99 {r['p99']:6.2f}s answered {r['answered']:4d} 503 {r['shed']:4d} "
            f"errors {r['errors']:3d}{' ' + str(r['error_kinds']) if r['error_kinds'] else ''} "
            f"RSS idle {r['idle_rss'] / 2**20:.0f} MiB peak {r['peak_rss'] / 2**20:.0f} MiB "
            f"(+{(r['peak_rss'] - r['idle_rss']) / 2**20:.0f}) over {r['seconds']:.1f}s")


def table(results: list[dict]) -> str:
    lines = ["| K | server | requests/s | scores/s | p50 s | p99 s | 503s | errors | RSS idle → peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['clients']} | {r['server']} | {r['requests_s']:.2f} | {r['scores_s']:.2f} | "
                     f"{r['p50']:.2f} | {r['p99']:.2f} | {r['shed']} | {r['errors']} | "
                     f"{r['idle_rss'] / 2**20:.0f} → {r['peak_rss'] / 2**20:.0f} |")
    by = {(r["clients"], r["server"]): r for r in results}
    lines.append("")
    for clients in sorted({r["clients"] for r in results}):
        batched, alone = by[(clients, "batched")], by[(clients, "one-at-a-time")]
        ratio = batched["scores_s"] / alone["scores_s"] if alone["scores_s"] else float("inf")
        lines.append(f"K={clients}: batched / one-at-a-time scores/s ×{ratio:.2f}")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    import torch

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
