"""The engine behind a framework object: shared when the caller passes one, else loaded on first use.

LangChain objects are pydantic models that users build at import time, in configs and in tests, often
long before (or without ever) running them; loading weights in the constructor would make that cost a
model load. ``LazyEngine`` holds the model name and loads it once, on the first call that needs it, even
with concurrent callers. It imports no framework, so every adapter whose objects are pydantic models can
mix it in. ``model``, ``backend``, ``calibration=`` (a ``pcd calibrate`` file), ``debias=`` and ``order_samples=`` build the
``LoadOptions`` it loads with; the file is read at construction. ``tests/test_langchain.py`` and ``tests/test_langchain_decisions.py`` check that
construction loads nothing and that a shared engine names the model.
"""

from __future__ import annotations

import asyncio
import threading
from typing import cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pcd_core import DEFAULT_MODEL, Calibration, Cascade, Engine, LoadOptions
from pcd_core.loading.options import BackendChoice

__all__ = ["LazyEngine"]


class LazyEngine(BaseModel):
    """``model``/``backend`` to load on first use, or ``engine`` to share one already loaded."""

    model: str = DEFAULT_MODEL
    """A model alias, Hugging Face id or local path, as ``pcd_core.Engine.load`` takes it."""
    backend: BackendChoice = "auto"
    """The backend that runs it, or ``auto`` to let the model's format and size pick (``pcd_core/loading/auto.py``)."""
    calibration: str | None = None
    """A calibration file written by ``pcd calibrate``, applied to the decisions it was fitted on; read
    when the engine loads (``Engine.load(calibration=...)``)."""
    debias: bool = False
    """Divide the model's content-free label prior out of every decision (``Engine.load(debias=...)``)."""
    order_samples: int = 1
    """Orders of each choice's and score's options every decision reads (``Engine.load(order_samples=...)``)."""
    engine: Engine | Cascade | None = Field(default=None, exclude=True)
    """An already loaded engine (or a ``Cascade`` of engines, pcd_core/cascade.py, which answers as one)
    to share; left out of dumps and trace parameters."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _load_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _calibration: Calibration | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _model_follows_engine(self) -> LazyEngine:
        # The name in traces and in response metadata must be the model that actually decides.
        if self.engine is not None:
            if "model" not in self.model_fields_set:
                self.model = self.engine.model_name
            elif self.model != self.engine.model_name:
                raise ValueError(
                    f"model={self.model!r} but the engine runs {self.engine.model_name!r}; pass one or the other"
                )
            if self.calibration is not None or self.debias or self.order_samples != 1:
                raise ValueError(
                    "calibration=, debias= and order_samples= apply when the engine is loaded here; "
                    "pass them to Engine.load"
                )
        elif self.calibration is not None:
            # read now (it is small), so that a bad file fails at construction, not at the first call
            self._calibration = Calibration.load(self.calibration)
        if self.engine is None:
            self.load_options()  # an option the backend refuses fails at construction, not at the first call
        return self

    def load_options(self) -> LoadOptions:
        """What ``load_engine`` loads, checked (an ``OptionError`` for an option the backend refuses)."""
        return LoadOptions(
            model=self.model,
            backend=self.backend,
            calibration=self._calibration,
            debias=self.debias,
            order_samples=self.order_samples,
        )

    def load_engine(self) -> Engine:  # a Cascade has the Engine's interface, and is typed as one here
        """The engine, loading the weights on first use (once, even with concurrent callers)."""
        if self.engine is None:
            with self._load_lock:
                if self.engine is None:
                    self.engine = Engine.load(self.load_options())
        return cast(Engine, self.engine)

    async def aload_engine(self) -> Engine:
        """``load_engine`` in a worker thread, so that a first call does not stall the event loop."""
        if self.engine is not None:
            return cast(Engine, self.engine)
        return await asyncio.to_thread(self.load_engine)
