"""Plain generation for chat: messages in, text out, token by token, marked as generated.

This is what the adapters answer plain chat with (no schema, so nothing to decide). The messages are
rendered through the model's own chat template (``enable_thinking=False``); everything before the
last message is the *head*, prefilled once and kept in the engine's head cache, so a conversation
that grows by one turn, or many requests behind one system prompt, re-read only what is new. Tokens
come from the same ``Backend.grow`` primitive that generated open fields use (one row), greedily, so
a reply is deterministic. It stops at an end-of-turn token, a stop string or ``max_new_tokens``.
The prompt is read like any request (``read_path.read_prompt``) and each step is counted there too
(``read_path.read_step``), into the reply's ``Stats``, the record ``fill`` and ``decide`` return.
``tests/test_chatting.py`` checks the stream against ``generate`` and against a plain decode loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from pcd_core.backends.base import GrowStep, Prefix, Rows
from pcd_core.concurrency.pass_join import Ticket, run_step, submit_step
from pcd_core.cost import Meter
from pcd_core.errors import PromptError, ReplyTooLongError
from pcd_core.reading.generation import MAX_ROOM
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.read_path import ms_since, read_prompt, read_step
from pcd_core.request.limits import check_text
from pcd_core.result import Generation
from pcd_core.tokenizer import TextTokenizer

Message = dict[str, Any]


def as_messages(messages: str | Sequence[Message]) -> list[Message]:
    """A string is one user message; otherwise role/content dicts, checked here, not in the template."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError(f"message {index} must be a dict with a 'role' and a 'content'")
        content = message.get("content")
        if not isinstance(content, str):
            raise PromptError(f"message {index}: only text content is supported, got {type(content).__name__}")
        checked.append({"role": message["role"], "content": content})
    if not checked:
        raise PromptError("there are no messages to answer")
    return checked


def transcript(messages: Sequence[Message]) -> str:
    """A conversation as the input text of a fill or a decision (the engine writes its own prompt
    around it): one message alone is its text; several are ``role: text`` paragraphs, so that the
    decision can tell who said what, the latest tool result included. Empty turns are left out.
    """
    turns = [(str(m["role"]), str(m["content"])) for m in messages if m.get("content")]
    if len(turns) == 1:
        return turns[0][1]
    return "\n\n".join(f"{role}: {content}" for role, content in turns)


def chat_ids(
    tokenizer: TextTokenizer, messages: str | Sequence[Message], max_new_tokens: int, context_length: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of the head and of the whole prompt (tokenized in one piece) for a reply to
    ``messages``; refused, before any pass, when the reply could outgrow the model's context.
    """
    head_text, rest = render_chat(tokenizer, as_messages(messages))
    head_ids = tokenizer.encode_head(head_text)
    whole = tokenizer.encode_head(head_text + rest)
    if len(whole) + max_new_tokens > context_length:
        raise ReplyTooLongError(
            f"the messages take {len(whole)} tokens and up to {max_new_tokens} may be generated, over "
            f"the model's context of {context_length}; shorten them or lower max_new_tokens",
            prompt_tokens=len(whole),
            max_new_tokens=max_new_tokens,
            context_length=context_length,
        )
    return head_ids, whole


def render_chat(tokenizer: TextTokenizer, messages: list[Message]) -> tuple[str, str]:
    """The prompt split into (head, rest): the head ends where the last message's content starts.

    Each content goes into the template as a placeholder; only the template's own text is marked for
    control tokens (``TextTokenizer.mark_control_tokens``), so a typed ``<|im_end|>`` in a message is
    read as the characters it is, never as the end of a turn.
    """
    for index, message in enumerate(messages):
        check_text(message["content"], ("messages", index, "content"))
    slots = [f"\u27e6pcd:message{index}\u27e7" for index in range(len(messages))]
    marked = [{**message, "content": slot} for message, slot in zip(messages, slots)]
    if tokenizer.chat_template:
        try:
            rendered = tokenizer.apply_chat_template(
                marked, tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
        except Exception as error:  # jinja2's TemplateError: the template refuses these roles or their order
            raise PromptError(
                f"the model's chat template cannot render these messages ({type(error).__name__}: {error}); "
                "change their roles or order (many templates take one system message, first)"
            ) from error
        text = str(rendered)
    else:  # a base model: plain role-tagged turns, then the assistant's turn opened
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in marked) + "Assistant:"
    pieces: list[str] = []
    for slot, message in zip(slots, messages):
        if text.count(slot) != 1:
            raise PromptError("the chat template dropped or repeated a message")
        before, text = text.split(slot)
        pieces += [tokenizer.mark_control_tokens(before), message["content"]]
    head = "".join(pieces[:-1])
    return head, pieces[-1] + tokenizer.mark_control_tokens(text)


def stream_reply(
    model: LoadedModel,
    messages: str | Sequence[Message],
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    result: Generation,
) -> Iterator[str]:
    """A reply's text deltas (``Engine.stream``): the prompt read like any request
    (``read_path.read_prompt``: the head cache, then the rest, with room for the reply), then the steps
    (``stream_tokens``), each joined with other replies' steps waiting then (``model.steps``,
    ``pass_join.py``). ``result.stats`` holds the reply's cost so far at every step, and its
    ``total_ms`` once the reply ends or its consumer stops pulling.
    """
    started = time.perf_counter()
    head_ids, whole = chat_ids(model.tokenizer, messages, max_new_tokens, model.backend.context_length)
    meter = Meter()
    with model.lock.turn() as turn:
        prefix = read_prompt(model, head_ids, whole, meter, room=min(max_new_tokens, MAX_ROOM))
    meter.stats = replace(meter.stats, queue_ms=turn.queue_ms)
    try:
        yield from stream_tokens(model, prefix, max_new_tokens=max_new_tokens, stop=stop, result=result, meter=meter)
    finally:
        result.stats = replace(meter.stats, total_ms=ms_since(started))


def stream_tokens(
    model: LoadedModel,
    prefix: Prefix,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    result: Generation,
    meter: Meter,
) -> Iterator[str]:
    """Yield text deltas as tokens are chosen; ``result`` is filled in as they come, its ``stats``
    from ``meter`` (the prompt's read already in it) after every step.

    The model lock is taken per step, not for the whole reply, so a long stream does not starve other
    requests on the same engine. Each step is handed to ``steps`` before the lock is asked for, so
    that a pass starting meanwhile reads it with other replies' steps (``pass_join.py``); it is counted
    by ``read_path.read_step``: the time it waited for the lock, the pass it ran or shared, one step.
    """
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    backend, tokenizer, lock, steps = model.backend, model.tokenizer, model.lock, model.steps
    end_ids = set(tokenizer.eos_ids)
    rows: Rows | None = None
    new: tuple[int, ...] = ()
    shown = ""

    def step(ticket: Ticket[GrowStep, Rows] | None) -> np.ndarray | None:
        nonlocal rows
        if ticket is None:  # the prompt's pass gave the first token's log-probs
            return backend.next_logp(prefix)
        rows = run_step(backend, steps, ticket)
        return rows.logp[0]

    while True:
        # the first grow starts the reply's row (rows=None), so a backend keeps its KV from there on
        ticket = submit_step(steps, prefix, rows, [new]) if new else None
        try:
            # a step another reply's pass read needs the model no more: its wait ends there
            with lock.turn(served=ticket.served if ticket is not None else None) as turn:
                read = read_step(backend, meter, partial(step, ticket), turn.queue_ms)
        finally:
            if ticket is not None:
                steps.withdraw(ticket)
        assert read is not None  # the one row always has a new token here
        logp = read
        token = int(np.argmax(logp))
        if token in end_ids:
            result.finish_reason = "stop"
            return
        result.token_ids.append(token)
        meter.stats = replace(meter.stats, output_tokens=meter.stats.output_tokens + 1)
        result.stats = meter.stats
        result.logp_sum += float(logp[token]) if math.isfinite(logp[token]) else 0.0
        new = (token,)
        text = tokenizer.decode(result.token_ids)
        cut = _stop_at(text, stop)
        if cut is not None:
            delta, result.text, result.finish_reason = text[len(shown) : cut], text[:cut], "stop"
            if delta:
                yield delta
            return
        result.text = text
        # hold back a half-written character and anything that may be the start of a stop string
        safe = len(text) - _held_back(text, stop)
        if safe > len(shown) and not text[:safe].endswith("\ufffd"):
            yield text[len(shown) : safe]
            shown = text[:safe]
        if result.stats.output_tokens >= max_new_tokens:
            result.finish_reason = "length"
            if shown != text:
                yield text[len(shown) :]
            return


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None
