"""``pcd bench --widths 1,2,4,8,16``: tokens per second of one pass as it reads more requests at once.

Batching (``pcd_core/planning/batching.py``, ``pass_join.py``) can only gain what a pass of many requests reads
per second over a pass of one: if one short request already keeps every core busy, reading sixteen
at once is barely faster than reading them one by one. This mode measures that ceiling on the loaded
model and machine. For each width K, one ``score`` pass reads K different requests of
``REQUEST_TOKENS`` tokens after the same ``PREFIX_TOKENS``-token prefix (a cached head's stand-in),
each its own row, as a batch's inputs are read; it is timed ``repeat`` times (median).
``speedup_over_narrowest`` is the tokens per second at width K over that at the narrowest width
asked: the most a batch of such requests can gain over reading them one at a time, before what the
batch itself adds (padding, requests asked again in later rounds, a server's work per request).
``docs/benchmarks.md`` reads it beside the batch figures.

Where the backend is a torch module, each record also says why the ceiling sits where it does:
``matrix_gflops`` is the rate at which the pass got through the layers' matrix products (two
operations per weight per token; the output head, read only at the queries, is left out), and
``product_gflops`` the rate of one lone product of the model's largest layer matrix by the widest
pass's tokens, timed in the same run on the same thread: about what the machine's cores do with
this dtype. Where one request's pass already runs at a good share of that, no batch can read many
times more tokens per second.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from pcd_core.backends import model_thread
from pcd_core.backends.base import Query
from pcd_core.bench.measure import timed, weights_dtype

#: tokens of the prefix every timed pass follows, about a short schema's head
PREFIX_TOKENS = 256
#: tokens of each request, about a one-sentence input with its template
REQUEST_TOKENS = 96
#: timed runs of the lone matrix product (median), after one untimed
PRODUCT_RUNS = 5
#: prose repeated into the prefix and the requests: ordinary words, no special tokens
FILLER = (
    "The parcel came two days late, the box was torn at one corner, and the kettle inside sparks "
    "whenever I plug it in, so I would like a replacement or my money back before the weekend. "
)


def filler_ids(tokenizer: Any, n_tokens: int, start: int = 0) -> tuple[int, ...]:
    """``n_tokens`` ids of ``FILLER`` repeated, from its ``start``-th token on."""
    one = list(tokenizer.encode(FILLER))
    return tuple((one * ((start + n_tokens) // len(one) + 1))[start : start + n_tokens])


def width_rows(tokenizer: Any, width: int) -> list[tuple[int, ...]]:
    """``width`` requests of ``REQUEST_TOKENS`` tokens, each naming its own number in its first few
    tokens and starting the prose at its own word, so that requests share no more than an opening
    word or two (what many inputs behind one template share too); the records count what was read.
    """
    rows = []
    for k in range(width):
        head = tuple(tokenizer.encode(f"Request {k + 1}:"))
        rows.append((head + filler_ids(tokenizer, REQUEST_TOKENS, k))[:REQUEST_TOKENS])
    return rows


def bench_widths(engine: Any, widths: list[int], repeat: int) -> list[dict[str, Any]]:
    """One record per width, narrowest first (as ``--widths`` sorts them), each with its speedup over
    the narrowest.
    """
    backend = engine.backend
    head = filler_ids(engine.tokenizer, PREFIX_TOKENS)
    records = []
    for width in widths:
        rows = width_rows(engine.tokenizer, width)
        queries = [Query(k, len(row) - 1, (0,)) for k, row in enumerate(rows)]
        runs, n_tokens = [], 0
        for run in range(repeat + 1):  # the first, untimed, warms the kernels for this shape
            # a prefix of its own for each run: a backend that keeps what its last pass read after a
            # prefix (the torch backend's requests) must read every request again
            prefix = backend.prefill(head)
            tokens = backend.counter.tokens_read
            timing = timed(backend, functools.partial(backend.score, prefix, rows, queries))
            if run:
                runs.append(timing)
                n_tokens = backend.counter.tokens_read - tokens
        ms = statistics.median(run.ms for run in runs)
        records.append(
            {
                "mode": "widths",
                "backend": backend.name,
                "dtype": weights_dtype(backend),
                "model": engine.model_name,
                "prefix_tokens": PREFIX_TOKENS,
                "requests": width,
                "tokens": n_tokens,
                "ms": ms,
                "tokens_per_s": n_tokens / (ms / 1000.0),
                "forward_passes": runs[-1].forward_passes,
            }
        )
    narrowest = min(records, key=lambda record: record["requests"])["tokens_per_s"]
    for record in records:
        record["speedup_over_narrowest"] = record["tokens_per_s"] / narrowest
    matrices = layer_matrices(backend)
    if matrices is not None:
        weights, largest = matrices
        widest = max(record["tokens"] for record in records)
        product = lone_product_gflops(backend, largest, widest, PRODUCT_RUNS)
        for record in records:
            record["matrix_gflops"] = 2 * weights * record["tokens_per_s"] / 1e9
            record["product_gflops"] = product
    return records


def layer_matrices(backend: Any) -> tuple[int, Any] | None:
    """The weights every token is multiplied by (the ``Linear`` layers' of a torch model, its output
    head left out) and the largest such matrix; None where the model is not a torch module.
    """
    model = getattr(backend, "model", None)
    try:
        import torch
    except ImportError:
        return None
    if not isinstance(model, torch.nn.Module):
        return None
    head = getattr(model, "get_output_embeddings", lambda: None)()
    matrices = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    if not matrices:
        return None
    return sum(int(w.numel()) for w in matrices), max(matrices, key=lambda w: w.numel())


def lone_product_gflops(backend: Any, weight: Any, n_tokens: int, runs: int) -> float:
    """Billions of operations per second of ``n_tokens`` random activations times ``weight`` (its
    dtype and device), on the model thread where the passes ran, the median of ``runs`` timed runs.
    Timed here rather than by ``measure.timed``, whose RSS sampler starts a thread per call: a
    bfloat16 product takes a few milliseconds, and that thread's start and wake-ups would weigh in.
    """
    import torch

    synchronize = getattr(backend, "synchronize", lambda: None)
    activations = torch.randn(n_tokens, weight.shape[1], dtype=weight.dtype, device=weight.device)

    def once() -> float:
        synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            torch.nn.functional.linear(activations, weight)
        synchronize()
        return time.perf_counter() - started

    seconds = model_thread.run(lambda: [once() for _ in range(runs + 1)][1:])
    return 2 * n_tokens * weight.numel() / statistics.median(seconds) / 1e9
