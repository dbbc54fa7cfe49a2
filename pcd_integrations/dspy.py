"""DSPy adapter: ``PCDLM``, one DSPy LM that answers decision types with ``decide`` and the rest with ``fill``.

DSPy 3.4's ``dspy.experimental`` decision types (``Noul``, ``Score``, ``Choice``, and ``bool`` and
``Literal`` outputs) reach an LM whose ``supports_decision_requests`` is true as a System One request:
``lm(state=..., questions=...)``, one question per output, answered with a probability per option.
``PCDLM`` answers those with ``engine.decide``, so the evidence DSPy records, and that ``ReAnchor``
fits thresholds, cuts and weights on, is exactly the engine's probabilities. Answers go through DSPy's
own request cache (``dspy.cache``), keyed by the request, as DSPy's ``TypeSafe`` client does, which is
what lets ``ReAnchor`` re-run a program for every candidate setting without reading the model again.

Every other signature (text and typed outputs) goes through DSPy's adapters to ``complete``, the
engine interface DSPy 3.4 recommends in place of ``BaseLM.forward``: ``PCDLM`` is a ``dspy.LM`` built
with ``engine=`` (``PCDCompletionEngine``). A request with a JSON schema (``dspy.JSONAdapter``, and the
``ChatAdapter``'s own fallback to it) is a ``fill`` of that schema, closed fields decided and open ones
generated under its grammar, so the JSON always parses; a request without one is greedy generation.
DSPy's default ``ChatAdapter`` asks for its own ``[[ ## field ## ]]`` text format instead; such a request
gets an empty reply, DSPy falls back to its ``JSONAdapter``, and the fill answers that (configure
``dspy.JSONAdapter()`` to skip the round trip).

DSPy reads ``supports_decision_requests`` before it knows a signature, from the LM alone; ``PCDLM``
answers it for the predictor that is asking (the innermost ``dspy.Predict`` DSPy is running): true
unless none of its outputs is a decision type. A signature that mixes decision and other outputs
therefore gets DSPy's own error naming the output it cannot send as a question.

Proof: ``tests/test_dspy.py`` on the embedded model.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from pcd_core import BackendUnavailableError, Engine, LoadOptions, SchemaError
from pcd_core.concurrency.model_lock import in_thread

try:
    import dspy
    from dspy.adapters.types.decision import decision_type
    from dspy.clients.base_lm import record_history
    from dspy.dsp.utils.settings import settings
    from dspy.lm15 import Message, Request, Response, Usage
    from dspy.utils.callback import with_callbacks
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("dspy", "dspy") from error

__all__ = ["PCDLM", "PCDAsyncCompletionEngine", "PCDCompletionEngine"]

logger = logging.getLogger(__name__)

#: The most tokens a generated reply has when DSPy does not set ``max_tokens``.
DEFAULT_MAX_TOKENS = 256
#: What DSPy's ChatAdapter writes into every request it formats: it asks for each output after a
#: ``[[ ## name ## ]]`` header, text a fill cannot be asked for (it has no schema).
CHAT_ADAPTER_MARKER = "[[ ## completed ## ]]"
#: The keys of an answer DSPy reads (``dspy/adapters/decision_state.py``) and the engine's candidate mass.
_ANSWER_KEYS = ("noul", "score", "choice", "confidence", "probabilities", "candidate_mass")


def _text(message: Message) -> str:
    texts = [getattr(part, "text", None) for part in message.parts]
    if any(text is None for text in texts):
        kinds = sorted({part.type for part in message.parts if getattr(part, "text", None) is None})
        raise ValueError(f"PCDLM reads text only; a {message.role} message holds {', '.join(kinds)} parts")
    return "\n".join(text for text in texts if text is not None)


def _system(request: Request) -> str:
    if request.system is None:
        return ""
    if isinstance(request.system, str):
        return request.system
    return "\n".join(getattr(part, "text", "") for part in request.system)


class PCDCompletionEngine:
    """DSPy's engine contract (``complete(Request) -> Response``) over a ``pcd_core.Engine``.

    A ``json_schema`` response format is filled; anything else is a greedy reply to the conversation.
    The cost of each call is in ``Response.provider_data["pcd"]``.
    """

    supports_response_schema = True
    supports_function_calling = False
    supports_reasoning = False
    supported_params = frozenset({"response_format", "max_tokens", "stop"})

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def complete(self, request: Request) -> Response:
        config = request.config
        system = _system(request)
        schema = (config.response_format or {}).get("schema") if config.response_format else None
        if schema is not None:
            return self._fill(request, schema, system)
        if CHAT_ADAPTER_MARKER in system:
            # No text parses as the ChatAdapter's outputs, so DSPy falls back to its JSONAdapter, whose
            # schema is then filled: one fill instead of a long generation a small model rarely formats.
            logger.info("a ChatAdapter request: answering with no text, so that DSPy asks for JSON (a fill)")
            return Response(
                id=None,
                model=self.engine.model_name,
                message=Message.assistant(""),
                finish_reason="stop",
                usage=Usage(input_tokens=0, output_tokens=0),
                provider_data={"pcd": {"skipped": "chat_adapter"}},
            )
        chat = [{"role": "system", "content": system}] if system else []
        for message in request.messages:
            role = "assistant" if message.role == "assistant" else "system" if message.role == "developer" else "user"
            chat.append({"role": role, "content": _text(message)})
        result = self.engine.generate(
            chat, max_new_tokens=config.max_tokens or DEFAULT_MAX_TOKENS, stop=tuple(config.stop)
        )
        stats = result.stats
        return Response(
            id=None,
            model=self.engine.model_name,
            message=Message.assistant(result.text),
            finish_reason="stop" if result.finish_reason == "stop" else "length",
            usage=Usage(input_tokens=stats.input_tokens, output_tokens=stats.output_tokens),
            provider_data={"pcd": {"generated": True, "cost": stats.to_dict()}},
        )

    def _fill(self, request: Request, schema: dict[str, Any], system: str) -> Response:
        # the conversation's last user turn holds the inputs; earlier turns are DSPy's demos
        turns = [_text(m) for m in request.messages]
        text = turns[-1] if len(turns) == 1 else "\n\n".join(turns)
        try:
            extraction = self.engine.fill(schema, text, task=system)
        except SchemaError as error:
            raise ValueError(f"PCDLM cannot fill the signature's outputs: {error}") from error
        stats = extraction.stats
        return Response(
            id=None,
            model=self.engine.model_name,
            message=Message.assistant(json.dumps(extraction.values, ensure_ascii=False)),
            finish_reason="stop",
            usage=Usage(input_tokens=stats.input_tokens, output_tokens=stats.output_tokens),
            provider_data={"pcd": extraction.to_dict()},
        )

    def close(self) -> None:
        """Nothing to close: the engine belongs to whoever loaded it."""


class PCDAsyncCompletionEngine:
    """``PCDCompletionEngine`` for DSPy's async calls: the same work in one of the engine's threads."""

    supports_response_schema = True
    supports_function_calling = False
    supports_reasoning = False
    supported_params = PCDCompletionEngine.supported_params

    def __init__(self, engine: Engine) -> None:
        self._sync = PCDCompletionEngine(engine)

    async def complete(self, request: Request) -> Response:
        return await in_thread(self._sync.complete, request)

    async def aclose(self) -> None:
        """Nothing to close: the engine belongs to whoever loaded it."""


def _asking_signature() -> Any:
    """The signature of the innermost ``dspy.Predict`` DSPy is running, or None outside one."""
    for module in reversed(settings.caller_modules or []):
        if isinstance(module, dspy.Predict):
            return module.signature
    return None


class PCDLM(dspy.LM):
    """A DSPy LM on a ``pcd_core.Engine``: decision outputs decided, every other signature filled.

    ``PCDLM(engine)`` shares a loaded engine; ``PCDLM.from_model("smollm2-135m")`` loads one. Sampling
    settings do not exist (decoding is decided or greedy). ``cache=True`` (the default) keeps answers
    in DSPy's cache, which ``ReAnchor`` requires.
    """

    def __init__(
        self, engine: Engine, *, cache: bool = True, max_tokens: int | None = None, callbacks: list[Any] | None = None
    ) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"PCDLM needs a pcd_core.Engine, not {engine!r}; or use PCDLM.from_model(name)")
        self.pcd_engine = engine
        super().__init__(
            f"pcd/{engine.model_name}",
            engine=PCDCompletionEngine(engine),
            async_engine=PCDAsyncCompletionEngine(engine),
            cache=cache,
            max_tokens=max_tokens,
            callbacks=callbacks,
            num_retries=0,  # a local engine's failure is not transient
        )

    @classmethod
    def from_model(cls, model: str | LoadOptions = "smollm2-135m", **keywords: Any) -> PCDLM:
        """Load a model (an alias, a Hugging Face id or a local path, as ``Engine.load`` takes it)."""
        return cls(Engine.load(model, **keywords))

    @property
    def supports_decision_requests(self) -> bool:
        """True unless the asking predictor's signature has no decision output (see the module docstring)."""
        signature = _asking_signature()
        if signature is None:
            return True
        return any(decision_type(field) is not None for field in signature.output_fields.values())

    def __deepcopy__(self, memo: dict[int, Any]) -> PCDLM:
        # optimizers deep-copy programs; the copy shares the engine (its weights) and this client
        return self

    # -- the decision path --------------------------------------------------------------------
    def __call__(
        self,
        prompt: Any = None,
        *,
        messages: Any = None,
        state: Any = None,
        questions: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``lm(state=, questions=)`` from DSPy's decision adapter; anything else is an ordinary LM call."""
        if questions is not None:
            return self._answer(state=state, questions=questions)
        return super().__call__(prompt, messages=messages, **kwargs)

    async def acall(
        self,
        prompt: Any = None,
        *,
        messages: Any = None,
        state: Any = None,
        questions: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if questions is not None:
            return await in_thread(self._answer, state=state, questions=questions)
        return await super().acall(prompt, messages=messages, **kwargs)

    def _request(self, state: Any, questions: dict[str, Any]) -> dict[str, Any]:
        """The cache key: the request, and the engine settings that change its answers (DSPy's disk
        cache outlives the process, so a reload with debias or a calibration must not hit old answers).
        """
        planner = self.pcd_engine.planner
        engine = {
            "backend": self.pcd_engine.backend.name,
            "debias": planner.debias,
            "order_samples": planner.order_samples,
            "calibration": repr(planner.calibration) if planner.calibration is not None else None,
        }
        model = self.pcd_engine.model_name
        return {"provider": "pcd", "model": model, "engine": engine, "state": state, "questions": questions}

    @with_callbacks
    def _answer(self, state: Any, questions: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """One ``decide`` per request, answered from DSPy's cache when the same request was asked."""
        request = self._request(state, questions)
        cached = dspy.cache.get(request) if self.cache else None
        if cached is not None:
            return self._finish(request, cached, cache_hit=True)
        response = self.pcd_engine.decide(state, questions)
        wire = response.to_wire()
        answers = {
            name: {key: answer[key] for key in _ANSWER_KEYS if key in answer}
            for name, answer in wire["answers"].items()
        }
        for name, answer in response.answers.items():
            answers[name]["candidate_mass"] = answer.candidate_mass
        usage = {"prompt_tokens": response.usage.input_tokens, "completion_tokens": 0}
        record = {"model": response.model, "answers": answers, "usage": usage}
        if self.cache:
            dspy.cache.put(request, record)
        return self._finish(request, record, cache_hit=False)

    def _finish(self, request: dict[str, Any], record: dict[str, Any], cache_hit: bool) -> dict[str, dict[str, Any]]:
        usage = {} if cache_hit else record["usage"]
        if settings.usage_tracker and usage:
            settings.usage_tracker.add_usage(record["model"], usage)
        if not settings.disable_history:
            record_history(
                self,
                {
                    "request": copy.deepcopy(request),
                    "response": copy.deepcopy(record),
                    "usage": usage,
                    "cache_hit": cache_hit,
                    "messages": None,
                    "prompt": json.dumps({"state": request["state"], "questions": request["questions"]}, default=str),
                    "outputs": [json.dumps(record["answers"])],
                    "model": self.model,
                },
            )
        return copy.deepcopy(record["answers"])
