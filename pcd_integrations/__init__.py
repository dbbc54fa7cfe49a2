"""Thin adapters that put a `pcd_core.Engine` behind other frameworks and protocols.

The ``pcd`` command (``commands/``), the HTTP server (``http/``), what any server runs on (``serving/``), the
protocols' wire models (``wire/``), LangChain (``langchain/``), LlamaIndex (``llama_index/``), DSPy
(``dspy.py``), pydantic-ai (``pydantic_ai.py``) and a remote ``/v1/decisions`` cascade stage
(``remote_decisions.py``); ``docs/layout.md`` has the table. This file imports none of them, so that each
framework's optional extra is imported only with its own door.
"""
