"""pcd-engine: parallel constrained decoding. An open causal LM as a typed-decision engine.

The engine reads every closed field of a schema out of one shared prompt and a few batched forward
passes, instead of letting the model write JSON token by token.
"""

import logging

from pcd_core.cascade import Cascade, EscalationRule, Stage
from pcd_core.concurrency.model_lock import Cancellation
from pcd_core.cost import Stats
from pcd_core.engine import Engine
from pcd_core.errors import (
    BackendError,
    BackendUnavailableError,
    Cancelled,
    FreeTextNotSupportedError,
    GenerationError,
    HiddenStatesUnavailableError,
    LimitError,
    ModelNotFoundError,
    OfflineError,
    OptionError,
    PcdError,
    PromptError,
    ReplyTooLongError,
    RequestError,
    SchemaError,
    TextError,
    TokenizationError,
    UpstreamError,
)
from pcd_core.loading.model_files import recommendation
from pcd_core.loading.options import BACKENDS, DEFAULT_MODEL, BackendName, LoadOptions
from pcd_core.reading.chatting import Message
from pcd_core.reading.generation import GeneratedField
from pcd_core.reading.rounds import DecodeOptions
from pcd_core.request.conversation import Conversation, Role, Turn
from pcd_core.request.limits import DEFAULT_LIMITS, Limits
from pcd_core.request.questions import (
    Answer,
    ChoiceAnswer,
    ChoiceQuestion,
    DecideRequest,
    DecideResponse,
    NoulAnswer,
    NoulQuestion,
    Question,
    ScoreAnswer,
    ScoreQuestion,
    Usage,
)
from pcd_core.request.schema import Field, Label, Schema, parse_schema
from pcd_core.result import Extraction, FieldResult, Generation, MembershipResult
from pcd_core.sessions.session import Session, SessionInterface, SessionTurn
from pcd_core.tools import (
    NO_TOOL,
    ToolChoice,
    ToolChoiceError,
    ToolDecision,
    ToolSpec,
    choose_tool,
    normalise_tool_choice,
    tool_arguments,
)
from pcd_core.trust.calibration import Calibration

__version__ = "0.1.0"

# a library logs, the application decides where to: silent unless the caller configures logging
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Cascade",
    "EscalationRule",
    "Session",
    "SessionInterface",
    "SessionTurn",
    "Stage",
    "__version__",
    "Answer",
    "BackendError",
    "BackendName",
    "BACKENDS",
    "BackendUnavailableError",
    "Calibration",
    "Cancellation",
    "Cancelled",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "choose_tool",
    "Conversation",
    "DecideRequest",
    "DecideResponse",
    "DecodeOptions",
    "DEFAULT_LIMITS",
    "DEFAULT_MODEL",
    "Engine",
    "Extraction",
    "Field",
    "FieldResult",
    "FreeTextNotSupportedError",
    "GeneratedField",
    "Generation",
    "GenerationError",
    "HiddenStatesUnavailableError",
    "Label",
    "LimitError",
    "Limits",
    "LoadOptions",
    "MembershipResult",
    "Message",
    "NO_TOOL",
    "normalise_tool_choice",
    "NoulAnswer",
    "NoulQuestion",
    "ModelNotFoundError",
    "OfflineError",
    "OptionError",
    "parse_schema",
    "PcdError",
    "PromptError",
    "Question",
    "recommendation",
    "ReplyTooLongError",
    "RequestError",
    "Role",
    "Schema",
    "SchemaError",
    "ScoreAnswer",
    "ScoreQuestion",
    "Stats",
    "TextError",
    "TokenizationError",
    "tool_arguments",
    "ToolChoice",
    "ToolChoiceError",
    "ToolDecision",
    "ToolSpec",
    "Turn",
    "UpstreamError",
    "Usage",
]
