"""Example models for the rule tests: the pipeline's zoo, and our own stand-ins for the patterns it lacks."""

from __future__ import annotations

import importlib

import onnx
import pytest

import rewrite_examples as example_models


def zoo_models() -> dict:
    try:
        return importlib.import_module("parastream.pipeline.zoo").MODELS
    except ImportError:
        return {}


@pytest.fixture
def zoo_model():
    """``zoo_model(name)`` -> ModelProto, from the zoo (our stand-in where the zoo has no such model)."""

    def get(name: str) -> onnx.ModelProto:
        models = zoo_models()
        factory = models.get(name) or example_models.MODELS[name]
        return factory()

    return get
