"""The store of source caches (kvlingo/serve/store.py): entries grow, match prefixes and evict finished ones first."""

from __future__ import annotations

import pytest
import torch

from kvlingo.serve.store import Store


def test_store_entries_grow_match_prefixes_and_evict_finished_first():
    store = Store(capacity_bytes=10_000)
    shape, model = (2, 1, 4), {"identity": {"path": "a"}}
    a = store.entry_for("e", "r1", model, True, shape, torch.float32, 3)
    k = torch.arange(2 * 1 * 5 * 4, dtype=torch.float32).view(2, 1, 5, 4)
    a.write(0, [5, 6, 7], k[:, :, :3], -k[:, :, :3])
    a.write(3, [8, 9], k[:, :, 3:], -k[:, :, 3:])  # past its capacity: it grows, keeping what it held
    assert a.n == 5 and torch.equal(a.prefix(5)[0], k) and torch.equal(a.prefix(4)[1], -k[:, :, :4])
    with pytest.raises(ValueError, match="cannot write from position 7"):
        a.write(7, [1], k[:, :, :1], k[:, :, :1])
    b = store.entry_for("e", "r2", model, True, shape, torch.float32, 2)
    b.write(0, [5, 6], k[:, :, :2], k[:, :, :2])
    assert [(e.key, c) for e, c in store.lookup([5, 6, 7, 1])] == [(a.key, 3), (b.key, 2)]
    assert store.lookup([1, 2]) == []
    assert store.entry_for("e", "r1", model, True, shape, torch.float32, 1) is a  # one entry per request
    store.finish("e", "r1")
    store.capacity_bytes = b.nbytes
    store.entry_for("e", "r3", model, True, shape, torch.float32, 1)  # over capacity: the finished entry goes
    assert a.key not in store.entries and b.key in store.entries
