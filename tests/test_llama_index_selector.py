"""PCDSelector in LlamaIndex's selector slot, on the embedded model: single and multi selection equal
``engine.decide``, the multi form is one engine call, and routers route by the decision end to end.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RouterQueryEngine
from llama_index.core.retrievers import RouterRetriever
from llama_index.core.tools import QueryEngineTool, RetrieverTool, ToolMetadata

from pcd_core import Engine
from pcd_integrations.llama_index import PCDLLM, PCDSelector

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_index_router.py"

CHOICES = [
    ToolMetadata(name="billing", description="Payments, charges, refunds and invoices."),
    ToolMetadata(name="technical", description="Crashes, bugs and error messages in the app."),
    ToolMetadata(name="shipping", description="Deliveries, parcels and tracking numbers."),
]
QUERY = "I was charged twice this month; how do I get the duplicate payment back?"


@pytest.fixture
def selector(engine: Engine) -> PCDSelector:
    return PCDSelector.from_defaults(engine=engine)


def test_single_selection_is_the_engine_choice(selector: PCDSelector, engine: Engine) -> None:
    questions = selector.questions(CHOICES)
    assert questions == {
        "selection": {
            "type": "choice",
            "instructions": questions["selection"]["instructions"],
            "criteria": {choice.name: choice.description for choice in CHOICES},
        }
    }
    expected = engine.decide(QUERY, questions).answers["selection"]
    result = selector.select(CHOICES, QUERY)
    [selection] = result.selections
    assert CHOICES[selection.index].name == expected.choice  # type: ignore[union-attr]
    for name, probability in expected.probabilities.items():  # type: ignore[union-attr]
        assert f"{name} {probability:.4f}" in selection.reason
    assert asyncio.run(selector.aselect(CHOICES, QUERY)) == result


def test_multi_selection_is_one_noul_per_choice_in_one_packed_pass(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    selector = PCDSelector.from_defaults(engine=engine, max_outputs=2)
    questions = selector.questions(CHOICES)
    assert list(questions) == ["billing", "technical", "shipping"]
    assert all(
        q["type"] == "noul" and CHOICES[i].description in q["instructions"] for i, q in enumerate(questions.values())
    )
    expected = {name: answer.noul for name, answer in engine.decide(QUERY, questions).answers.items()}  # type: ignore[union-attr]
    one_noul = engine.decide(QUERY, {"billing": questions["billing"]}).stats.forward_passes

    calls: list[int] = []
    decide = engine.decide

    def counting_decide(state: Any, asked: Any, **keywords: Any) -> Any:
        response = decide(state, asked, **keywords)
        calls.append(response.stats.forward_passes)
        return response

    monkeypatch.setattr(engine, "decide", counting_decide)
    result = selector.select(CHOICES, QUERY)
    assert calls == [one_noul]  # three questions cost what one does: the same packed pass
    ranked = sorted(expected, key=lambda name: -expected[name])
    picked = [name for name in ranked if expected[name] >= 0.5][:2] or ranked[:1]
    assert [CHOICES[i].name for i in result.inds] == picked
    for index, reason in zip(result.inds, result.reasons):
        assert f"{expected[CHOICES[index].name]:.4f}" in reason  # type: ignore[index]
    assert asyncio.run(selector.aselect(CHOICES, QUERY)) == result


def test_choices_without_names_are_numbered_options(selector: PCDSelector, engine: Engine) -> None:
    unnamed = [ToolMetadata(description="Refunds\nand invoices."), ToolMetadata(description="Crashes and bugs.")]
    questions = selector.questions(unnamed)
    assert questions["selection"]["criteria"] == {"option 1": "Refunds and invoices.", "option 2": "Crashes and bugs."}
    picked = engine.decide(QUERY, questions).answers["selection"].choice  # type: ignore[union-attr]
    # plain strings are wrapped as descriptions by LlamaIndex; the pick indexes the caller's list
    assert selector.select(["Refunds\nand invoices.", "Crashes and bugs."], QUERY).ind == int(picked[-1]) - 1


def test_construction_errors_are_clear(engine: Engine) -> None:
    assert PCDSelector.from_defaults(llm=PCDLLM(engine)).engine is engine
    with pytest.raises(ValueError, match="takes a PCDLLM"):
        PCDSelector.from_defaults(llm=MockLLM())
    with pytest.raises(ValueError, match="at least one choice"):
        PCDSelector(engine, max_outputs=0)
    with pytest.raises(ValueError, match="template"):
        PCDSelector(engine, multi=True, instructions="Is it relevant?")


# -- routers ----------------------------------------------------------------------------------

DOCS = {
    "billing": "Duplicate charges are refunded to the original card within five business days.",
    "technical": "If the app crashes on save, update to version 2.3 and clear the cache.",
}


def _index(name: str) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=DOCS[name])], embed_model=MockEmbedding(embed_dim=8))


def test_router_query_engine_runs_the_engine_the_decision_picked(selector: PCDSelector, engine: Engine) -> None:
    # MockLLM echoes its prompt, so each answer shows which index's text it was synthesised from
    tools = [
        QueryEngineTool.from_defaults(
            query_engine=_index(name).as_query_engine(llm=MockLLM()), name=name, description=CHOICES[i].description
        )
        for i, name in enumerate(DOCS)
    ]
    router = RouterQueryEngine(selector=selector, query_engine_tools=tools, llm=MockLLM())
    for query in (QUERY, "The app crashes with an error whenever I press save."):
        picked = engine.decide(query, selector.questions([t.metadata for t in tools])).answers["selection"].choice  # type: ignore[union-attr]
        response = router.query(query)
        assert [tools[i].metadata.name for i in response.metadata["selector_result"].inds] == [picked]
        other = next(name for name in DOCS if name != picked)
        assert DOCS[picked] in str(response) and DOCS[other] not in str(response)


def test_router_retriever_retrieves_from_the_retriever_the_decision_picked(
    selector: PCDSelector, engine: Engine
) -> None:
    tools = [
        RetrieverTool.from_defaults(
            retriever=_index(name).as_retriever(), name=name, description=CHOICES[i].description
        )
        for i, name in enumerate(DOCS)
    ]
    retriever = RouterRetriever(selector=selector, retriever_tools=tools, llm=MockLLM())
    picked = engine.decide(QUERY, selector.questions([t.metadata for t in tools])).answers["selection"].choice  # type: ignore[union-attr]
    assert [node.get_content() for node in retriever.retrieve(QUERY)] == [DOCS[picked]]


def test_router_example_runs_and_prints_each_route(engine: Engine) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    routes = [line for line in result.stdout.splitlines() if line.startswith("  routed to ")]
    assert len(routes) == 2
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import llama_index_router as example
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    selector = PCDSelector.from_defaults(engine=engine)
    for question, route in zip(example.QUESTIONS, routes):
        picked = engine.decide(question, selector.questions(example.metadatas())).answers["selection"].choice  # type: ignore[union-attr]
        assert route.startswith(f"  routed to {picked}: PCD choice {picked!r}")
