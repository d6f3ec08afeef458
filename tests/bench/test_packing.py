"""Projections on oneDNN-packed weights (kvlingo/bench/packing.py) against F.linear and transformers' own
logits; a stale or failed pack falls back and says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from refs import random_ids, random_maps, transformers_split

from kvlingo.bench import packing, timing
from kvlingo.bench.packing import packed
from kvlingo.core import linear
from kvlingo.core.cache import capture, continue_from


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_at_any_row_count(bias, monkeypatch, few_rows_everywhere):
    g = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(generator=g)
    holder = torch.nn.Sequential(layer)
    real, ran = torch.ops.mkldnn._linear_pointwise, []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: ran.append(a[0].shape[0]) or real(*a))
    with packed(holder):
        assert packing.status(holder) == {"packed_layers": 1, "packed_bytes": 96 * 200 * 4, "failure": None}
        for rows in (1, 3, 16, 300):  # a decode step, inside and outside ROWS, a prefill
            x = torch.randn(1, rows, 96, generator=g)
            with torch.no_grad(), linear.few_rows(holder, rows):  # few_rows leaves a packed layer to its pack
                assert vars(layer)["forward"].__func__ is packing.packed_linear
                got = holder(x)
            ref = F.linear(x, layer.weight, layer.bias)
            assert got.shape == ref.shape and got.is_contiguous()
            assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert ran == [1, 3, 16, 300]  # oneDNN's linear ran every time
    assert packing.status(holder)["packed_layers"] == 0 and packing.packed_weight(layer) is None
    assert "forward" not in vars(layer)  # the block's end switched the layer back
    with linear.few_rows(holder, 1):  # a decode step's row count switches nothing
        assert "forward" not in vars(layer)


def test_a_pack_goes_stale_when_its_weight_changes_and_is_never_used_with_gradients(few_rows_everywhere):
    g = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(64, 80, bias=False)
    holder = torch.nn.Sequential(layer)
    x = torch.randn(5, 64, generator=g)
    with packed(holder):
        with torch.no_grad():
            layer.weight.add_(1.0)  # an optimizer step's in-place update
        assert packing.packed_weight(layer) is None  # stale: the layer runs as if unpacked
        with torch.no_grad():
            assert torch.equal(holder(x), F.linear(x, layer.weight))
    with packed(holder):  # packed again, for the new weight
        assert packing.packed_weight(layer) is not None
        xg = x.clone().requires_grad_(True)
        out = holder(xg)  # gradients wanted: never the packed op
        assert torch.equal(out, F.linear(xg, layer.weight))
        out.sum().backward()
        assert xg.grad is not None and layer.weight.grad is not None
    off_cpu = torch.nn.Sequential(torch.nn.Linear(64, 80, bias=False, device="meta"))
    with packed(off_cpu):  # off a CPU: nothing packed, nothing said
        assert packing.status(off_cpu) is None and "forward" not in vars(off_cpu[0])
    with packed(holder, on=False):
        assert packing.status(holder)["packed_layers"] == 0


def test_packing_that_fails_leaves_every_layer_unpacked_and_says_why(monkeypatch, few_rows_everywhere):
    monkeypatch.setitem(packing._state, "failure", None)
    holder = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16, bias=False))

    def no_onednn(weight):
        raise RuntimeError("this torch was built without oneDNN")

    first = torch.ops.mkldnn._reorder_linear_weight
    calls = []

    def fail_second(weight, batch_size=None):  # the first layer packs, the second fails: both end unpacked
        calls.append(1)
        if len(calls) > 1:
            no_onednn(weight)
        return first(weight)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail_second)
    with packed(holder):
        assert all(packing.packed_weight(m) is None and "forward" not in vars(m) for m in holder)
        assert packing.status(holder) == {
            "packed_layers": 0,
            "packed_bytes": 0,
            "failure": "RuntimeError: this torch was built without oneDNN",
        }


def test_packed_target_logits_equal_transformers(models, few_rows_everywhere):
    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(40, target.config.vocab_size, 4)
    prefix, new = ids[:, :24], ids[:, 24:]  # a 16-token turn
    ref = transformers_split(target, prefix, new)
    with packed(target):
        paths = timing.HandoffPaths(source, target, random_maps(source, target), prefix, new)
        n_linear = sum(type(m) is torch.nn.Linear for m in target.modules())
        held = packing.status(target)
        assert held["packed_layers"] == n_linear and held["packed_bytes"] > 0
        assert packing.status(source)["packed_layers"] == 0  # only the model the block names
        with torch.no_grad():
            cap = capture(target, prefix, kind="preallocated")
            got = continue_from(target, cap.keys, cap.values, new, kind="preallocated").logits[0]
        assert (got - ref).abs().max().item() <= 1e-5
        with torch.inference_mode():
            reprefill = paths.target_reprefill()
        assert (reprefill - ref[-1]).abs().max().item() <= 1e-5
    assert packing.status(target)["packed_layers"] == 0
