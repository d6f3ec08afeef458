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

`pack(model)` goes further on a CPU: it gives each of a model's large FP32 projections a copy of
its weight in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's
CPU freezing pass uses), and inside `few_rows` those layers run oneDNN's linear on it, for any
row count. Measured on the 2-core machine (2 threads, FP32, the seven projections of a
Qwen3-0.6B layer, median ms):

    rows        1     4     16    64    256   1024  4112
    F.linear    4.58  7.88  11.1  23.9  72.5  238   753
    (W·xᵀ)ᵀ     4.04  6.74  6.70  20.1  77.6  327   -
    packed      3.55  2.64  4.46  11.7  47.7  174   621

and on the whole Qwen3-0.6B shape (random weights, 4,096-token context): a 16-token turn 393 →
286 ms, a 4,112-token prefill 39.6 → 35.8 s. It costs a second copy of those weights (about the
model's size again: the tied LM head is packed too), held until `unpack(model)`, so nothing packs
by itself: the optimised timing mode packs the target it times (kvlingo.eval.timing), for the
re-prefill and the handoff's new turn alike. The products are oneDNN's, not MKL's: the same up
to FP32 rounding (the tests hold them to the FP32 tolerance). A pack goes stale when its weight
changes (an optimizer step, a load): the layer then runs as if unpacked. Where the op is missing or fails (a torch built without oneDNN), nothing is
packed and `status()` says why.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROWS = range(16, 129)  # row counts that take (W·xᵀ)ᵀ (see the table above)
MIN_WEIGHT = 1 << 20  # weights smaller than this (in elements) keep F.linear
PACK = "_kvlingo_packed"  # attribute of a packed layer: (weight version, data pointer, oneDNN weight)
_state: dict = {"failure": None}
_packed = weakref.WeakSet()  # models `pack` gave packs to (so `few_rows` skips the others' layers at once)


def large_fp32(layer: nn.Linear) -> bool:
    """Whether a layer's weight is FP32 with MIN_WEIGHT elements or more (what `pack` packs)."""
    return layer.weight.dtype == torch.float32 and layer.weight.numel() >= MIN_WEIGHT


def takes(layer: nn.Linear) -> bool:
    """Whether a layer's weights take the few-rows form: bias-free, FP32, MIN_WEIGHT elements or more."""
    return layer.bias is None and large_fp32(layer)


def packed_weight(layer: nn.Linear) -> torch.Tensor | None:
    """The layer's oneDNN weight from `pack`, or None (never packed, or its weight changed since)."""
    held = vars(layer).get(PACK)
    if held is None or held[0] != layer.weight._version or held[1] != layer.weight.data_ptr():
        return None
    return held[2]


def few_rows_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for x [..., in]: oneDNN's linear on the packed weight when the layer has one (and no
    gradient is wanted), else (W·xᵀ)ᵀ when x has a row count in ROWS (and the weight is large enough),
    else `F.linear`."""
    packed = packed_weight(layer)
    if packed is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] \
            and not (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, layer.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or not takes(layer):
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mm(layer.weight, x.reshape(rows, x.shape[-1]).t())  # [out, rows]
    return out.t().contiguous().view(*x.shape[:-1], layer.weight.shape[0])


@contextmanager
def few_rows(model, rows: int):
    """Run `model`'s own `nn.Linear` layers through `few_rows_linear` inside a block that feeds it `rows`
    tokens, then as before: the packed ones (`pack`) at any row count, the others for a row count in ROWS.

    Nothing is switched off a CPU, nor for an unpacked layer the few-rows form would not take (a bias,
    not FP32, under MIN_WEIGHT: a toy model's), nor for a layer that already has a forward of its own
    (a hook library's wrapper)."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or (rows not in ROWS and model not in _packed):
        yield
        return
    layers = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)
              and (packed_weight(m) is not None or (rows in ROWS and takes(m)))]
    for layer in layers:
        layer.forward = few_rows_linear.__get__(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def pack(model) -> int:
    """Give `model`'s `large_fp32` `nn.Linear` layers on a CPU (with or without a bias) a oneDNN copy of
    their weight, used inside `few_rows` for any row count. Layers already packed with their current
    weight are kept. Returns the bytes the packs hold (0 off a CPU, or when packing fails: `status()`
    says why)."""
    total = 0
    for layer in model.modules():
        if type(layer) is not nn.Linear or layer.weight.device.type != "cpu" or not large_fp32(layer):
            continue
        if packed_weight(layer) is None:
            try:
                weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
            except Exception as err:  # torch without oneDNN, or an op that changed: run unpacked
                _state["failure"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                unpack(model)
                return 0
            setattr(layer, PACK, (layer.weight._version, layer.weight.data_ptr(), weight))
        total += layer.weight.numel() * layer.weight.element_size()
    if total:
        _packed.add(model)
    return total


def unpack(model) -> None:
    """Drop the packs `pack` gave `model` (their memory with them)."""
    for layer in model.modules():
        vars(layer).pop(PACK, None)
    _packed.discard(model)


def status(model) -> dict | None:
    """What `pack` did for `model`: layers packed, the bytes their packs hold, and why packing failed in
    this process (None when it did not). None for a model off a CPU, which `pack` leaves alone."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu":
        return None
    held = [m for m in model.modules() if type(m) is nn.Linear and packed_weight(m) is not None]
    return {"packed_layers": len(held), "packed_bytes": sum(m.weight.numel() * m.weight.element_size() for m in held),
            "failure": _state["failure"]}
