"""The README's commands are the ones that run: CI's test command and the example files exist."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"TEST_COMMAND='(.+)'", ci).group(1)
    assert readme_commands()[1] == command


def test_the_main_command_uses_shipped_examples():
    main = readme_commands()[0]
    for path in re.findall(r"examples/\S+", main):
        assert (ROOT / path).is_file(), path


def bench_records(name: str) -> list[dict]:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())["records"]


def test_the_benchmark_table_is_the_recorded_run():
    """Every row of the README's table is a record in docs/bench, as `pcd bench --json` wrote it."""
    readme = (ROOT / "README.md").read_text()
    for record in bench_records("main.json") + bench_records("fields.json"):
        row = (
            f"| {record['schema']} | {record['fields']} | {record['pcd_ms']:.0f} | {record['prefill_ms']:.0f} "
            f"| {record['pcd_over_prefill']:.2f}× | {record['pcd_forward_passes']} | {record['ratio']:.1f}× "
            f"| {record['arc_ratio']:.1f}× "
            f"| {record['seq_ratio']:.1f}× | {record['seq_forward_passes']} |"
        )
        assert row in readme, row


def test_the_dtype_table_is_the_recorded_runs():
    readme = (ROOT / "README.md").read_text()
    for name in ("dtype_float32", "dtype_float32_long", "dtype_bfloat16", "dtype_bfloat16_long"):
        run = json.loads((ROOT / "docs" / "bench" / f"{name}.json").read_text())
        (record,) = run["records"]
        assert f"--dtype {run['meta']['dtype']} --json docs/bench/{name}.json" in readme
        row = (
            f"| {run['meta']['dtype']} | {record['input_tokens']} | {record['pcd_ms']:.0f} | {record['prefill_ms']:.0f} "
            f"| {record['pcd_over_prefill']:.2f}× | {record['seq_ratio']:.2f}× | {record['pcd_forward_passes']} |"
        )
        assert row in readme, row
        assert record["pcd_valid"] and "Xeon" in run["meta"]["machine"]
    full, half = (bench_records(f"dtype_{dtype}.json")[0]["pcd_output"] for dtype in ("float32", "bfloat16"))
    kept = sum(half[name] == value for name, value in full.items())
    assert f"SmolLM2 in bfloat16 keeps {kept} of {len(full)} float32 decisions" in " ".join(readme.split())


def test_the_long_input_and_mlx_figures_are_the_recorded_runs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    long_input = bench_records("long_input.json")[0]
    assert f"({long_input['input_tokens']} tokens" in readme
    assert f"PCD took {long_input['pcd_over_prefill']:.2f}× the request prefill" in readme
    mlx = bench_records("mlx_linux.json")[0]
    assert mlx["backend"] == "mlx" and mlx["pcd_forward_passes"] == 4
    assert f"PCD {mlx['pcd_ms'] / 1000:.0f} s in 4 passes" in readme
    assert f"AR {mlx['ar_ms'] / 1000:.0f} s ({mlx['ratio']:.1f}×" in readme
    budget = bench_records("budget.json")[0]
    assert f"took {budget['pcd_forward_passes']} passes and {budget['pcd_ms']:.0f} ms" in readme
    assert budget["pcd_output"] == bench_records("main.json")[0]["pcd_output"]  # "the same 28 values"
    for record in bench_records("main.json") + bench_records("long_input.json") + [mlx]:
        assert record["pcd_valid"], record["schema"]


def test_the_open_fields_figures_are_the_recorded_run():
    readme = (ROOT / "README.md").read_text()
    mixed = bench_records("mixed.json")[0]
    assert mixed["pcd_valid"] and mixed["arc_valid"] and mixed["seq_valid"]
    passes = mixed["pcd_forward_passes"]
    assert passes == 2 + mixed["pcd_stats"]["open_steps"]  # 2 closed, then the steps (the first writes them in)
    assert f"| {mixed['pcd_ms']:,.0f} | {passes} (".replace(",", " ") in readme
    assert f"({mixed['arc_ratio']:.1f}× PCD) | {mixed['arc_forward_passes']} |" in readme
    assert f"({mixed['seq_ratio']:.1f}× PCD) | {mixed['seq_forward_passes']} |" in readme
    assert f"| {mixed['peak_mem_mb']:.0f} MB | yes |" in readme
    assert f"{mixed['arc_ratio']:.1f}× over constrained AR (target 5×)" in readme
    prefill_row = (
        f"| the request's prefill alone | {mixed['prefill_ms']:,.0f} | 1 | {mixed['prefill_peak_mem_mb']:.0f} MB |"
    )
    assert prefill_row.replace(",", " ") in readme
    assert f"With both changes the fill took {mixed['pcd_ms']:,.0f} ms".replace(",", " ") in readme
    second = bench_records("mixed_second.json")[0]
    assert f"`docs/bench/mixed_second.json`) gave {second['arc_ratio']:.1f}×" in readme
    assert f"PCD's median was {second['pcd_ms']:,.0f} ms".replace(",", " ") in readme
    before, room = bench_records("mixed_before.json")[0], bench_records("mixed_room.json")[0]
    assert before["pcd_forward_passes"] == mixed["pcd_forward_passes"] + 1  # the answers' own pass
    assert f"took {before['pcd_ms']:,.0f} ms before".replace(",", " ") in readme
    assert f"and {room['pcd_ms']:,.0f} ms after".replace(",", " ") in readme


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of one ``## `` section of the README, in order."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"\n## {section}\n")
    end = readme.find("\n## ", start + 1)
    return re.findall(r"```python\n(.+?)\n```", readme[start : end if end > 0 else None], re.S)


def _tour_checks():
    """What each API tour snippet must leave behind, besides running: a property of its result."""
    return [
        lambda ns: type(ns["out"].value).__name__ == "Ticket" and len(ns["outs"]) == len(ns["texts"]) == 3,
        lambda ns: set(ns["resp"].answers) == {"refund", "team", "anger"},
        lambda ns: (
            ns["out"].fields["customer_name"].method == "generated"
            and set(ns["out"].value.address.model_fields) == {"city", "country"}
        ),
        lambda ns: ns["reply"].output_tokens > 0 and ns["reply"].finish_reason in {"stop", "length"},
    ]


@pytest.mark.parametrize("index", range(4))
def test_every_api_tour_snippet_runs_as_written_on_the_real_model(engine, monkeypatch, index):
    """Each snippet of the README's API tour runs on its own, in a fresh namespace, with nothing
    defined elsewhere (issue 24, item 12). ``Engine.load()`` hands back the session's SmolLM2-135M,
    the model it loads by default, so that the four snippets load it once.
    """
    from pcd_core import Engine

    blocks = python_blocks("API tour")
    assert len(blocks) == 4, "the API tour has four snippets; update the checks with the README"
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(blocks[index], f"README.md, API tour snippet {index + 1}", "exec"), namespace)
    assert _tour_checks()[index](namespace)


def test_the_choice_table_is_the_recorded_run():
    """Each row of the many-options table is a record of the `pcd bench --choices` run the README names."""
    readme = (ROOT / "README.md").read_text()
    assert "pcd bench --choices 64,128,255 --repeat 1 --json docs/bench/choices.json" in readme
    records = bench_records("choices.json")
    assert [record["options"] for record in records] == [64, 128, 255]
    for record in records:
        spaced = [f"{value:,.0f}".replace(",", " ") for value in (record["ms"], record["row_tokens"])]
        row = (
            f"| {record['options']} | {spaced[0]} | {record['forward_passes']} | {spaced[1]} | {record['n_rows']} "
            f"| {record['input_tokens']:,} |".replace(",", " ")
        )
        assert row in readme, row
