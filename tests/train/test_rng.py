"""Random state (kvlingo/train/rng.py) round-trips through a checkpoint."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvlingo.train import checkpoints as C
from kvlingo.train import rng as R

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_rng_state_roundtrips_through_a_checkpoint(tmp_path):
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3)

    with R.preserved_rng():  # leave the session's RNGs as they were
        R.seed_everything(7)
        C.save_checkpoint(tmp_path, 1, {"rng": R.rng_state()})
        first = draw()
        R.set_rng_state(C.newest_checkpoint(tmp_path)["rng"])
        again = draw()
        assert first[:2] == again[:2] and torch.equal(first[2], again[2])
        R.seed_everything(7)
        with R.preserved_rng():
            draw()
        after = draw()
        assert after[:2] == first[:2] and torch.equal(after[2], first[2])
