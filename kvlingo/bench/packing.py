"""A model's projections on weights packed for oneDNN, inside a block the caller opens.

`with packed(model):` gives each of the model's large FP32 `nn.Linear` layers on a CPU
(`linear.large_fp32`, with or without a bias) a copy of its weight in oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass uses), and runs
those layers on it for any row count until the block ends, when the copies are dropped. The
copies cost about the model's size again (a tied LM head is packed too), so nothing packs by
itself: the optimised timing mode packs the target it times, never the source. The products
are oneDNN's, not MKL's: the same up to FP32 rounding. A pack whose weight changes (an
optimizer step, a load) goes stale and its layer runs `F.linear`, as does any call that wants
gradients. Where the op is missing or fails (a torch built without oneDNN), nothing is packed
and `status` says why.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..core.linear import large_fp32

PACK = "_kvlingo_packed"  # attribute of a packed layer: (weight version, data pointer, oneDNN weight)
_state: dict = {"failure": None}


def packed_weight(layer: nn.Linear) -> torch.Tensor | None:
    """The layer's oneDNN weight, or None (not packed, or its weight changed since)."""
    held = vars(layer).get(PACK)
    if held is None or held[0] != layer.weight._version or held[1] != layer.weight.data_ptr():
        return None
    return held[2]


def packed_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for x [..., in]: oneDNN's linear on the packed weight when it is current, x is FP32 on a
    CPU and no gradient is wanted; `F.linear` otherwise."""
    packed = packed_weight(layer)
    if (
        packed is None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or not x.shape[-1]
        or (torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad))
    ):
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, layer.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


@contextmanager
def packed(model, on: bool = True):
    """Run `model`'s large FP32 projections on oneDNN-packed weights inside the block (`on` False: as they are).
    Layers that already have a forward of their own (a hook library's wrapper) are left alone."""
    if not on:
        yield
        return
    pack(model)
    try:
        yield
    finally:
        unpack(model)


def pack(model) -> int:
    """Pack `model`'s large FP32 `nn.Linear` layers on a CPU and switch them to `packed_linear`; returns the
    bytes the packs hold (0 off a CPU, or when packing fails: `status` says why)."""
    total = 0
    for layer in model.modules():
        if (
            type(layer) is not nn.Linear
            or layer.weight.device.type != "cpu"
            or not large_fp32(layer)
            or "forward" in vars(layer)
        ):
            continue
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        except Exception as err:  # torch without oneDNN, or an op that changed: run unpacked
            _state["failure"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            unpack(model)
            return 0
        setattr(layer, PACK, (layer.weight._version, layer.weight.data_ptr(), weight))
        layer.forward = packed_linear.__get__(layer)
        total += layer.weight.numel() * layer.weight.element_size()
    return total


def unpack(model) -> None:
    """Drop the packs `pack` gave `model` (their memory with them) and the layers' switch to them."""
    for layer in model.modules():
        if vars(layer).pop(PACK, None) is not None:
            vars(layer).pop("forward", None)


def status(model) -> dict | None:
    """What packing did for `model`: layers packed, the bytes their packs hold, and why packing failed in
    this process (None when it did not). None for a model off a CPU, which is never packed."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu":
        return None
    held = [m for m in model.modules() if type(m) is nn.Linear and packed_weight(m) is not None]
    return {
        "packed_layers": len(held),
        "packed_bytes": sum(m.weight.numel() * m.weight.element_size() for m in held),
        "failure": _state["failure"],
    }
