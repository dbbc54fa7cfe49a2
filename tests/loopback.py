"""A real ``pcd serve`` app on a loopback socket, in a background thread, for real HTTP clients; and
the check of an OpenAI error as the SDK raises it, shared by the OpenAI routes' tests.

The ``openai`` SDK talks over its own HTTP stack, so its tests need a listening server rather than an
in-process transport. uvicorn binds port 0, and the port it got is read back once it has started.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

START_TIMEOUT_S = 30


def assert_openai_bad_request(error: Any, param: str, words: str) -> None:
    """``error`` is the SDK's ``BadRequestError`` for OpenAI's 400 body, pointing at ``param`` and saying ``words``."""
    assert error.status_code == 400 and error.type == "invalid_request_error", error.body
    assert error.param == param and words in error.message, error.body
    assert set(error.body) == {"message", "type", "param", "code"} and error.code


@contextmanager
def serving(app: Any, lifespan: str = "off") -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL (``http://127.0.0.1:PORT``).
    ``lifespan="on"`` runs the app's lifespan, which the MCP SDK's session manager needs.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, name="loopback-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_S)
