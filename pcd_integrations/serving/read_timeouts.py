"""How long ``pcd serve`` and ``pcd-mcp`` wait for a client to send its request: headers, then body.

uvicorn times out an idle keep-alive connection, but not a client that sends its headers or its body
a byte at a time: such sockets stay open for as long as the client likes, each holding a connection
slot (41 of them were kept open for 45 s before these bounds). Two bounds close them:

- the **header timeout**, at the connection: from the moment it opens (or its previous response is
  complete) the request's headers must have arrived within ``header_s``, or the server answers
  ``408 Request Timeout`` and closes it. uvicorn has no such setting, so `http_protocol` builds its
  HTTP/1.1 protocol (h11) with a timer added;
- the **body timeout**, in the ASGI app: ``guards.BodyLimit``, which reads the whole body before the
  app sees it, gives up after ``body_s`` with a 408 in the route's error shape.

``tests/test_hardening_servers.py`` drips headers and bodies over raw loopback sockets to both servers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_READ_TIMEOUTS", "ReadTimeouts", "http_protocol"]


@dataclass(frozen=True)
class ReadTimeouts:
    """Seconds a client has to send its request's headers, and then its body (``--header-timeout``,
    ``--body-timeout``). The defaults leave room for a 1 MiB body (the default ``--max-body-bytes``)
    over a link of 40 kB/s, and refuse a client that sends less.
    """

    header_s: float = 10.0
    body_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in (("header_s", self.header_s), ("body_s", self.body_s)):
            if not value > 0:
                raise ValueError(f"ReadTimeouts.{name} must be a positive number of seconds, got {value!r}")


DEFAULT_READ_TIMEOUTS = ReadTimeouts()


def _timeout_response(message: str) -> bytes:
    body = json.dumps({"detail": {"error_type": "request_timeout", "message": message}}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def http_protocol(header_s: float) -> type[asyncio.Protocol]:
    """The h11 protocol of uvicorn, closing a connection whose request headers take over ``header_s``
    (pass it as ``uvicorn.Config(http=...)``); uvicorn is imported here, when a server is built.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    late = _timeout_response(f"the request headers did not arrive within {header_s:g} s (--header-timeout)")

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _awaited_after: Any = None  # the cycle before the request whose headers are awaited

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._awaited_after:
                self._disarm()  # h11 has read the headers: a new request cycle has begun

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if self.cycle is before and not self.transport.is_closing():  # a pipelined one has its headers
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._disarm()
            self._awaited_after = self.cycle
            self._header_timer = self.loop.call_later(header_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:  # nothing of a request read yet: it can be answered
                self.transport.write(late)
            self.transport.close()

    return HeaderTimeoutProtocol
