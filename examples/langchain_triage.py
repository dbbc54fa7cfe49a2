"""Triage support tickets with a LangChain chain: ``prompt | ChatPCD().with_structured_output(Ticket)``.

Every field is decided among its allowed values, so each result is a valid ``Ticket``; the raw message
says how sure the model was (confidence) and how much of its probability fell on allowed values at
all (candidate mass; the engine warns when it is low: the model wanted to write something else).

    python examples/langchain_triage.py      # loads the embedded SmolLM2-135M on first use
"""

from __future__ import annotations

from typing import Literal

from langchain_core.prompts import ChatPromptTemplate
from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_integrations.langchain import ChatPCD

TICKETS = [
    "I was charged twice for my March invoice. Please refund the duplicate payment today.",
    "The mobile app crashes every time I tap 'Export'. Started after yesterday's update.",
    "How do I change the email address on my account? No rush.",
    "Your team fixed my login problem in ten minutes. Thank you, great service!",
    "Our whole office cannot log in since 9am and we have a client demo at noon. Help!",
]


class Ticket(BaseModel):
    """A customer support ticket, triaged."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    category: Literal["billing", "bug", "account", "praise"] = Field(description="What the ticket is about")
    sentiment: Literal["positive", "neutral", "negative"] = Field(description="The customer's mood")
    wants_refund: bool = Field(description="Does the customer ask for money back?")


PROMPT = ChatPromptTemplate.from_messages([("human", "Support ticket:\n{ticket}")])


def main(engine: Engine | None = None) -> list[Ticket]:
    """Triage ``TICKETS`` and print every decision; returns the parsed tickets."""
    chain = PROMPT | ChatPCD(engine=engine).with_structured_output(Ticket, include_raw=True)
    results = chain.batch([{"ticket": text} for text in TICKETS])
    for text, result in zip(TICKETS, results):
        print(text)
        for name, decision in result["raw"].response_metadata["pcd"].items():
            print(
                f"  {name:<13}{decision['value']!s:<10}confidence {decision['confidence']:.2f}"
                f"  candidate mass {decision['candidate_mass']:.2f}"
            )
        for warning in result["raw"].response_metadata["pcd_warnings"]:
            print(f"  ! {warning}")
    return [result["parsed"] for result in results]


if __name__ == "__main__":
    main()
