"""The docs are true: their code runs as written and their figures are the recorded runs.

Every ```python block of ``README.md`` and ``docs/*.md`` is a test of its own: it runs in a fresh
namespace, with nothing defined elsewhere, on the session's SmolLM2-135M (``Engine.load`` hands back
the session engine after checking that the call names that model, so a page's blocks load it once). A
block that cannot run here (it needs a vLLM server, models of your own) carries
``<!-- not-run: why -->`` on the line right above its fence, and ``test_every_python_block_runs_or_says_why``
holds every block to one or the other. Blocks that talk to ``http://127.0.0.1:8000`` run against a
loopback ``pcd serve`` on the session engine. ``CHECKS`` adds what a block must leave behind, besides
running. The tables of the benchmark, quality and backend pages are compared with the JSON records
under ``docs/bench`` and ``docs/eval`` that the commands beside them wrote.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SERVER_URL = "http://127.0.0.1:8000"
NOT_RUN = re.compile(r"^<!-- not-run: (?P<why>.+?) -->$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where it starts, its language, its code, and why it is not run."""

    page: str
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, in order, with the ``not-run`` reason written right above each."""
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, end = opening["indent"], i + 1
        while lines[end] != f"{indent}```":
            end += 1
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        page = path.relative_to(ROOT).as_posix()
        blocks.append(Block(page, i + 1, opening["lang"], code, marker["why"] if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in PAGES for block in page_blocks(path)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.lang == "python"]
RUN_BLOCKS = [block for block in PYTHON_BLOCKS if block.not_run is None]


def page(name: str) -> str:
    return (ROOT / name).read_text()


def flat(name: str) -> str:
    """A page with its line breaks and runs of spaces as single spaces, for claims wrapped over lines."""
    return " ".join(page(name).split())


def _probability(value: Any) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


#: (page, a string only that block holds) -> what the block must leave in its namespace
CHECKS: dict[tuple[str, str], Callable[[dict[str, Any]], bool]] = {
    ("README.md", "engine.fill(Ticket"): lambda ns: (
        type(ns["out"].value).__name__ == "Ticket"
        and _probability(ns["out"].fields["wants_refund"].probability)
        and ns["out"].fields["summary"].method == "generated"
        and ns["out"].stats.forward_passes >= 2
    ),
    ("README.md", "engine.decide("): lambda ns: (
        set(ns["resp"].answers) == {"refund", "team"}
        and abs(sum(ns["resp"].answers["team"].probabilities.values()) - 1) < 1e-6
    ),
    ("docs/python-api.md", "engine.fill_many"): lambda ns: (
        type(ns["out"].value).__name__ == "Ticket" and len(ns["outs"]) == len(ns["texts"]) == 3
    ),
    ("docs/python-api.md", '"anger"'): lambda ns: set(ns["resp"].answers) == {"refund", "team", "anger"},
    ("docs/python-api.md", "customer_name"): lambda ns: (
        ns["out"].fields["customer_name"].method == "generated"
        and set(type(ns["out"].value.address).model_fields) == {"city", "country"}
    ),
    ("docs/python-api.md", "engine.generate("): lambda ns: (
        ns["reply"].output_tokens > 0 and ns["reply"].finish_reason in {"stop", "length"}
    ),
    ("docs/models.md", 'backend="auto"'): lambda ns: ns["engine"].model_name == "smollm2-135m",
    ("docs/http.md", "client.decisions.create"): lambda ns: (
        _probability(ns["refund"].probability)
        and ns["team"].choice in {"billing", "shipping"}
        and ns["decision"].usage.input_tokens > 0
    ),
    ("docs/http.md", "client.chat.completions.parse"): lambda ns: (
        type(ns["reply"].choices[0].message.parsed).__name__ == "Ticket"
        and set(ns["call"].x_pcd["tool_choice"]["probabilities"]) >= {"refund_payment"}
    ),
    ("docs/langchain.md", "ChatPCD(model="): lambda ns: (
        type(ns["out"]["parsed"]).__name__ == "Ticket"
        and ns["out"]["raw"].response_metadata["pcd"]["summary"]["method"] == "generated"
        and {"get_weather", "add"} <= set(ns["message"].response_metadata["pcd"]["tool_choice"]["probabilities"])
    ),
    ("docs/langchain.md", "PCDDecisionModel(model="): lambda ns: (
        set(ns["response"].choices["team"].probabilities) == {"billing", "bugs"}
        and _probability(ns["response"].nouls["refund"].noul)
    ),
    ("docs/llama-index.md", "PCDProgram.from_defaults"): lambda ns: (
        type(ns["ticket"]).__name__ == "Ticket" and "sentiment" in ns["program"].last_decisions
    ),
    ("docs/vllm.md", "def replica_for"): lambda ns: (
        ns["replica_for"](ns["__test_engine__"], {"team": ["billing", "sales"]}, ["a", "b"]) in {"a", "b"}
    ),
}


def test_every_python_block_runs_or_says_why():
    """Each python block either runs here or carries a ``not-run`` reason; no marker stands alone, and
    no block hides under another spelling of its language."""
    assert len(RUN_BLOCKS) >= 10, [block.name for block in RUN_BLOCKS]
    for block in PYTHON_BLOCKS:
        assert block.not_run is None or len(block.not_run.split()) >= 3, f"{block.name}: say why it is not run"
    for block in ALL_BLOCKS:
        assert block.lang not in {"py", "python3", "pycon"}, f"{block.name}: spell it ```python"
        assert block.not_run is None or block.lang == "python", f"{block.name}: not-run is for python blocks"
    for path in PAGES:
        markers = [line for line in path.read_text().split("\n") if "not-run:" in line]
        marked = [block for block in ALL_BLOCKS if block.page == path.relative_to(ROOT).as_posix() and block.not_run]
        assert len(markers) == len(marked), f"{path.name}: a not-run marker is not right above a fence"


def test_each_check_names_one_block():
    for page_name, needle in CHECKS:
        holders = [block.name for block in RUN_BLOCKS if block.page == page_name and needle in block.code]
        assert len(holders) == 1, (page_name, needle, holders)


@pytest.fixture(scope="module")
def server_url(engine: Any) -> Any:
    pytest.importorskip("uvicorn", reason="the HTTP snippets need the 'http' extra")
    from loopback import serving

    from pcd_integrations.http import create_app

    with serving(create_app(engine)) as url:
        yield url


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda block: block.name)
def test_every_python_block_runs_as_written_on_the_real_model(block, engine, monkeypatch, request):
    from pcd_core import Engine

    real_load = inspect.signature(Engine.load)

    def session_engine(cls: type, *args: Any, **kwargs: Any) -> Any:
        bound = real_load.bind(*args, **kwargs)  # a keyword Engine.load does not take fails here
        assert bound.arguments.get("model") in {None, "smollm2-135m"}, f"{block.name} loads another model"
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(session_engine))
    code = block.code
    if SERVER_URL in code:
        code = code.replace(SERVER_URL, request.getfixturevalue("server_url"))
    namespace: dict[str, Any] = {"__name__": "docs_snippet"}
    exec(compile(code, block.name, "exec", dont_inherit=True), namespace)  # not this file's __future__ flags
    namespace["__test_engine__"] = engine
    for (page_name, needle), check in CHECKS.items():
        if page_name == block.page and needle in block.code:
            assert check(namespace), f"{block.name}: the block ran, but left the wrong result"


def test_the_flags_in_the_operations_table_are_the_servers_flags():
    """The server-flags table names only flags that ``pcd serve --help`` and ``pcd-mcp --help`` list."""
    table = [line for line in page("docs/operations.md").split("\n") if line.startswith("| ") and "`--" in line]
    assert table
    for script, column in (("pcd", 2), ("pcd-mcp", 3)):
        command = [str(Path(sys.executable).with_name(script))] + (["serve"] if script == "pcd" else []) + ["--help"]
        listed = set(re.findall(r"--[a-z][a-z0-9-]+", subprocess.run(command, capture_output=True, text=True).stdout))
        named = {flag for row in table for flag in re.findall(r"`(--[a-z][a-z0-9-]+)", row.split("|")[column])}
        assert named and named <= listed, (script, named - listed)


def bench_records(name: str) -> list[dict]:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())["records"]


def test_the_benchmark_table_is_the_recorded_run():
    """Every row of the benchmark page's first table is a record in docs/bench, as `pcd bench --json` wrote it."""
    text = page("docs/benchmarks.md")
    for record in bench_records("main.json") + bench_records("fields.json"):
        row = (
            f"| {record['schema']} | {record['fields']} | {record['pcd_ms']:.0f} | {record['prefill_ms']:.0f} "
            f"| {record['pcd_over_prefill']:.2f}× | {record['pcd_forward_passes']} | {record['ratio']:.1f}× "
            f"| {record['arc_ratio']:.1f}× "
            f"| {record['seq_ratio']:.1f}× | {record['seq_forward_passes']} |"
        )
        assert row in text, row


def test_the_dtype_table_is_the_recorded_runs():
    text = page("docs/benchmarks.md")
    for name in ("dtype_float32", "dtype_float32_long", "dtype_bfloat16", "dtype_bfloat16_long"):
        run = json.loads((ROOT / "docs" / "bench" / f"{name}.json").read_text())
        (record,) = run["records"]
        assert f"--dtype {run['meta']['dtype']} --json docs/bench/{name}.json" in text
        row = (
            f"| {run['meta']['dtype']} | {record['input_tokens']} | {record['pcd_ms']:.0f} | {record['prefill_ms']:.0f} "
            f"| {record['pcd_over_prefill']:.2f}× | {record['seq_ratio']:.2f}× | {record['pcd_forward_passes']} |"
        )
        assert row in text, row
        assert record["pcd_valid"] and "Xeon" in run["meta"]["machine"]
    full, half = (bench_records(f"dtype_{dtype}.json")[0]["pcd_output"] for dtype in ("float32", "bfloat16"))
    kept = sum(half[name] == value for name, value in full.items())
    assert f"SmolLM2 in bfloat16 keeps {kept} of {len(full)} float32 decisions" in flat("docs/models.md")


def test_the_long_input_and_budget_figures_are_the_recorded_runs():
    text = flat("docs/benchmarks.md")
    long_input = bench_records("long_input.json")[0]
    assert f"({long_input['input_tokens']} tokens" in text
    assert f"PCD took {long_input['pcd_over_prefill']:.2f}× the request prefill" in text
    budget = bench_records("budget.json")[0]
    assert f"took {budget['pcd_forward_passes']} passes and {budget['pcd_ms']:.0f} ms" in text
    assert budget["pcd_output"] == bench_records("main.json")[0]["pcd_output"]  # "the same 28 values"
    for record in bench_records("main.json") + bench_records("long_input.json"):
        assert record["pcd_valid"], record["schema"]


def test_the_mlx_figures_are_the_recorded_run():
    text = flat("docs/mlx.md")
    mlx = bench_records("mlx_linux.json")[0]
    assert mlx["backend"] == "mlx" and mlx["pcd_forward_passes"] == 4 and mlx["pcd_valid"]
    assert f"PCD {mlx['pcd_ms'] / 1000:.0f} s in 4 passes" in text
    assert f"AR {mlx['ar_ms'] / 1000:.0f} s ({mlx['ratio']:.1f}×" in text


def test_the_open_fields_figures_are_the_recorded_run():
    text = page("docs/benchmarks.md")
    mixed = bench_records("mixed.json")[0]
    assert mixed["pcd_valid"] and mixed["arc_valid"] and mixed["seq_valid"]
    passes = mixed["pcd_forward_passes"]
    assert passes == 2 + mixed["pcd_stats"]["open_steps"]  # 2 closed, then the steps (the first writes them in)
    assert f"| {mixed['pcd_ms']:,.0f} | {passes} (".replace(",", " ") in text
    assert f"({mixed['arc_ratio']:.1f}× PCD) | {mixed['arc_forward_passes']} |" in text
    assert f"({mixed['seq_ratio']:.1f}× PCD) | {mixed['seq_forward_passes']} |" in text
    assert f"| {mixed['peak_mem_mb']:.0f} MB | yes |" in text
    assert f"{mixed['arc_ratio']:.1f}× over constrained AR (target 5×)" in text
    prefill_row = (
        f"| the request's prefill alone | {mixed['prefill_ms']:,.0f} | 1 | {mixed['prefill_peak_mem_mb']:.0f} MB |"
    )
    assert prefill_row.replace(",", " ") in text
    assert f"With both changes the fill took {mixed['pcd_ms']:,.0f} ms".replace(",", " ") in text
    second = bench_records("mixed_second.json")[0]
    assert f"`docs/bench/mixed_second.json`) gave {second['arc_ratio']:.1f}×" in text
    assert f"PCD's median was {second['pcd_ms']:,.0f} ms".replace(",", " ") in text
    before, room = bench_records("mixed_before.json")[0], bench_records("mixed_room.json")[0]
    assert before["pcd_forward_passes"] == mixed["pcd_forward_passes"] + 1  # the answers' own pass
    assert f"took {before['pcd_ms']:,.0f} ms before".replace(",", " ") in text
    assert f"and {room['pcd_ms']:,.0f} ms after".replace(",", " ") in text


def test_the_choice_table_is_the_recorded_run():
    """Each row of the many-options table is a record of the `pcd bench --choices` run the page names."""
    text = page("docs/benchmarks.md")
    assert "pcd bench --choices 64,128,255 --repeat 1 --json docs/bench/choices.json" in text
    records = bench_records("choices.json")
    assert [record["options"] for record in records] == [64, 128, 255]
    for record in records:
        spaced = [f"{value:,.0f}".replace(",", " ") for value in (record["ms"], record["row_tokens"])]
        row = (
            f"| {record['options']} | {spaced[0]} | {record['forward_passes']} | {spaced[1]} | {record['n_rows']} "
            f"| {record['input_tokens']:,} |".replace(",", " ")
        )
        assert row in text, row


def test_every_figure_of_the_figure_pages_is_shipped():
    """Each image the pages show is a file under docs/ (mkdocs --strict checks links, not images in every case)."""
    for path in PAGES[1:]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()):
            assert (path.parent / target).is_file(), (path.name, target)


def test_the_llamacpp_speed_figures_are_the_recorded_run():
    text = flat("docs/llamacpp.md")
    run = json.loads((ROOT / "docs" / "bench" / "llamacpp_support_ticket_28.json").read_text())
    (record,) = run["records"]
    assert f"`{run['meta']['command']}`" in text
    assert record["backend"] == "llamacpp" and record["rival_backend"] == "torch" and record["pcd_valid"]
    assert f"PCD on llama.cpp {record['pcd_ms'] / 1000:.1f} s in {record['pcd_forward_passes']} passes" in text
    assert f"the request prefill alone {record['prefill_ms'] / 1000:.1f} s" in text
    assert f"AR on llama.cpp {record['ar_ms'] / 1000:.1f} s ({record['ratio']:.1f}×" in text
    assert f"{record['arc_ms'] / 1000:.1f} s ({record['arc_ratio']:.1f}×, {record['arc_tokens']} tokens)" in text
    assert f"sequential jump-forward on llama.cpp {record['seq_ms'] / 1000:.1f} s ({record['seq_ratio']:.1f}×)" in text
    assert (
        f"PCD on torch fp32 {record['rival_pcd_ms'] / 1000:.1f} s, so llama.cpp is {record['rival_ratio']:.2f}×" in text
    )


def _versus_cells(run: dict) -> list[str]:
    """The cells docs/llamacpp.md's versus tables show for one ``pcd bench --versus torch`` record."""
    cells = []
    for fill in run["records"][:-1]:
        assert fill["rival_backend"] == "torch" and fill["pcd_valid"]
        cells += [
            f"| {fill['pcd_ms'] / 1000:.2f} s | {fill['rival_pcd_ms'] / 1000:.2f} s |",
            f"{fill['rival_ratio']:.2f}x",
        ]
    lines = run["records"][-1]
    assert lines["mode"] == "versus"
    return cells + [
        f"| {lines['generation_tokens_per_s']:.1f} tokens/s | {lines['rival_generation_tokens_per_s']:.1f} tokens/s |",
        f"{lines['generation_ratio']:.2f}x",
        f"| {lines['cold_load_ms'] / 1000:.1f} s | {lines['rival_cold_load_ms'] / 1000:.1f} s | **{lines['load_ratio']:.2f}x**",
        f"| {lines['rss_mb']:,.0f} MB | {lines['rival_rss_mb']:,.0f} MB | {lines['rss_ratio']:.3f} |",
    ]


def test_the_llamacpp_versus_and_settings_figures_are_the_recorded_runs():
    text = flat("docs/llamacpp.md")
    for name in ("llamacpp_versus.json", "qwen1.5b_llamacpp_versus_torch.json"):
        run = json.loads((ROOT / "docs" / "bench" / name).read_text())
        # the shell's '' is an empty argument, which the recorded command shows as nothing
        assert run["meta"]["command"].replace("--baselines  ", "--baselines '' ") in text, name
        for cell in _versus_cells(run):
            assert cell in text, (name, cell)
    settings = json.loads((ROOT / "docs" / "bench" / "llamacpp_settings.json").read_text())
    first, second = settings["torch_over_llamacpp_per_round"]
    for name in ("t2", "t1"):
        assert f"{first[name]:.2f}× and {second[name]:.2f}×" in text
    assert f"{first['t2_nofa']:.2f}× and {second['t2_nofa']:.2f}× (2 threads)" in text
    assert f"{first['t1_nofa']:.2f}× and {second['t1_nofa']:.2f}× (1 thread)" in text


def test_the_injection_table_is_the_recorded_runs():
    """The last two rows of the prompt-injection table are the two runs of examples/injection_eval.py."""
    text = page("docs/limits.md")
    for name in ("injection_before.json", "injection.json"):
        run = json.loads((ROOT / "docs" / name).read_text())
        flips = {kind: int(count.split("/")[0]) for kind, count in run["flips_by_kind"].items()}
        injected = flips["plain"] + flips["authority"] + flips["fake_turn"]
        assert injected == round(run["flip_rate"] * run["n_cases"])
        row = (
            f"(`docs/{name}`) | {flips['plain']} | {flips['authority']} | {flips['fake_turn']} | {injected} "
            f"| {flips['benign']} | {round(run['clean_accuracy'] * 14)} |"
        )
        assert row in text, row


REPO_PATH = re.compile(r"(?<![\w/.$<-])((?:pcd_core|pcd_integrations|mcp_server|tests|examples|docs)/[\w./-]*[\w/])")
DOTTED = re.compile(r"`((?:pcd_core|pcd_integrations|mcp_server)(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    """Whether ``pcd_core.limits.Limits`` names a module, or an attribute of one, that imports."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[end:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.name)
def test_every_repository_path_the_page_names_exists(path):
    """Paths and modules named in the text follow the code when it moves (issue 31 moved the commands
    out of pcd_core); a stale one fails here rather than sending a reader to a file that is gone."""
    text = path.read_text()
    for name in REPO_PATH.findall(text):
        if "<" in name or "*" in name:
            continue
        assert (ROOT / name).exists(), f"{path.name} names {name}, which is not in the repository"
    for dotted in DOTTED.findall(text):
        assert _resolves(dotted), f"{path.name} names {dotted}, which does not import"


def test_the_throughput_table_is_the_recorded_runs():
    """Each row of the many-inputs table is the record its `pcd bench --throughput` command wrote."""
    text = page("docs/benchmarks.md")
    for name in (
        "throughput_sentiment.json",
        "throughput_sentiment_bf16.json",
        "throughput_ticket.json",
        "throughput_ticket_bf16.json",
        "throughput_triage.json",
        "throughput_triage_bf16.json",
    ):
        assert f"--json docs/bench/{name}" in text
        (record,) = bench_records(name)
        row = (
            f"| {record['schema']} | {record['backend']} | {record['dtype']} | {record['fields']} | {record['documents']} "
            f"| {record['solo_docs_per_s']:.2f} | {record['docs_per_s']:.2f} | {record['speedup']:.2f}x "
            f"| {record['solo_forward_passes']} | {record['forward_passes']} | {record['solo_peak_rss_mb']:.0f} "
            f"| {record['peak_rss_mb']:.0f} | {record['same_answers']} |"
        )
        assert row in text, row


def assert_rendered_rows_in_benchmarks(names, starts, per_record):
    """Each record file's rows, as ``pcd bench`` renders them (those that begin with ``starts``,
    ``per_record`` of them a file), are in docs/benchmarks.md beside the command that wrote it.
    """
    import io

    from pcd_core.bench.report import write_table

    text = page("docs/benchmarks.md")
    for name in names:
        assert f"--json docs/bench/{name}" in text
        rendered = io.StringIO()
        write_table(bench_records(name), rendered)
        rows = [line for line in rendered.getvalue().splitlines() if line.startswith(starts)]
        assert len(rows) == per_record
        for row in rows:
            assert row in text, row


def test_the_clients_table_is_the_recorded_runs():
    """Each row of the many-clients table is ``pcd bench --clients``'s own rendering of its record."""
    names = ("clients_torch.json", "clients_torch_bf16.json", "clients_llamacpp.json")
    assert_rendered_rows_in_benchmarks(names, ("| chat", "| decisions", "| structured"), 3)


def test_the_widths_table_is_the_recorded_runs():
    """Each row of the pass-width table is ``pcd bench --widths``'s own rendering of its record."""
    names = ("widths_torch.json", "widths_torch_bf16.json", "widths_llamacpp.json")
    assert_rendered_rows_in_benchmarks(names, ("| torch", "| llamacpp"), 6)


def test_the_triage_schema_file_is_the_clients_benchs():
    """``docs/bench/triage_schema.json`` (the many-inputs table's triage rows) is the schema of the
    clients bench's ``structured`` route, so the two figures are of one schema."""
    from pcd_integrations.commands.bench_clients import TRIAGE

    assert json.loads((ROOT / "docs/bench/triage_schema.json").read_text()) == TRIAGE
