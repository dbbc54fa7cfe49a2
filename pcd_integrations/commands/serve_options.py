"""The server flags that `pcd serve` and `pcd-mcp` share, declared once.

``ServeOptions`` is to the servers what ``LoadOptions`` is to the model: every field carries its help,
flag and value parser, ``add_serve_options`` turns the fields into argparse flags for either command,
and ``ServeOptions.from_args`` builds the checked options back from a namespace. `pcd-mcp` defaults each
flag to an environment variable (``PCD_MCP_`` and the flag's name), so that an agent host's config can set
it either way; `pcd serve` takes flags only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pcd_core import Limits, OptionError
from pcd_integrations.commands.common import non_negative, positive, positive_seconds
from pcd_integrations.serving.operations import Backpressure
from pcd_integrations.serving.read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts

__all__ = ["ServeOptions", "add_serve_options", "switch_value"]


def _server_option(
    default: Any, help: str, *, parse: Callable[[str], Any] | None = None, flag: str | None = None, **cli: Any
) -> Any:
    """A field with its help, its value parser (None: a switch) and, where it differs from the field's
    name, its flag; ``metavar`` and ``http_only`` (meaningful only over HTTP, which `pcd-mcp` says) ride along.
    """
    return field(default=default, metadata={"help": help, "parse": parse, "flag": flag, **cli})


@dataclass(frozen=True)
class ServeOptions:
    """How a server listens and what it refuses; ``api_key_env`` names the variable that holds the key,
    so that the key itself never appears in argv or in a process listing.
    """

    host: str = _server_option(
        "127.0.0.1",
        "address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface, with --api-key-env)",
        parse=str,
    )
    port: int = _server_option(8000, "TCP port to listen on", parse=int)
    api_key_env: str | None = _server_option(
        None,
        "require 'Authorization: Bearer <key>', the key read from environment variable VAR",
        parse=str,
        metavar="VAR",
        http_only=True,
    )
    max_body_bytes: int = _server_option(
        1 << 20, "refuse request bodies over this many bytes with 413", parse=positive, http_only=True
    )
    header_timeout_s: float = _server_option(
        DEFAULT_READ_TIMEOUTS.header_s,
        "close a connection whose request headers take over S seconds, with 408",
        parse=positive_seconds,
        flag="--header-timeout",
        metavar="S",
        http_only=True,
    )
    body_timeout_s: float = _server_option(
        DEFAULT_READ_TIMEOUTS.body_s,
        "answer 408 to a request whose body takes over S seconds to arrive",
        parse=positive_seconds,
        flag="--body-timeout",
        metavar="S",
        http_only=True,
    )
    max_queue: int | None = _server_option(
        None,
        "at most N requests wait for the model; one more gets 503 with Retry-After (default: no bound)",
        parse=non_negative,
        metavar="N",
        http_only=True,
    )
    timeout_s: float | None = _server_option(
        None,
        "a request not answered within S seconds gets 504 and its work stops at its next pass (default: none)",
        parse=positive_seconds,
        flag="--timeout",
        metavar="S",
        http_only=True,
    )
    otel: bool = _server_option(
        False,
        "an OpenTelemetry span per request and per forward pass, to the tracer provider the process "
        "configures (the otel extra)",
        http_only=True,
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise OptionError(f"--port {self.port} is not a TCP port (1..65535)")
        if self.max_body_bytes < 1:
            raise OptionError(f"max_body_bytes must be 1 or more, got {self.max_body_bytes}")
        ReadTimeouts(header_s=self.header_timeout_s, body_s=self.body_timeout_s)  # checks both
        try:
            Backpressure(max_queue=self.max_queue, timeout_s=self.timeout_s)
        except ValueError as error:
            raise OptionError(str(error)) from error

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(**{spec.name: getattr(args, _dest(spec)) for spec in dataclasses.fields(cls)})

    def api_key(self) -> str | None:
        """The key the server requires, read from ``api_key_env`` now; None when no key is asked for."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise OptionError(f"--api-key-env {self.api_key_env}: that environment variable is unset or empty")
        return key

    @property
    def limits(self) -> Limits:
        return Limits(max_body_bytes=self.max_body_bytes)

    @property
    def read_timeouts(self) -> ReadTimeouts:
        return ReadTimeouts(header_s=self.header_timeout_s, body_s=self.body_timeout_s)

    @property
    def backpressure(self) -> Backpressure:
        return Backpressure(max_queue=self.max_queue, timeout_s=self.timeout_s)


def _flag(spec: dataclasses.Field[Any]) -> str:
    return spec.metadata["flag"] or f"--{spec.name.replace('_', '-')}"


def _dest(spec: dataclasses.Field[Any]) -> str:
    return _flag(spec).removeprefix("--").replace("-", "_")


def switch_value(value: str | None) -> bool:
    """An on/off environment variable: 1, true, yes or on (any case) is on; unset or anything else is off."""
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def add_serve_options(
    parser: argparse.ArgumentParser, *, port: int = 8000, environment: str | None = None, http_note: str = ""
) -> None:
    """Every ``ServeOptions`` flag on ``parser``. ``environment`` is the prefix of the variables each flag
    defaults to (``PCD_MCP_``), named in its help; ``http_note`` opens the help of the flags that only
    mean something over HTTP (`pcd-mcp` also speaks stdio).
    """
    for spec in dataclasses.fields(ServeOptions):
        meta, flag = spec.metadata, _flag(spec)
        default = port if spec.name == "port" else spec.default
        variable = f"{environment}{_dest(spec).upper()}" if environment else None
        help_text = (http_note if meta.get("http_only") else "") + meta["help"]
        if variable is not None:
            help_text += f" ({variable})"
        elif default not in (None, False) and "default" not in help_text:
            help_text += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
        if meta["parse"] is None:  # a switch
            on = switch_value(os.environ.get(variable)) if variable else False
            parser.add_argument(flag, dest=_dest(spec), action="store_true", default=on, help=help_text)
            continue
        if variable is not None and variable in os.environ:
            default = os.environ[variable]  # argparse parses a string default with ``type``
        kwargs: dict[str, Any] = {"dest": _dest(spec), "type": meta["parse"], "default": default, "help": help_text}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(flag, **kwargs)
