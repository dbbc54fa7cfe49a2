"""A pass stopped inside (``pcd_core/backends/pass_stop.py``) on the real SmolLM2-135M, torch backend.

The cancellation is set from inside the pass itself, by a forward hook on one decoder layer, so where
the pass stops is an order of layers, not a timing: the layers that ran are counted by hooks on every
layer. A stopped decide and a reply stopped inside a generation step must leave the engine answering
the same and other requests as a freshly loaded engine does; a pass that carries two callers' work
(``pcd_core/concurrency/pass_join.py``) must run to its end when one of them is cancelled.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pcd_core import Cancelled, Engine
from pcd_core.backends.pass_stop import set_stopping_inside, stopping_inside
from pcd_core.concurrency.model_lock import Cancellation, cancellable, run_cancellable

STATE = "The invoice for March was charged twice. Please refund the duplicate and confirm by email."
OTHER_STATE = "The heater smells of burning plastic after ten minutes."
PROMPT = "Write a long story about a lighthouse."
OTHER_PROMPT = "List three colours."
#: the layer whose end sets the cancellation: the pass must stop before the next one
CANCEL_AT = 5


def questions(n: int, word: str) -> dict[str, Any]:
    return {f"q{k}": {"type": "noul", "instructions": f"Is the message about {word} {k}?"} for k in range(n)}


LONG = questions(8, "topic")
SHORT = {"hazard": {"type": "noul", "instructions": "Does the customer report a safety hazard?"}}


@pytest.fixture(scope="module")
def fresh() -> Engine:
    """A second engine on the same model, which never sees a stopped pass: the reference."""
    return Engine.load("smollm2-135m")


@contextmanager
def layer_log(engine: Engine, token: Cancellation | None = None, at_pass: int = 1) -> Iterator[list[list[int]]]:
    """The layers each pass of the block runs (a pass starts when layer 0 runs); with ``token``, it is
    set when layer ``CANCEL_AT`` of pass ``at_pass`` (1-based) has run.
    """
    passes: list[list[int]] = []

    def ran(index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if index == 0:
                passes.append([])
            passes[-1].append(index)
            if token is not None and index == CANCEL_AT and len(passes) == at_pass:
                token.cancel("the client went away")

        return hook

    layers = engine.backend.decoder.layers
    hooks = [layer.register_forward_hook(ran(i)) for i, layer in enumerate(layers)]
    try:
        yield passes
    finally:
        for hook in hooks:
            hook.remove()


def same_answers(got: Any, want: Any, tolerance: float = 1e-6) -> None:
    assert set(got.answers) == set(want.answers)
    for qid, answer in want.answers.items():
        assert got.answers[qid].noul == pytest.approx(answer.noul, abs=tolerance), qid
        assert got.answers[qid].candidate_mass == pytest.approx(answer.candidate_mass, abs=tolerance), qid


def test_a_cancellation_set_inside_a_long_pass_stops_it_before_its_next_layer(engine, fresh):
    """A warm decide of 8 questions is one pass of 30 layers; cancelled at the end of layer 6 it
    runs no seventh, raises ``Cancelled`` saying the pass was stopped inside, and gives the model
    back; the same decide and another then answer as on an engine that never stopped a pass.
    """
    assert stopping_inside()
    engine.decide(STATE, LONG)  # the head cached and the priors measured
    token = Cancellation()
    before = engine.backend.forward_passes
    with layer_log(engine, token) as passes, pytest.raises(Cancelled, match="stopped inside, before decoder layer 7"):
        run_cancellable(token, lambda: engine.decide(STATE, LONG))
    assert passes == [list(range(CANCEL_AT + 1))]
    assert engine.backend.forward_passes - before == 1
    assert not engine.model.lock.holds() and engine.model.lock.waiting == 0
    with layer_log(engine) as passes:
        again = engine.decide(STATE, LONG)
    assert passes == [list(range(engine.backend.n_layers))]
    same_answers(again, fresh.decide(STATE, LONG))
    same_answers(engine.decide(OTHER_STATE, SHORT), fresh.decide(OTHER_STATE, SHORT))


def test_with_the_check_off_the_same_cancellation_lets_the_pass_end(engine):
    """``set_stopping_inside(False)`` (what ``PCD_STOP_INSIDE_PASSES=0`` sets): the cancelled pass
    runs all its layers; a decide of one pass has no boundary after it, so it answers in full.
    """
    engine.decide(STATE, LONG)
    token = Cancellation()
    before = set_stopping_inside(False)
    try:
        with layer_log(engine, token) as passes:
            answered = run_cancellable(token, lambda: engine.decide(STATE, LONG))
    finally:
        set_stopping_inside(before)
    assert token.cancelled and passes == [list(range(engine.backend.n_layers))]
    assert set(answered.answers) == set(LONG)


def test_a_reply_stopped_inside_a_step_leaves_later_replies_as_on_a_fresh_engine(engine, fresh):
    """With the chat head cached, a reply's first pass reads its prompt with room behind it and its
    second, the first step, writes its rows into that room (``torch_cache.Room``). Stopped inside
    that step, it leaves nothing half-written that a later reply reads: the same prompt and another
    get the tokens and log-probabilities of a fresh engine.
    """
    engine.generate(OTHER_PROMPT, max_new_tokens=1)  # the chat head cached
    token = Cancellation()
    with layer_log(engine, token, at_pass=2) as passes, pytest.raises(Cancelled, match="stopped inside"):
        run_cancellable(token, lambda: engine.generate(PROMPT, max_new_tokens=12))
    assert [len(layers) for layers in passes] == [engine.backend.n_layers, CANCEL_AT + 1]
    for prompt in (PROMPT, OTHER_PROMPT):
        got, want = engine.generate(prompt, max_new_tokens=12), fresh.generate(prompt, max_new_tokens=12)
        assert got.token_ids == want.token_ids
        assert got.logp_sum == pytest.approx(want.logp_sum, abs=1e-6)


def test_a_joined_pass_runs_to_its_end_when_one_of_its_callers_is_cancelled(engine):
    """Two decides queued behind the test's hold are read in one joined pass; the first caller's
    cancellation, set inside that pass, does not stop it: all 30 layers run, and the other caller
    gets the answers it gets alone.
    """
    alone = {state: engine.decide(state, SHORT) for state in (STATE, OTHER_STATE)}  # heads and priors cached
    token = Cancellation()
    outcome: dict[str, Any] = {}

    def cancelled() -> None:
        try:
            with cancellable(token):
                outcome["cancelled"] = engine.decide(STATE, SHORT)
        except Cancelled as error:
            outcome["cancelled"] = error

    def other() -> None:
        outcome["other"] = engine.decide(OTHER_STATE, SHORT)

    threads = [threading.Thread(target=cancelled), threading.Thread(target=other)]
    before = engine.backend.forward_passes
    with layer_log(engine, token) as passes:
        with engine.model.lock:  # both queue behind this hold, the cancelled caller first
            for queued, thread in enumerate(threads, start=1):
                thread.start()
                while engine.waiting < queued:
                    time.sleep(0.005)
        for thread in threads:
            thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert token.cancelled and engine.backend.forward_passes - before == 1
    assert passes == [list(range(engine.backend.n_layers))]
    # a joined read differs from a read alone by float rounding only (tests/test_stepping.py's bound)
    same_answers(outcome["other"], alone[OTHER_STATE], tolerance=1e-5)
    if not isinstance(outcome["cancelled"], Cancelled):  # the pass ran to its end: its answers are whole
        same_answers(outcome["cancelled"], alone[STATE], tolerance=1e-5)


def test_hangup_bench_records_the_short_decides_wait_with_the_check_off_and_on(engine, tmp_path, capsys, monkeypatch):
    """``pcd bench --hangup 6`` on the served engine: a record with the check off and one with it on,
    each drop's short decide answered with its queue time, its wall time and the long pass's tokens.
    """
    pytest.importorskip("fastapi", reason="--hangup serves the engine (the http extra)")
    from pcd_integrations.commands.main import main as pcd

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    out = tmp_path / "hangup.json"
    assert pcd(["bench", "--hangup", "6", "--repeat", "1", "--json", str(out)]) == 0
    boundary, inside = json.loads(out.read_text())["records"]
    assert (boundary["stop_inside"], inside["stop_inside"]) == (False, True)
    for record in (boundary, inside):
        assert record["mode"] == "hangup" and record["questions"] == 6 and len(record["drops"]) == 1
        (drop,) = record["drops"]
        assert drop["short_queue_ms"] >= 0.0 and drop["short_wall_ms"] > 0.0
        assert drop["long_tokens"] > 6 and drop["passes"] >= 1
        assert drop["dropped_after_ms"] > drop["pass_started_after_ms"] > 0.0
        assert record["short_decide_ms"] > 0.0
    assert stopping_inside()  # the run leaves the setting as it found it
    assert "| torch | float32 | 6 |" in capsys.readouterr().out


def test_hangup_options_are_checked_before_a_model_loads(capsys):
    from pcd_integrations.commands.main import main as pcd

    assert pcd(["bench", "--hangup", "-1"]) == 2
    assert pcd(["bench", "--hangup", "8", "--clients", "2"]) == 2
    assert capsys.readouterr().err.count("pcd: error: --hangup") == 2


class CountedStop:
    """A stop signal that is set from its ``after``-th look on: where a llama.cpp pass stops is then
    a count of the abort callback's looks, not a timing.
    """

    reason = "the client went away"

    def __init__(self, after: int) -> None:
        self.after, self.looks = after, 0

    @property
    def cancelled(self) -> bool:
        self.looks += 1
        return self.looks > self.after


def test_llamacpp_stops_inside_llama_decode_and_leaves_no_cells_behind(llama_engine):
    """A warm decide's pass on llama.cpp asks its abort callback between graph nodes; set after 50
    looks (of the hundreds a whole pass takes) it stops inside ``llama_decode``, every sequence id
    the pool holds free has no cells left, and the same decide then answers as before.
    """
    from pcd_core.backends.llamacpp_backend import llama
    from pcd_core.backends.pass_stop import watching

    backend = llama_engine.backend
    before = llama_engine.decide(STATE, LONG)  # the head cached and the priors measured
    whole = CountedStop(10**9)
    with watching(whole):
        llama_engine.decide(STATE, LONG)
    stopped = CountedStop(50)
    with watching(stopped), pytest.raises(Cancelled, match="stopped inside llama_decode"):
        llama_engine.decide(STATE, LONG)
    assert 50 < stopped.looks < whole.looks / 2
    free = list(backend.sequences._free)
    assert [seq for seq in free if llama.llama_memory_seq_pos_max(backend._memory, seq) != -1] == []
    same_answers(llama_engine.decide(STATE, LONG), before)
