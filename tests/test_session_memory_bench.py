"""``pcd bench --session FILE --session-memory N``: evictions, the KV held, the re-read and the RSS
record, on the real embedded model with a small ``max_sessions``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pcd_core.bench.report import write_table
from pcd_core.bench.session_memory import bench_session_memory
from pcd_core.bench.sessions import load_conversation

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "support_conversation.json"


@pytest.fixture(scope="module")
def small_engine():
    from pcd_core import Engine

    return Engine.load("smollm2-135m", max_sessions=2)


@pytest.fixture(scope="module")
def record(small_engine):
    schema, turns = load_conversation(EXAMPLE)
    partial: list[dict] = []
    record = bench_session_memory(small_engine, schema, turns, n_sessions=4, tokens=300, on_session=partial.append)
    record["partial_records"] = partial
    return record


def test_four_sessions_over_two_evict_two_and_never_hold_more_than_two(record):
    rows = record["per_session"]
    assert [r["evictions"] for r in rows] == [0, 0, 1, 2] and record["evictions"] == 2
    assert [r["sessions_holding_kv"] for r in rows] == [1, 2, 2, 2]
    longest = record["longest_session_tokens"]
    assert all(r["kv_tokens_held"] <= 2 * longest for r in rows)
    assert record["max_kv_tokens_held"] > longest  # two sessions held at once
    # each session reached the size asked for, each read in one append after the turns it added
    assert all(r["conversation_tokens"] >= 300 and r["turns"] > 2 for r in rows)
    assert all(r["append_tokens"] > r["conversation_tokens"] for r in rows)
    assert record["sessions_holding_kv_after_close"] == 0
    assert [len(p["per_session"]) for p in record["partial_records"]] == [1, 2, 3, 4]


def test_the_evicted_first_session_reads_again_and_equals_a_fresh_fill(record):
    reread = record["reread"]
    assert reread["kv_tokens_before"] == 0 and reread["read_again"]
    assert any("evicted" in warning for warning in reread["warnings"])
    assert reread["append_tokens"] > reread["conversation_tokens"]  # the whole conversation again
    assert reread["same_values"] and reread["max_probability_gap"] < 1e-5


def test_the_rss_fields_are_positive_and_the_bound_is_the_stated_formula(record):
    rows = record["per_session"]
    for key in ("baseline_rss_bytes", "peak_rss_bytes", "bound_bytes", "rss_after_close_bytes"):
        assert isinstance(record[key], int) and record[key] > 0, key
    assert all(isinstance(r["rss_bytes"], int) and r["rss_bytes"] > 0 for r in rows)
    # a session's state keeps at least its KV: every storage it holds, measured
    assert record["state_bytes_per_token"] >= record["kv_bytes_per_token"] > 0
    assert record["bound_sessions"] == 3  # max_sessions, and the one read before the oldest drops its KV
    expected = record["baseline_rss_bytes"] + 3 * record["longest_session_tokens"] * record["bytes_per_token"]
    assert record["bound_bytes"] == int(expected)
    assert record["within_bound"] == (record["peak_rss_bytes"] <= record["bound_bytes"])


def test_the_command_writes_the_record_and_its_table(small_engine, tmp_path, monkeypatch, capsys):
    from pcd_core.engine import Engine
    from pcd_integrations.commands.main import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: small_engine))
    out = tmp_path / "memory.json"
    argv = ["bench", "--session", str(EXAMPLE), "--session-memory", "3", "--session-tokens", "60", "--json", str(out)]
    assert main(argv) == 0
    written = json.loads(out.read_text())
    assert written["meta"]["model"] == "smollm2-135m"
    (memory,) = written["records"]
    assert memory["mode"] == "session_memory" and memory["sessions"] == 3 and memory["evictions"] == 1
    assert "partial" not in memory and memory["reread"]["read_again"]
    assert "| torch | float32 | 3 |" in capsys.readouterr().out


def test_session_memory_needs_a_conversation_and_is_checked_before_a_model_loads(tmp_path, capsys):
    from pcd_integrations.commands.main import main

    assert main(["bench", "--session-memory", "3"]) == 2
    assert main(["bench", "--session", str(EXAMPLE), "--session-memory", "3", "--session-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--session-memory needs --session" in err and "--session-tokens 0" in err


def test_the_memory_section_is_the_recorded_run():
    path = ROOT / "docs" / "bench" / "session_memory.json"
    if not path.exists():
        pytest.skip("session_memory.json was not recorded")
    page = (ROOT / "docs" / "sessions.md").read_text()
    assert "--json docs/bench/session_memory.json" in page and "<!-- MEASURE -->" not in page
    rendered = io.StringIO()
    write_table(json.loads(path.read_text())["records"], rendered)
    rows = [line for line in rendered.getvalue().splitlines() if line.startswith(("| torch", "| llamacpp"))]
    assert rows and all(row in page for row in rows), rows
