"""Example models for the rule tests: the pipeline's zoo (tests may use the pipeline; rewrite/ itself may not)."""

from __future__ import annotations

import onnx
import pytest

from parastream.pipeline import zoo


@pytest.fixture
def zoo_model():
    """``zoo_model(name)`` -> a fresh ModelProto of the example zoo."""

    def get(name: str) -> onnx.ModelProto:
        return zoo.MODELS[name]()

    return get
