"""Every in-process model's work runs on one thread (``pcd_core/backends/model_thread.py``), for the
thread that asked: its result, its error, its context, its pass counts.
"""

import multiprocessing
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import pytest

from pcd_core.backends import model_thread

_VALUE: ContextVar[str] = ContextVar("test_model_thread_value", default="unset")


def test_a_call_runs_on_the_model_thread_in_its_callers_context_for_its_caller():
    caller = threading.current_thread()
    token = _VALUE.set("the caller's")
    try:
        seen = model_thread.run(lambda: (threading.current_thread().name, _VALUE.get(), model_thread.acting_thread()))
    finally:
        _VALUE.reset(token)
    assert seen == ("pcd-model", "the caller's", caller)
    assert model_thread.acting_thread() is caller  # off the model thread, a thread acts for itself


def test_a_call_made_on_the_model_thread_runs_at_once_and_an_error_reaches_the_caller():
    def nested() -> str:
        return model_thread.run(lambda: threading.current_thread().name)  # would deadlock if queued

    assert model_thread.run(nested) == "pcd-model"

    def fail() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        model_thread.run(fail)
    assert model_thread.run(lambda: 7) == 7  # the thread goes on after an error


def test_a_forked_child_starts_a_model_thread_of_its_own():
    """The parent's model thread does not exist in a forked child; a call there must not wait for it."""
    model_thread.run(lambda: None)  # the parent's thread is running
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        assert pool.apply_async(_name_of_the_model_thread).get(timeout=60) == "pcd-model"


def _name_of_the_model_thread() -> str:
    return model_thread.run(lambda: threading.current_thread().name)


_INTERRUPTED = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background process ignores SIGINT
from pcd_core import Engine
engine = Engine.load()
print("reading", flush=True)
while True:
    engine.generate("Tell me a long story about a lighthouse.", max_new_tokens=400)
"""


def test_an_interrupted_process_ends_cleanly_while_the_model_thread_reads():
    """Ctrl-C while a pass runs on the model thread: the command stops with KeyboardInterrupt after
    that pass, and the process does not abort (a daemon model thread killed inside torch's kernels
    made it print "terminate called without an active exception" and dump core).
    """
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "reading\n"
        time.sleep(1.0)  # well inside the reply's steps
        child.send_signal(signal.SIGINT)
        _, errors = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGINT, errors[-2000:]
    assert "KeyboardInterrupt" in errors and "terminate called" not in errors


def test_the_engines_passes_run_on_the_model_thread_whichever_thread_calls(engine):
    """Fills and replies called from the main thread and from a pool's threads all run the model on
    the one model thread, and each caller's tally counts its own passes, as its ``Stats`` do.
    """
    runners: set[str] = set()
    hook = engine.backend.decoder.register_forward_hook(lambda *_: runners.add(threading.current_thread().name))
    schema = {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"]}

    def fill(text: str) -> tuple[int, int]:
        before = engine.backend.counter.mine().forward_passes
        result = engine.fill(schema, text, use_head_cache=False)
        return result.stats.forward_passes, engine.backend.counter.mine().forward_passes - before

    def reply(text: str) -> tuple[int, int]:  # its steps count their passes inside the backend's hook
        before = engine.backend.counter.mine().forward_passes
        result = engine.generate(text, max_new_tokens=3)
        # the prompt's passes give the first token, a step each of the others
        assert result.stats.forward_passes >= result.stats.output_tokens == 3
        return result.stats.forward_passes, engine.backend.counter.mine().forward_passes - before

    texts = ["Please call me back.", "Refund me now!", "Thanks, all good."]
    try:
        charged = [fill("The server room is on fire."), reply("Say hello.")]
        with ThreadPoolExecutor(3) as pool:
            charged += list(pool.map(fill, texts)) + list(pool.map(reply, texts))
    finally:
        hook.remove()
    assert runners == {"pcd-model"}
    assert all(passes == mine and passes >= 1 for passes, mine in charged), charged
