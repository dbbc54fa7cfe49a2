"""Load test: ``pcd serve --backend vllm`` under 1 and under 8 concurrent clients, over a real socket.

    python examples/vllm_load.py --vllm-url http://127.0.0.1:8000 [--model smollm2-135m] [--requests 16]

Starts ``pcd serve --backend vllm`` on a free loopback port (stopped by its PID at the end), sends
``--requests`` distinct ``/v1/systemone`` requests one at a time, then the same requests from 8
clients at once, and prints requests/s for both. Every concurrent answer must equal the sequential
answer to the same request (to 1e-4 in probability: vLLM's batches change float reductions), so
that concurrency is shown to change speed only. With the engine lock held around remote calls the 8
clients queue on it; docs/vllm.md explains why the lock must not cover a remote backend.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

STATE = (
    "Order #{n}. The customer writes: 'The blender arrived with a cracked jar and the motor smells like "
    "burning plastic. I want my money back, not a replacement.' Order value: ${n}.00."
)
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {
        "type": "choice",
        "instructions": "Which team owns this?",
        "criteria": {"returns": "refunds", "safety": "hazards", "logistics": "shipping", "sales": None},
    },
    "frustration": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["calm", "annoyed", "frustrated", "angry", "furious"],
    },
}


def start_pcd(vllm_url: str, model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "pcd_integrations.commands", "serve", "--backend", "vllm", "--base-url", vllm_url]
    command += ["--model", model, "--port", str(port)]
    server = subprocess.Popen(command, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"pcd serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("pcd serve did not become ready in 300 s")


def ask(http: httpx.Client, n: int) -> dict[str, Any]:
    response = http.post("/v1/systemone", json={"state": STATE.format(n=n), "questions": QUESTIONS})
    response.raise_for_status()
    return response.json()["answers"]


def same(a: Any, b: Any) -> bool:
    """Equal answers: the same labels and booleans, probabilities within 1e-4."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-4)
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", required=True, help="the running vLLM server")
    parser.add_argument("--model", default="smollm2-135m", help="the tokenizer files of the server's model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    server, url = start_pcd(args.vllm_url, args.model)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            ask(http, 0)  # warm the head in vLLM's prefix cache
            started = time.perf_counter()
            sequential = [ask(http, n) for n in range(1, args.requests + 1)]
            one = args.requests / (time.perf_counter() - started)
            with ThreadPoolExecutor(args.clients) as pool:
                started = time.perf_counter()
                concurrent = list(pool.map(lambda n: ask(http, n), range(1, args.requests + 1)))
                many = args.requests / (time.perf_counter() - started)
        equal = sum(same(a, b) for a, b in zip(sequential, concurrent))
        print(f"1 client: {one:.2f} req/s; {args.clients} clients: {many:.2f} req/s ({many / one:.2f}x)")
        print(f"answers equal to the sequential ones: {equal}/{args.requests}")
        if equal != args.requests:
            raise SystemExit(1)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
