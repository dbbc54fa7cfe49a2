"""A real ``pcd serve`` app on a loopback socket for real HTTP clients (``pcd_integrations/serving/loopback.py``:
the ``openai`` SDK talks over its own HTTP stack, so its tests need a listening server rather than an
in-process transport), and the check of an OpenAI error as the SDK raises it, shared by the OpenAI
routes' tests.
"""

from __future__ import annotations

from typing import Any

from pcd_integrations.serving.loopback import serving

__all__ = ["assert_openai_bad_request", "serving"]


def assert_openai_bad_request(error: Any, param: str, words: str) -> None:
    """``error`` is the SDK's ``BadRequestError`` for OpenAI's 400 body, pointing at ``param`` and saying ``words``."""
    assert error.status_code == 400 and error.type == "invalid_request_error", error.body
    assert error.param == param and words in error.message, error.body
    assert set(error.body) == {"message", "type", "param", "code"} and error.code
