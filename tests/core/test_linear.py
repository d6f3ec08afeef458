"""Linear layers over a few rows (kvlingo/core/linear.py) against F.linear, and the switch of a model's layers
for a block only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from refs import random_ids

from kvlingo.core import linear


@pytest.mark.parametrize("rows", [1, 8, 15, 16, 17, 30, 64, 128, 129, 300])
def test_few_rows_linear_equals_f_linear(rows, few_rows_everywhere):
    g = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=False)
    with torch.no_grad():
        layer.weight.normal_(generator=g)
    x = torch.randn(1, rows, 96, generator=g)
    with torch.no_grad():
        got, ref = linear.few_rows_linear(layer, x), F.linear(x, layer.weight)
    assert got.shape == ref.shape == (1, rows, 200) and got.is_contiguous()
    if rows in linear.ROWS:  # the same dot products, maybe blocked otherwise: FP32 rounding of sums of 96 terms
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    else:  # outside its range it is F.linear itself
        assert torch.equal(got, ref)


def test_few_rows_leaves_biased_bf16_and_small_layers_to_f_linear(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)
    g = torch.Generator().manual_seed(0)
    biased = torch.nn.Linear(32, 48)
    x = torch.randn(2, 10, 32, generator=g)  # 20 rows
    with torch.no_grad():
        assert torch.equal(linear.few_rows_linear(biased, x), F.linear(x, biased.weight, biased.bias))
        low = torch.nn.Linear(32, 48, bias=False).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        assert torch.equal(linear.few_rows_linear(low, xb), F.linear(xb, low.weight))
        monkeypatch.setattr(linear, "MIN_WEIGHT", 1 << 20)
        small = torch.nn.Linear(32, 48, bias=False)  # below MIN_WEIGHT: a toy model's layer
        got = linear.few_rows_linear(small, x)
        assert torch.equal(got, F.linear(x, small.weight))
        monkeypatch.setattr(torch, "mm", None)  # and the few-rows product is not taken at all
        assert torch.equal(linear.few_rows_linear(small, x), got)


def test_few_rows_switches_a_model_for_the_block_only(models, few_rows_everywhere):
    model = models["small", torch.float32]
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    ids = random_ids(20, model.config.vocab_size, 3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with linear.few_rows(model, 1):  # a decode step's row count: nothing switched
            assert all("forward" not in vars(m) for m in layers)
        with linear.few_rows(model, 20):
            assert all("forward" in vars(m) for m in layers)
            got = model(input_ids=ids).logits  # 20 rows: every projection takes (W·xᵀ)ᵀ
        assert all("forward" not in vars(m) for m in layers)
        with pytest.raises(RuntimeError, match="inside"):
            with linear.few_rows(model, 20):
                raise RuntimeError("inside")
        assert all("forward" not in vars(m) for m in layers)  # switched back after an error too
    assert (got - ref).abs().max().item() <= 1e-5
