"""``LoadOptions`` (pcd_core/loading/options.py): one checked value behind ``Engine.load``, every command's model
flags and the adapters; an option a backend cannot honour is refused the same way for every backend,
before anything loads.

The expected refusals below are written out by hand, backend by backend, from what each backend does
(``pcd_core/backends/``), not read from the table under test.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from mcp_server.__main__ import parse_args as mcp_parse_args
from pcd_core import Engine, LoadOptions, OptionError
from pcd_core.loading import load as model_load
from pcd_core.loading import model_files
from pcd_core.loading.options import BACKENDS, load_options
from pcd_integrations.commands import common
from pcd_integrations.commands.main import build_parser, main
from pcd_integrations.serving.lazy_engine import LazyEngine

URL = "http://127.0.0.1:9"  # vllm needs an address; nothing listens there and nothing connects

#: (backend, option, value) that the backend cannot honour: what it would otherwise silently ignore
REFUSED = [
    ("mlx", "device", "cpu"),
    ("llamacpp", "device", "cpu"),
    ("vllm", "device", "cuda"),
    ("mlx", "dtype", "bfloat16"),
    ("llamacpp", "dtype", "float32"),
    ("vllm", "dtype", "float16"),
    ("mlx", "row_layout", "copies"),  # MLX always packs
    ("llamacpp", "row_layout", "copies"),  # sequence sets are a packed layout
    ("vllm", "row_layout", "packed"),  # the server reads a copy of the prefix per row
    ("torch", "threads", 2),
    ("mlx", "threads", 2),
    ("vllm", "threads", 2),
    ("torch", "base_url", URL),
    ("mlx", "base_url", URL),
    ("llamacpp", "base_url", URL),
    ("torch", "api_key", "secret"),
    ("llamacpp", "api_key", "secret"),
    ("mlx", "dummy_weights", "tiny-llama"),
    ("llamacpp", "dummy_weights", "tiny-llama"),
]

#: the same options where the backend does honour them, so that the table refuses no more than it should
HONOURED = [
    ("torch", {"device": "cpu", "dtype": "bfloat16", "row_layout": "copies"}),
    ("mlx", {"dtype": "float32", "row_layout": "packed"}),
    ("llamacpp", {"threads": 3, "row_layout": "packed"}),
    ("vllm", {"base_url": URL, "api_key": "secret", "row_layout": "copies"}),
    ("torch", {"dummy_weights": "tiny-llama", "max_pass_bytes": 1 << 20, "head_cache_size": 0}),
]


def _with_url(backend: str, options: dict) -> dict:
    return {"base_url": URL, **options} if backend == "vllm" else options


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a refused option got as far as finding or loading a model."""
    monkeypatch.setattr(model_files, "resolve", lambda name: pytest.fail(f"resolved {name!r} after a bad option"))
    monkeypatch.setattr(model_load, "_load", lambda options: pytest.fail(f"loaded {options}"))


@pytest.mark.parametrize(("backend", "name", "value"), REFUSED)
def test_an_option_the_backend_cannot_honour_is_refused_before_anything_loads(no_load, backend, name, value):
    with pytest.raises(OptionError) as caught:
        Engine.load("smollm2-135m", backend=backend, **_with_url(backend, {name: value}))
    message = str(caught.value)
    # one message shape for every backend and option: who refuses what, and what to do
    assert message.startswith(f"the {backend} backend cannot honour {name}=")
    assert f"leave {name} unset or choose another backend" in message
    if name == "api_key":
        assert "secret" not in message  # a key is never echoed into a log line
    else:
        assert repr(value) in message


@pytest.mark.parametrize(("backend", "given"), HONOURED)
def test_the_options_a_backend_honours_are_kept(backend, given):
    options = LoadOptions(backend=backend, **given)
    assert {name: getattr(options, name) for name in given} == given


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_at_their_defaults_ask_nothing_of_any_backend(backend):
    options = LoadOptions(backend=backend, **_with_url(backend, {}))
    assert (options.row_layout, options.device, options.dtype, options.threads) == ("auto", None, None, None)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"backend": "tpu"}, "backend must be one of auto, torch, mlx, llamacpp, vllm, got 'tpu'"),
        ({"dtype": "float8"}, "dtype must be one of float32, float16, bfloat16"),
        ({"row_layout": "diagonal"}, "row_layout must be one of auto, packed, copies"),
        ({"max_tokens_per_pass": 0}, "max_tokens_per_pass must be a positive whole number, got 0"),
        ({"threads": -1, "backend": "llamacpp"}, "threads must be a positive whole number"),
        ({"max_pass_bytes": True}, "max_pass_bytes must be a positive whole number, got True"),
        ({"head_cache_size": -1}, "head_cache_size must be 0"),
        ({"model": ""}, "model must be a model name or path"),
        ({"backend": "vllm"}, "needs base_url"),
        ({"dummy_weights": "tiny-llama", "model": "gemma3-270m"}, "not both"),
    ],
)
def test_a_bad_value_is_an_option_error(given, says):
    with pytest.raises(OptionError, match=says.replace("(", r"\(")):
        LoadOptions(**given)


def test_keywords_build_options_and_override_given_ones():
    built = load_options("gemma3-270m", backend="llamacpp", threads=2)
    assert built == LoadOptions(model="gemma3-270m", backend="llamacpp", threads=2)
    assert load_options(built, threads=4).threads == 4 and built.threads == 2  # frozen: a new value
    assert load_options() == LoadOptions()
    with pytest.raises(OptionError, match="unknown load option"):
        load_options(max_tokens=5)
    with pytest.raises(OptionError, match="named twice"):
        load_options("gemma3-270m", model="smollm2-135m")
    with pytest.raises(OptionError, match="cannot honour threads"):  # an override is checked again
        load_options(built, backend="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.threads = 8  # type: ignore[misc]


def _flags(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _subparser(name: str):
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return commands.choices[name]


@pytest.mark.parametrize("command", ["fill", "decide", "serve", "eval", "calibrate", "bench", "pcd-mcp"])
def test_every_command_offers_every_model_option_of_load_options(command):
    from mcp_server.__main__ import build_parser as mcp_parser

    parser = mcp_parser() if command == "pcd-mcp" else _subparser(command)
    expected = {
        "--model",
        "--backend",
        "--device",
        "--dtype",
        "--row-layout",
        "--max-tokens-per-pass",
        "--threads",
        "--base-url",
        "--vllm-api-key-env",
    }
    assert expected <= _flags(parser)
    assert ("--dummy-weights" in _flags(parser)) == (command == "bench")  # timing only


def test_the_flags_build_the_options_they_name(monkeypatch):
    monkeypatch.setenv("MY_VLLM_KEY", "k-123")
    argv = ["fill", "--schema", "s.json", "--backend", "llamacpp", "--threads", "2", "--max-tokens-per-pass", "64"]
    options = common.options_from_args(build_parser().parse_args(argv))
    assert options == LoadOptions(backend="llamacpp", threads=2, max_tokens_per_pass=64)
    argv = ["decide", "q.json", "--backend", "vllm", "--base-url", URL, "--vllm-api-key-env", "MY_VLLM_KEY"]
    options = common.options_from_args(build_parser().parse_args(argv))
    assert (options.backend, options.base_url, options.api_key) == ("vllm", URL, "k-123")


def test_pcd_refuses_an_unhonoured_flag_in_one_line_before_loading(no_load, tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    (tmp_path / "in.txt").write_text("fine")
    argv = ["fill", "--schema", str(schema), "--input", str(tmp_path / "in.txt"), "--backend", "mlx"]
    assert main([*argv, "--row-layout", "copies"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the mlx backend cannot honour row_layout='copies'" in err


@pytest.mark.parametrize(
    ("env", "argv", "says"),
    [
        ({"PCD_BACKEND": "llamacpp", "PCD_DEVICE": "cuda"}, [], "the llamacpp backend cannot honour device='cuda'"),
        ({"PCD_ROW_LAYOUT": "copies"}, ["--backend", "mlx"], "the mlx backend cannot honour row_layout='copies'"),
        ({"PCD_BACKEND": "torch"}, ["--threads", "2"], "the torch backend cannot honour threads=2"),
        ({"PCD_DEVICE": "cpu"}, ["--threads", "2"], "no backend honours device and threads together"),
        ({"PCD_BACKEND": "tpu"}, [], "backend must be one of"),
    ],
)
def test_pcd_mcp_checks_flags_and_their_variables_the_same_way(monkeypatch, capsys, env, argv, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        mcp_parse_args(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_pcd_mcp_reads_the_vllm_key_from_its_variable_by_default(monkeypatch):
    monkeypatch.setenv("PCD_VLLM_API_KEY", "k-456")
    args = mcp_parse_args(["--backend", "vllm", "--base-url", URL])
    assert (args.load_options.backend, args.load_options.api_key) == ("vllm", "k-456")
    assert all(value != "k-456" for name, value in vars(args).items() if name != "load_options")


def test_an_adapter_refuses_an_unhonoured_backend_at_construction_and_loads_nothing(no_load):
    with pytest.raises(ValueError, match="needs base_url"):
        LazyEngine(backend="vllm")
    lazy = LazyEngine(model="gemma3-270m", backend="llamacpp")
    assert lazy.engine is None and lazy.load_options() == LoadOptions(model="gemma3-270m", backend="llamacpp")


def test_a_row_layout_reaches_the_torch_backend_and_its_stats(engine):
    """A real load with ``row_layout="copies"``: the layout the fill reports is the one asked for."""
    copies = Engine.load(row_layout="copies", max_pass_bytes=1 << 30, head_cache_size=1)
    assert (copies.backend.row_layout, copies.backend.max_pass_bytes) == ("copies", 1 << 30)
    schema = {"type": "object", "properties": {"urgent": {"type": "boolean"}}}
    text = "The server is down and customers cannot pay."
    filled = copies.fill(schema, text)
    assert filled.stats.row_layout == "copies"
    assert filled.fields["urgent"].probability == pytest.approx(
        engine.fill(schema, text).fields["urgent"].probability, abs=1e-4
    )
