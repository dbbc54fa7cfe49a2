"""The benchmark's outputs: a table for the terminal, the JSON records, and the plot for the docs (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

_COLUMNS = (
    ("schema", "schema", "{}"),
    ("backend", "backend", "{}"),
    ("fields", "fields", "{}"),
    ("pcd_ms", "PCD ms", "{:.0f}"),
    ("prefill_ms", "prefill ms", "{:.0f}"),
    ("pcd_forward_passes", "PCD passes", "{}"),
    ("ar_ms", "AR ms", "{:.0f}"),
    ("ratio", "AR/PCD", "{:.1f}x"),
    ("ar_tokens", "AR tok", "{}"),
    ("ar_stop", "AR stop", "{}"),
    ("arc_ms", "ARC ms", "{:.0f}"),
    ("arc_ratio", "ARC/PCD", "{:.1f}x"),
    ("seq_ms", "seq ms", "{:.0f}"),
    ("seq_ratio", "seq/PCD", "{:.1f}x"),
    ("seq_forward_passes", "seq passes", "{}"),
    ("pcd_valid", "PCD valid", "{}"),
    ("ar_valid", "AR valid", "{}"),
    ("arc_valid", "ARC valid", "{}"),
    ("agreement", "agree AR", "{}"),
    ("seq_agreement", "agree seq", "{}"),
    ("peak_mem_mb", "PCD +MB", "{:.0f}"),
    ("prefill_peak_mem_mb", "prefill +MB", "{:.0f}"),
)

_THROUGHPUT = (  # pcd bench --throughput: one at a time, then read together, on the same engine
    ("schema", "schema", "{}"),
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("fields", "fields", "{}"),
    ("documents", "documents", "{}"),
    ("solo_docs_per_s", "solo docs/s", "{:.2f}"),
    ("docs_per_s", "batched docs/s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("solo_forward_passes", "solo passes", "{}"),
    ("forward_passes", "batched passes", "{}"),
    ("solo_peak_rss_mb", "solo peak RSS MB", "{:.0f}"),
    ("peak_rss_mb", "batched peak RSS MB", "{:.0f}"),
    ("same_answers", "same answers", "{}"),
)
_CLIENTS = (  # pcd bench --clients: one HTTP client, then N at once, on the same served engine
    ("route", "route", "{}"),
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("clients", "clients", "{}"),
    ("one_requests_per_s", "1 client req/s", "{:.2f}"),
    ("many_requests_per_s", "N clients req/s", "{:.2f}"),
    ("requests_ratio", "req/s ratio", "{:.2f}x"),
    ("one_tokens_per_s", "1 client tok/s", "{:.1f}"),
    ("many_tokens_per_s", "N clients tok/s", "{:.1f}"),
    ("tokens_ratio", "tok/s ratio", "{:.2f}x"),
    ("one_p50_ms", "1 client p50 ms", "{:.0f}"),
    ("many_p50_ms", "N clients p50 ms", "{:.0f}"),
    ("one_forward_passes", "1 client passes", "{}"),
    ("many_forward_passes", "N clients passes", "{}"),
    ("one_peak_rss_mb", "1 client peak RSS MB", "{:.0f}"),
    ("many_peak_rss_mb", "N clients peak RSS MB", "{:.0f}"),
)
_CHOICES = (  # pcd bench --choices
    ("backend", "backend", "{}"),
    ("options", "options", "{}"),
    ("ms", "ms", "{:.0f}"),
    ("forward_passes", "passes", "{}"),
    ("row_tokens", "row tokens", "{}"),
    ("n_rows", "rows", "{}"),
    ("input_tokens", "input tokens", "{}"),
)

_WIDTHS = (  # pcd bench --widths
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("prefix_tokens", "prefix tokens", "{}"),
    ("requests", "requests a pass", "{}"),
    ("tokens", "pass tokens", "{}"),
    ("ms", "ms", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("speedup_over_narrowest", "over the narrowest", "{:.2f}x"),
    ("matrix_gflops", "matrix GFLOP/s", "{:.0f}"),
    ("product_gflops", "lone product GFLOP/s", "{:.0f}"),
)


_SESSION = (  # pcd bench --session
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("turns", "turns", "{}"),
    ("median_turn_tokens", "turn tokens (median)", "{:.0f}"),
    ("median_append_tokens", "tokens an append read (median)", "{:.0f}"),
    ("median_row_tokens", "of which rows", "{:.0f}"),
    ("session_tokens", "session tokens", "{}"),
    ("reread_tokens", "re-read tokens", "{}"),
    ("session_ms", "session ms", "{:.0f}"),
    ("reread_ms", "re-read ms", "{:.0f}"),
    ("speedup", "speedup", "{:.1f}x"),
    ("turn5_ms", "turn 5 ms", "{:.0f}"),
    ("turn40_ms", "turn 40 ms", "{:.0f}"),
    ("late_over_early", "turns 38-42 / 3-7", "{:.2f}x"),
    ("max_probability_gap", "max probability gap", "{:.1e}"),
)


_SESSION_MEMORY = (  # pcd bench --session FILE --session-memory N
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("sessions", "sessions", "{}"),
    ("longest_session_tokens", "tokens a session held", "{}"),
    ("max_sessions", "max_sessions", "{}"),
    ("evictions", "evictions", "{}"),
    ("baseline_rss_mb", "RSS after load MB", "{:.0f}"),
    ("bound_mb", "stated bound MB", "{:.0f}"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
    ("within_bound", "within", "{}"),
    ("median_append_ms", "append ms (median)", "{:.0f}"),
    ("reread_max_probability_gap", "re-read gap", "{:.1e}"),
    ("rss_after_close_mb", "RSS after close MB", "{:.0f}"),
)


_HANGUP = (  # pcd bench --hangup N
    ("backend", "backend", "{}"),
    ("dtype", "dtype", "{}"),
    ("questions", "questions", "{}"),
    ("long_tokens", "long pass tokens", "{}"),
    ("stop_inside", "stops inside its pass", "{}"),
    ("repeat", "drops", "{}"),
    ("median_short_queue_ms", "short decide queue ms (median)", "{:.0f}"),
    ("median_short_wall_ms", "short decide wall ms (median)", "{:.0f}"),
    ("short_decide_ms", "short decide alone ms (median)", "{:.1f}"),
)


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None:
        return "-"
    if key in ("agreement", "seq_agreement"):
        return f"{value}/{record['fields']}"
    return fmt.format(value)


def write_table(records: list[dict[str, Any]], out: TextIO) -> None:
    """A Markdown table per kind of record, so that the same text goes into the terminal and the docs."""
    modes = (
        (None, _COLUMNS),
        ("throughput", _THROUGHPUT),
        ("clients", _CLIENTS),
        ("choices", _CHOICES),
        ("widths", _WIDTHS),
        ("session", _SESSION),
        ("session_memory", _SESSION_MEMORY),
        ("hangup", _HANGUP),
    )
    for mode, columns in modes:
        picked = [r for r in records if r.get("mode") == mode]
        if picked:
            if mode is not None:
                out.write("\n")
            head = [title for _, title, _ in columns]
            _markdown(head, [[_cell(r, key, fmt) for key, _, fmt in columns] for r in picked], out)


def _markdown(head: list[str], rows: list[list[str]], out: TextIO) -> None:
    out.write("| " + " | ".join(head) + " |\n")
    out.write("|" + "|".join("---" for _ in head) + "|\n")
    out.writelines("| " + " | ".join(row) + " |\n" for row in rows)


def write_json(records: list[dict[str, Any]], path: str, meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "records": records}, indent=2, ensure_ascii=False) + "\n")


def write_plot(records: list[dict[str, Any]], path: str, title: str) -> None:
    """Milliseconds per request against the number of fields: one panel per backend, one line per
    method, one marker style per schema.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("--plot needs matplotlib; run: pip install 'pcd-engine[bench]'") from error
    compared = [r for r in records if r.get("mode") is None]
    backends = sorted({r["backend"] for r in compared})
    figure, axes = plt.subplots(1, max(1, len(backends)), figsize=(6 * max(1, len(backends)), 4.5), squeeze=False)
    methods = (("pcd_ms", "PCD"), ("seq_ms", "sequential jump-forward"), ("arc_ms", "AR-constrained"), ("ar_ms", "AR"))
    for axis, backend in zip(axes[0], backends):
        mine = [r for r in compared if r["backend"] == backend]
        for key, label in methods:
            for schema in sorted({r["schema"] for r in mine}):
                points = sorted((r["fields"], r[key]) for r in mine if r["schema"] == schema and r.get(key))
                if points:
                    xs, ys = zip(*points)
                    axis.plot(xs, ys, marker="o", label=f"{label} ({schema})")
        axis.set_yscale("log")
        axis.set_xlabel("fields")
        axis.set_ylabel("ms per request (median)")
        axis.set_title(f"{title} - {backend}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
