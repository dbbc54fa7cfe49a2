"""Thin adapters that put a `pcd_core.Engine` behind other frameworks and protocols (HTTP, LangChain, ...)."""
