"""Layer ranking (kvlingo/train/ranking.py) recovers planted source layers."""

from __future__ import annotations

import pytest
import torch

from kvlingo.train.ranking import LayerStats

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_ranking_recovers_planted_source_layers():
    """Target layer t is a linear function of source layer perm[t]: R² singles it out."""
    g = torch.Generator().manual_seed(5)
    perm = [2, 0, 3]
    W = torch.randn(3, 8, 6, generator=g, dtype=torch.float64)
    stats = LayerStats(4, 8, 3, 6)
    for part in (0, 1, 0, 0, 1):
        x = torch.randn(4, 120, 8, generator=g, dtype=torch.float64)
        y = torch.stack([x[perm[t]] @ W[t] for t in range(3)]) + 0.1 * torch.randn(
            3, 120, 6, generator=g, dtype=torch.float64
        )
        for which in (0, 1):
            stats.update(part, which, x, y)
    r2 = stats.r2()  # [2, L_s, L_t]
    assert r2.argmax(1)[0].tolist() == perm and r2.max() > 0.95 and r2.min() < 0.1
