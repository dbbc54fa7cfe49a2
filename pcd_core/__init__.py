"""pcd-engine: parallel constrained decoding. An open causal LM as a typed-decision engine.

The engine reads every closed field of a schema out of one shared prompt and a few batched forward
passes, instead of letting the model write JSON token by token.
"""

import logging

from .cost import Stats
from .decoding import DecodeOptions
from .engine import Engine
from .errors import (
    BackendError,
    BackendUnavailableError,
    Cancelled,
    FreeTextNotSupportedError,
    HiddenStatesUnavailableError,
    ModelNotFoundError,
    OfflineError,
    OptionError,
    PcdError,
    PromptError,
    SchemaError,
    TokenizationError,
    UpstreamError,
)
from .options import LoadOptions
from .questions import (
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
from .result import Extraction, FieldResult
from .schema import Field, Label, Schema, parse_schema

__version__ = "0.1.0"

# a library logs, the application decides where to: silent unless the caller configures logging
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "Answer",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "DecideRequest",
    "DecideResponse",
    "NoulAnswer",
    "NoulQuestion",
    "Question",
    "ScoreAnswer",
    "ScoreQuestion",
    "Usage",
    "BackendError",
    "UpstreamError",
    "BackendUnavailableError",
    "HiddenStatesUnavailableError",
    "Cancelled",
    "DecodeOptions",
    "LoadOptions",
    "Engine",
    "Extraction",
    "Field",
    "FreeTextNotSupportedError",
    "FieldResult",
    "Label",
    "ModelNotFoundError",
    "OfflineError",
    "OptionError",
    "PcdError",
    "PromptError",
    "Schema",
    "SchemaError",
    "Stats",
    "TokenizationError",
    "parse_schema",
    "__version__",
]
