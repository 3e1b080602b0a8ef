"""GET /v1/models: the one served model, and the check every generation endpoint makes."""

from __future__ import annotations

import time

from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.openai.errors import model_not_found


class ModelsService:
    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.created = int(time.time())

    def card(self) -> dict:
        return {
            "id": self.engine.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "hybridserve",
            "max_model_len": self.engine.max_model_len,
        }

    def list(self) -> dict:
        return {"object": "list", "data": [self.card()]}

    def retrieve(self, model: str) -> dict:
        check_model(self.engine, model)
        return self.card()


def check_model(engine: ServingEngine, model: str | None) -> None:
    """A request may omit `model`; naming another model is a 404."""
    if model is not None and model != engine.model_name:
        raise model_not_found(model)
