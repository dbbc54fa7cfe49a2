"""Jev-style questions over one state: what ``Engine.decide`` does before and after its one pass.

``plan_decide`` needs no model, so the engine runs it before taking the model lock, on a request
already validated and bounded (``limits.check_decide``): it renders each question's row after the
state and checks that the longest one fits the context. The state is then read as the trunk that
every question's row hangs from, in the same pass (``DecidePlan.read``, through
``read_path.read_request``, the path ``fill`` reads its request with): a warm request is one forward
pass, a cold one two, for one question or sixty-four. ``DecidePlan.respond`` turns the readouts into
typed answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from pcd_core.backends.packing import pack_tree
from pcd_core.cost import Meter, Stats
from pcd_core.errors import PromptError
from pcd_core.prompting.prompt import PromptParts, normalise_input
from pcd_core.prompting.question_rows import STATE_CLOSE, AskedQuestion, as_text, ask
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.read_path import count_request, read_request
from pcd_core.reading.readout import Readout
from pcd_core.reading.rounds import DecisionTask, Decoded, RoundStats, plan_rows
from pcd_core.request.conversation import Conversation
from pcd_core.request.limits import DEFAULT_LIMITS, Limits, check_row_tokens
from pcd_core.request.questions import (
    Answer,
    ChoiceAnswer,
    ChoiceQuestion,
    DecideRequest,
    DecideResponse,
    NoulAnswer,
    NoulQuestion,
    ScoreAnswer,
    ScoreQuestion,
)
from pcd_core.result import low_mass_warnings
from pcd_core.tokenizer import TextTokenizer
from pcd_core.trust.calibration_applying import Adjust


class DecideKeywords(TypedDict, total=False):
    """The keywords of ``Engine.decide`` after ``state`` and ``questions``, spelt out (and documented)
    once so that ``adecide`` takes exactly them (``Unpack[DecideKeywords]``), as ``FillKeywords`` does
    for fills.
    """

    # earlier turns and the caller's instructions (conversation.py), cached with the head only when
    # a cache_key (OpenAI's prompt_cache_key) says the caller will come back with them
    context: Conversation | None
    cache_key: str | None
    # as in FillKeywords; a calibration covers a question whose id and answer names (true/false, the
    # options, the level indices) it was fitted on
    debias: bool | None
    calibrate: bool
    # K > 1 also reads K - 1 rotations of each choice's and score's options as more rows of the same
    # pass and averages them (DecidePlan.merged); None: the engine's default (LoadOptions.order_samples)
    order_samples: int | None
    # the state fence's nonce (prompt.fence): a session's secret (session.py); None hashes the text
    fence_nonce: str | None


@dataclass(frozen=True)
class DecidePlan:
    """One validated request: the head's ids, the whole prompt up to the state's end, the questions."""

    request: DecideRequest
    head_ids: tuple[int, ...]
    whole: tuple[int, ...]
    asked: tuple[AskedQuestion, ...]
    # per question, its other rotations (``order_samples``): more rows in the same pass, none for a noul
    siblings: tuple[tuple[AskedQuestion, ...], ...] = ()

    def tasks(self) -> list[DecisionTask]:
        every = [*self.asked, *(a for rotated in self.siblings for a in rotated)]
        return [DecisionTask(a.trie, "trie", branch_norm=a.branch_norm) for a in every]

    def merged(self, readouts: list[Readout]) -> tuple[list[Readout], list[float | None]]:
        """Each question's readout, its rotations' probabilities (mapped back) averaged in, and its
        ``order_spread``: how far the top option's probability moved across the rotations (None: one).
        """
        primary, rest = readouts[: len(self.asked)], iter(readouts[len(self.asked) :])
        out: list[Readout] = []
        spreads: list[float | None] = []
        for first, rotated in zip(primary, self.siblings or [() for _ in self.asked]):
            if not rotated:
                out.append(first)
                spreads.append(None)
                continue
            samples = [first, *(restore(a, next(rest)) for a in rotated)]
            mean = [sum(r.probabilities[i] for r in samples) / len(samples) for i in range(len(first.probabilities))]
            top = max(range(len(mean)), key=lambda i: (mean[i], -i))
            candidate_mass = sum(r.candidate_mass for r in samples) / len(samples)
            out.append(Readout(first.logmass, tuple(mean), candidate_mass, top, first.hidden))
            spreads.append(max(r.probabilities[top] for r in samples) - min(r.probabilities[top] for r in samples))
        return out, spreads

    def read(
        self, model: LoadedModel, meter: Meter, pause: Callable[[], None], hidden: bool = False
    ) -> tuple[Decoded, list[str]]:
        """The one pass (two cold): the state as the trunk of every question's row, counted into
        ``meter``. The caller holds the lock, whose ``pause`` it passes on. ``hidden`` (a head answers
        some question) keeps each question's hidden state at its first decision point, same pass.
        """
        passes_before = model.backend.counter.mine().forward_passes
        rounds = RoundStats()
        decoded, warnings = read_request(
            model, self.head_ids, self.whole, self.tasks(), meter, rounds, pause=pause, hidden=hidden
        )
        count_request(model.backend, meter, rounds, passes_before, len(self.head_ids))
        return decoded, warnings

    def row_tokens(self) -> int:
        """The distinct tokens of every row the pass reads, as it packs them: a question's text once,
        its branches (a code's second letters, the quote of ``"true"``) hanging from it. It is
        ``stats.row_tokens`` when the rows fit one pass; more passes read a shared start again.
        """
        rows, _ = plan_rows([(task.trie.row, path) for task in self.tasks() for path in task.pending])
        return len(pack_tree(rows).tokens)

    def respond(
        self,
        model: str,
        readouts: Sequence[Readout],
        stats: Stats,
        warnings: list[str],
        adjust: Adjust | None = None,
        spreads: list[float | None] | None = None,
    ) -> DecideResponse:
        """The typed answers. ``adjust`` debiases / calibrates each readout and says what it did
        (``debiased``, ``calibrated`` and, where a calibration fitted them, ``abstained`` /
        ``answer_set``; default: raw); ``spreads`` are the rotated questions' ``order_spread``.
        Candidate mass stays raw.
        """
        flags: list[dict[str, Any]] = [{} for _ in readouts]
        if adjust is not None:
            adjusted = [adjust(qid, r) for qid, r in zip(self.request.questions, readouts)]
            readouts, flags = [r for r, _ in adjusted], [f for _, f in adjusted]
        if spreads is not None:
            flags = [f if spread is None else {**f, "order_spread": spread} for f, spread in zip(flags, spreads)]
        answers = {
            qid: answer_of(a.question, a.names, r).model_copy(update=_named(f, a.names))
            for qid, a, r, f in zip(self.request.questions, self.asked, readouts, flags)
        }
        masses = {qid: r.candidate_mass for qid, r in zip(self.request.questions, readouts)}
        return DecideResponse(
            model=model,
            answers=answers,
            stats=stats,
            warnings=warnings + low_mass_warnings(masses, "question"),
        )


def restore(asked: AskedQuestion, readout: Readout) -> Readout:
    """A rotated question's readout with its labels back in the order the question gave them."""
    order = asked.order
    if order is None:
        return readout
    back = sorted(range(len(order)), key=lambda j: order[j])  # given index -> readout index
    return Readout(
        tuple(readout.logmass[j] for j in back),
        tuple(readout.probabilities[j] for j in back),
        readout.candidate_mass,
        order[readout.best],
    )


def rotation_shifts(question: Any, order_samples: int) -> list[int]:
    """The shifts of a choice's or a score's other rotations: ``order_samples`` spread evenly round its
    list, the one at 0 (the question as given) left out, duplicates once; a noul has no list to rotate.
    """
    if isinstance(question, NoulQuestion):
        return []
    n = len(question.criteria)
    return sorted({k * n // order_samples for k in range(1, order_samples)} - {0})


def _named(flags: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """An answer's flags with its answer set's label indices (``calibration_applying.decision_flags``) as names,
    and a head's ``zero_shot`` probabilities keyed by them.
    """
    named = dict(flags)
    if flags.get("answer_set") is not None:
        named["answer_set"] = [names[i] for i in flags["answer_set"]]
    if flags.get("zero_shot") is not None:
        named["zero_shot"] = dict(zip(names, flags["zero_shot"]))
    return named


def plan_decide(
    tokenizer: TextTokenizer,
    prompt: PromptParts,
    request: DecideRequest,
    context_length: int,
    limits: Limits = DEFAULT_LIMITS,
    cache_turns: bool = True,
    order_samples: int = 1,
    nonce: str | None = None,
) -> DecidePlan:
    """Render a validated request (``limits.check_decide``); a state too long or rows over
    ``limits.max_row_tokens`` raise here, before any pass.

    The head the engine caches is the whole head when ``cache_turns`` is set, else the part that
    requests with other earlier turns share (``PromptParts.shared_head``), so that one conversation
    does not push the common head out of the cache; the rest is read as the request's own trunk.
    """
    head_ids = tokenizer.encode_head(prompt.head if cache_turns else prompt.shared_head or prompt.head)
    # the reminder that the state has ended belongs to the trunk, which every question's row shares
    state_text = prompt.head + normalise_input(as_text(request.state, nonce)) + STATE_CLOSE
    whole = tokenizer.encode_head(state_text)
    asked = tuple(ask(tokenizer, prompt, state_text, q, qid) for qid, q in request.questions.items())
    siblings = tuple(
        tuple(ask(tokenizer, prompt, state_text, q, qid, shift) for shift in rotation_shifts(q, order_samples))
        for qid, q in request.questions.items()
    )
    longest = max(max(len(v.ids) for v in a.trie.variants) for a in asked)
    if len(whole) + longest > context_length:
        raise PromptError(
            f"the state and its longest question need {len(whole) + longest} tokens, over the "
            f"model's context of {context_length}; shorten the state"
        )
    plan = DecidePlan(request, head_ids, whole, asked, siblings)
    check_row_tokens(limits, plan.row_tokens())
    return plan


def answer_of(
    question: NoulQuestion | ChoiceQuestion | ScoreQuestion, names: Sequence[str], readout: Readout
) -> Answer:
    """A question's typed answer from its readout, whose labels are ``names`` (``answer_names``
    order): probabilities by answer name, a score's expected level, the raw log masses as logits
    (-1e30 for an impossible answer, which JSON cannot spell).
    """
    probabilities = dict(zip(names, readout.probabilities))
    logits = {n: (v if v != -math.inf else -1e30) for n, v in zip(names, readout.logmass)}
    if isinstance(question, NoulQuestion):
        return NoulAnswer(noul=probabilities["true"], candidate_mass=readout.candidate_mass)
    if isinstance(question, ChoiceQuestion):
        return ChoiceAnswer(
            choice=names[readout.best],
            probabilities=probabilities,
            confidence=readout.confidence,
            candidate_mass=readout.candidate_mass,
            logits=logits,
        )
    return ScoreAnswer(
        score=sum(i * p for i, p in enumerate(readout.probabilities)),
        legend={str(i): level for i, level in enumerate(question.criteria)},
        probabilities=probabilities,
        confidence=readout.confidence,
        candidate_mass=readout.candidate_mass,
        logits=logits,
    )
