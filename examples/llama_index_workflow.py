"""Triage support messages with PCD inside a LlamaIndex Workflow; unsure ones go to a review list.

Three steps: ``load`` turns the messages into LlamaIndex documents and fans them out, ``classify``
fills a closed `Triage` object for each one with `PCDProgram` (a relevance flag, a topic and a risk
level, each one of its allowed values by construction), and ``route`` waits for every document and
sends any whose least confident field falls below the threshold to review. The confidence comes
from the engine's own decision, with no answer text to parse.

Run it with ``python examples/llama_index_workflow.py [--model NAME]``; ``tests/test_llama_index.py``
runs `main`. The embedded 135M model keeps CI fast but reads these messages poorly (it leans to the
first topic); every answer is still a valid `Triage`, and a larger model (``--model``) reads better.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Literal

from llama_index.core import Document
from llama_index.core.workflow import Context, Event, StartEvent, StopEvent, Workflow, step
from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_integrations.llama_index import PCDProgram

# A decision whose weakest field has a lower confidence than this goes to a person. Confidence is
# the normalised peak, (n·max p − 1)/(n − 1): 0 when the allowed values are tied, 1 when one is sure.
CONFIDENCE_THRESHOLD = 0.5

MESSAGES = {
    "ticket-1": "I was charged twice for my March invoice. Please refund the duplicate payment.",
    "ticket-2": "Since 9am every card payment at checkout fails with error 503. Nobody can pay.",
    "ticket-3": "Someone logged into my account from another country and changed my bank details.",
    "ticket-4": "It would be great if the app could export my receipts as a CSV file.",
    "ticket-5": "Does anyone know a good recipe for banana bread?",
}

PROMPT = "A message sent to the support desk of an online payments service:\n\n{message}"


class Triage(BaseModel):
    """How the support desk should handle a message."""

    relevant: bool = Field(description="Is the message about the payments service?")
    topic: Literal["billing", "outage", "security", "feature_request", "other"] = Field(
        description="What the message is about"
    )
    risk: Literal["low", "medium", "high"] = Field(description="How much harm follows if nobody acts on it today")


class Decision(BaseModel):
    """One document's triage and how sure the engine was of each field."""

    source: str
    triage: Triage
    probability: dict[str, float]
    confidence: dict[str, float]

    @property
    def weakest_confidence(self) -> float:
        return min(self.confidence.values())


class TriageReport(BaseModel):
    accepted: list[Decision]
    review: list[Decision]


class DocumentEvent(Event):
    position: int
    document: Document


class ClassifiedEvent(Event):
    position: int
    decision: Decision


class TriageWorkflow(Workflow):
    """load -> classify (one event per document) -> route (once all are classified)."""

    def __init__(self, program: PCDProgram[Triage], threshold: float = CONFIDENCE_THRESHOLD, **kwargs) -> None:
        super().__init__(**kwargs)
        self.program = program
        self.threshold = threshold

    @step
    async def load(self, ctx: Context, ev: StartEvent) -> DocumentEvent | StopEvent | None:
        messages = ev.get("messages", MESSAGES)
        documents = [Document(id_=source, text=text) for source, text in messages.items()]
        if not documents:
            return StopEvent(result=TriageReport(accepted=[], review=[]))
        await ctx.store.set("n_documents", len(documents))
        for position, document in enumerate(documents):
            ctx.send_event(DocumentEvent(position=position, document=document))
        return None

    # Several workers only queue on the engine's lock, but they let `afill` calls wait in threads
    # while the loop keeps serving the other steps.
    @step(num_workers=4)
    async def classify(self, ev: DocumentEvent) -> ClassifiedEvent:
        extraction = await self.program.aextract(message=ev.document.text)
        decision = Decision(
            source=ev.document.id_,
            triage=extraction.value,
            probability={name: f.probability for name, f in extraction.fields.items()},
            confidence={name: f.confidence for name, f in extraction.fields.items()},
        )
        return ClassifiedEvent(position=ev.position, decision=decision)

    @step
    async def route(self, ctx: Context, ev: ClassifiedEvent) -> StopEvent | None:
        n_documents = await ctx.store.get("n_documents")
        events = ctx.collect_events(ev, [ClassifiedEvent] * n_documents)
        if events is None:
            return None
        decisions = [e.decision for e in sorted(events, key=lambda e: e.position)]
        return StopEvent(
            result=TriageReport(
                accepted=[d for d in decisions if d.weakest_confidence >= self.threshold],
                review=[d for d in decisions if d.weakest_confidence < self.threshold],
            )
        )


def format_decision(decision: Decision) -> str:
    fields = ", ".join(
        f"{name}={getattr(decision.triage, name)!r} (p={decision.probability[name]:.2f}, "
        f"conf={decision.confidence[name]:.2f})"
        for name in decision.confidence
    )
    return f"{decision.source}: {fields}"


async def triage(program: PCDProgram[Triage], messages: dict[str, str] | None = None) -> TriageReport:
    workflow = TriageWorkflow(program, timeout=600)
    return await workflow.run(messages=MESSAGES if messages is None else messages)


def main(engine: Engine | None = None) -> TriageReport:
    """Triage `MESSAGES` on ``engine`` (the embedded default model if None) and print the routes."""
    program = PCDProgram.from_defaults(output_cls=Triage, prompt_template_str=PROMPT, engine=engine or Engine.load())
    report = asyncio.run(triage(program))
    print(f"accepted (every field's confidence >= {CONFIDENCE_THRESHOLD}):")
    for decision in report.accepted:
        print("  " + format_decision(decision))
    print("review:")
    for decision in report.review:
        print("  " + format_decision(decision))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an embedded alias, a Hugging Face id or a local path")
    args = parser.parse_args()
    main(Engine.load(args.model) if args.model else None)
