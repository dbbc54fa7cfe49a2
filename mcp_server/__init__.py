"""pcd-engine's MCP server: typed decisions as tools for agent hosts (see `mcp_server.server`).

The names load on first use, so that `python -m mcp_server --help` and argument errors stay instant
instead of importing the engine and the MCP SDK first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_server", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mcp_server import server

        return getattr(server, name)
    raise AttributeError(f"module 'mcp_server' has no attribute {name!r}")
