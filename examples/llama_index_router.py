"""Route support questions between two LlamaIndex query engines by a PCD decision.

``RouterQueryEngine(selector=PCDSelector.from_defaults(engine=engine), ...)``: the selector reads which
query engine fits each question as one PCD choice over the tools' names and descriptions, so the pick
is always one of them and comes with its probability. The two query engines are tiny vector indexes
over one document each; a mock embedding and LlamaIndex's ``MockLLM`` (which echoes its prompt) stand in
for real ones, so the answer shows which document it was built from.

    python examples/llama_index_router.py      # loads the embedded SmolLM2-135M
"""

from __future__ import annotations

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RouterQueryEngine
from llama_index.core.tools import QueryEngineTool, ToolMetadata

from pcd_core import Engine
from pcd_integrations.llama_index import PCDSelector

# name -> (what the tool is for, the one document it answers from)
TOOLS = {
    "billing": (
        "Payments, charges, refunds and invoices.",
        "Duplicate charges are refunded to the original card within five business days.",
    ),
    "technical": (
        "Crashes, bugs and error messages in the app.",
        "If the app crashes on save, update to version 2.3 and clear the cache.",
    ),
}
QUESTIONS = [
    "I was charged twice this month; how do I get the duplicate payment back?",
    "The app crashes with an error whenever I press save. What should I do?",
]


def metadatas() -> list[ToolMetadata]:
    """What the selector sees of each tool: its name and description."""
    return [ToolMetadata(name=name, description=description) for name, (description, _) in TOOLS.items()]


def build_router(engine: Engine) -> RouterQueryEngine:
    tools = [
        QueryEngineTool(
            query_engine=VectorStoreIndex.from_documents(
                [Document(text=document)], embed_model=MockEmbedding(embed_dim=8)
            ).as_query_engine(llm=MockLLM()),
            metadata=metadata,
        )
        for metadata, (_, document) in zip(metadatas(), TOOLS.values())
    ]
    return RouterQueryEngine(selector=PCDSelector.from_defaults(engine=engine), query_engine_tools=tools, llm=MockLLM())


def main(engine: Engine | None = None) -> None:
    router = build_router(engine or Engine.load())
    names = list(TOOLS)
    for question in QUESTIONS:
        response = router.query(question)
        selection = response.metadata["selector_result"]
        print(question)
        print(f"  routed to {names[selection.ind]}: {selection.reason}")
        used = [name for name, (_, document) in TOOLS.items() if document in str(response)]
        print(f"  answer synthesised from the {', '.join(used)} document")


if __name__ == "__main__":
    main()
