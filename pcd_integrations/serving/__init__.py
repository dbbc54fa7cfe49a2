"""What running an engine behind a door needs, shared by ``pcd serve``, ``pcd-mcp`` and the adapters.

The ASGI guards (``guards.py``), request ids, back-pressure and health (``operations.py``), metrics
(``metrics.py``), tracing (``tracing.py``), slow-client read timeouts (``read_timeouts.py``), the engine
loaded on a background thread (``engine_loader.py``) or on first use (``lazy_engine.py``), blocking
engine iterators stepped from async code (``threads.py``), and an app on a loopback socket
(``loopback.py``). Nothing here imports a server's routes or a framework adapter, and this file imports
nothing, so that an adapter importing one module does not pull in the servers' optional packages.
"""
