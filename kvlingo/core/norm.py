"""The keys' RMSNorm (Qwen3's k_norm) in FP32, as a function and in place."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm over head_dim for x [layers, heads, tokens, dim], weight [layers, dim], in FP32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight[:, None, None, :] * x


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float, squares: torch.Tensor) -> torch.Tensor:
    """`rms_norm` in place on FP32 x (same operations, same bits); `squares` is x-sized scratch."""
    var = torch.pow(x, 2, out=squares).mean(-1, keepdim=True)
    x.mul_(torch.rsqrt(var.add_(eps)))
    return x.mul_(weight[:, None, None, :])
