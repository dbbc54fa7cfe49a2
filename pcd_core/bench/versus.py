"""The cross-backend lines of ``pcd bench --versus`` beyond the fill: plain generation, cold load, RSS.

- Plain generation: the same greedy chat reply on both engines, back to back in each repeat, as
  tokens per second of the whole call (the short prompt's read included, the same on both sides).
- Cold load and memory: each backend loads in a fresh Python process of its own (``python -m
  pcd_core.bench.versus``), with ``PCD_CACHE_DIR`` pointed at a new empty folder, so that no weights
  or tokenizer cache helps it and neither backend's libraries or pages count for the other. The child
  times ``Engine.load`` and runs one fill so the engine has touched what a fill needs. Then a second
  fresh process loads again from the cache the first one wrote and fills once: the loaded engine's
  resident memory (RSS) is taken there, as a server or a script that runs after the first load holds
  it. Both are recorded: the first process can hold what only a first load needs (the llama.cpp
  backend builds its tokenizer through transformers' GGUF reader, which imports torch;
  ``pcd_core/backends/llamacpp_loading.py``). The GGUF file itself may sit in the operating system's
  page cache for both: that is not a weights cache.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from pcd_core.bench.measure import rss_bytes
from pcd_core.errors import PcdError

#: what both engines are asked to write for the generation line: long enough to run the whole budget
GENERATION_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
GENERATION_TOKENS = 96


@dataclass(frozen=True)
class LoadProbe:
    """What one backend's fresh process measured: its load and its memory."""

    backend: str
    load_ms: float
    rss_before_mb: float  # the process after Python and the engine's imports, before the load
    rss_loaded_mb: float  # after the load and one fill


def _generation_ms(engine: Any) -> tuple[float, int]:
    started = time.perf_counter()
    reply = engine.generate(GENERATION_PROMPT, max_new_tokens=GENERATION_TOKENS)
    return (time.perf_counter() - started) * 1000.0, reply.output_tokens


def bench_generation(engine: Any, rival: Any, repeat: int) -> dict[str, Any]:
    """Plain generation tokens/s on ``engine`` and on ``rival``, alternating, medians of ``repeat``;
    ``generation_ratio`` is this engine's rate over the rival's (per repeat, then the median).
    """
    for side in (engine, rival):  # warm-up: the chat head and the step loop
        side.generate(GENERATION_PROMPT, max_new_tokens=4)
    ours, theirs = [], []
    for _ in range(repeat):
        ours.append(_generation_ms(engine))
        theirs.append(_generation_ms(rival))
    rates = [n / (ms / 1000.0) for ms, n in ours]
    rival_rates = [n / (ms / 1000.0) for ms, n in theirs]
    return {
        "generation_tokens": ours[-1][1],
        "generation_tokens_per_s": statistics.median(rates),
        "rival_generation_tokens": theirs[-1][1],
        "rival_generation_tokens_per_s": statistics.median(rival_rates),
        "generation_ratio": statistics.median(a / b for a, b in zip(rates, rival_rates)),
    }


def probe_load(model: str, backend: str, schema: dict[str, Any], text: str) -> LoadProbe:
    """Load ``model`` on ``backend`` in this process and fill ``schema`` once (run in a fresh child)."""
    from pcd_core.engine import Engine

    before = rss_bytes()
    started = time.perf_counter()
    engine = Engine.load(model, backend=backend)
    load_ms = (time.perf_counter() - started) * 1000.0
    engine.fill(schema, text)
    return LoadProbe(backend, load_ms, before / 2**20, rss_bytes() / 2**20)


def probe_in_child(model: str, backend: str, schema: dict[str, Any], text: str) -> tuple[LoadProbe, LoadProbe]:
    """``probe_load`` in a fresh process with an empty cache folder of its own (the cold load), then in
    another fresh process with the cache it wrote (the warm one); the folder is removed afterwards.
    """
    request = json.dumps({"model": model, "backend": backend, "schema": schema, "text": text})
    with tempfile.TemporaryDirectory(prefix="pcd-cold-") as cache:
        cold, warm = (_run_child(request, cache, backend) for _ in range(2))
    return cold, warm


def _run_child(request: str, cache: str, backend: str) -> LoadProbe:
    done = subprocess.run(
        [sys.executable, "-m", __name__],
        input=request,
        capture_output=True,
        text=True,
        env={**os.environ, "PCD_CACHE_DIR": cache},
        check=False,
    )
    if done.returncode != 0:  # the child's traceback ends with the error itself
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise PcdError(f"the load of {backend!r} failed: {last}")
    return LoadProbe(**json.loads(done.stdout.strip().splitlines()[-1]))


def bench_cold(model: str, backend: str, rival: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    """Cold load time and loaded RSS of both backends, each in fresh processes of its own, one backend
    after the other; ``load_ratio`` is the rival's cold load time over this backend's, ``rss_ratio``
    this one's RSS over the rival's, both after a warm load (``rss_cold_mb``: after the cold one).
    """
    (ours, our_warm), (theirs, their_warm) = (probe_in_child(model, name, schema, text) for name in (backend, rival))
    return {
        "cold_load_ms": ours.load_ms,
        "rival_cold_load_ms": theirs.load_ms,
        "load_ratio": theirs.load_ms / ours.load_ms,
        "warm_load_ms": our_warm.load_ms,
        "rival_warm_load_ms": their_warm.load_ms,
        "rss_mb": our_warm.rss_loaded_mb,
        "rss_before_load_mb": our_warm.rss_before_mb,
        "rss_cold_mb": ours.rss_loaded_mb,
        "rival_rss_mb": their_warm.rss_loaded_mb,
        "rival_rss_before_load_mb": their_warm.rss_before_mb,
        "rival_rss_cold_mb": theirs.rss_loaded_mb,
        "rss_ratio": our_warm.rss_loaded_mb / their_warm.rss_loaded_mb,
    }


def _child() -> None:
    request = json.loads(sys.stdin.read())
    probe = probe_load(request["model"], request["backend"], request["schema"], request["text"])
    print(json.dumps(asdict(probe)))


if __name__ == "__main__":
    _child()
