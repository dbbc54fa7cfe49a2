"""One root for every error the engine raises, so that each adapter can catch it in one place.

HTTP maps SchemaError, PromptError, TokenizationError and OptionError to 422; the MCP server turns
them into tool errors. Soft problems (low candidate mass, a skipped cache) are warnings on the result instead.
"""

from __future__ import annotations


class PcdError(Exception):
    """The root of every error pcd-engine raises on purpose."""


class SchemaError(PcdError, ValueError):
    """A schema or question that the engine cannot read: duplicates, cycles, recursion, sizes."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"field {field!r}: {message}" if field is not None else message)


class OptionError(PcdError, ValueError):
    """A call option the engine does not offer (an unknown strategy): the caller's, not the schema's."""


class PromptError(PcdError, ValueError):
    """A prompt that cannot be built or read: a template that loses the input slot, an input over the
    context, or a pass whose estimated memory is over the backend's ``max_pass_bytes``.
    """


class TokenizationError(PcdError, ValueError):
    """A token boundary that re-tokenizes, so that the row would not be what the model reads."""

    def __init__(self, message: str, *, field: str | None = None, text: str | None = None) -> None:
        self.field = field
        self.text = text
        where = f"field {field!r}: " if field is not None else ""
        shown = f" (text {text!r})" if text is not None else ""
        super().__init__(f"{where}{message}{shown}")


class ModelNotFoundError(PcdError, LookupError):
    """A named model is not where its name points (a store, the Hub cache); the message says what is."""


class OfflineError(ModelNotFoundError):
    """A Hub model is not in the local cache and downloading is off (``offline=True``, ``--offline``,
    ``HF_HUB_OFFLINE=1``); the message names what is missing.
    """


class FreeTextNotSupportedError(PcdError, NotImplementedError):
    """Free-text generation was asked of an adapter that only reads closed decisions."""


class GenerationError(PcdError, RuntimeError):
    """An open field that cannot be finished as valid JSON: its cap cut a value that cannot close.

    ``text`` is what the row wrote before it stopped (the whole of it; the message shows its ends) and
    ``cause`` why it stopped (``"max_new_tokens"``, ``"no_allowed_token"``), so that a caller can see
    where the model went.
    """

    def __init__(self, message: str, *, field: str | None = None, text: str = "", cause: str = "") -> None:
        self.field, self.text, self.cause = field, text, cause
        super().__init__(message)


class Cancelled(PcdError):
    """The request was cancelled (its client went away) and stopped at its next pass boundary, or inside
    a pass that served it alone (``backends/pass_stop.py``), having given the model back; raised by the
    engine when a ``model_lock.Cancellation`` it runs under is set.
    """


class BackendError(PcdError, RuntimeError):
    """A backend broke its contract at run time."""


class HiddenStatesUnavailableError(BackendError):
    """The backend cannot return hidden states (a remote server that sends log-probs only), so a
    trained head cannot be read through it.
    """


class UpstreamError(BackendError):
    """A remote model server (vLLM) refused a read or did not answer it: the fault is upstream, neither
    the caller's nor this engine's, so HTTP reports it as 502 rather than as our own 500.
    """


class BackendUnavailableError(BackendError, ImportError):
    """An optional extra is not installed; the message names the pip command."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(
            f"the {extra!r} backend needs {module!r}, which is not installed; run: pip install 'pcd-engine[{extra}]'"
        )


# -- bad requests: a malformed call, text the tokenizer must not read, a request over a bound ---------
class RequestError(PcdError, ValueError):
    """A call whose arguments do not form a request (``state=5``, ``questions=None``, an unknown type).

    ``errors`` keeps pydantic's details as ``{"loc", "msg", "type"}`` items, so that HTTP can answer them
    in its own ``detail[]`` shape.
    """

    def __init__(self, message: str, *, errors: tuple[dict, ...] = ()) -> None:
        self.errors = errors
        super().__init__(message)


class ReplyTooLongError(PromptError):
    """A reply cap that, with the prompt, is over the model's context. The numbers let a protocol name
    its own parameter (``max_tokens`` on chat completions) and the most it may be: ``room_tokens``.
    """

    def __init__(self, message: str, *, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        self.prompt_tokens, self.max_new_tokens, self.context_length = prompt_tokens, max_new_tokens, context_length
        super().__init__(message)

    @property
    def room_tokens(self) -> int:
        """The most tokens a reply to this prompt may have (0: the prompt alone fills the context)."""
        return max(0, self.context_length - self.prompt_tokens)


class TextError(PromptError):
    """User text that cannot be read as written: invalid Unicode, or a number JSON cannot hold.

    ``loc`` names where it is, as a path into the request (``("questions", "q1", "criteria", "A")``).
    """

    def __init__(self, message: str, *, loc: tuple[str | int, ...]) -> None:
        self.loc = loc
        super().__init__(f"{'.'.join(map(str, loc))}: {message}" if loc else message)


class LimitError(RequestError):
    """A request over one of the bounds in ``pcd_core/request/limits.py``; the message names the setting."""

    def __init__(self, setting: str, value: int, limit: int, what: str, hint: str = "") -> None:
        self.setting, self.value, self.limit = setting, value, limit
        super().__init__(f"{what}: {value} is over the limit of {limit} ({setting}){'; ' + hint if hint else ''}")


class SessionError(PcdError):
    """A session (``pcd_core/sessions/session.py``) that cannot take the call: closed, or over a bound."""


class SessionClosedError(SessionError, ValueError):
    """``append``, ``fork`` or ``when`` on a session after its ``close()``."""


class SessionOverflowError(SessionError, PromptError):
    """A conversation over a bound (the model's context or ``max_session_tokens``): the message names
    the bound and its value, and ``keep_last_tokens`` as the way to drop early turns on purpose.
    """

    def __init__(self, message: str, *, setting: str, limit: int, needed: int) -> None:
        self.setting, self.limit, self.needed = setting, limit, needed
        super().__init__(message)
