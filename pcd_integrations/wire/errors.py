"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for every OpenAI route.

One model for the routes (``pcd_integrations/http/app.py``) and for the body-size guard in front of them
(``pcd_integrations/serving/guards.py``), so that a 413 reads like every other OpenAI error.
``tests/test_chat_completions.py`` and ``tests/test_decisions_api.py`` read it through the real SDK.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """Every error of the OpenAI routes, as the ``openai`` SDK reads it into ``APIStatusError``."""

    error: OpenAIErrorInfo


def openai_error_body(status_code: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON body; ``type`` is OpenAI's: ``server_error`` for a 5xx, else ``invalid_request_error``."""
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    return OpenAIErrorBody(error=OpenAIErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()
