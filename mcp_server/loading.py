"""Awaiting the engine in a tool call, so that the MCP handshake never waits for the weights.

On stdio the SDK runs the lifespan before it answers `initialize`, and a cold load takes seconds to
minutes; so the lifespan only starts `pcd_integrations.serving.engine_loader.EngineLoader` (the same loader `pcd serve`
uses), and each tool call awaits the engine, reporting progress while it waits.
`tests/test_mcp_server.py::test_a_call_during_the_load_waits_and_reports_progress` holds the load open
and checks both.
"""

from __future__ import annotations

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from pcd_core import Engine
from pcd_integrations.serving.engine_loader import EngineFactory, EngineLoader

__all__ = ["PROGRESS_INTERVAL_S", "EngineFactory", "EngineLoader", "engine_for"]

#: How often a tool call waiting for the model reports progress.
PROGRESS_INTERVAL_S = 1.0


async def engine_for(loader: EngineLoader, ctx: Context) -> Engine:
    """The engine, waiting for the load and reporting progress (seconds waited) meanwhile."""

    async def report(waited_s: float) -> None:
        await ctx.report_progress(waited_s, None, f"loading the model ({waited_s:.0f} s)")

    engine = await loader.wait(report, PROGRESS_INTERVAL_S)
    if engine is None:
        raise ToolError(f"the model failed to load: {loader.error}; see the server log on stderr")
    return engine
