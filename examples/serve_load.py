"""Load on a real ``pcd serve``: 8 clients, mixed routes, for a bounded time; requests/s, p50/p99 latency
and the server's resident memory before and after.

    python examples/serve_load.py [--seconds 600] [--clients 8] [--model smollm2-135m]

Starts ``pcd serve`` as a subprocess on a free loopback port (its RSS is read from /proc, so Linux
only), waits for ``/readyz``, sends one request of each kind to warm the caches, reads the RSS, then
runs the clients until the time is up: each picks the next of five requests in turn (System One with two
questions, OpenAI Decisions with one predicate, the same over a conversation of input items, a chat
completion filling a two-field json_schema, a short generated chat reply). Prints per route the requests, errors, requests/s and p50/p99 latency, the
server's own counters from ``/metrics``, and its RSS: idle before the load, after ``--warmup`` seconds
under load (the first concurrent requests allocate their buffers once), and at the end, with the change
from the second to the third, which is what a leak would show. ``--output FILE`` also writes the
figures as JSON (``docs/bench/serve_load.json``, which ``docs/operations-load.md`` reports).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

STATE = "Order #55120. The blender arrived with a cracked jar and the motor smells like burning plastic. Refund me."
SYSTEMONE = {
    "state": STATE,
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {
            "type": "choice",
            "instructions": "Which team owns this?",
            "criteria": {"returns": "refunds", "safety": "hazards", "sales": None},
        },
    },
}
DECISIONS = {"input": STATE, "questions": [{"type": "predicate", "instructions": "Is there a safety hazard?"}]}
FILL = {
    "messages": [{"role": "user", "content": STATE}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "Ticket",
            "schema": {
                "type": "object",
                "properties": {"urgent": {"type": "boolean"}, "team": {"enum": ["returns", "safety", "sales"]}},
                "required": ["urgent", "team"],
            },
        },
    },
}
# the Decisions input items of openai 3.57: instructions, earlier turns (assistant, a function call and
# its output), then the user's message; the turns are read anew each time (no prompt_cache_key)
TURNS = {
    "input": [
        {"role": "developer", "content": "Safety problems outrank refunds."},
        {"role": "user", "content": "My blender order #55120 arrived."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Is anything wrong with it?"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup_order", "arguments": '{"order": 55120}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Delivered yesterday; one blender."},
        {"role": "user", "content": STATE},
    ],
    "questions": [{"type": "predicate", "instructions": "Is there a safety hazard?"}],
}
GENERATE = {"messages": [{"role": "user", "content": "Say hello in three words."}], "max_tokens": 8}
MIX = (
    ("/v1/systemone", SYSTEMONE),
    ("/v1/decisions", DECISIONS),
    ("/v1/decisions (turns)", TURNS),
    ("/v1/chat/completions (fill)", FILL),
    ("/v1/chat/completions (text)", GENERATE),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(model: str, port: int) -> subprocess.Popen[bytes]:
    pcd = shutil.which("pcd", path=str(Path(sys.executable).parent)) or "pcd"
    command = [pcd, "serve", "--port", str(port), "--model", model, "--no-playground"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(base: str, server: subprocess.Popen[bytes], deadline_s: float = 600.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pcd serve exited with status {server.returncode}")
        try:
            if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("pcd serve was not ready in time")


def run(base: str, model: str, clients: int, seconds: float) -> dict[str, list[tuple[float, int]]]:
    """Each client sends the next request of the mix until the time is up; (seconds, status) per route."""
    results: dict[str, list[tuple[float, int]]] = defaultdict(list)
    lock = threading.Lock()
    turns = itertools.count()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=base, timeout=max(seconds, 60.0)) as http:
            while time.monotonic() < stop_at:
                name, body = MIX[next(turns) % len(MIX)]
                started = time.perf_counter()
                status = http.post(name.split(" ")[0], json={"model": model, **body}).status_code
                with lock:
                    results[name].append((time.perf_counter() - started, status))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds under load before the RSS baseline (default: a tenth of the run)",
    )
    parser.add_argument("--model", default=os.environ.get("PCD_MODEL", "smollm2-135m"))
    parser.add_argument("--output", metavar="FILE", help="also write the figures as JSON to FILE")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port)
    try:
        wait_ready(base, server)
        for name, body in MIX:  # warm: heads cached, the first compile done
            httpx.post(f"{base}{name.split(' ')[0]}", json={"model": args.model, **body}, timeout=600)
        before = rss_mib(server.pid)
        started = time.monotonic()
        warmup_s = args.warmup if args.warmup is not None else args.seconds / 10
        warm: list[float] = []
        timer = threading.Timer(warmup_s, lambda: warm.append(rss_mib(server.pid)))
        timer.start()
        results = run(base, args.model, args.clients, args.seconds)
        timer.cancel()
        elapsed = time.monotonic() - started
        after = rss_mib(server.pid)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = summarise(results, elapsed, metrics)
    report.update(
        command=" ".join(["python", "examples/serve_load.py", *sys.argv[1:]]),
        model=args.model,
        clients=args.clients,
        seconds=round(elapsed, 1),
        rss_mib={
            "idle_before": round(before, 1),
            "after_warmup": round(warm[0], 1) if warm else None,
            "end": round(after, 1),
        },
        warmup_s=warmup_s,
        rss_change_after_warmup_percent=round((after - warm[0]) / warm[0] * 100, 2) if warm else None,
    )
    print(f"{args.clients} clients for {elapsed:.0f} s on {args.model}")
    for name, row in report["routes"].items():
        print(
            f"{name:30s} {row['requests']:5d} requests {row['errors']:3d} errors {row['requests_per_s']:6.2f} req/s "
            f"p50 {row['p50_ms']:7.0f} ms p99 {row['p99_ms']:7.0f} ms"
        )
    print(f"RSS idle before the load {before:.1f} MiB, at the end {after:.1f} MiB")
    if warm:
        print(
            f"RSS after {warmup_s:.0f} s under load {warm[0]:.1f} MiB; from there to the end "
            f"{report['rss_change_after_warmup_percent']:+.1f}%"
        )
    for sample, value in report["counters"].items():
        print(f"  {sample} {value:g}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


def summarise(results: dict[str, list[tuple[float, int]]], elapsed: float, metrics: str) -> dict[str, Any]:
    """Per route (and for all) requests, errors, requests/s and p50/p99 latency; the server's counters."""
    every = [row for rows in results.values() for row in rows]
    routes = {}
    for name, rows in [*results.items(), ("all", every)]:
        latencies = [s for s, _ in rows]
        routes[name] = {
            "requests": len(rows),
            "errors": sum(1 for _, status in rows if status >= 400),
            "requests_per_s": round(len(rows) / elapsed, 3),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        }
    counters = {}
    for family in text_string_to_metric_families(metrics):
        if family.name in {"pcd_forward_passes", "pcd_requests_rejected", "pcd_head_cache"}:
            for sample in family.samples:
                counters[f"{sample.name}{json.dumps(sample.labels, sort_keys=True)}"] = sample.value
    return {"routes": routes, "counters": counters}


if __name__ == "__main__":
    main()
