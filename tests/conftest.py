"""Shared fixtures. Real-model tests use the embedded SmolLM2-135M, loaded once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA_DIR = Path(__file__).resolve().parents[1] / "pcd_core" / "benchdata"


def load_case(name: str) -> dict:
    return json.loads((DATA_DIR / f"{name}.json").read_text())


def schema_cases() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json") if "json_schema" in json.loads(p.read_text()))


@pytest.fixture(scope="session")
def engine():
    from pcd_core import Engine

    return Engine.load("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_engine():
    from pcd_core import Engine

    return Engine.load("gemma3-270m")
