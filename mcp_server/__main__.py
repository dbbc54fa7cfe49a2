"""`pcd-mcp`: check the arguments, then serve the MCP tools over stdio or streamable HTTP.

Every flag has an environment variable, so that an agent host's config can set either. Arguments are
checked before the model loads or a transport opens, so a typo fails in a second with exit status 2.
Logs go to stderr: on stdio, stdout is the wire. Run on the default model, it logs the README's
recommendation of a bigger local one at start (``pcd_core.models.recommendation``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from pcd_core.errors import PcdError
from pcd_core.options import BACKEND_MODULES
from pcd_integrations.commands.common import add_model_options, options_from_args
from pcd_integrations.read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts

TRANSPORTS = ("stdio", "streamable-http")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _flag(value: str | None) -> bool:
    """An on/off environment variable: 1, true, yes or on (any case) is on; unset or anything else is off."""
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="pcd-mcp",
        description="Serve pcd-engine's typed decisions (noul, choice, score, decide, fill) as MCP tools.",
        epilog="Each flag defaults to the environment variable named in its help.",
    )
    add = parser.add_argument
    add(
        "--transport",
        default=env("PCD_MCP_TRANSPORT", "stdio"),
        help=f"one of {', '.join(TRANSPORTS)} (PCD_MCP_TRANSPORT; default stdio)",
    )
    add("--host", default=env("PCD_MCP_HOST", "127.0.0.1"), help="HTTP bind address (PCD_MCP_HOST)")
    add(
        "--port",
        type=_port,
        default=env("PCD_MCP_PORT", "8765"),
        help="HTTP port; the endpoint is /mcp (PCD_MCP_PORT; default 8765)",
    )
    # the model flags are LoadOptions' own, each defaulting to its environment variable
    add_model_options(parser, environment=True)
    add(
        "--calibration",
        metavar="FILE",
        default=env("PCD_CALIBRATION"),
        help="a calibration file written by pcd calibrate, applied to the answers it was fitted on (PCD_CALIBRATION)",
    )

    def switch(option: str, variable: str, meaning: str) -> None:
        """An on/off flag whose default is the environment variable ``variable`` (``_flag``)."""
        add(option, action="store_true", default=_flag(env(variable)), help=f"{meaning} ({variable}=1)")

    switch("--debias", "PCD_DEBIAS", "divide out the model's content-free label prior from every answer")
    switch(
        "--stateless",
        "PCD_MCP_STATELESS",
        "streamable HTTP without sessions: each request stands alone, so any replica behind a load "
        "balancer can answer it",
    )
    switch(
        "--json-response",
        "PCD_MCP_JSON_RESPONSE",
        "streamable HTTP answers as one application/json body instead of an SSE stream",
    )
    add(
        "--api-key-env",
        metavar="VAR",
        default=env("PCD_MCP_API_KEY_ENV"),
        help="streamable-http only: require 'Authorization: Bearer <key>', the key read from environment "
        "variable VAR (PCD_MCP_API_KEY_ENV)",
    )
    add(
        "--max-body-bytes",
        type=_positive_int,
        default=env("PCD_MCP_MAX_BODY_BYTES", str(1 << 20)),
        help="streamable-http only: refuse request bodies over this many bytes with 413 "
        "(PCD_MCP_MAX_BODY_BYTES; default 1048576)",
    )
    for option, variable, default_s, meaning in (
        (
            "--header-timeout",
            "PCD_MCP_HEADER_TIMEOUT",
            DEFAULT_READ_TIMEOUTS.header_s,
            "close a connection whose request headers take over S seconds, with 408",
        ),
        (
            "--body-timeout",
            "PCD_MCP_BODY_TIMEOUT",
            DEFAULT_READ_TIMEOUTS.body_s,
            "answer 408 to a request whose body takes over S seconds to arrive",
        ),
    ):
        add(
            option,
            type=_seconds,
            metavar="S",
            default=env(variable, str(default_s)),
            help=f"streamable-http only: {meaning} ({variable}; default {default_s:g})",
        )
    add(
        "--log-level",
        default=env("PCD_LOG_LEVEL", "INFO"),
        help=f"one of {', '.join(LOG_LEVELS)} (PCD_LOG_LEVEL; default INFO)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check every argument; exits with status 2 and a message on stderr for a bad one.

    `choices=` is not used because argparse does not check it against defaults, which come from the
    environment here.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.log_level = args.log_level.upper()
    if args.transport not in TRANSPORTS:
        parser.error(f"--transport must be one of {', '.join(TRANSPORTS)}, got {args.transport!r}")
    if args.transport != "streamable-http" and (args.stateless or args.json_response):
        parser.error("--stateless and --json-response apply to --transport streamable-http only")
    if importlib.util.find_spec("mcp") is None:
        parser.error("the MCP server needs the 'mcp' package; run: pip install 'pcd-engine[mcp]'")
    try:  # every model option, and whether the backend honours it (pcd_core/options.py)
        args.load_options = options_from_args(args, calibration=args.calibration, debias=args.debias)
    except PcdError as error:
        parser.error(str(error))
    module = BACKEND_MODULES[args.load_options.backend]
    if importlib.util.find_spec(module) is None:
        parser.error(
            f"the {args.backend!r} backend needs {module!r}, which is not installed; "
            f"run: pip install 'pcd-engine[{args.backend}]'"
        )
    if args.log_level not in LOG_LEVELS:
        parser.error(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    args.api_key = None
    if args.api_key_env is not None:
        if args.transport != "streamable-http":
            parser.error("--api-key-env needs --transport streamable-http; stdio has no one to authenticate")
        args.api_key = os.environ.get(args.api_key_env)
        if not args.api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty")
    try:  # read now: a bad file fails here, not as a failed load behind an open transport
        args.load_options = replace(args.load_options, calibration=args.load_options.fitted_calibration())
    except PcdError as exc:
        parser.error(f"--calibration: {exc}")
    from pcd_core.models import resolve

    try:
        resolve(args.model)  # finds embedded packages and .gguf files without loading weights
    except PcdError as exc:
        parser.error(f"--model {args.model!r}: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level, format="%(asctime)s %(name)s: %(message)s")

    # Imported after the checks: pulling in the engine and the SDK takes a while.
    from mcp_server.server import serve
    from pcd_core import Engine
    from pcd_core.limits import Limits
    from pcd_core.models import recommendation

    advice = recommendation(args.model)
    if advice is not None:
        logger.warning(advice)

    load = functools.partial(Engine.load, args.load_options)
    serve(
        load,
        transport=args.transport,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        stateless=args.stateless,
        json_response=args.json_response,
        api_key=args.api_key,
        limits=Limits(max_body_bytes=args.max_body_bytes),
        read_timeouts=ReadTimeouts(header_s=args.header_timeout, body_s=args.body_timeout),
    )


if __name__ == "__main__":
    main()
