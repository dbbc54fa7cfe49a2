"""Concurrent replies share passes (``pcd_core/concurrency/pass_join.py``) on the real SmolLM2-135M, torch backend.

Each reply read concurrently must be the reply read alone (the same tokens, the same log-probs to
float rounding, the same passes charged to it), while the engine runs fewer passes than the replies
one after another; a step another reply's pass read is charged to its own reply; a withdrawn step is
never read; a step that cannot be read fails its own reply only; a reply cancelled while others run
leaves them as they were. Concurrent closed fills of one schema share passes too, each read as
alone, and one cancelled while it waits leaves the others' joined read as it was.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, Field

from pcd_core.concurrency.model_lock import Cancellation, cancellable
from pcd_core.concurrency.pass_join import PassJoin, run_step, step_join, submit_step
from pcd_core.errors import BackendError, Cancelled
from pcd_core.request.questions import distribution

PROMPTS = [
    "Tell me a short fact about the number 7.",
    "Write one sentence about the sea.",
    "What is a good name for a cat?",
    "Say hello in French, then in German, and explain which is more polite.",
    "List three colours.",
    "Why is the sky blue?",
]
NEW_TOKENS = 12


def run_threads(calls):
    """Run every call in a thread of its own, released together; their results in order."""
    results = [None] * len(calls)
    errors = []
    start = threading.Barrier(len(calls))

    def run(k):
        start.wait()
        try:
            results[k] = calls[k]()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def test_concurrent_replies_read_as_alone_in_fewer_passes(engine):
    engine.generate(PROMPTS[0], max_new_tokens=1)  # the chat head cached, so every reply below finds it
    alone = [engine.generate(prompt, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS]
    passes = engine.backend.forward_passes
    together = run_threads([lambda p=prompt: engine.generate(p, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS])
    spent = engine.backend.forward_passes - passes
    for solo, joined in zip(alone, together, strict=True):
        assert joined.token_ids == solo.token_ids and joined.text == solo.text
        assert joined.logp_sum == pytest.approx(solo.logp_sum, abs=1e-3)
        # each step is one pass to its reply, whether it ran it or shared another reply's
        assert joined.stats.forward_passes == solo.stats.forward_passes
        assert joined.stats.open_steps == solo.stats.open_steps
    assert spent < sum(solo.stats.forward_passes for solo in alone)


def test_concurrent_fills_open_fields_and_a_reply_share_steps_and_read_as_alone(engine):
    class Note(BaseModel):
        urgent: bool
        summary: str = Field(max_length=60)

    texts = ["The heater sparks when I plug it in.", "Where is order 1182? It is two weeks late."]
    engine.warmup(Note)
    engine.generate(PROMPTS[0], max_new_tokens=1)
    alone = [engine.fill(Note, text) for text in texts]
    reply = engine.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS)
    passes = engine.backend.forward_passes
    calls = [lambda t=text: engine.fill(Note, t) for text in texts]
    *together, joined_reply = run_threads([*calls, lambda: engine.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS)])
    spent = engine.backend.forward_passes - passes
    for solo, joined in zip(alone, together, strict=True):
        assert joined.values == solo.values
        assert joined.fields["urgent"].probability == pytest.approx(solo.fields["urgent"].probability, abs=1e-5)
        assert joined.stats.forward_passes == solo.stats.forward_passes
        assert joined.stats.open_steps == solo.stats.open_steps
    assert joined_reply.token_ids == reply.token_ids
    assert spent < sum(solo.stats.forward_passes for solo in alone) + reply.stats.forward_passes


def test_a_joined_pass_takes_waiting_work_oldest_first_while_its_tokens_fit():
    ran = []

    def run_many(works):
        ran.append(list(works))
        return [work * 10 for work in works]

    join = PassJoin(run_many=run_many, run_alone=lambda work, _: run_many([work])[0], budget=lambda: (100, None))
    own, fits, over, small = (join.submit(k, None, tokens) for k, tokens in ((1, 60), (2, 40), (3, 1), (4, 1)))
    assert join.run(own) == 10 and ran == [[1, 2]]
    assert fits.done and not over.done and not small.done  # the first that does not fit closes the pass
    assert join.run(over) == 30 and ran[-1] == [3, 4]


def test_a_step_read_by_another_replys_pass_is_charged_to_its_own_reply(engine):
    backend = engine.backend
    steps = step_join(backend)
    first = backend.prefill(engine.tokenizer.encode("The weather today is"))
    second = backend.prefill(engine.tokenizer.encode("My favourite food is a bowl of"))
    want = [backend.grow(first, None, [(11,)]).logp[0], backend.grow(second, None, [(12,), (13,)]).logp]
    ours, theirs = submit_step(steps, first, None, [(11,)]), submit_step(steps, second, None, [(12,), (13,)])
    passes = backend.forward_passes
    mine = backend.counter.mine().forward_passes
    rows = run_step(backend, steps, ours)
    assert backend.forward_passes - passes == 1 and theirs.done
    assert backend.counter.mine().forward_passes - mine == 1
    np.testing.assert_allclose(rows.logp[0], want[0], atol=1e-4)

    charged = []

    def collect():
        before = backend.counter.mine().forward_passes
        read = run_step(backend, steps, theirs)
        charged.append((backend.counter.mine().forward_passes - before, read))

    thread = threading.Thread(target=collect)
    thread.start()
    thread.join()
    assert backend.forward_passes - passes == 1  # read from the shared pass: no pass of its own
    ((n_passes, read),) = charged
    assert n_passes == 1
    for got, expected in zip(read.logp, want[1], strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_a_withdrawn_step_is_not_read(engine):
    backend = engine.backend
    steps = step_join(backend)
    prefix = backend.prefill(engine.tokenizer.encode("One, two, three,"))
    kept, withdrawn = submit_step(steps, prefix, None, [(5,)]), submit_step(steps, prefix, None, [(6,)])
    steps.withdraw(withdrawn)
    run_step(backend, steps, kept)
    assert kept.done and not withdrawn.done and withdrawn.result is None


def test_a_step_that_cannot_be_read_fails_its_own_reply_only(engine):
    backend = engine.backend
    steps = step_join(backend)
    prefix = backend.prefill(engine.tokenizer.encode("Count with me:"))
    one_row = backend.grow(prefix, None, [(5,)])
    wrong = submit_step(steps, prefix, one_row, [(6,), (7,)])  # two rows' tokens for one row
    fine = submit_step(steps, prefix, None, [(5,)])
    with pytest.raises(BackendError, match="2 extensions for 1 rows"):
        run_step(backend, steps, wrong)
    assert fine.done and fine.error is None
    np.testing.assert_allclose(
        run_step(backend, steps, fine).logp[0], backend.grow(prefix, None, [(5,)]).logp[0], atol=1e-4
    )


def test_a_reply_cancelled_while_others_run_leaves_them_as_alone(engine):
    alone = [engine.generate(prompt, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS[:3]]
    token = Cancellation()
    started = threading.Event()

    def cancelled_reply():
        with cancellable(token):
            for count, _ in enumerate(engine.stream("Tell me a very long story about a dragon.", max_new_tokens=64)):
                if count == 2:
                    started.set()
        return "finished"

    def cancel():
        started.wait()
        token.cancel("the client went away")

    outcome = []

    def guarded():
        try:
            outcome.append(cancelled_reply())
        except Cancelled as error:
            outcome.append(error)

    canceller = threading.Thread(target=cancel)
    canceller.start()
    calls = [guarded] + [lambda p=prompt: engine.generate(p, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS[:3]]
    together = run_threads(calls)[1:]
    canceller.join()
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    for solo, joined in zip(alone, together, strict=True):
        assert joined.token_ids == solo.token_ids
    assert engine.waiting == 0


STATES = [
    "My kettle sparks when I plug it in and the cable got hot.",
    "The parcel came two days late but everything works.",
    "Please cancel my subscription, I am moving abroad.",
    "The heater smells of burning plastic after ten minutes.",
    "Can I change the colour of the lamp I ordered yesterday?",
]
QUESTIONS = {
    "hazard": {"type": "noul", "instructions": "Does the customer report a safety hazard?"},
    "team": {"type": "choice", "instructions": "Who should answer?", "criteria": {"safety": None, "billing": None}},
}


def test_concurrent_decides_read_as_alone_in_fewer_passes(engine):
    engine.decide(STATES[0], QUESTIONS)  # head cached and priors measured, as every decide below finds them
    alone = [engine.decide(state, QUESTIONS) for state in STATES]
    passes = engine.backend.forward_passes
    together = run_threads([lambda s=state: engine.decide(s, QUESTIONS) for state in STATES])
    spent = engine.backend.forward_passes - passes
    for solo, joined in zip(alone, together, strict=True):
        for qid in QUESTIONS:
            want, got = solo.answers[qid], joined.answers[qid]
            assert getattr(got, "choice", None) == getattr(want, "choice", None)
            assert distribution(got) == pytest.approx(distribution(want), abs=1e-5)
            assert got.candidate_mass == pytest.approx(want.candidate_mass, abs=1e-5)
        assert joined.stats.forward_passes == solo.stats.forward_passes == 1
    assert spent < len(STATES)


class Triage(BaseModel):
    """A closed schema: every field is decided, none generated, so concurrent fills of it join."""

    urgent: bool
    team: Literal["safety", "billing", "shipping", "accounts"]
    mood: Literal["calm", "annoyed", "angry"]


class Flag(BaseModel):
    spam: bool


def same_fill(joined, solo):
    assert joined.values == solo.values
    for name, field_result in solo.fields.items():
        assert joined.fields[name].probability == pytest.approx(field_result.probability, abs=1e-5)
        assert joined.fields[name].candidate_mass == pytest.approx(field_result.candidate_mass, abs=1e-5)
    assert joined.stats.forward_passes == solo.stats.forward_passes


def test_concurrent_closed_fills_read_as_alone_in_fewer_passes(engine):
    engine.warmup(Triage)
    engine.warmup(Flag)
    alone = [engine.fill(Triage, state) for state in STATES]
    flag_alone = engine.fill(Flag, STATES[2])
    passes = engine.backend.forward_passes
    calls = [lambda s=state: engine.fill(Triage, s) for state in STATES]
    *together, flag = run_threads([*calls, lambda: engine.fill(Flag, STATES[2])])  # another schema: its own pass
    spent = engine.backend.forward_passes - passes
    for solo, joined in zip(alone, together, strict=True):
        same_fill(joined, solo)
    same_fill(flag, flag_alone)
    assert spent < sum(solo.stats.forward_passes for solo in alone) + flag_alone.stats.forward_passes


def test_a_fill_cancelled_while_waiting_leaves_the_joined_fills_as_alone(engine):
    engine.warmup(Triage)
    alone = [engine.fill(Triage, state) for state in STATES[:3]]
    token = Cancellation()
    results, outcome = [None] * 3, []

    def fill(k):
        results[k] = engine.fill(Triage, STATES[k])

    def cancelled():
        try:
            with cancellable(token):
                outcome.append(engine.fill(Triage, STATES[4]))
        except Cancelled as error:
            outcome.append(error)

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(3)] + [threading.Thread(target=cancelled)]
    with engine.model.lock:  # every fill queues behind this hold, its work submitted
        for thread in threads:
            thread.start()
        while engine.waiting < len(threads):
            time.sleep(0.01)
        token.cancel("the client went away")
        while engine.waiting > len(threads) - 1:
            time.sleep(0.01)
        passes = engine.backend.forward_passes
    for thread in threads:
        thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    for solo, joined in zip(alone, results, strict=True):
        same_fill(joined, solo)
    assert engine.backend.forward_passes - passes == alone[0].stats.forward_passes  # one joined read for three
    assert engine.waiting == 0
