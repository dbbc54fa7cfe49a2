"""ASGI guards shared by ``pcd serve`` and ``pcd-mcp``: a body-size bound, a bearer key, a loud warning.

They sit in front of the app, so an oversized body is refused before anything parses it (413) and a
request without the key never reaches a tool (401); both answer in the servers' error shape,
``{"detail": {"error_type", "message"}}``, except that a 413 on a path in ``openai_paths`` takes
OpenAI's shape (``pcd_integrations/wire/errors.py``), as every other error of those routes does. Pure ASGI,
no framework import: the MCP SDK's Starlette app and the FastAPI app take them alike.
``tests/test_hardening_servers.py`` drives both; ``tests/test_chat_completions.py`` the OpenAI 413.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pcd_core import LimitError, Limits
from pcd_core.request.limits import check_body_size
from pcd_integrations.wire.errors import openai_error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(
    send: Send,
    status: int,
    error_type: str,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    openai: bool = False,
) -> None:
    """One JSON error response, in OpenAI's shape when ``openai``; ASCII-escaped, so that no text in it
    can fail to encode.
    """
    shaped = (
        openai_error_body(status, error_type, message)
        if openai
        else {"detail": {"error_type": error_type, "message": message}}
    )
    await send_body(send, status, json.dumps(shaped).encode(), "application/json", headers)


async def send_body(
    send: Send, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
) -> None:
    """One whole response, sent from middleware that answers before the app (errors, health, metrics)."""
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuse a body over ``limits.max_body_bytes`` with 413, from its Content-Length or as it streams.

    The body is read here, up to the bound, and handed on whole: the app never sees a byte past it.
    A body that takes over ``body_timeout_s`` to arrive gets 408 (``read_timeouts.py``).
    """

    def __init__(
        self, app: App, limits: Limits, openai_paths: frozenset[str] = frozenset(), body_timeout_s: float = 30.0
    ) -> None:
        self.app = app
        self.limits = limits
        self.openai_paths = openai_paths
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        openai = scope.get("path") in self.openai_paths
        chunks: list[bytes] = []
        try:
            declared = dict(scope.get("headers") or ()).get(b"content-length")
            if declared is not None and declared.isdigit():
                check_body_size(self.limits, int(declared))
            async with asyncio.timeout(self.body_timeout_s):
                n_bytes, more = 0, True
                while more:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away
                        return
                    chunk = message.get("body", b"")
                    n_bytes += len(chunk)
                    check_body_size(self.limits, n_bytes)
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except LimitError as error:
            await send_error(send, 413, "payload_too_large", str(error), openai=openai)
            return
        except TimeoutError:
            late = f"the request body did not arrive within {self.body_timeout_s:g} s (--body-timeout)"
            # the rest of the body may still be on its way: the connection cannot carry another request
            await send_error(send, 408, "request_timeout", late, {"Connection": "close"}, openai=openai)
            return
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class BearerAuth:
    """Require ``Authorization: Bearer <key>`` on every HTTP request (the MCP endpoint has no open route)."""

    def __init__(self, app: App, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            # compare_digest: the time taken does not tell how much of the key matched
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                message = "a valid 'Authorization: Bearer <key>' header is required"
                await send_error(send, 401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(logger: logging.Logger, server: str, host: str, api_key: str | None) -> bool:
    """Log a loud warning when ``host`` is reachable from other machines and no key guards it."""
    if api_key or is_loopback(host):
        return False
    logger.warning(
        "%s is listening on %s WITHOUT an API key: anyone who can reach this address can run the model. "
        "Set --api-key-env VAR (the key in environment variable VAR), or bind to 127.0.0.1.",
        server,
        host,
    )
    return True
