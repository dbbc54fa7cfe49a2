"""Loading the engine in the background, so that the MCP handshake never waits for the weights.

On stdio the SDK runs the lifespan before it answers `initialize`, and a cold load takes seconds to
minutes; so the lifespan only starts a thread, and each tool call awaits the engine, reporting progress
while it waits. `tests/test_mcp_server.py::test_a_call_during_the_load_waits_and_reports_progress`
holds the load open and checks both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from pcd_core import Engine

logger = logging.getLogger(__name__)

#: How often a tool call waiting for the model reports progress.
PROGRESS_INTERVAL_S = 1.0

EngineFactory = Callable[[], Engine]


class EngineLoader:
    """Builds the engine once on a background thread; tool calls await it.

    A thread rather than a task: loading is blocking work (weights, conversion) that must not stall the
    event loop, which is answering the handshake meanwhile.
    """

    def __init__(self, engine_or_factory: Engine | EngineFactory) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._error: BaseException | None = None
        if callable(engine_or_factory) and not hasattr(engine_or_factory, "decide"):
            self._factory: EngineFactory | None = engine_or_factory
        else:
            self._factory = None
            self._engine = engine_or_factory
            self._done.set()

    def start(self) -> None:
        """Start loading, once; later calls do nothing."""
        with self._lock:
            if self._factory is None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._load, name="pcd-mcp-load", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            self._engine = self._factory()
        except BaseException as exc:  # reported to every tool call; the server keeps answering
            self._error = exc
            logger.exception("the model failed to load")
        else:
            logger.info("model %s loaded in %.1f s", self._engine.model_name, time.perf_counter() - started)
        finally:
            self._done.set()

    async def get(self, ctx: Context) -> Engine:
        """The engine, waiting for the load and reporting progress (seconds waited) meanwhile."""
        self.start()
        started = time.perf_counter()
        while not self._done.is_set():
            waited_s = round(time.perf_counter() - started, 1)
            await ctx.report_progress(waited_s, None, f"loading the model ({waited_s:.0f} s)")
            await anyio.to_thread.run_sync(self._done.wait, PROGRESS_INTERVAL_S, abandon_on_cancel=True)
        if self._error is not None:
            raise ToolError(f"the model failed to load: {self._error}; see the server log on stderr")
        return self._engine
