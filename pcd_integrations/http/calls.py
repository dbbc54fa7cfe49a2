"""How the HTTP routes reach the engine: the loaded engine or a 503, the requested model checked, one
blocking call in a worker thread that stops when its client goes, and a reply streamed as events.

Engine errors a request caused become 4xx ``ApiError``s pointed into the body (``errors.py``);
a backend failure is a 500 and a remote model server's a 502, each in the route's error shape.
``pcd_integrations/http/app.py`` calls these from its routes; ``tests/test_http.py`` (errors, a model
still loading) and ``tests/test_fairness.py`` (a request whose client goes away stops at its next
pass) cover them.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from pcd_core import BackendError, Cancellation, Cancelled, DecideResponse, Engine, PcdError, UpstreamError
from pcd_core.concurrency.model_lock import in_worker
from pcd_integrations.http.errors import ApiError, openai_error, request_error, wire_safe
from pcd_integrations.serving.engine_loader import EngineLoader
from pcd_integrations.serving.threads import iterate_in_thread
from pcd_integrations.wire import accepts_model
from pcd_integrations.wire.chat_reply import ChatCompletionChunk

if TYPE_CHECKING:
    from fastapi import Request

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def served_engine(loader: EngineLoader) -> Engine:
    """The engine, or a 503 that says whether it is still loading or failed to."""
    if loader.engine is not None:
        return loader.engine
    if loader.status == "error":
        raise ApiError(503, "model_load_failed", f"the model failed to load: {loader.error}")
    raise ApiError(503, "model_loading", "the model is still loading; retry shortly", headers={"Retry-After": "1"})


def check_model(requested: str | None, loader: EngineLoader, loc: str, aliases: frozenset[str] = frozenset()) -> None:
    """404 for a request that names a model this server does not serve; ``aliases`` are names the
    route's protocol reserves for whatever model the server serves (``wire.JEV_ALIASES``).
    """
    served = loader.model_name
    if served is not None and not accepts_model(requested, served, aliases):
        message = f"the model {requested!r} is not served here; this server answers with {served!r}"
        raise ApiError(404, "model_not_found", message, loc=["body", loc])


#: how often a running request looks whether its client is still there (a pass takes longer)
DISCONNECT_POLL_S = 0.1


async def _cancel_on_disconnect(request: "Request", token: Cancellation) -> None:
    """Set ``token`` once the client of ``request`` has gone; runs until it has, or is cancelled."""
    while not token.cancelled:
        if await request.is_disconnected():
            token.cancel("the client closed the connection")
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def in_engine(call: Callable[[], _T], where: dict[str, str | int], state_field: str, request: "Request") -> _T:
    """One blocking engine call in a worker thread; caller errors become 422s pointed into the body.

    The call runs under a ``Cancellation`` that is set when the client disconnects, or when this
    coroutine itself is cancelled (a dropped stream, a stopping server), so that the engine stops at
    its next pass boundary instead of computing an answer nobody reads (``pcd_core/concurrency/model_lock.py``).
    """
    token = Cancellation()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, token))
    try:
        return await in_worker(call, token, "the request was abandoned")
    except Cancelled as error:  # nobody reads this answer; it is shaped for the log and the tests
        logger.info("stopped a request whose client went away: %s", error)
        raise ApiError(499, "client_closed_request", str(error)) from error
    except PcdError as error:
        if isinstance(error, UpstreamError):  # the remote model server's fault: a bad gateway, not ours
            logger.error("the model server failed a valid request: %s", error)
            raise ApiError(502, "upstream_error", str(error)) from error
        if isinstance(error, BackendError):
            logger.exception("the engine failed on a valid request")
            raise ApiError(500, "backend_error", f"{type(error).__name__}: {error}") from error
        raise request_error(error, where, state_field) from error
    except Exception as error:  # a server fault, reported in the error shape, never as bare text
        logger.exception("the engine failed on a valid request")
        raise ApiError(500, "internal_error", f"{type(error).__name__}: {error}") from error
    finally:
        watcher.cancel()


async def decide(
    loader: EngineLoader,
    state: Any,
    questions: dict[str, Any],
    state_field: str,
    where: dict[str, str | int],
    request: "Request",
    **context: Any,
) -> DecideResponse:
    """The one engine call behind both decision routes; ``context`` is ``Engine.decide``'s
    ``context`` and ``cache_key`` (OpenAI's earlier input items and ``prompt_cache_key``).
    """
    engine = served_engine(loader)
    return await in_engine(lambda: engine.decide(state, questions, **context), where, state_field, request)


async def server_sent(events: Iterator[ChatCompletionChunk]) -> AsyncIterator[str]:
    """Each chunk as a server-sent event, produced in a worker thread, then ``data: [DONE]``.

    The status line is sent by now, so a failure past this point is an error event in OpenAI's shape
    (the ``openai`` SDK raises it as an ``APIError``), never a cut-off stream.
    """
    try:
        async for event in iterate_in_thread(events):
            yield f"data: {json.dumps(event.model_dump(mode='json'), ensure_ascii=False)}\n\n"
    except Exception as error:  # the request was valid (its first step ran before the stream began)
        logger.exception("the engine failed while streaming a reply")
        body = openai_error(500, "stream_error", f"{type(error).__name__}: {error}", None)
        yield f"data: {json.dumps(wire_safe(body))}\n\n"
        return
    yield "data: [DONE]\n\n"
