"""The MCP tools: typed decisions (`noul`, `choice`, `score`, `decide`, `fill`) on a local `Engine`.

Each tool translates its arguments into engine questions or a schema, awaits the engine on a worker
thread, and returns a pydantic model, so the SDK publishes a typed `outputSchema` and answers with
`structured_content`. The server never builds prompts or touches token ids.

Invariants:
- The model loads once, on a background thread started by the lifespan, so the handshake is answered
  at once; a tool call made during the load waits for it and reports progress.
- Arguments are checked before waiting for the model, so a bad call fails at once, as a `ToolError`.
- Engine errors caused by the caller (`SchemaError`, `PromptError`, `TokenizationError`, pydantic
  `ValidationError`) become `ToolError`s; nothing a caller sends can stop the server.
- Model access is serialised by the engine's own lock, so concurrent calls are safe.

`tests/test_mcp_server.py` proves these in process, over real stdio and over streamable HTTP.

The streamable-HTTP app and its guards live in ``mcp_server/http_transport.py``. The tools stay
together here: they share the lifespan's engine, its load progress and one error translation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

try:
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ToolAnnotations
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the MCP server needs the 'mcp' package, which is not installed; run: pip install 'pcd-engine[mcp]'"
    ) from exc
from pydantic import Field, JsonValue, ValidationError

from mcp_server.http_transport import MCP_PATH, SERVED, Served, http_app
from mcp_server.loading import EngineFactory, EngineLoader, engine_for
from mcp_server.results import (
    NO_AT,
    YES_AT,
    ChoiceResult,
    DecideResult,
    FieldDecision,
    FieldGenerated,
    FieldMemberships,
    FillResult,
    NoulResult,
    ScoreResult,
    Usage,
    verdict_of,
)
from mcp_server.sessions import add_session_tools
from pcd_core import (
    DEFAULT_LIMITS,
    Cancellation,
    ChoiceQuestion,
    DecideResponse,
    Engine,
    Extraction,
    FieldResult,
    GeneratedField,
    GenerationError,
    LimitError,
    Limits,
    NoulQuestion,
    OptionError,
    PromptError,
    Question,
    RequestError,
    SchemaError,
    ScoreQuestion,
    TokenizationError,
    __version__,
    parse_schema,
)
from pcd_core.concurrency.model_lock import in_worker
from pcd_core.request.limits import check_decide, check_fill
from pcd_integrations.serving.operations import Backpressure, trace_cost
from pcd_integrations.serving.read_timeouts import DEFAULT_READ_TIMEOUTS, ReadTimeouts, http_protocol

if TYPE_CHECKING:
    pass

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
State = Annotated[
    str | dict[str, Any] | list[Any],
    Field(description="What the question is about: text, or any JSON object or array (shown as JSON)."),
]
QuestionText = Annotated[
    str | dict[str, Any] | list[Any],
    Field(description="The question to answer about the state: plain words, or a JSON object or array."),
]
_TOOL_ANNOTATIONS = ToolAnnotations(read_only_hint=True, open_world_hint=False, idempotent_hint=True)
# a GenerationError (an open field its cap cut where it cannot close) names the field and its cap
_CALLER_ERRORS = (
    SchemaError,
    PromptError,
    TokenizationError,
    OptionError,
    LimitError,
    RequestError,
    GenerationError,
    ValidationError,
)
_T = TypeVar("_T")
# the wire names of question fields, as the single-question tools call them
_NAMES = {"instructions": "question"}
_CHOICE_NAMES = {**_NAMES, "criteria": "options"}
_SCORE_NAMES = {**_NAMES, "criteria": "levels"}


def _caller_error(exc: Exception, names: dict[str, str] | None = None) -> ToolError:
    """A ToolError whose message an agent can act on.

    `names` maps wire field names to this tool's argument names (`criteria` is `options` in `choice`),
    so that the message names what the caller actually sent.
    """
    items = exc.errors() if isinstance(exc, ValidationError) else exc.errors if isinstance(exc, RequestError) else ()
    if items:
        names = names or {}
        problems = "; ".join(
            f"{'.'.join(names.get(str(part), str(part)) for part in err['loc']) or 'value'}: {err['msg']}"
            for err in items
        )
        return ToolError(_wire_safe(f"invalid arguments: {problems}"))
    return ToolError(_wire_safe(str(exc)))


def _wire_safe(text: str) -> str:
    """Lone surrogates as escapes, so that the error message itself always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _checked(build: Callable[[], Any], names: dict[str, str] | None = None) -> Any:
    """Run `build`, turning a caller's mistake into a ToolError."""
    try:
        return build()
    except _CALLER_ERRORS as exc:
        raise _caller_error(exc, names) from exc


def _trust(answer: Any) -> dict[str, Any]:
    """An answer's or a field's ``debiased`` / ``calibrated`` / ``abstained`` flags, answer set and order
    spread, for its tool result.
    """
    flags = ("debiased", "calibrated", "abstained", "answer_set", "method", "zero_shot")
    # a fill's field is read in one order: only a question's answer has an order spread; only a
    # cascade's answers name their engine and escalation
    later = ("order_spread", "engine", "escalation")
    return {flag: getattr(answer, flag) for flag in flags} | {flag: getattr(answer, flag, None) for flag in later}


def _stage_costs(result: Any) -> list[dict[str, Any]] | None:
    """A cascade's cost per engine (``stages`` of its result); None for an engine's own result."""
    stages = getattr(result, "stages", None)
    return [stage.model_dump() for stage in stages] if stages else None


def _reported(answer: Any, model: str, usage: Usage) -> dict[str, Any]:
    """What every question tool's result carries besides its answer: mass, trust flags, model, usage."""
    return {"candidate_mass": answer.candidate_mass, "model": model, "usage": usage, **_trust(answer)}


async def _in_worker(call: Callable[[], _T]) -> _T:
    """One blocking engine call in a worker thread, stopped at its next pass boundary when the tool call
    is abandoned: the SDK cancels the handler on ``notifications/cancelled`` (or when its transport
    goes), and the ``Cancellation`` set on the way out reaches the engine (``pcd_core/concurrency/model_lock.py``).
    """
    return await in_worker(call, Cancellation(), "the MCP request was cancelled")


def _filled_fields(extraction: Extraction) -> dict[str, FieldDecision | FieldMemberships | FieldGenerated]:
    """Each field of a fill as its tool result reports it: decided, decided label by label, or generated."""
    fields: dict[str, FieldDecision | FieldMemberships | FieldGenerated] = {}
    for name, f in extraction.fields.items():
        if isinstance(f, FieldResult):
            fields[name] = FieldDecision(
                value=f.value,
                probability=f.probability,
                candidate_mass=f.candidate_mass,
                confidence=f.confidence,
                **_trust(f),
            )
        elif isinstance(f, GeneratedField):
            fields[name] = FieldGenerated(
                value=f.value, text=f.text, n_tokens=f.n_tokens, mean_probability=f.mean_probability
            )
        else:  # a multi-label list (MembershipResult)
            fields[name] = FieldMemberships(
                value=list(f.value), memberships=dict(f.memberships), candidate_mass=f.candidate_mass
            )
    return fields


def build_server(
    engine_or_factory: Engine | EngineFactory,
    *,
    name: str = "pcd",
    log_level: LogLevel = "INFO",
    limits: Limits = DEFAULT_LIMITS,
) -> MCPServer:
    """An MCP server whose tools answer on `engine_or_factory`.

    Pass an `Engine` to serve it as is, or a zero-argument factory (such as a `functools.partial` of
    `Engine.load`) to load it in the background when the server starts. ``limits`` bounds each call
    before the model is waited for (the engine applies its own as well).
    """
    loader = EngineLoader(engine_or_factory, thread_name="pcd-mcp-load")

    @asynccontextmanager
    async def lifespan(_server: MCPServer) -> AsyncIterator[EngineLoader]:
        loader.start()
        yield loader

    server = MCPServer(
        name,
        instructions=(
            "Local, deterministic judgements by a small language model, read from its next-token "
            "probabilities: no text is generated, and every answer comes with its probabilities. Use noul "
            "for a yes/no question, choice to pick one of named options, score to place the state on an "
            "ordered scale, decide for several such questions about one state in one pass, and fill to "
            "fill a JSON object: closed fields (booleans, enums) decided with probabilities, open ones "
            "(strings, numbers, nested objects) generated under the schema."
        ),
        version=__version__,
        lifespan=lifespan,
        log_level=log_level,
    )

    served = SERVED[server] = Served(loader)

    async def decide_on(ctx: Context, state: Any, questions: dict[str, Any]) -> DecideResponse:
        engine = await engine_for(loader, ctx)
        try:
            response = await _in_worker(lambda: engine.decide(state, questions))
        except _CALLER_ERRORS as exc:
            raise _caller_error(exc) from exc
        if served.metrics is not None:
            served.metrics.decided(MCP_PATH, response)
        trace_cost(response.stats)
        return response

    async def ask(ctx: Context, state: Any, question: Any) -> tuple[Any, str, Usage]:
        resp = await decide_on(ctx, state, {"q": question})
        return resp.answers["q"], resp.model, resp.usage

    @server.tool(
        title="Yes/no judgement",
        description=(
            "Answer a yes/no question about the state with a probability. Use it for checks and "
            "gates (is this a complaint? does the text mention a deadline?). Returns noul = P(yes) and "
            f"a verdict: yes when noul >= {YES_AT}, no when noul <= {NO_AT}, uncertain in between. "
            "criteria may say what counts as yes ('true') and as no ('false')."
        ),
        annotations=_TOOL_ANNOTATIONS,
    )
    async def noul(
        state: State,
        question: QuestionText,
        ctx: Context,
        criteria: Annotated[
            dict[Literal["true", "false"], JsonValue] | None,
            Field(
                description="Optional: what counts as yes ('true') and as no ('false'), as text or JSON; "
                "either or both."
            ),
        ] = None,
    ) -> NoulResult:
        asked = _checked(lambda: NoulQuestion(instructions=question, criteria=criteria), _NAMES)
        answer, model, usage = await ask(ctx, state, asked)
        return NoulResult(
            noul=answer.noul,
            verdict=verdict_of(answer.noul),
            **_reported(answer, model, usage),
        )

    @server.tool(
        title="Pick one option",
        description=(
            "Pick the one option that best answers the question about the state, from 2 to 255 named "
            "options (classification, routing, intent). Each option maps to a description or null. "
            "Returns the choice, every option's probability, the runner-up and a confidence in [0, 1]."
        ),
        annotations=_TOOL_ANNOTATIONS,
    )
    async def choice(
        state: State,
        question: QuestionText,
        options: Annotated[
            dict[str, JsonValue],
            Field(
                description="Option name to a description of when it applies (text or JSON), or null; 2 to 255 options."
            ),
        ],
        ctx: Context,
    ) -> ChoiceResult:
        asked = _checked(lambda: ChoiceQuestion(instructions=question, criteria=options), _CHOICE_NAMES)
        answer, model, usage = await ask(ctx, state, asked)
        ranked = sorted(answer.probabilities, key=answer.probabilities.__getitem__, reverse=True)
        return ChoiceResult(
            choice=answer.choice,
            confidence=answer.confidence,
            probabilities=answer.probabilities,
            runner_up=next(name for name in ranked if name != answer.choice),
            **_reported(answer, model, usage),
        )

    @server.tool(
        title="Score on a scale",
        description=(
            "Place the state on an ordered scale of 2 to 10 levels, listed from lowest to highest "
            "(severity, sentiment, urgency, quality). Returns the expected level index as score, the "
            "nearest level's text, each level's probability and a confidence in [0, 1]."
        ),
        annotations=_TOOL_ANNOTATIONS,
    )
    async def score(
        state: State,
        question: QuestionText,
        levels: Annotated[
            list[JsonValue], Field(description="The scale's levels, lowest first, as text or JSON; 2 to 10 of them.")
        ],
        ctx: Context,
    ) -> ScoreResult:
        asked = _checked(lambda: ScoreQuestion(instructions=question, criteria=levels), _SCORE_NAMES)
        answer, model, usage = await ask(ctx, state, asked)
        return ScoreResult(
            score=answer.score,
            nearest_level=levels[min(len(levels) - 1, max(0, round(answer.score)))],
            confidence=answer.confidence,
            probabilities=answer.probabilities,
            legend=answer.legend,
            **_reported(answer, model, usage),
        )

    @server.tool(
        title="Many questions, one state",
        description=(
            "Ask several independent questions about the same state in one call; the state is read "
            "once, so this is much cheaper than one call per question. questions maps your ids to "
            "System One questions: {'type': 'noul'|'choice'|'score', 'instructions': ..., 'criteria': "
            "...}, with criteria as for the noul, choice (options) and score (levels) tools. Answers "
            "come back in the System One wire format, keyed by the same ids."
        ),
        annotations=_TOOL_ANNOTATIONS,
    )
    async def decide(
        state: State,
        questions: Annotated[
            dict[str, Question],
            Field(description="Question id to question; at least one. Ids are never shown to the model."),
        ],
        ctx: Context,
    ) -> DecideResult:
        _checked(lambda: check_decide(limits, state, questions))
        resp = await decide_on(ctx, state, questions)
        return DecideResult(model=resp.model, answers=resp.answers, usage=resp.usage, cascade=_stage_costs(resp))

    @server.tool(
        title="Fill a JSON object",
        description=(
            "Fill a JSON object from the state against a JSON Schema. Closed properties (boolean, enum, "
            "const, anyOf/oneOf of consts, arrays of enum values; $ref into $defs is fine) are decided "
            "and come back with their probability and candidate mass (kind 'decided' or 'multi-label'); "
            "open ones (strings, numbers, nested objects, free arrays) are generated under the schema, "
            "so the value is valid, and come back with the text written (kind 'generated'). Use it to "
            "extract a record in one call."
        ),
        annotations=_TOOL_ANNOTATIONS,
    )
    async def fill(
        state: Annotated[str, Field(description="The text to read.")],
        schema: Annotated[dict[str, Any], Field(description="A JSON Schema of an object.")],
        ctx: Context,
    ) -> FillResult:
        _checked(lambda: check_fill(limits, parse_schema(schema), state))
        engine = await engine_for(loader, ctx)
        try:
            ex = await _in_worker(lambda: engine.fill(schema, state))
        except _CALLER_ERRORS as exc:
            raise _caller_error(exc) from exc
        if served.metrics is not None:
            served.metrics.filled(MCP_PATH, ex)
        trace_cost(ex.stats)
        return FillResult(
            value=dict(ex.value),
            fields=_filled_fields(ex),
            warnings=list(ex.warnings),
            model=engine.model_name,
            usage=Usage.of(ex.stats),
            cascade=_stage_costs(ex),
        )

    async def run_checked(call: Callable[[], Any]) -> Any:
        try:
            return await _in_worker(call)
        except _CALLER_ERRORS as exc:
            raise _caller_error(exc) from exc

    served.sessions = add_session_tools(server, lambda ctx: engine_for(loader, ctx), run_checked, _checked)
    return server


def serve(
    engine_or_factory: Engine | EngineFactory,
    *,
    transport: Literal["stdio", "streamable-http"] = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    log_level: LogLevel = "INFO",
    stateless: bool = False,
    json_response: bool = False,
    api_key: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    read_timeouts: ReadTimeouts = DEFAULT_READ_TIMEOUTS,
    backpressure: Backpressure | None = None,
    tracing: bool = False,
) -> None:
    """Serve the tools until the client goes away (stdio) or the process is stopped (HTTP, at /mcp).

    ``stateless`` and ``json_response`` are the SDK's streamable-HTTP settings: no session ids, and one
    JSON body per request instead of an SSE stream. Either way the model loads once per process. Over
    HTTP, ``api_key`` requires ``Authorization: Bearer <key>`` on every request, bodies over
    ``limits.max_body_bytes`` get 413 before the SDK parses them, and a client gets 408 when its
    headers or its body take longer than ``read_timeouts`` allows (``pcd_integrations/serving/read_timeouts.py``).
    ``backpressure`` (``--max-queue``, ``--timeout``) and ``tracing`` (``--otel``) are ``pcd serve``'s
    (``pcd_integrations/serving/operations.py``, ``tracing.py``), applied to ``POST /mcp``.
    """
    server = build_server(engine_or_factory, log_level=log_level, limits=limits)
    if transport == "stdio":
        server.run()
        return
    import uvicorn

    from pcd_integrations.serving.operations import log_config
    from pcd_integrations.serving.tracing import RequestTracer

    app = http_app(
        server,
        host,
        api_key,
        limits,
        stateless=stateless,
        json_response=json_response,
        read_timeouts=read_timeouts,
        backpressure=backpressure,
        tracer=RequestTracer() if tracing else None,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        log_config=log_config(uvicorn.config.LOGGING_CONFIG),
        http=http_protocol(read_timeouts.header_s),
    )
