"""Linear layers over a few rows on a CPU, with the product taken the other way round.

A new turn runs every projection of the model on a handful of tokens: [rows, in] @ [in, out].
On a CPU, torch hands `F.linear` to MKL as x·Wᵀ, and MKL runs that shape on one thread
whatever the thread count; (W·xᵀ)ᵀ is the same product with the weight's rows on the long
side, which MKL splits across threads. `few_rows` takes the second form for ROWS rows, on
bias-free FP32 weights of MIN_WEIGHT elements or more (a toy model's products take microseconds
either way, and keep transformers' own bits). Each output is one dot product either way, but a
BLAS may block it differently, so the tests hold it to the FP32 tolerance, not to the bit.
Elsewhere than on a CPU, or in another dtype, nothing changes.

`few_rows(model, rows)` switches a model's `nn.Linear` layers for one call of that many tokens
and back, as `attention.using` switches its attention; a forward on a preallocated cache
(kvlingo.core.cache.run_with_cache) turns both on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROWS = range(16, 129)  # row counts that take (W·xᵀ)ᵀ: below 16 it was no faster, above 128 within 5%
MIN_WEIGHT = 1 << 20  # weights smaller than this (in elements) keep F.linear


def large_fp32(layer: nn.Linear) -> bool:
    """Whether a layer's weight is FP32 with MIN_WEIGHT elements or more."""
    return layer.weight.dtype == torch.float32 and layer.weight.numel() >= MIN_WEIGHT


def takes(layer: nn.Linear) -> bool:
    """Whether a layer's weights take the few-rows form: bias-free (a fused bias add may round differently),
    FP32, MIN_WEIGHT elements or more."""
    return layer.bias is None and large_fp32(layer)


def few_rows_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for x [..., in]: (W·xᵀ)ᵀ when x has a row count in ROWS (on a CPU, in FP32, and the
    layer `takes` it), else `F.linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or not takes(layer):
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mm(layer.weight, x.reshape(rows, x.shape[-1]).t())  # [out, rows]
    return out.t().contiguous().view(*x.shape[:-1], layer.weight.shape[0])


@contextmanager
def few_rows(model, rows: int):
    """Run `model`'s own `nn.Linear` layers through `few_rows_linear` inside a block that feeds it `rows`
    tokens, then as before. Nothing is switched off a CPU, for a row count outside ROWS, for a layer the
    few-rows form would not take (a bias, not FP32, under MIN_WEIGHT), nor for a layer that already has a
    forward of its own (a hook library's wrapper, or `kvlingo.bench.packing`'s)."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or rows not in ROWS:
        yield
        return
    layers = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m) and takes(m)]
    for layer in layers:
        layer.forward = few_rows_linear.__get__(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
