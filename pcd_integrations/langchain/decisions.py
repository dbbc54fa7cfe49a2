"""LangChain's decision-model slot on the PCD engine: ``PCDDecisionModel(BaseDecisionModel)``.

Whatever takes a ``langchain_core.decisions.BaseDecisionModel`` (``ModelRouterMiddleware``,
``AutoModeMiddleware``, a chain of your own) takes this one: ``Noul``, ``Choice`` and ``Score``
questions go to ``engine.decide`` as they are, and its answers come back as LangChain's answer types
with the probabilities the engine read. The engine answers every question of a request from one
reading of the state and one packed pass, so an answer does not depend on the other questions.

Translation only, one way each:
- the state becomes the engine's state: a string as it is; a message as role-tagged text
  (``[user] ...``, ``[assistant] ...``, an AI message's tool calls as ``[assistant tool call] name
  {args}`` lines); a list of messages as those lines joined; any other JSON as JSON, with each message
  inside it turned into its role-tagged string;
- questions are LangChain's models, dumped into the engine's question shape (their field names are
  the same); ``Box`` questions and media blocks raise typed errors that name what is not supported;
- answers keep the engine's candidate mass (``answer.candidate_mass``) and say whether they were
  debiased and calibrated (``answer.debiased``, ``answer.calibrated``), whether the engine abstained
  (``answer.abstained``: LangChain 1.8 has no refusal answer, so the flag is the mapping) and the
  answer set where a calibration fitted one (``answer.answer_set``), and usage counts every token
  the engine read, with 0 output tokens.

``tests/test_langchain_decisions.py`` checks each of these on the embedded model, against
``engine.decide`` directly, and inside ``create_agent`` with both middlewares.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from functools import partial
from typing import Any

from pcd_core import (
    BackendUnavailableError,
    ChoiceAnswer,
    DecideResponse,
    NoulAnswer,
    PcdError,
    PromptError,
    SchemaError,
    ScoreAnswer,
    Stats,
)
from pcd_core.concurrency.model_lock import in_thread

try:
    from langchain_core import decisions
    from langchain_core.decisions import BaseDecisionModel, Box, ClassifierRequest, ClassifierResponse, State
    from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, UsageMetadata, is_data_content_block
    from langchain_core.runnables import RunnableConfig
    from langchain_core.runnables.config import get_config_list
    from pydantic import BaseModel, TypeAdapter
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("langchain", "langchain-core") from error

from pcd_integrations.serving.lazy_engine import LazyEngine

__all__ = [
    "PCDChoiceAnswer",
    "PCDDecisionModel",
    "PCDNoulAnswer",
    "PCDScoreAnswer",
    "UnsupportedContentError",
    "UnsupportedQuestionError",
    "pcd_questions",
    "render_message",
    "render_state",
]

_QUESTIONS: TypeAdapter[dict[str, decisions.Question]] = TypeAdapter(dict[str, decisions.Question])
# LangChain's standard media blocks are recognised by is_data_content_block; these are the
# provider-style parts (OpenAI chat and Responses) that it does not know.
_PROVIDER_MEDIA = frozenset({"image_url", "input_image", "input_audio", "input_file"})
_ROLES = {"human": "user", "ai": "assistant"}


class UnsupportedContentError(PromptError):
    """A media block (image, audio, video, file) in a decision's state or questions: PCD reads text."""


class UnsupportedQuestionError(SchemaError):
    """A question type the engine does not answer: ``Box`` (a location in an image)."""


class _Trust(BaseModel):
    """Whether the engine debiased and calibrated the answer (``x_debiased`` / ``x_calibrated`` on its wire),
    and whether it abstained (``x_abstained``) and which answers its set holds (``x_answer_set``). LangChain
    1.8's decision answers have no refusal of their own, so an abstained answer keeps its type and its
    probabilities and says ``abstained=True``: a router reads the flag and takes its fallback.
    """

    debiased: bool = False
    calibrated: bool = False
    abstained: bool = False
    answer_set: list[str] | list[int] | None = None  # a score's are level indices, as its probabilities' keys
    order_spread: float | None = None  # read in several orders of its options: how far the top one moved
    method: str = "trie"  # "head": a trained head answered (x_method), its zero-shot reading in zero_shot
    zero_shot: dict[str, float] | None = None


class PCDNoulAnswer(decisions.NoulAnswer, _Trust):
    """LangChain's ``NoulAnswer`` plus the engine's candidate mass and trust flags for the question."""

    candidate_mass: float
    """How much of the model's next-token probability fell on an allowed answer at all."""


class PCDChoiceAnswer(decisions.ChoiceAnswer, _Trust):
    """LangChain's ``ChoiceAnswer`` plus the engine's candidate mass and trust flags for the question."""

    candidate_mass: float


class PCDScoreAnswer(decisions.ScoreAnswer, _Trust):
    """LangChain's ``ScoreAnswer`` plus the engine's candidate mass and trust flags for the question."""

    candidate_mass: float


def _reject_media(block: Mapping[str, Any], where: str) -> None:
    kind = block.get("type")
    if kind in _PROVIDER_MEDIA or is_data_content_block(dict(block)):
        raise UnsupportedContentError(
            f"{where} is a {kind!r} block; PCDDecisionModel reads text only, so pass the text "
            "(for example a transcript or a caption) instead"
        )


def render_message(message: BaseMessage, where: str = "message") -> str:
    """A message as role-tagged lines: its text, then one line per tool call of an AI message."""
    role = message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type, message.type)
    if isinstance(message.content, list):
        for index, block in enumerate(message.content):
            if isinstance(block, Mapping):
                _reject_media(block, f"{where}.content[{index}]")
    calls = message.tool_calls if isinstance(message, AIMessage) else []
    lines = [f"[{role}] {message.text}".rstrip()] if message.text or not calls else []
    lines += [f"[{role} tool call] {call['name']} {json.dumps(call['args'], ensure_ascii=False)}" for call in calls]
    return "\n".join(lines)


def _json_state(value: Any, where: str) -> Any:
    if isinstance(value, BaseMessage):
        return render_message(value, where)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        _reject_media(value, where)
        return {str(key): _json_state(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return [_json_state(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise PromptError(
        f"{where} is a {type(value).__name__}; a decision state holds text, numbers, booleans, null, "
        "messages, and objects or arrays of those"
    )


def render_state(state: State) -> str | dict[str, Any] | list[Any]:
    """The engine's state for a LangChain ``State``; see the module docstring for the rules."""
    if isinstance(state, str):
        return state
    if isinstance(state, BaseMessage):
        return render_message(state, "state")
    if isinstance(state, Sequence) and state and all(isinstance(item, BaseMessage) for item in state):
        messages: Sequence[BaseMessage] = state  # type: ignore[assignment]  # checked just above
        return "\n".join(render_message(item, f"state[{index}]") for index, item in enumerate(messages))
    return _json_state(state, "state")


def pcd_questions(questions: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """LangChain questions (models or their dicts) as the engine's question dicts, keyed the same."""
    asked: dict[str, dict[str, Any]] = {}
    for qid, question in _QUESTIONS.validate_python(dict(questions)).items():
        if isinstance(question, Box):
            raise UnsupportedQuestionError(
                "Box questions locate something in an image, and the PCD engine reads text only; "
                "ask a Noul, Choice or Score question instead",
                field=qid,
            )
        asked[qid] = _json_state(question.model_dump(mode="json"), f"questions[{qid!r}]")
    return asked


def usage_metadata(stats: Stats) -> UsageMetadata:
    """LangChain's usage from a call's cost record (``pcd_core/cost.py``): tokens read, tokens generated
    (none for a decision) and the head tokens served from the cache; ``ChatPCD`` reports the same.
    """
    return UsageMetadata(
        input_tokens=stats.input_tokens,
        output_tokens=stats.output_tokens,
        total_tokens=stats.input_tokens + stats.output_tokens,
        input_token_details={"cache_read": stats.cached_tokens},
    )


def classifier_response(response: DecideResponse, asked: Mapping[str, Mapping[str, Any]]) -> ClassifierResponse:
    """The engine's answers as LangChain's, in the order of the questions."""
    answers: dict[str, decisions.Answer] = {}
    for qid, answer in response.answers.items():
        trust: dict[str, Any] = {
            "debiased": answer.debiased,
            "calibrated": answer.calibrated,
            "abstained": answer.abstained,
            "answer_set": answer.answer_set,
            "order_spread": answer.order_spread,
            "method": answer.method,
            "zero_shot": answer.zero_shot,
        }
        if isinstance(answer, ScoreAnswer) and answer.answer_set is not None:
            trust["answer_set"] = [int(level) for level in answer.answer_set]
        if isinstance(answer, NoulAnswer):
            # renormalised in float64, P(yes) can overshoot 1 by an ulp; LangChain's model checks <= 1
            noul = min(1.0, max(0.0, answer.noul))
            answers[qid] = PCDNoulAnswer(type="noul", noul=noul, candidate_mass=answer.candidate_mass, **trust)
        elif isinstance(answer, ChoiceAnswer):
            answers[qid] = PCDChoiceAnswer(
                type="choice",
                choice=answer.choice,
                probabilities=dict(answer.probabilities),
                confidence=answer.confidence,
                candidate_mass=answer.candidate_mass,
                **trust,
            )
        elif isinstance(answer, ScoreAnswer):
            answers[qid] = PCDScoreAnswer(
                type="score",
                score=answer.score,
                legend=dict(enumerate(asked[qid]["criteria"])),
                probabilities={int(level): p for level, p in answer.probabilities.items()},
                confidence=answer.confidence,
                candidate_mass=answer.candidate_mass,
                **trust,
            )
    return ClassifierResponse(model=response.model, answers=answers, usage=usage_metadata(response.stats))


class PCDDecisionModel(LazyEngine, BaseDecisionModel):
    """LangChain's decision model on the PCD engine: ``Noul``, ``Choice`` and ``Score`` questions.

    ``PCDDecisionModel(model="smollm2-135m")`` loads the weights on first use;
    ``PCDDecisionModel(engine=engine)`` shares a loaded ``pcd_core.Engine``. Each request is one
    ``engine.decide`` call; async calls await ``engine.adecide``, which runs in a worker thread, so the
    event loop keeps running. ``batch`` and ``abatch`` first read the requests that share a question
    set together (``engine.decide_many``: one forward pass for all of their states, each answer its
    own ``decide``'s to 1e-5), then run each request as its own traced run, which takes its answer
    from that read; a group whose read fails is decided request by request, so each error stays with
    its own request.

    Answers are ``PCDNoulAnswer``/``PCDChoiceAnswer``/``PCDScoreAnswer``, subclasses of LangChain's
    answer types that add ``candidate_mass``; ``model_dump(serialize_as_any=True)`` keeps it.
    A Noul has no confidence in LangChain's types; a Choice's and a Score's confidence is the engine's
    normalised peak, ``(n * max p - 1) / (n - 1)``.
    """

    @property
    def _provider(self) -> str:
        return "pcd"

    def _classify(self, state: State, questions: dict[str, Any]) -> ClassifierResponse:
        asked, text = pcd_questions(questions), render_state(state)
        read = _take(text, asked)
        return classifier_response(read if read is not None else self.load_engine().decide(text, asked), asked)

    async def _aclassify(self, state: State, questions: dict[str, Any]) -> ClassifierResponse:
        asked, text = pcd_questions(questions), render_state(state)
        read = _take(text, asked)
        if read is None:
            read = await (await self.aload_engine()).adecide(text, asked)
        return classifier_response(read, asked)

    def _read_together(self, inputs: Sequence[ClassifierRequest]) -> dict[tuple[str, str], list[Any]]:
        """The answers of every group of requests that share a question set, read with one
        ``decide_many`` per group, keyed by (questions, state) for ``_take``.
        """
        read: dict[tuple[str, str], list[Any]] = {}
        for asked, key, texts in _groups(inputs):
            try:
                responses = self.load_engine().decide_many(texts, asked)
            except PcdError:
                continue  # each request decides alone, and its own error goes to it
            for text, response in zip(texts, responses):
                read.setdefault((key, _state_key(text)), []).append(response)
        return read

    async def _aread_together(self, inputs: Sequence[ClassifierRequest]) -> dict[tuple[str, str], list[Any]]:
        """``_read_together`` with the engine loaded and the reads run in worker threads."""
        await self.aload_engine()
        return await in_thread(self._read_together, inputs)

    def batch(
        self,
        inputs: list[ClassifierRequest],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        configs = get_config_list(config, len(inputs))
        token = _READ.set(self._read_together(inputs))
        try:
            return [_outcome(partial(self.invoke, r, c), return_exceptions) for r, c in zip(inputs, configs)]
        finally:
            _READ.reset(token)

    async def abatch(
        self,
        inputs: list[ClassifierRequest],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        outputs = []
        token = _READ.set(await self._aread_together(inputs))  # the tasks below copy this context
        try:
            for request, request_config in zip(inputs, get_config_list(config, len(inputs))):
                task = asyncio.ensure_future(self.ainvoke(request, request_config))
                await asyncio.wait([task])  # one request at a time; its error is re-raised or kept below
                outputs.append(_outcome(task.result, return_exceptions))
        finally:
            _READ.reset(token)
        return outputs


#: a batch's answers read together, keyed by (questions, state): each request takes its own
_READ: ContextVar[dict[tuple[str, str], list[Any]] | None] = ContextVar("pcd_decisions_read", default=None)


def _state_key(text: Any) -> str:
    return json.dumps(text, sort_keys=True, default=str)


def _groups(inputs: Sequence[Any]) -> list[tuple[dict[str, Any], str, list[Any]]]:
    """The states of the requests that can be read, grouped by their question set; a request whose
    state or questions are refused is left to its own ``invoke``, which raises the error for it.
    """
    groups: dict[str, tuple[dict[str, Any], list[Any]]] = {}
    for request in inputs:
        try:
            asked, text = pcd_questions(dict(request["questions"])), render_state(request["state"])
        except (PcdError, KeyError, TypeError):
            continue
        key = json.dumps(asked, sort_keys=True, default=str)
        groups.setdefault(key, (asked, []))[1].append(text)
    return [(asked, key, texts) for key, (asked, texts) in groups.items()]


def _take(text: Any, asked: dict[str, Any]) -> Any:
    """The answer a batch read for this request, once (None outside a batch or when none was read)."""
    read = _READ.get()
    key = (json.dumps(asked, sort_keys=True, default=str), _state_key(text))
    if read is None or not read.get(key):
        return None
    return read[key].pop(0)


def _outcome(call: Callable[[], Any], keep_errors: bool) -> Any:
    """``call()``, or the exception it raised when the caller asked for exceptions in the batch."""
    try:
        return call()
    except Exception as error:
        if not keep_errors:
            raise
        return error
