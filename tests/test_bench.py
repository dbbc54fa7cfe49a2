"""``pcd bench`` end to end on the real embedded model (a tiny schema, one repeat), and its judges."""

from __future__ import annotations

import json
import platform

import pytest

from pcd_core.bench import BenchCase, agreement, bench_case, is_valid, parse_lenient, valid_output
from pcd_core.bench.checks import json_object_end
from pcd_core.request.schema import parse_schema
from pcd_integrations.commands.main import main as pcd

TINY = {
    "type": "object",
    "properties": {
        "urgent": {"type": "boolean", "description": "The sender needs help today"},
        "sentiment": {"enum": ["POSITIVE", "NEUTRAL", "NEGATIVE"], "description": "Overall tone"},
        "channel": {"enum": ["EMAIL", "PHONE", "CHAT"], "description": "How to answer"},
    },
    "required": ["urgent", "sentiment", "channel"],
}
INPUT = "Our checkout has been down since 9am and we are losing orders. Call me right away!"

RECORD_KEYS = {
    "schema",
    "backend",
    "fields",
    "pcd_ms",
    "ar_ms",
    "ratio",
    "pcd_forward_passes",
    "ar_forward_passes",
    "ar_tokens",
    "ar_stop",
    "pcd_valid",
    "ar_valid",
    "agreement",
    "prefill_ms",
    "peak_mem_mb",
    "prefill_peak_mem_mb",
    "arc_ms",
    "arc_ratio",
    "arc_valid",
    "seq_ms",
    "seq_ratio",
    "seq_agreement",
    "seq_forward_passes",
}


def test_strict_validity_rejects_quoted_booleans_missing_keys_and_invented_labels():
    schema = parse_schema(TINY)
    good = {"urgent": True, "sentiment": "NEGATIVE", "channel": "PHONE"}
    assert is_valid(schema, good)
    assert not is_valid(schema, dict(good, urgent="true"))
    assert not is_valid(schema, dict(good, urgent=1))
    assert not is_valid(schema, {"urgent": True, "sentiment": "NEGATIVE"})
    assert not is_valid(schema, dict(good, channel="FAX"))
    assert not is_valid(schema, dict(good, extra=True))
    assert not is_valid(schema, None)


def test_validity_also_asks_the_json_schema_itself():
    at_most_two = dict(TINY, maxProperties=2)  # a JSON Schema rule that the field parser does not read
    good = {"urgent": True, "sentiment": "NEGATIVE", "channel": "PHONE"}
    assert valid_output(TINY, parse_schema(TINY), good)
    assert is_valid(parse_schema(at_most_two), good) and not valid_output(at_most_two, parse_schema(at_most_two), good)
    assert not valid_output(TINY, parse_schema(TINY), dict(good, urgent="true"))
    assert not valid_output(TINY, parse_schema(TINY), None)


def test_pcd_valid_is_the_json_schema_verdict_on_pcd_output(engine):
    at_most_two = dict(TINY, maxProperties=2)
    record = bench_case(engine, BenchCase("tiny", at_most_two, INPUT), repeat=1, baselines=())
    assert record["pcd_valid"] is False  # three keys written, as the fields ask; two allowed
    assert record["pcd_forward_passes"] == 1  # the second wave read behind each answer of the first


def test_agreement_counts_decisions_and_forgives_spelling_only():
    schema = parse_schema(TINY)
    ours = {"urgent": True, "sentiment": "NEGATIVE", "channel": "PHONE"}
    assert agreement(schema, ours, {"urgent": "true", "sentiment": "NEGATIVE", "channel": "EMAIL"}) == 2
    assert agreement(schema, ours, {"sentiment": "negative"}) == 0
    assert agreement(schema, ours, ours) == 3


def test_lenient_parse_reads_a_looping_object_key_by_key():
    schema = parse_schema(TINY)
    closed = '{\n  "urgent": true, "sentiment": "NEGATIVE", "channel": "PHONE"}\nextra text {'
    assert parse_lenient(schema, closed) == {"urgent": True, "sentiment": "NEGATIVE", "channel": "PHONE"}
    looping = '{\n  "urgent": "true",\n  "sentiment": "NEGATIVE", "note": "a } in a string", "urgent": false'
    assert json_object_end(looping) is None
    assert parse_lenient(schema, looping) == {"urgent": "true", "sentiment": "NEGATIVE"}


def test_bench_records_every_method_and_pcd_is_valid(engine, tmp_path, monkeypatch, capsys):
    from pcd_core.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    schema_file = tmp_path / "tiny.json"
    schema_file.write_text(json.dumps(TINY))
    (tmp_path / "input.txt").write_text(INPUT)
    out = tmp_path / "out.json"
    argv = [
        "--schema",
        str(schema_file),
        "--input",
        str(tmp_path / "input.txt"),
        "--repeat",
        "1",
        "--ar-cap",
        "8",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "out.png"),
    ]
    assert pcd(["bench", *argv]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert RECORD_KEYS <= set(record)
    assert record["fields"] == 3 and record["pcd_valid"] and record["pcd_forward_passes"] == 1
    assert record["ar_tokens"] <= 8 and record["ar_stop"] in ("brace", "cap", "eos")
    assert record["arc_valid"]
    # one pass for the request with the first row, one per later field, one per deeper decision node
    assert 3 <= record["seq_forward_passes"] <= 6
    assert (tmp_path / "out.png").stat().st_size > 0
    assert "| tiny | torch | 3 |" in capsys.readouterr().out


def test_bad_arguments_fail_before_a_model_loads(tmp_path, capsys):
    assert pcd(["bench", "--schema", str(tmp_path / "missing.json")]) == 2
    assert pcd(["bench", "--schema", "support_ticket", "--fields", "99"]) == 2
    assert pcd(["bench", "--schema", "support_ticket", "--baselines", "ar,beam"]) == 2
    assert "pcd: error" in capsys.readouterr().err


MIXED = {
    "type": "object",
    "properties": {
        **TINY["properties"],
        "name": {"type": "string", "maxLength": 30, "description": "Who wrote it"},
        "orders_lost": {"type": "integer", "minimum": 0, "description": "Orders lost so far"},
    },
    "required": [*TINY["required"], "name", "orders_lost"],
}


def test_bench_on_a_mixed_schema_is_valid_for_pcd_grammar_ar_and_sequential(engine):
    case = BenchCase("mixed", MIXED, INPUT + " -- Ana Ruiz, 14 orders lost")
    record = bench_case(engine, case, repeat=1, baselines=("arc", "seq"))
    assert record["pcd_valid"] and record["arc_valid"] and record["seq_valid"]
    assert record["arc_engine"] == "llguidance"
    # the parallel fill: the closed fields' one pass (the second wave read ahead in it), then the
    # longest open row (its first step writes both waves' answers in)
    stats = record["pcd_stats"]
    assert record["pcd_forward_passes"] == 1 + stats["open_steps"]
    assert record["seq_forward_passes"] > record["pcd_forward_passes"]
    assert set(record["pcd_output"]) == set(MIXED["properties"])


def test_validity_of_open_values_is_the_json_schema_validators():
    schema = parse_schema(MIXED)
    good = {"urgent": True, "sentiment": "NEGATIVE", "channel": "PHONE", "name": "Ana", "orders_lost": 14}
    assert valid_output(MIXED, schema, good)
    assert not valid_output(MIXED, schema, dict(good, orders_lost=-1))
    assert not valid_output(MIXED, schema, dict(good, name="x" * 31))
    assert not valid_output(MIXED, schema, {k: v for k, v in good.items() if k != "name"})


def test_scripted_generators_write_pcds_document_one_pass_per_token(engine):
    """With dummy weights the generators follow PCD's answer; here on the real model, whose own
    choices would write another document: both take exactly the script's tokens, and the record
    keeps no answers.
    """
    from pcd_core.bench.baselines import scripted_document
    from pcd_core.bench.runner import ANSWER_KEYS

    script = scripted_document(engine, engine.compile(TINY), engine.fill(TINY, INPUT).value)
    record = bench_case(engine, BenchCase("tiny", TINY, INPUT), repeat=1, baselines=("ar", "arc"), scripted=True)
    assert record["ar_stop"] == record["arc_stop"] == "brace"
    assert record["ar_tokens"] == record["arc_tokens"] == record["arc_forward_passes"] == len(script)
    assert record["pcd_forward_passes"] == 1
    assert all(record[key] is None for key in ANSWER_KEYS)


def test_choice_bench_records_time_passes_and_row_tokens_per_option_count(engine, tmp_path, monkeypatch, capsys):
    from pcd_core.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    out = tmp_path / "choices.json"
    assert pcd(["bench", "--choices", "8,60", "--repeat", "1", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["mode"], r["options"], r["forward_passes"]) for r in records] == [("choices", 8, 1), ("choices", 60, 1)]
    # the 60-option list is read once, its second letters hanging from it: not once per first letter
    assert records[0]["row_tokens"] < records[1]["row_tokens"] < 13 * 60
    assert records[1]["n_rows"] > 1 and all(r["ms"] > 0 for r in records)
    assert "| torch | 60 |" in capsys.readouterr().out


def test_choice_counts_are_checked_before_a_model_loads(capsys):
    assert pcd(["bench", "--choices", "1,8"]) == 2
    assert pcd(["bench", "--choices", "8,256"]) == 2
    assert pcd(["bench", "--choices", "eight"]) == 2
    assert capsys.readouterr().err.count("pcd: error: --choices") == 3


def test_throughput_times_the_solo_loop_and_the_batch_on_one_engine(engine, tmp_path, monkeypatch, capsys):
    from pcd_core.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    schema_file, inputs, out = tmp_path / "tiny.json", tmp_path / "inputs.jsonl", tmp_path / "out.json"
    schema_file.write_text(json.dumps(TINY))
    inputs.write_text("\n".join(json.dumps({"text": t}) for t in (INPUT, "All good here, thanks.", "Refund me.")))
    argv = ["bench", "--schema", str(schema_file), "--throughput", "5", "--throughput-inputs", str(inputs)]
    assert pcd([*argv, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["documents"] == 5 and record["same_answers"] is True
    assert record["solo_forward_passes"] == 5 and record["forward_passes"] == 1  # TINY: two waves, one pass
    assert record["speedup"] == record["solo_ms"] / record["total_ms"] > 0
    assert record["peak_rss_mb"] >= record["solo_peak_rss_mb"] > 0
    assert "| tiny | torch | float32 | 3 | 5 |" in capsys.readouterr().out
    inputs.write_text('{"words": "no text key"}\n')
    assert pcd([*argv]) == 2
    assert "--throughput-inputs" in capsys.readouterr().err


def test_clients_time_one_http_client_and_several_on_one_served_engine(engine, tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi", reason="--clients serves the engine (the http extra)")
    from pcd_core.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    out = tmp_path / "clients.json"
    argv = ["bench", "--clients", "3", "--client-requests", "2", "--client-tokens", "4", "--json", str(out)]
    assert pcd(argv) == 0
    written = json.loads(out.read_text())
    chat, decisions, structured = written["records"]
    # the meta says what moves the ratios: the dtype computed in, and the CPU's matrix extensions
    from pcd_integrations.commands.bench import CPU_FEATURES

    meta = written["meta"]
    assert meta["dtype"] == "float32" and set(meta["cpu_features"]) <= set(CPU_FEATURES)
    if platform.machine() == "x86_64":  # the x86 machines this project runs on (Xeon, EPYC) all have AVX2
        assert "avx2" in meta["cpu_features"]
    assert (chat["route"], decisions["route"], structured["route"]) == ("chat", "decisions", "structured")
    for record in (chat, decisions, structured):
        assert (record["one_requests"], record["many_requests"]) == (2, 6)
        assert record["requests_ratio"] == record["many_requests_per_s"] / record["one_requests_per_s"] > 0
        assert record["many_peak_rss_mb"] >= record["one_peak_rss_mb"] > 0
    # every reply's tokens are counted from its usage (tests/test_stepping.py checks the shared passes)
    assert 0 < chat["one_tokens"] <= 2 * 4 and 0 < chat["many_tokens"] <= 6 * 4
    assert decisions["one_forward_passes"] == 2  # one pass for each warm decide
    assert structured["one_tokens"] is None and structured["one_forward_passes"] >= 2  # closed fills: no tokens
    assert "| chat | torch | float32 | 3 |" in capsys.readouterr().out


def test_clients_options_are_checked_before_a_model_loads(capsys):
    assert pcd(["bench", "--clients", "-1"]) == 2
    assert pcd(["bench", "--clients", "2", "--client-requests", "0"]) == 2
    assert pcd(["bench", "--clients", "2", "--throughput", "4"]) == 2
    assert capsys.readouterr().err.count("pcd: error: --client") == 3


def test_width_bench_times_one_pass_per_width_after_one_prefix(engine, tmp_path, monkeypatch, capsys):
    from pcd_core.bench.widths import PREFIX_TOKENS, REQUEST_TOKENS
    from pcd_core.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    out = tmp_path / "widths.json"
    assert pcd(["bench", "--widths", "4,1", "--repeat", "2", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["mode"], r["requests"], r["forward_passes"]) for r in records] == [("widths", 1, 1), ("widths", 4, 1)]
    one, four = records
    # every request is read whole in each timed pass, none taken from the pass before
    assert one["tokens"] == REQUEST_TOKENS and 4 * REQUEST_TOKENS - 3 <= four["tokens"] <= 4 * REQUEST_TOKENS
    for record in records:
        assert record["prefix_tokens"] == PREFIX_TOKENS and record["dtype"] == "float32"
        assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["ms"] * 1000.0)
    assert one["speedup_over_narrowest"] == 1.0
    assert four["speedup_over_narrowest"] == pytest.approx(four["tokens_per_s"] / one["tokens_per_s"])
    # the layers' matrices, counted from the model's shapes: q and o are hidden x hidden, k and v
    # hidden x (kv heads x head size), gate, up and down hidden x intermediate; the tied head is out
    config = engine.backend.model.config
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    per_layer = (
        2 * config.hidden_size**2 + 2 * config.hidden_size * kv + 3 * config.hidden_size * config.intermediate_size
    )
    for record in records:
        assert record["matrix_gflops"] == pytest.approx(
            2 * config.num_hidden_layers * per_layer * record["tokens_per_s"] / 1e9
        )
    # one lone product, timed once for the run and shared by its records; how the rates compare is the
    # benchmark's finding on the machine at hand, so this test holds no timing against another
    assert one["product_gflops"] == four["product_gflops"] > 0.0
    assert "| torch | float32 | 256 | 4 |" in capsys.readouterr().out


def test_widths_are_checked_before_a_model_loads(capsys):
    assert pcd(["bench", "--widths", "0,8"]) == 2
    assert pcd(["bench", "--widths", "wide"]) == 2
    assert pcd(["bench", "--widths", "8", "--throughput", "4"]) == 2
    assert capsys.readouterr().err.count("pcd: error: --widths") == 3
