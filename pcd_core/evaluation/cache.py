"""The model's raw answers on labelled examples, kept in a JSONL file so that no example is read twice.

Reading the examples is the whole cost of ``pcd eval`` and ``pcd calibrate``; fitting and scoring take
milliseconds. With ``--answers FILE`` each example's raw answer (per field or question: the probability
row and the candidate mass; and the AR-constrained baseline's pick, when it ran) is appended to FILE as
it is read, and an example already there is taken from it. So a refit (``--bias``, ``--bias-sd``,
``--debias``), a larger ``--train-limit``, or a run that was stopped half way, costs only the examples
not yet read.

With ``--head probe`` each field's final hidden state at its first decision point is kept too, as
float16 bytes in base64 (``encode_state``): 576 values of SmolLM2-135M take 1.5 kB a line, and float16
moves a head's probabilities by less than 1e-3 (``tests/test_heads_engine.py``), so a refit of the heads
with other options, or on more examples, reads nothing again. A line without states (version 1, or
read without ``--head``) serves a run without heads and is read again by one with them.

An entry is keyed by a hash of the model's name, the schema (or questions) and the example's text, so
answers of another model, schema or text are never mixed in. The key does not see the weights or the
engine's code: the file belongs to one model install and one pcd-engine version, and is deleted when
either changes. ``tests/test_eval.py`` checks that cached answers give the report fresh ones give.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import PcdError

#: the line format written; version 2 adds ``hidden`` (None or per field a base64 float16 state), and
#: later ``hidden_parts`` (what the states hold, ``Backend.hidden_parts``; a line without it holds the
#: final state only). A file of another version is refused rather than misread
CACHE_VERSION = 2
READABLE_CACHE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class CachedAnswer:
    probabilities: dict[str, list[float]]  # per field (or question id), in label order
    candidate_mass: dict[str, float]
    constrained_ar: dict[str, int] | None  # the baseline's label index per field (-1: not written); None: not run
    hidden: dict[str, np.ndarray] | None = None  # per field, the hidden state at its first decision point
    hidden_parts: tuple[str, ...] = FINAL_STATE  # what each state holds, in order (Backend.hidden_parts)


def encode_state(state: np.ndarray) -> str:
    """A hidden state as base64 of its float16 little-endian bytes."""
    return base64.b64encode(np.asarray(state, dtype="<f2").tobytes()).decode("ascii")


def decode_state(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype="<f2").astype(np.float32)


def answer_key(model: str, source: Any, text: str) -> str:
    """The entry's key: the model's name, the schema or questions, and the text, hashed together."""
    scope = json.dumps([model, source, text], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()


class AnswerCache:
    """One JSONL file of raw answers; read whole when opened, so a malformed file fails before any model loads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._entries: dict[str, CachedAnswer] = {}
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise PcdError(f"cannot read the answers file {str(self.path)!r}: {error}") from error
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                if entry["version"] not in READABLE_CACHE_VERSIONS:
                    raise ValueError(f"version {entry['version']!r}, not one of {READABLE_CACHE_VERSIONS}")
                key, ar, states = str(entry["key"]), entry["constrained_ar"], entry.get("hidden")
                answer = CachedAnswer(
                    {name: [float(p) for p in row] for name, row in entry["probabilities"].items()},
                    {name: float(m) for name, m in entry["candidate_mass"].items()},
                    None if ar is None else {name: int(i) for name, i in ar.items()},
                    None if states is None else {name: decode_state(text) for name, text in states.items()},
                    tuple(str(part) for part in entry.get("hidden_parts") or FINAL_STATE),
                )
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise PcdError(
                    f"{self.path}:{number} is not a line of a pcd answers file ({error}); delete the file to "
                    "read the examples again"
                ) from error
            self._entries[key] = answer  # a later line (the baseline or the states added) wins

    def get(
        self, key: str, *, needs_constrained: bool, needs_hidden: tuple[str, ...] | None = None
    ) -> CachedAnswer | None:
        """The cached answer under ``key``, or None when there is none, or it lacks a needed baseline
        pick, or hidden states holding the parts ``needs_hidden`` (states of other parts are read again).
        """
        found = self._entries.get(key)
        if found is None or (needs_constrained and found.constrained_ar is None):
            return None
        if needs_hidden is not None and (found.hidden is None or found.hidden_parts != needs_hidden):
            return None
        return found

    def put(self, key: str, answer: CachedAnswer) -> None:
        """Keep ``answer`` and append it to the file at once, so a stopped run keeps what it read."""
        self._entries[key] = answer
        line = {
            "version": CACHE_VERSION,
            "key": key,
            "probabilities": answer.probabilities,
            "candidate_mass": answer.candidate_mass,
            "constrained_ar": answer.constrained_ar,
            "hidden": None if answer.hidden is None else {n: encode_state(v) for n, v in answer.hidden.items()},
            "hidden_parts": None if answer.hidden is None else list(answer.hidden_parts),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
        except OSError as error:
            raise PcdError(f"cannot write the answers file {str(self.path)!r}: {error}") from error
