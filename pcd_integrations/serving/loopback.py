"""A ``pcd serve`` app on a loopback socket, in a background thread, for real HTTP clients in the same
process: ``pcd bench --clients`` (``pcd_integrations/commands/bench_clients.py``) and the tests of the HTTP routes.

uvicorn binds port 0, and the port it got is read back once it has started.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

START_TIMEOUT_S = 30


@contextmanager
def serving(app: Any, lifespan: Literal["on", "off"] = "off", **config: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL (``http://127.0.0.1:PORT``).
    ``lifespan="on"`` runs the app's lifespan, which the MCP SDK's session manager needs; ``config``
    goes on to ``uvicorn.Config`` (the servers' tests pass ``http=``, the protocol with read timeouts).
    """
    import uvicorn

    settings = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan, **config)
    server = uvicorn.Server(settings)
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
