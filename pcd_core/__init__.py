"""pcd-engine: parallel constrained decoding. An open causal LM as a typed-decision engine.

The engine reads every closed field of a schema out of one shared prompt and a few batched forward
passes, instead of letting the model write JSON token by token.
"""

import logging

from pcd_core.cost import Stats
from pcd_core.engine import Engine
from pcd_core.errors import (
    BackendError,
    BackendUnavailableError,
    Cancelled,
    FreeTextNotSupportedError,
    HiddenStatesUnavailableError,
    OptionError,
    PcdError,
    PromptError,
    SchemaError,
    TokenizationError,
    UpstreamError,
)
from pcd_core.loading.options import LoadOptions
from pcd_core.reading.rounds import DecodeOptions
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
from pcd_core.result import Extraction, FieldResult

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
