"""LlamaIndex prompts and messages as the engine's input text: the one translation every LlamaIndex
class here shares.

The engine writes its own instructions and value catalog around the text it reads, so a prompt or a
chat history becomes the *input*, not the model's whole prompt. Non-text blocks (images, documents)
raise `PromptError`: dropping them would answer on less than the caller sent. ``PCDProgram``
(``program.py``) and ``PCDLLM``'s tool turns (``llm.py``) read through it;
``tests/test_llama_index.py`` checks the formatting and the refusal on the embedded model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pcd_core import BackendUnavailableError, PromptError

try:
    from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock
    from llama_index.core.prompts import BasePromptTemplate
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

from pcd_core.reading.chatting import transcript

__all__ = ["engine_content", "messages_to_text", "prompt_to_text"]


def _text_of(message: ChatMessage) -> str:
    """A message's text; non-text blocks raise `PromptError` (dropping them would answer on less)."""
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise PromptError(
                f"a {message.role.value} message holds a {type(block).__name__}; the PCD engine "
                "reads text only, so pass the text (for example a document's .text) instead"
            )
    return message.content or ""


def prompt_to_text(prompt: BasePromptTemplate, prompt_args: Mapping[str, Any], system_prompt: str | None = None) -> str:
    """Format a LlamaIndex prompt into the input text the engine reads.

    The engine writes its own instructions and value catalog around this text, so the prompt is the
    input, not the model's whole prompt. One message is passed as it is; several keep their roles as
    ``role: text`` paragraphs, so that a system instruction is still told apart from the document.
    Images and other non-text blocks raise `PromptError`.
    """
    messages = prompt.format_messages(**prompt_args)
    if system_prompt:
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=system_prompt), *messages]
    return messages_to_text(messages)


def messages_to_text(messages: Sequence[ChatMessage]) -> str:
    """Messages as the input text of a fill or a decision: one alone as it is, else ``role: text``."""
    return transcript([{"role": message.role.value, "content": engine_content(message)} for message in messages])


def engine_content(message: ChatMessage) -> str:
    """The message's text; an assistant turn that only called tools is shown as its calls, so that
    the next turn reads what was done rather than an empty reply.
    """
    text = _text_of(message)
    calls = message.additional_kwargs.get("tool_calls") if message.role == MessageRole.ASSISTANT else None
    if not text and calls:
        return json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
    return text
