"""``pcd serve``, the HTTP server: the app and its routes (``app.py``), the engine calls in a worker
thread (``calls.py``), the error bodies of both protocols (``errors.py``), the session routes
(``sessions.py``), what ``POST /v1/chat/completions`` runs (``chat_completions.py``) and the playground
page (``playground/``). The protocols' wire models are ``pcd_integrations/wire/``; what any server needs
to run (guards, operations, metrics, tracing, the background loader) is ``pcd_integrations/serving/``.

``create_app`` and ``serve`` are re-exported here, the path users import them from. FastAPI and uvicorn
(the ``http`` extra) are imported only when an app is built, so importing this package needs neither.
"""

from pcd_integrations.http.app import create_app, serve

__all__ = ["create_app", "serve"]
