"""``pcd bench --backend vllm``: PCD on a vLLM server against that server's own JSON generation.

The competitor is vLLM itself: the same prompt as token ids, minus the ``{`` the engine writes, sent
to ``/v1/completions`` with ``structured_outputs={"json": schema}``, so that vLLM's grammar engine
(xgrammar or guidance, whichever the server picks) masks every step while the model writes the object
greedily, one token per step, with vLLM's own batching and caches. The baselines of ``baselines.py``
would read the whole vocabulary through the backend each step (vocabulary / 128 requests), which
measures the protocol, not vLLM. Every repeat runs PCD then vLLM back to back; the ratio is the
median of the per-repeat ratios, as in ``runner.py``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, TextIO

from pcd_core.backends.vllm_backend import VllmBackend
from pcd_core.bench.checks import agreement, is_valid
from pcd_core.bench.runner import BenchCase, ar_cap, strict_json
from pcd_core.errors import BackendError


def generate_json(engine: Any, case: BenchCase, max_tokens: int) -> dict[str, Any]:
    """One greedy, grammar-constrained generation of the whole object by vLLM, timed."""
    backend: VllmBackend = engine.backend
    compiled = engine.compile(case.schema)
    opener = compiled.layout.opener
    text = compiled.prompt.head + compiled.prompt.request_text(case.text)
    # the engine writes the opener itself; vLLM's grammar makes the model write the whole object
    prompt = engine.tokenizer.encode_head(text[: len(text) - len(opener)] if text.endswith(opener) else text)
    body = {
        "model": backend.served_model,
        "prompt": [list(prompt)],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "structured_outputs": {"json": case.schema},
    }
    started = time.perf_counter()
    # a whole object one token a step: far longer than one read, so the read timeout does not apply
    data = backend.request_json("POST", "/v1/completions", body, timeout_s=3600.0)
    ms = (time.perf_counter() - started) * 1000.0
    choice = (data.get("choices") or [{}])[0]
    if "text" not in choice:
        raise BackendError(f"vLLM's structured generation returned no text: {data!r:.300}")
    return {
        "text": choice["text"],
        "ms": ms,
        "tokens": int((data.get("usage") or {}).get("completion_tokens", 0)),
        "stop": choice.get("finish_reason"),
    }


def bench_vllm_case(engine: Any, case: BenchCase, *, repeat: int = 3, cap: int | None = None) -> dict[str, Any]:
    schema = engine.compile(case.schema).schema
    max_tokens = cap or 2 * ar_cap(case.n_fields)  # room for the grammar's whitespace
    engine.warmup(case.schema)
    engine.fill(case.schema, case.text)  # warm-up: the head and the request in vLLM's prefix cache
    generate_json(engine, case, 8)
    pcd_ms, vllm_ms, runs = [], [], []
    for _ in range(repeat):
        started = time.perf_counter()
        result = engine.fill(case.schema, case.text)
        pcd_ms.append((time.perf_counter() - started) * 1000.0)
        runs.append(generate_json(engine, case, max_tokens))
        vllm_ms.append(runs[-1]["ms"])
    last = runs[-1]
    written = strict_json(last["text"])
    return {
        "schema": case.name,
        "backend": "vllm",
        "model": engine.model_name,
        "fields": case.n_fields,
        "repeat": repeat,
        "pcd_ms": statistics.median(pcd_ms),
        "pcd_requests": result.stats.forward_passes,
        "pcd_valid": is_valid(schema, result.values),
        "vllm_json_ms": statistics.median(vllm_ms),
        "vllm_json_ratio": statistics.median(v / p for v, p in zip(vllm_ms, pcd_ms)),
        "vllm_json_tokens": last["tokens"],
        "vllm_json_stop": last["stop"],
        "vllm_json_valid": all(is_valid(schema, strict_json(run["text"])) for run in runs),
        "vllm_json_agreement": agreement(schema, result.values, written or {}),
        "vllm_json_output": last["text"],
        "pcd_output": result.values,
    }


def write_vllm_table(records: list[dict[str, Any]], out: TextIO) -> None:
    out.write("| schema | fields | PCD ms | PCD requests | vLLM JSON ms | vLLM/PCD | vLLM tokens | agree | valid |\n")
    out.write("|---|---|---|---|---|---|---|---|---|\n")
    for r in records:
        out.write(
            f"| {r['schema']} | {r['fields']} | {r['pcd_ms']:.0f} | {r['pcd_requests']} | {r['vllm_json_ms']:.0f} "
            f"| {r['vllm_json_ratio']:.1f}x | {r['vllm_json_tokens']} | {r['vllm_json_agreement']}/{r['fields']} "
            f"| {r['pcd_valid']}/{r['vllm_json_valid']} |\n"
        )
