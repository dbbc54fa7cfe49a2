"""``backend="auto"`` and ``dtype="auto"``: the rule on described machines, and what a real load reports.

The rule's branches are checked on ``Machine`` values (a CUDA box, an AMX CPU, this project's CPU
without AMX, a CPU without the llamacpp extra), with the expected pick written out here from the rule
as docs/models.md states it, not computed by the code under test. Real loads check that a result's
stats name the backend and dtype that ran, and ``pcd models`` lists a store built in a temporary folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pcd_core import Engine, LoadOptions, OptionError, PcdError
from pcd_core.loading import auto
from pcd_core.loading.auto import LLAMACPP_MIN_BYTES, Machine, choose
from pcd_core.loading.load import chosen_options
from pcd_core.loading.model_files import EMBEDDED
from pcd_integrations.commands.main import main

CPU = Machine(cuda=False, amx=False, avx512_bf16=True, apple_silicon=False, llamacpp=True)
AMX = Machine(cuda=False, amx=True, avx512_bf16=True, apple_silicon=False, llamacpp=True)
GPU = Machine(cuda=True, amx=False, avx512_bf16=False, apple_silicon=False, llamacpp=True)
BARE = Machine(cuda=False, amx=False, avx512_bf16=False, apple_silicon=False, llamacpp=False)
SCHEMA = {"type": "object", "properties": {"urgent": {"type": "boolean"}}}

MB = 1_000_000


@pytest.mark.parametrize(
    ("machine", "model_format", "size", "backend", "dtype"),
    [
        (CPU, "gguf", 98 * MB, "torch", "float32"),  # the embedded SmolLM2
        (CPU, "gguf", 253 * MB, "llamacpp", None),  # Gemma 3 270M
        (CPU, "gguf", 491 * MB, "llamacpp", None),  # Qwen2.5-Coder-0.5B
        (CPU, "gguf", 1117 * MB, "llamacpp", None),  # Qwen2.5-Coder-1.5B
        (CPU, "safetensors", 3000 * MB, "torch", "float32"),  # llama.cpp cannot read it
        (AMX, "gguf", 98 * MB, "torch", "bfloat16"),
        (AMX, "gguf", 1117 * MB, "llamacpp", None),
        (GPU, "gguf", 1117 * MB, "torch", "bfloat16"),
        (GPU, "safetensors", 3000 * MB, "torch", "bfloat16"),
        (BARE, "gguf", 1117 * MB, "torch", "float32"),  # no llamacpp extra
    ],
)
def test_auto_follows_the_written_rule(machine, model_format, size, backend, dtype):
    picked = choose(LoadOptions(), model_format, size, machine)
    assert (picked.backend, picked.dtype) == (backend, dtype), picked.reason


def test_the_threshold_sits_between_the_measured_models():
    """docs/bench/auto*_quiet.json: SmolLM2 (98 MB) read closed fields faster on torch; Gemma 3 (253 MB)
    and the Qwen models (491 MB, 1,117 MB) filled faster on llama.cpp."""
    assert 98 * MB < LLAMACPP_MIN_BYTES <= 253 * MB


@pytest.mark.parametrize(
    ("given", "backend"),
    [
        ({"threads": 2}, "llamacpp"),
        ({"device": "cpu"}, "torch"),
        ({"dtype": "bfloat16"}, "torch"),
        ({"row_layout": "copies"}, "torch"),
        ({"base_url": "http://127.0.0.1:9"}, "vllm"),
    ],
)
def test_an_option_only_one_backend_honours_picks_it(given, backend):
    for size in (98 * MB, 1117 * MB):
        assert choose(LoadOptions(**given), "gguf", size, CPU).backend == backend


def test_a_named_backend_is_kept_and_auto_is_the_default():
    assert LoadOptions().backend == "auto" and LoadOptions(dtype="auto") == LoadOptions()
    assert choose(LoadOptions(backend="torch"), "gguf", 1117 * MB, CPU).backend == "torch"
    assert choose(LoadOptions(backend="llamacpp"), "gguf", 98 * MB, CPU).backend == "llamacpp"
    with pytest.raises(OptionError, match="no backend honours device and threads together"):
        LoadOptions(threads=2, device="cpu")


def test_the_default_model_loads_as_before_and_its_stats_say_so(engine):
    stats = engine.fill(SCHEMA, "The server is down!").stats
    assert (stats.backend, stats.dtype) == ("torch", "bfloat16" if auto.this_machine().amx else "float32")
    options, choice = chosen_options(LoadOptions())
    assert options.backend == "torch" and choice.reason.startswith("a GGUF under")


def test_a_large_gguf_resolves_to_llamacpp_on_this_cpu():
    pytest.importorskip("llama_cpp", reason="the llamacpp extra")
    if auto.this_machine().cuda:
        pytest.skip("on CUDA auto picks torch")
    try:
        EMBEDDED["qwen2.5-coder-0.5b"].locate()
    except PcdError as error:  # the slices are an optional download
        pytest.skip(f"qwen2.5-coder-0.5b is not installed: {error}")
    options, choice = chosen_options(LoadOptions(model="qwen2.5-coder-0.5b"))
    assert (options.backend, choice.dtype) == ("llamacpp", None)


@pytest.mark.slow
def test_with_amx_torch_computes_in_bfloat16_after_its_self_check(monkeypatch):
    """On a machine described as having AMX, the same load computes in bfloat16 (the layout
    self-check passed in it), and the result says so."""
    monkeypatch.setattr(auto, "this_machine", lambda: AMX)
    engine = Engine.load("smollm2-135m")
    assert (engine.backend.name, engine.backend.compute_dtype) == ("torch", "bfloat16")
    assert engine.fill(SCHEMA, "The server is down!").stats.dtype == "bfloat16"


def test_llamacpp_results_say_they_ran_on_the_gguf():
    pytest.importorskip("llama_cpp", reason="the llamacpp extra")
    stats = Engine.load("smollm2-135m", threads=2).fill(SCHEMA, "The server is down!").stats
    assert (stats.backend, stats.dtype) == ("llamacpp", "gguf")  # threads: a llama.cpp option, so auto picked it


def test_pcd_models_lists_every_store_with_the_backend_auto_picks(tmp_path, monkeypatch, capsys):
    gguf = EMBEDDED["smollm2-135m"].locate()
    monkeypatch.setenv("HOME", str(tmp_path))
    ollama = tmp_path / "ollama"
    digest = "0" * 64
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").symlink_to(gguf)
    manifest = ollama / "manifests/registry.ollama.ai/library/smol/latest"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    studio = tmp_path / "studio"
    (studio / "me" / "smol").mkdir(parents=True)
    (studio / "me" / "smol" / "smol.gguf").symlink_to(gguf)
    hf = tmp_path / "hub" / "models--org--repo" / "snapshots" / ("1" * 40)
    hf.mkdir(parents=True)
    (hf / "model.gguf").symlink_to(gguf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    assert main(["models", "--lmstudio-dir", str(studio), "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    size = os.path.getsize(gguf)
    for name, store in (
        ("ollama:smol:latest", "ollama"),
        ("lmstudio:me/smol", "lmstudio"),
        ("org/repo:model.gguf", "hf"),
    ):
        assert rows[name]["store"] == store and rows[name]["size_bytes"] == size and rows[name]["format"] == "gguf"
        assert rows[name]["backend"] == "torch"  # 98 MB: under the threshold on a CPU, and torch on CUDA
    assert rows["smollm2-135m"]["default"] is True
    assert main(["models", "--lmstudio-dir", str(studio)]) == 0
    table = capsys.readouterr().out
    assert "ollama:smol:latest" in table and "lmstudio:me/smol" in table and "torch" in table


ROOT = Path(__file__).resolve().parents[1]
#: the runs of ``pcd bench --auto`` that docs/models.md's table shows
AUTO_RUNS = ("auto.json", "auto_smollm2.json")


def test_the_models_table_is_the_recorded_run():
    """Every measured model of the ``pcd bench --auto`` runs (``AUTO_RUNS``) is a row of docs/models.md's
    table, each figure as the run recorded it; auto's pick is never the slower choice by more than the
    spread of that choice's own repeats."""
    text = (ROOT / "docs" / "models.md").read_text()
    measured = []
    for name in AUTO_RUNS:
        report = json.loads((ROOT / "docs" / "bench" / name).read_text())
        assert report["meta"]["command"] in text
        measured += [record for record in report["records"] if "skipped" not in record]
    assert {record["model"] for record in measured} >= {"smollm2-135m", "qwen2.5-coder-0.5b"}
    for record in measured:
        choices = record["choices"]
        cells = []
        for label in ("torch float32", "llamacpp"):
            medians = choices[label]["median_ms"]
            cells.append(f"{medians['support_ticket'] / 1000:.1f} s | {medians['support_ticket_mixed'] / 1000:.1f} s")
        auto_pick = f"{record['auto']['backend']} {record['auto']['dtype'] or ''}".strip()
        row = f"| {record['model']} | {record['size_bytes'] / 1e6:.0f} MB | {auto_pick} | {' | '.join(cells)} |"
        assert row in text, row
        picked = choices["llamacpp" if record["auto"]["backend"] == "llamacpp" else "torch float32"]
        for case in ("support_ticket", "support_ticket_mixed"):
            fastest = min(choice["median_ms"][case] for choice in choices.values())
            spread = max(picked["ms"][case]) - min(picked["ms"][case])
            assert picked["median_ms"][case] <= fastest + spread, (record["model"], case)


#: the same measurement with every other job on the machine paused (docs/models.md, "On a quiet machine")
QUIET_RUNS = ("auto_smollm2_quiet.json", "auto_qwen1.5b_quiet.json", "auto_gemma_quiet.json")


def _auto_row(record: dict) -> str:
    cells = []
    for label in ("torch float32", "llamacpp"):
        medians = record["choices"][label]["median_ms"]
        cells.append(f"{medians['support_ticket'] / 1000:.2f} s | {medians['support_ticket_mixed'] / 1000:.2f} s")
    auto_pick = f"{record['auto']['backend']} {record['auto']['dtype'] or ''}".strip()
    return f"| {record['model']} | {record['size_bytes'] / 1e6:.0f} MB | {auto_pick} | {' | '.join(cells)} |"


def test_the_quiet_table_is_the_recorded_run():
    """docs/models.md's quiet table is the recorded quiet runs, row by row, each under its command.
    Where auto's pick is the slower choice there, the page says so in its own words (not checked here)."""
    text = (ROOT / "docs" / "models.md").read_text()
    for name in QUIET_RUNS:
        report = json.loads((ROOT / "docs" / "bench" / name).read_text())
        assert report["meta"]["command"] in text
        for record in report["records"]:
            assert _auto_row(record) in text, _auto_row(record)
