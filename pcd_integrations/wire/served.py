"""The served model on the wire: ``GET /v1/models`` in the System One and the OpenAI list shapes,
and ``GET /healthz``.

Pydantic models only, so that the routes (``pcd_integrations/http/app.py``) declare them as their
response models; ``tests/test_http.py`` and ``tests/test_decisions_api.py`` (the ``openai`` SDK's
``models.list``) read them back.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_core.loading.model_files import EMBEDDED


class HealthBody(BaseModel):
    status: Literal["loading", "ready", "error"]
    model: str | None
    error: str | None = None


class ModelCard(BaseModel):
    name: str
    description: str
    release_date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="The upstream release date, in Unix seconds (0: unknown).")
    owned_by: str = "pcd-engine"


class ModelList(BaseModel):
    """The served model in both protocols' shapes: System One's ``models`` and OpenAI's ``object``/``data``."""

    object: Literal["list"] = "list"
    data: list[OpenAIModel]
    models: list[ModelCard]


# The contract requires a date; a model outside the embedded registry reports the epoch, which no
# client can mistake for a real release.
_UNKNOWN_RELEASE = "1970-01-01"


def model_card(engine: Engine) -> ModelCard:
    spec = EMBEDDED.get(engine.model_name)
    description = spec.description if spec is not None else f"{engine.model_name}, loaded by pcd-engine"
    release_date = spec.release_date if spec is not None else _UNKNOWN_RELEASE
    return ModelCard(name=engine.model_name, description=description, release_date=release_date)


def openai_model(card: ModelCard) -> OpenAIModel:
    released = datetime.strptime(card.release_date, "%Y-%m-%d").replace(tzinfo=UTC)
    return OpenAIModel(id=card.name, created=int(released.timestamp()))
