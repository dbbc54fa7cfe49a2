"""The HTTP server's errors: ``ApiError``, the error bodies of System One and of OpenAI, and how an
engine error caused by a request becomes a 4xx pointed at the part of the body it is about.

``pcd_integrations/http/app.py`` raises ``ApiError`` from its routes and renders it in the protocol of the
route (System One 422 ``{"detail": [{"loc", "msg", "type"}]}`` or ``{"detail": {"error_type",
"message"}}``; OpenAI 400 ``{"error": {"message", "type", "param", "code"}}``). Every text in an error
may come from the request, so bodies pass through ``wire_safe`` before they are encoded.
``tests/test_http.py``, ``tests/test_decisions_api.py`` and ``tests/test_hardening_servers.py`` check
the shapes through real clients.
"""

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from pcd_core import LimitError, PcdError, PromptError, RequestError, SchemaError, TextError, TokenizationError
from pcd_integrations.wire import chat, decisions
from pcd_integrations.wire.errors import openai_error_body

# Engine errors that mean "this request cannot be answered", by their System One detail type; any
# other PcdError that is not a BackendError is the caller's too, typed by its class name.
_REQUEST_ERRORS = (
    (TextError, "text_error"),
    (LimitError, "limit_error"),
    (RequestError, "request_error"),
    (PromptError, "prompt_error"),
    (TokenizationError, "tokenization_error"),
    (SchemaError, "schema_error"),
)
#: The parts of an error location that are a path in an OpenAI body (the rest are union tags).
_OPENAI_FIELDS = decisions.FIELD_NAMES | chat.FIELD_NAMES


class ValidationErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """A request the server will not run: HTTP 422."""

    detail: list[ValidationErrorItem]


class ErrorInfo(BaseModel):
    error_type: str
    message: str


class ErrorBody(BaseModel):
    """Every error that is not a validation error: 401, 404, 503, 500."""

    detail: ErrorInfo


class ApiError(Exception):
    """An error the server reports in the protocol's shape; ``loc`` points into the body."""

    def __init__(
        self,
        status_code: int,
        error_type: str,
        message: str,
        headers: dict[str, str] | None = None,
        loc: Sequence[str | int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = headers
        self.loc = list(loc) if loc is not None else None


def wire_safe(value: Any) -> Any:
    """Lone surrogates written as escapes, everywhere in a JSON value: a response must always encode."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {wire_safe(k): wire_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [wire_safe(v) for v in value]
    return value


def request_error(error: PcdError, where: dict[str, str | int], state_field: str) -> ApiError:
    """An engine error caused by the request, pointed at the part of the body it is about.

    ``where`` maps each engine question id to its place in the body's ``questions`` (empty: the
    route has no questions, and a schema error points at the body). A request the question models
    refused keeps pydantic's first location; bad text names where it is.
    """
    if isinstance(error, RequestError) and error.errors:
        first = error.errors[0]
        return ApiError(
            422, str(first.get("type", "request_error")), str(first.get("msg", error)), loc=["body", *first["loc"]]
        )
    if isinstance(error, TextError):
        return ApiError(422, "text_error", str(error), loc=["body", *error.loc])
    if isinstance(error, LimitError):
        loc: list[str | int] = ["body"]
    elif isinstance(error, PromptError):
        loc = ["body", state_field]
    elif where:
        field = getattr(error, "field", None)
        loc = ["body", "questions", where[field]] if field in where else ["body", "questions"]
    else:
        loc = ["body"]
    kind = next((name for cls, name in _REQUEST_ERRORS if isinstance(error, cls)), None)
    kind = kind or re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower().removesuffix("_error") + "_error"
    return ApiError(422, kind, str(error), loc=loc)


def openai_param(loc: Sequence[str | int]) -> str | None:
    """``["body", "questions", 0, "choices"]`` as OpenAI writes it: ``questions[0].choices``."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _OPENAI_FIELDS:
            param += f".{part}"
    return param.lstrip(".") or None


def openai_error(status_code: int, error_type: str, message: str, loc: Sequence[str | int] | None) -> dict[str, Any]:
    return openai_error_body(status_code, error_type, message, openai_param(loc or []))
