"""Loading an `Engine` on a background thread, so that a server answers while the weights load.

``pcd serve`` (``pcd_integrations/http/app.py``) and ``pcd-mcp`` (``mcp_server/loading.py``) both listen at
once and load the model meanwhile; a cold load takes seconds to minutes. This module is the one place
that does it: the load runs once, on its own thread (loading is blocking work that must not stall an
event loop, and an in-process ASGI test client never runs a lifespan), and a failed load is recorded,
never raised into the server, so that every later request can say why. Each server maps the state to
its own protocol (HTTP 503, an MCP tool error). ``tests/test_http.py`` and ``tests/test_mcp_server.py``
hold a load open and make one fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pcd_core import Engine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], "Engine"]
LoadStatus = Literal["loading", "ready", "error"]


class EngineLoader:
    """One engine, given or built once by a factory on a background thread.

    ``status`` is ``loading``, then ``ready`` or ``error`` (with ``error`` the reason); ``loaded`` is set
    when the load has ended either way. ``model_name`` is the given name while loading, then the
    loaded engine's own.
    """

    def __init__(
        self,
        engine_or_factory: Engine | EngineFactory,
        *,
        model_name: str | None = None,
        thread_name: str = "pcd-load",
    ) -> None:
        self.loaded = threading.Event()
        self.error: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._thread_name = thread_name
        self._engine: Engine | None = None
        self._factory: EngineFactory | None = None
        # duck-typed, so that a stand-in engine (a test's oracle engine) is served as it is
        if hasattr(engine_or_factory, "decide"):
            self._engine = engine_or_factory  # type: ignore[assignment]
            self.loaded.set()
        elif callable(engine_or_factory):
            self._factory = engine_or_factory
        else:
            raise TypeError(f"expected an Engine or a function that loads one, not {engine_or_factory!r}")
        self.model_name = self._engine.model_name if self._engine is not None else model_name

    @property
    def status(self) -> LoadStatus:
        if self._engine is not None:
            return "ready"
        return "error" if self.error is not None else "loading"

    @property
    def engine(self) -> Engine | None:
        """The engine once it is ready, else None."""
        return self._engine

    def start(self) -> None:
        """Start the load, once; later calls, and calls with a ready engine, do nothing."""
        with self._lock:
            if self._factory is None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._load, name=self._thread_name, daemon=True)
            self._thread.start()

    def _load(self) -> None:
        assert self._factory is not None
        started = time.perf_counter()
        try:
            engine = self._factory()
        except BaseException as exc:  # recorded for every later request; the server keeps running
            logger.exception("loading the model failed")
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            self.model_name = engine.model_name
            self._engine = engine
            logger.info("model %s loaded in %.1f s", engine.model_name, time.perf_counter() - started)
        finally:
            self.loaded.set()

    async def wait(self, on_wait: Callable[[float], Awaitable[None]], interval_s: float = 1.0) -> Engine | None:
        """Await the end of the load without blocking the event loop; None when it failed.

        ``on_wait(seconds_waited)`` runs before each wait of up to ``interval_s``, so that a caller can
        report progress.
        """
        import anyio

        self.start()
        started = time.perf_counter()
        while not self.loaded.is_set():
            await on_wait(round(time.perf_counter() - started, 1))
            await anyio.to_thread.run_sync(self.loaded.wait, interval_s, abandon_on_cancel=True)
        return self._engine
