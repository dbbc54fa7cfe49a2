"""LangChain's standard chat-model suites on ChatPCD; ``GAPS`` below is our public list of gaps.

The unit suite passes in full. The integration suite runs on the embedded model through the shared
session engine; every test there is green, skipped by the suite for a feature we do not claim
(images, audio, PDFs, JSON mode, per-call model switching, VCR timing), or listed in ``GAPS`` as a
strict xfail: it must fail with exactly the error named, so a gap that closes shows up as XPASS.
The unit suite's ``test_serdes`` skips: ChatPCD is not lc-serializable, because langchain-core's
loader only rebuilds classes from its own registry.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from pcd_core import Engine
from pcd_integrations.langchain import ChatPCD

#: test name -> (why it fails, the exception it must fail with). Empty: every test that applies passes.
GAPS: dict[str, tuple[str, type[BaseException]]] = {}


def expected_failure(base_test: Callable[..., Any], reason: str, raises: type[BaseException]) -> Any:
    """The standard test itself, run unchanged, marked as a strict xfail that must raise ``raises``.

    ``functools.wraps`` keeps the signature and the suite's parametrize marks, so every variant
    still runs.
    """
    if inspect.iscoroutinefunction(base_test):

        @functools.wraps(base_test)
        async def test(self: Any, *args: Any, **kwargs: Any) -> None:
            await base_test(self, *args, **kwargs)

    else:

        @functools.wraps(base_test)
        def test(self: Any, *args: Any, **kwargs: Any) -> None:
            base_test(self, *args, **kwargs)

    return pytest.mark.xfail(reason=reason, raises=raises, strict=True)(test)


class TestChatPCDUnit(ChatModelUnitTests):
    """Construction, parameters, structured-output binding and serialization; no weights load."""

    @property
    def chat_model_class(self) -> type[ChatPCD]:
        return ChatPCD

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m"}


class TestChatPCDIntegration(ChatModelIntegrationTests):
    """The standard integration suite on the embedded model, sharing the session engine."""

    @pytest.fixture(autouse=True)
    def _shared_engine(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def chat_model_class(self) -> type[ChatPCD]:
        return ChatPCD

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.engine, "max_tokens": 48}

    @property
    def has_tool_calling(self) -> bool:
        """bind_tools: the tool is a PCD choice, its arguments a fill."""
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        """``method="json_mode"`` is served by the same fill, so the JSON always parses."""
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        """One ChatPCD is one loaded model; a per-call ``model=`` that differs raises ValueError."""
        return False


for _name, (_reason, _raises) in GAPS.items():
    setattr(
        TestChatPCDIntegration,
        _name,
        expected_failure(getattr(ChatModelIntegrationTests, _name), _reason, _raises),
    )
