"""Jev-style questions over one state: what ``Engine.decide`` does before and after its one pass.

``plan_decide`` needs no model, so the engine runs it before taking the model lock, on a request
already validated and bounded (``limits.check_decide``): it renders each question's row after the
state and checks that the longest one fits the context. The state is then read as the trunk that
every question's row hangs from, in the same pass (``DecidePlan.read``, through
``reading.read_request``, the path ``fill`` reads its request with): a warm request is one forward
pass, a cold one two, for one question or sixty-four. ``DecidePlan.respond`` turns the readouts into
typed answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .asking import AskedQuestion, as_text, ask
from .backends.base import Backend, pack_tree
from .calibration import Adjust
from .decoding import DecisionTask, Decoded, RoundStats, plan_rows
from .errors import PromptError
from .limits import DEFAULT_LIMITS, Limits, check_row_tokens
from .prompt import PromptParts, normalise_input
from .questions import DecideRequest, DecideResponse, Usage, answer_of
from .reading import HeadLookup, count_request, read_request
from .readout import Readout
from .result import Stats, low_mass_warnings
from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class DecidePlan:
    """One validated request: the head's ids, the whole prompt up to the state's end, the questions."""

    request: DecideRequest
    head_ids: tuple[int, ...]
    whole: tuple[int, ...]
    asked: tuple[AskedQuestion, ...]

    def tasks(self) -> list[DecisionTask]:
        return [DecisionTask(a.trie, "trie", branch_norm=a.branch_norm) for a in self.asked]

    def read(
        self, backend: Backend, lookup: HeadLookup, stats: Stats, pause: Callable[[], None]
    ) -> tuple[Decoded, list[str]]:
        """The one pass (two cold): the state as the trunk of every question's row, counted into
        ``stats``. The caller holds the lock, whose ``pause`` it passes on.
        """
        passes_before = backend.counter.mine().forward_passes
        rounds = RoundStats()
        decoded, warnings = read_request(
            backend, lookup, self.head_ids, self.whole, self.tasks(), stats, rounds, pause=pause
        )
        count_request(backend, stats, rounds, passes_before, len(self.head_ids))
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
    ) -> DecideResponse:
        """The typed answers; ``adjust`` debiases / calibrates each readout and says which it did
        (default: raw). Candidate mass stays raw.
        """
        flags: list[dict[str, bool]] = [{} for _ in readouts]
        if adjust is not None:
            adjusted = [adjust(qid, r) for qid, r in zip(self.request.questions, readouts)]
            readouts, flags = [r for r, _ in adjusted], [f for _, f in adjusted]
        answers = {
            qid: answer_of(a.question, a.names, r).model_copy(update=f)
            for qid, a, r, f in zip(self.request.questions, self.asked, readouts, flags)
        }
        masses = {qid: r.candidate_mass for qid, r in zip(self.request.questions, readouts)}
        return DecideResponse(
            model=model,
            answers=answers,
            usage=Usage.of(stats),
            stats=stats,
            warnings=warnings + low_mass_warnings(masses, "question"),
        )


def plan_decide(
    tokenizer: TextTokenizer,
    prompt: PromptParts,
    request: DecideRequest,
    context_length: int,
    limits: Limits = DEFAULT_LIMITS,
) -> DecidePlan:
    """Render a validated request (``limits.check_decide``); a state too long or rows over
    ``limits.max_row_tokens`` raise here, before any pass.
    """
    head_ids = tokenizer.encode_head(prompt.head)
    state_text = prompt.head + normalise_input(as_text(request.state))
    whole = tokenizer.encode_head(state_text)
    asked = tuple(ask(tokenizer, prompt, state_text, q, qid) for qid, q in request.questions.items())
    longest = max(max(len(v.ids) for v in a.trie.variants) for a in asked)
    if len(whole) + longest > context_length:
        raise PromptError(
            f"the state and its longest question need {len(whole) + longest} tokens, over the "
            f"model's context of {context_length}; shorten the state"
        )
    plan = DecidePlan(request, head_ids, whole, asked)
    check_row_tokens(limits, plan.row_tokens())
    return plan
