"""Fair model access (``pcd_core/concurrency/model_lock.py``): first come first served, handed over between passes.

The lock's order is checked with plain threads. On the real model, the test thread holds the
engine's lock while a long request and then a short one queue behind it, and lets go: the short one
must finish first (an order, not a timing), each request must count only its own passes, and both
answers must equal those of the same calls made one after the other.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from pcd_core import Cancelled
from pcd_core.concurrency.model_lock import Cancellation, ModelLock, cancellable, run_cancellable

STATE = "The invoice for March was charged twice. Please refund the duplicate and confirm by email."
LONG_QUESTIONS = {
    f"q{i}": {"type": "noul", "instructions": text}
    for i, text in enumerate(
        [
            "Does the customer ask for money back?",
            "Is the customer angry?",
            "Is this about an invoice?",
            "Does the message mention email?",
            "Is the message spam?",
            "Does the customer threaten to cancel?",
        ]
    )
}
SHORT_STATE = "The app crashes when I open the camera."
SHORT_QUESTIONS = {"bug": {"type": "noul", "instructions": "Does the message report a software bug?"}}


class Note(BaseModel):
    urgent: bool = Field(description="Whether it must be handled today")
    topic: Literal["BILLING", "TECHNICAL"]
    summary: str = Field(max_length=40, description="One short sentence")


def wait_until(condition: Any, what: str, deadline_s: float = 120.0) -> None:
    """Poll ``condition`` until it holds; a deadline, so that a broken lock fails instead of hanging."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.005)


def run_queued(lock: ModelLock, calls: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Queue ``calls`` behind a held ``lock`` in their order, let go, and record the finishing order."""
    finished: list[str] = []
    results: dict[str, Any] = {}

    def run(name: str, call: Any) -> None:
        results[name] = call()
        finished.append(name)

    threads = []
    with lock:
        for queued, (name, call) in enumerate(calls.items(), start=1):
            thread = threading.Thread(target=run, args=(name, call))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=queued: lock.waiting == n, f"{name!r} waits for the model")
    for thread in threads:
        thread.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    return finished, results


# -- the lock, with threads only ------------------------------------------------------------------
def test_waiting_threads_get_the_model_in_arrival_order():
    lock = ModelLock()
    order: list[int] = []

    def take(index: int) -> None:
        with lock:
            order.append(index)

    finished, _ = run_queued(lock, {str(i): (lambda i=i: take(i)) for i in range(5)})
    assert order == [0, 1, 2, 3, 4] and finished == ["0", "1", "2", "3", "4"]


def queue_waiter(lock: ModelLock, position: int = 1) -> tuple[threading.Thread, threading.Event]:
    """A thread queued for ``lock`` (held by the caller) at ``position`` (counting from 1) that sets
    its event once it gets it.
    """
    ran = threading.Event()

    def waiter() -> None:
        with lock:
            ran.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: lock.waiting == position, "the waiter queues")
    return thread, ran


def test_an_offer_hands_over_to_a_waiter_and_comes_back():
    lock = ModelLock()
    with lock:
        assert lock.offer() == 0.0  # nobody waits: the holder keeps the model
        thread, ran = queue_waiter(lock)
        waited = lock.offer()
        assert ran.is_set() and waited > 0.0  # the waiter ran inside the offer, then the holder came back
    thread.join(timeout=60)


def test_a_nested_hold_never_hands_over():
    lock = ModelLock()
    with lock:
        thread, ran = queue_waiter(lock)
        with lock:  # reentrant: the same thread takes it again at once
            assert lock.offer() == 0.0 and not ran.is_set()
        assert not ran.is_set()  # the outer hold still has it
    thread.join(timeout=60)
    assert ran.is_set()


def test_release_by_a_thread_that_does_not_hold_the_lock_is_refused():
    lock = ModelLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_model():
    lock = ModelLock()
    token = Cancellation()
    outcome: list[object] = []

    def cancelled_waiter() -> None:
        try:
            with cancellable(token), lock.turn():
                outcome.append("ran")
        except Cancelled as error:
            outcome.append(error)

    with lock:
        thread = threading.Thread(target=cancelled_waiter)
        thread.start()
        wait_until(lambda: lock.waiting == 1, "the waiter queues")
        second, ran = queue_waiter(lock, position=2)
        token.cancel("the client went away")
        thread.join(timeout=60)
        assert lock.waiting == 1  # only the second waiter is left, while the holder still has the model
    second.join(timeout=60)
    assert ran.is_set()
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled) and "client went away" in str(outcome[0])
    assert not lock.holds() and lock.waiting == 0


def test_a_cancelled_turn_stops_at_its_next_pause_and_gives_the_model_back():
    lock = ModelLock()
    token = Cancellation()
    reached: list[int] = []
    with pytest.raises(Cancelled), cancellable(token), lock.turn() as turn:
        for boundary in range(5):
            reached.append(boundary)
            if boundary == 2:
                token.cancel()
            turn.pause()
    assert reached == [0, 1, 2] and not lock.holds()


# -- the engine, on the real model ----------------------------------------------------------------
@pytest.fixture
def one_row_per_pass(engine):
    """Every row in a pass of its own, so that a request has many pass boundaries."""
    saved = engine.backend.max_tokens_per_pass
    engine.backend.max_tokens_per_pass = 1
    yield engine
    engine.backend.max_tokens_per_pass = saved


def test_a_short_decide_behind_a_long_one_finishes_first_with_the_sequential_answers(one_row_per_pass):
    engine = one_row_per_pass
    engine.decide(SHORT_STATE, SHORT_QUESTIONS)  # the shared head is cached from here on
    long_alone = engine.decide(STATE, LONG_QUESTIONS)
    short_alone = engine.decide(SHORT_STATE, SHORT_QUESTIONS)
    assert long_alone.stats.forward_passes > short_alone.stats.forward_passes + 1
    assert long_alone.stats.queue_ms == short_alone.stats.queue_ms == 0.0  # nobody was in the way

    finished, results = run_queued(
        engine.model.lock,
        {
            "long": lambda: engine.decide(STATE, LONG_QUESTIONS),
            "short": lambda: engine.decide(SHORT_STATE, SHORT_QUESTIONS),
        },
    )
    assert finished == ["short", "long"]
    print(
        {
            name: (r.stats.forward_passes, round(r.stats.queue_ms), round(r.stats.total_ms))
            for name, r in results.items()
        }
    )
    for name, alone in (("long", long_alone), ("short", short_alone)):
        together = results[name]
        assert together.answers == alone.answers, name  # to 0.0: the same passes read the same tensors
        assert together.stats.forward_passes == alone.stats.forward_passes, name  # its own passes only
        assert together.stats.row_tokens == alone.stats.row_tokens, name
        assert together.stats.queue_ms > 0.0, name
        assert together.to_wire()["x_queue_ms"] == together.stats.queue_ms


def test_a_decide_behind_a_fill_with_an_open_field_runs_between_its_generation_steps(engine):
    engine.warmup(Note)
    fill_alone = engine.fill(Note, STATE)
    short_alone = engine.decide(SHORT_STATE, SHORT_QUESTIONS)
    assert fill_alone.stats.open_steps > 2

    finished, results = run_queued(
        engine.model.lock,
        {"fill": lambda: engine.fill(Note, STATE), "short": lambda: engine.decide(SHORT_STATE, SHORT_QUESTIONS)},
    )
    assert finished == ["short", "fill"]
    together = results["fill"]
    assert together.value == fill_alone.value
    assert {n: r.to_dict() for n, r in together.fields.items()} == {
        n: r.to_dict() for n, r in fill_alone.fields.items()
    }
    assert together.stats.forward_passes == fill_alone.stats.forward_passes
    assert results["short"].answers == short_alone.answers
    assert together.stats.queue_ms > 0.0 and results["short"].stats.queue_ms > 0.0


# -- every protocol reports the wait ------------------------------------------------------------
HELLO = [{"role": "user", "content": "Say hello."}]


def _last_reply(engine: Any, body: dict[str, Any]) -> Any:
    from pcd_integrations.http.chat_completions import reply_steps
    from pcd_integrations.wire.chat import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": engine.model_name, "max_tokens": 4, **body})
    *_, reply = reply_steps(engine, request)
    return reply


def test_chat_replies_behind_a_busy_model_report_their_wait_on_the_wire(engine):
    schema = {"type": "json_schema", "json_schema": {"name": "Note", "schema": Note.model_json_schema()}}
    refund = {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund a duplicate payment.",
            "parameters": {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"]},
        },
    }
    bodies = {
        "generated": {"messages": HELLO},
        "filled": {"messages": [{"role": "user", "content": STATE}], "response_format": schema},
        "tool_call": {"messages": [{"role": "user", "content": STATE}], "tools": [refund], "tool_choice": "required"},
    }
    for body in bodies.values():  # heads cached, so that the runs below read the same passes
        _last_reply(engine, body)
    alone = {name: _last_reply(engine, body) for name, body in bodies.items()}
    generation_alone = engine.generate(HELLO, max_new_tokens=4)
    calls: dict[str, Any] = {name: (lambda body=body: _last_reply(engine, body)) for name, body in bodies.items()}
    calls["generate"] = lambda: engine.generate(HELLO, max_new_tokens=4)
    _, results = run_queued(engine.model.lock, calls)

    assert generation_alone.queue_ms == 0.0
    assert results["generate"].text == generation_alone.text
    assert results["generate"].queue_ms > 0.0  # it queued behind the test's hold and the three replies
    for name, reply in alone.items():
        together = results[name]
        assert (reply.pcd.method, together.pcd.method) == (name, name)
        assert reply.pcd.queue_ms == 0.0, name
        assert together.pcd.queue_ms > 0.0, name
        assert (together.content, together.pcd.forward_passes) == (reply.content, reply.pcd.forward_passes), name


# -- cancellation on the real model -------------------------------------------------------------
def run_until_cancelled(engine: Any, call: Any, after_passes: int) -> tuple[object, int]:
    """Run ``call`` in a thread under a cancellation that is set once the backend has read
    ``after_passes`` more passes; returns what the call raised or returned and the passes it read.
    """
    token = Cancellation()
    outcome: list[object] = []
    before = engine.backend.forward_passes

    def run() -> None:
        try:
            outcome.append(run_cancellable(token, call))
        except Cancelled as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: engine.backend.forward_passes >= before + after_passes or not thread.is_alive(), "passes run")
    token.cancel("the client went away")
    thread.join(timeout=600)
    assert not thread.is_alive()
    return outcome[0], engine.backend.forward_passes - before


@pytest.mark.parametrize("kind", ["generate", "fill"])
def test_a_cancelled_request_stops_at_its_next_pass_and_the_model_is_free(engine, kind):
    """Cancelled after 3 passes of a 200-step reply (or of a fill's generation steps), the request
    raises ``Cancelled`` within a pass or two; the next request finds the model free (no wait) and
    answers as it does alone.
    """
    engine.decide(SHORT_STATE, SHORT_QUESTIONS)  # the shared head cached
    short_alone = engine.decide(SHORT_STATE, SHORT_QUESTIONS)
    story = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 400}}, "required": ["story"]}
    calls = {
        "generate": lambda: engine.generate("Write a long story about a lighthouse.", max_new_tokens=200),
        "fill": lambda: engine.fill(story, STATE, max_new_tokens={"story": 200}),
    }
    outcome, passes = run_until_cancelled(engine, calls[kind], after_passes=3)
    assert isinstance(outcome, Cancelled), outcome
    assert 3 <= passes <= 6, passes  # stopped at the boundary after the cancel, of up to 200 steps
    assert not engine.model.lock.holds() and engine.model.lock.waiting == 0
    after = engine.decide(SHORT_STATE, SHORT_QUESTIONS)
    assert after.stats.queue_ms == 0.0 and after.answers == short_alone.answers
