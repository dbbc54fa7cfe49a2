"""Hidden states at the queried positions, read in the same pass as the log-probs: a
trained head reads them at no extra pass.

``check_backend`` (pcd_core/testing.py) already holds every backend that reads them to the contract:
same values, same pass count, packed equal to alone. Here: the torch backend's states are the model's
own (transformers' last hidden state, then the mean of its middle layers' outputs), llama.cpp's final
state agrees with torch's on the same GGUF, and a backend without them refuses by a typed error before
any pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.backends.base import Query, middle_layers
from pcd_core.errors import HiddenStatesUnavailableError
from pcd_core.testing import OracleBackend

torch = pytest.importorskip("torch")

TEXT = "The customer wrote that the parcel arrived late and damaged, and asked for"


@pytest.fixture(scope="module")
def ids(engine):
    encode = engine.tokenizer.encode
    return encode(TEXT), [encode(" a refund"), encode(" a new parcel"), encode(" an apology from the team")]


def _reference(engine, sequence: list[int]) -> np.ndarray:
    """From transformers' own outputs at every position of ``sequence``: the final hidden state (after
    the last norm), then the mean of the middle layers' outputs (``hidden_states[i + 1]`` is layer i's).
    """
    with torch.inference_mode():
        out = engine.backend.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    layers = middle_layers(engine.backend.n_layers)
    middle = torch.stack([out.hidden_states[i + 1][0] for i in layers]).mean(0)
    return torch.cat([out.hidden_states[-1][0], middle], -1).float().numpy()


def test_torch_states_are_the_models_own_at_each_query(engine, ids):
    prompt, rows = ids
    prefix = engine.backend.prefill(prompt)
    queries = [Query(r, p, (0,)) for r, row in enumerate(rows) for p in range(len(row))]
    queries.append(Query(0, -1, (0,)))  # after the prefix itself
    read = engine.backend.score(prefix, rows, queries, hidden=True)
    assert read.hidden is not None and engine.backend.hidden_parts == ("final", "middle")
    assert read.hidden[0].shape == (2 * engine.backend.model.config.hidden_size,)
    for k, query in enumerate(queries[:-1]):
        want = _reference(engine, prompt + rows[query.row][: query.position + 1])[-1]
        np.testing.assert_allclose(read.hidden[k], want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(read.hidden[-1], _reference(engine, prompt)[-1], rtol=1e-3, atol=1e-4)
    assert engine.backend.score(prefix, rows, queries).hidden is None  # only on request


def test_llamacpp_states_agree_with_torch(engine, ids):
    pytest.importorskip("llama_cpp")
    from pcd_core.engine import Engine

    llama = Engine.load("smollm2-135m", backend="llamacpp")
    prompt, rows = ids
    queries = [Query(r, len(row) - 1, (0,)) for r, row in enumerate(rows)]
    got = llama.backend.score(llama.backend.prefill(prompt), rows, queries, hidden=True).hidden
    want = engine.backend.score(engine.backend.prefill(prompt), rows, queries, hidden=True).hidden
    assert got is not None and want is not None and llama.backend.hidden_parts == ("final",)
    for a, b in zip(got, want):
        b = b[: len(a)]  # torch's final part; llama.cpp gives no middle layers
        cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        # measured: 0.9992 at the end of an 8-token prompt (Q4_1 weights against their fp32 copy)
        assert cosine > 0.99, cosine


def test_a_backend_without_hidden_states_refuses_before_any_pass():
    backend = OracleBackend(vocab_size=8)
    prefix = backend.prefill([1, 2, 3])
    before = backend.forward_passes
    with pytest.raises(HiddenStatesUnavailableError, match="oracle backend does not expose hidden states"):
        backend.score(prefix, [[4, 5]], [Query(0, 1, (0,))], hidden=True)
    assert backend.forward_passes == before


def test_llamacpp_reads_hidden_states_only_when_asked_and_at_no_extra_pass(llama_engine):
    """llama.cpp computes hidden states only for passes that ask (with them on, every token of a batch
    becomes an output). A fill that keeps them costs the passes of one that does not, also when its
    first field's answers are single tokens, read at the end of the request's own prefill.
    """
    schema = {
        "type": "object",
        "properties": {"urgent": {"type": "boolean"}, "team": {"enum": ["billing", "shipping", "accounts"]}},
    }
    plain = llama_engine.fill(schema, TEXT, use_head_cache=False)
    kept = llama_engine.fill(schema, TEXT, use_head_cache=False, hidden=True)
    assert kept.stats.forward_passes == plain.stats.forward_passes
    width = (llama_engine.backend._n_embd,)
    for name in schema["properties"]:
        assert plain.fields[name].hidden is None
        state = kept.fields[name].hidden
        assert state is not None and state.shape == width and np.all(np.isfinite(state))
        assert kept.fields[name].probabilities == pytest.approx(plain.fields[name].probabilities, abs=1e-6)
    # every query right after the trunk: no row pass, so the trunk's own prefill keeps the state
    backend, prompt = llama_engine.backend, llama_engine.tokenizer.encode(TEXT)
    head, answers = backend.prefill(prompt[:4]), [Query(0, -1, (5, 6, 7))]
    before = backend.forward_passes
    read = backend.score(head, [prompt[4:5]], answers, trunk=prompt[4:], hidden=True)
    assert backend.forward_passes == before + 1 and read.hidden is not None and read.hidden[0].shape == width


def test_llamacpp_reads_a_prefixs_last_state_again_when_it_was_not_kept(llama_engine, ids):
    """A prefix read without its hidden state (``prefill`` not told) gets it on first need: its last
    token read again at its position, one token in one pass, then kept."""
    backend = llama_engine.backend
    prompt = llama_engine.tokenizer.encode(TEXT)
    kept = backend.prefill(prompt, hidden=True)
    plain = backend.prefill(prompt)
    assert plain.state.hidden is None
    before = (backend.forward_passes, backend.counter.tokens_read)
    again = backend.score(plain, [prompt[:1]], [Query(0, -1, (0,))], hidden=True).hidden
    assert (backend.forward_passes, backend.counter.tokens_read) == (before[0] + 1, before[1] + 1)
    assert again is not None and plain.state.hidden is again[0]
    a, b = again[0], kept.state.hidden
    # measured: cosine 0.9999; a read placed in other cells moves single values by up to 0.4
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
    backend.score(plain, [prompt[:1]], [Query(0, -1, (0,))], hidden=True)
    assert backend.forward_passes == before[0] + 1  # kept: no second read
