"""The tiny pair's models in FP32, loaded once per module."""

from __future__ import annotations

import pytest
import torch

from kvlingo.inputs.models import ModelSpec, load_model


@pytest.fixture(scope="module")
def large32(tiny_pair_paths):
    return load_model(ModelSpec.parse(str(tiny_pair_paths[0])), "cpu", torch.float32)


@pytest.fixture(scope="module")
def small32(tiny_pair_paths):
    return load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
