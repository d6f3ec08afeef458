"""Linear layers over a few rows on a CPU, with the product taken the other way round.

A new turn runs every projection of the model on a handful of tokens: [rows, in] @ [in, out]
with rows = 16 in `make perf`. On a CPU, torch hands `F.linear` to MKL as x·Wᵀ, and MKL runs
that shape on one thread whatever the thread count; (W·xᵀ)ᵀ is the same product with the
weight's rows on the long side, which MKL splits across threads. Measured on the 2-core
machine (2 threads, FP32, the seven projections of a Qwen3-0.6B layer, median of 25):

    rows           1     8     16    17    24    30    33    48    64    100   128
    x·Wᵀ / (W·xᵀ)ᵀ 1.04  1.00  1.58  1.16  1.22  0.86  1.33  1.16  1.20  0.98  1.09

so `few_rows` takes the second form for ROWS rows (below 16 it was no faster, and not
bit-identical there; above 128 within 5%), on weights of MIN_WEIGHT elements or more (a toy
model's products take microseconds either way, and keep transformers' own bits). In that range
both forms gave the same bits on this machine (each output is one dot product either way; a BLAS
may still block it differently, so the tests hold it to the FP32 tolerance, not to the bit).
Layers with a bias keep `F.linear` (a fused bias add may round differently). Elsewhere than on a
CPU, or in another dtype, nothing changes.

`few_rows(model, rows)` switches a model's `nn.Linear` layers for one call of that many tokens
and back, as `attention.using` switches its attention: the optimised timing mode's cache
(kvlingo.core.cache) turns both on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROWS = range(16, 129)  # row counts that take (W·xᵀ)ᵀ (see the table above)
MIN_WEIGHT = 1 << 20  # weights smaller than this (in elements) keep F.linear


def takes(layer: nn.Linear) -> bool:
    """Whether a layer's weights take the few-rows form: bias-free, FP32, MIN_WEIGHT elements or more."""
    return layer.bias is None and layer.weight.dtype == torch.float32 and layer.weight.numel() >= MIN_WEIGHT


def few_rows_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for x [..., in]: (W·xᵀ)ᵀ when x has a row count in ROWS (and the weight is large enough),
    else `F.linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or not takes(layer):
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mm(layer.weight, x.reshape(rows, x.shape[-1]).t())  # [out, rows]
    return out.t().contiguous().view(*x.shape[:-1], layer.weight.shape[0])


@contextmanager
def few_rows(model, rows: int):
    """Run `model`'s own `nn.Linear` layers through `few_rows_linear` inside a block that feeds it `rows`
    tokens, then as before.

    Nothing is switched for a row count outside ROWS (a decode step, a prefill) or off a CPU, nor for
    a layer the few-rows form would not take (a bias, not FP32, under MIN_WEIGHT: a toy model's) or
    that already has a forward of its own (a hook library's wrapper)."""
    params = next(model.parameters(), None)
    if rows not in ROWS or params is None or params.device.type != "cpu":
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
