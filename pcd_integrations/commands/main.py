"""``pcd``: fill a schema, answer a question file, list the embedded models, benchmark, serve.

Arguments and files are checked (files read, the schema or questions parsed) before any model is
loaded, so a typo costs milliseconds, not a model load. A mistake is one line on stderr and exit
status 2, never a traceback: :func:`main` is the one place that turns a ``PcdError`` or ``OSError`` into
that line. Each subcommand is an ``add_*`` function in :data:`COMMANDS` that builds its parser and sets
its ``run``; ``tests/test_cli.py`` drives each on the real model.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcd_core import DEFAULT_MODEL, PcdError, __version__
from pcd_core.loading.model_files import cache_dir
from pcd_integrations.commands import cascading, common
from pcd_integrations.commands.output import decide_record, decide_table, fill_record, fill_table

logger = logging.getLogger(__name__)

#: inputs per ``engine.fill_many`` call with ``--jsonl``: results stream out, and the bar moves, per chunk
JSONL_CHUNK = 8


# -- fill ---------------------------------------------------------------------------------------
def cmd_fill(args: argparse.Namespace) -> int:
    from pcd_core import parse_schema

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
    cascading.check_cascade_args(args)
    engine = cascading.cascaded(common.load_engine(args), args)
    result = engine.fill(schema, text, strategy=args.strategy, debias=args.debias)
    if args.json:
        common.print_json(fill_record(result, engine.model_name))
    else:
        print(fill_table(result))
        if (line := cascading.summary(result.fields)) is not None:
            print(line)
    return 0


def _fill_jsonl(args: argparse.Namespace, schema: Any, items: list[tuple[dict[str, Any], str]]) -> int:
    """One JSON line per input, in input order, each with its ``line`` number (and ``id`` if given)."""
    from tqdm.auto import tqdm

    cascading.check_cascade_args(args)
    engine = cascading.cascaded(common.load_engine(args), args)
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
    from pcd_integrations.commands.evaluate import add_trust_options  # light: no model, no matplotlib

    add_trust_options(fill)
    cascading.add_cascade_options(fill)
    fill.set_defaults(run=cmd_fill)


# -- decide -------------------------------------------------------------------------------------


def cmd_decide(args: argparse.Namespace) -> int:
    data = common.read_questions(args.questions)
    state = common.read_state(args.state) if args.state else data.get("state")
    if state is None:
        raise PcdError("give --state FILE (the question file carries no state)")
    common.check_questions(args.questions, state, data["questions"])
    cascading.check_cascade_args(args)
    engine = cascading.cascaded(common.load_engine(args), args)
    response = engine.decide(state, data["questions"], debias=args.debias)
    if args.json:
        common.print_json(decide_record(response))
    else:
        print(decide_table(response))
        if (line := cascading.summary(response.answers)) is not None:
            print(line)
    return 0


def add_decide(commands: Any) -> None:
    decide = commands.add_parser("decide", help="answer a question file ({state, questions}) with probabilities")
    decide.add_argument("questions", metavar="FILE", help="JSON with 'questions' and 'state', as POST /v1/systemone")
    decide.add_argument("--state", metavar="FILE", help="the state to ask about instead (.json as JSON, else text)")
    decide.add_argument("--json", action="store_true", help="print the /v1/systemone response instead of a table")
    common.add_model_options(decide, opt_in=("order_samples",))
    from pcd_integrations.commands.evaluate import add_trust_options

    add_trust_options(decide)
    cascading.add_cascade_options(decide)
    decide.set_defaults(run=cmd_decide)


# -- models, serve ------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    """The models found here (embedded, HF cache, Ollama, LM Studio), with what backend="auto" runs them on."""
    from pcd_core.loading.auto import this_machine
    from pcd_core.loading.local_models import local_models

    rows = local_models(args.lmstudio_dir)
    if args.json:
        common.print_json([dataclasses.asdict(row) | {"default": row.name == DEFAULT_MODEL} for row in rows])
        return 0
    print(f"{'model':<52} {'from':<9} {'size':>9}  {'format':<13} auto (on {this_machine().describe()})")
    for row in rows:
        size = f"{row.size_bytes / 1e6:,.0f} MB" if row.size_bytes else "-"
        runs = f"{row.backend} {row.dtype}".strip() if row.backend else "-"
        default = " (default)" if row.name == DEFAULT_MODEL else ""
        print(f"{row.name + default:<52} {row.store:<9} {size:>9}  {row.format:<13} {runs}")
    missing = [row for row in rows if row.format == "not installed"]
    for row in missing:
        print(f"to install {row.name}: {row.note}")
    print(f"weights cache: {cache_dir()}")
    return 0


def add_models(commands: Any) -> None:
    models = commands.add_parser(
        "models",
        help="list the models found here (embedded, Hugging Face cache, Ollama, LM Studio) and the backend "
        "auto runs each on",
    )
    models.add_argument("--lmstudio-dir", metavar="DIR", help="LM Studio's models folder, if not the one it uses")
    models.add_argument("--json", action="store_true", help="print the rows as JSON")
    models.set_defaults(run=cmd_models)


def add_bench(commands: Any) -> None:
    from pcd_integrations.commands.bench import add_bench_parser  # light: torch and matplotlib load only when it runs

    add_bench_parser(commands)


def cmd_serve(args: argparse.Namespace) -> int:
    """Check the server options, the key and the extra first; then listen at once and load in the background."""
    from pcd_integrations.commands.serve_options import ServeOptions

    options = ServeOptions.from_args(args)
    api_key = options.api_key()
    try:
        import fastapi  # noqa: F401  (fail here, with the hint, not after the model has loaded)
        import uvicorn  # noqa: F401

        from pcd_integrations.http.app import serve
    except ImportError as error:
        raise PcdError(f"{error}; run: pip install 'pcd-engine[http]'") from error
    if options.otel and importlib.util.find_spec("opentelemetry") is None:
        raise PcdError("--otel needs opentelemetry-api, which is not installed; run: pip install 'pcd-engine[otel]'")
    from pcd_core import Calibration, recommendation

    # read now, so that a bad file is an error here and not a failed load behind a listening server
    args.calibration = Calibration.load(args.calibration) if args.calibration else None
    cascading.check_cascade_args(args)
    advice = recommendation(args.model)
    if advice is not None:
        logger.warning(advice)
    serve(
        lambda: cascading.cascaded(common.load_engine(args, debias=args.debias), args),
        host=options.host,
        port=options.port,
        api_key=api_key,
        model_name=args.model,
        limits=options.limits,
        playground=not args.no_playground,
        backpressure=options.backpressure,
        tracing=options.otel,
        read_timeouts=options.read_timeouts,
    )
    return 0


def add_serve(commands: Any) -> None:
    from pcd_integrations.commands.serve_options import add_serve_options

    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API: /v1/systemone, /v1/decisions and /v1/chat/completions",
    )
    add_serve_options(serve)
    serve.add_argument(
        "--no-playground",
        action="store_true",
        help="do not serve the playground page at / and /playground (it needs no key to load, only to decide)",
    )
    common.add_model_options(serve, opt_in=("order_samples",))
    from pcd_integrations.commands.evaluate import add_trust_options  # light: no model, no matplotlib

    add_trust_options(serve, "every answer")
    cascading.add_cascade_options(serve)
    serve.set_defaults(run=cmd_serve)


#: every subcommand, in the order ``pcd --help`` lists them
def add_eval(commands: Any) -> None:
    from pcd_integrations.commands.evaluate import add_eval_parsers  # light: the model and matplotlib load when it runs

    add_eval_parsers(commands)


def add_watch(commands: Any) -> None:
    from pcd_integrations.commands.watch import add_watch as add  # light: the model loads when it runs

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
