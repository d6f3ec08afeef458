"""RoPE: strip a model's rotation from its cached keys, and apply another model's.

cos/sin come from each model's own `rotary_emb` module (its `inv_freq` buffer, its
schedule), evaluated in FP32 with autocast off, so that a strip with the source's
schedule is the exact inverse of what the source applied. In BF16 the model rotates in
BF16; we strip and re-apply in FP32 and round once at the end (measured: doing it all
in BF16 loses up to 0.125 per element).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def rope_tables(model, n_tokens: int, start: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 (cos, sin) of shape [tokens, head_dim] for positions start..start+n_tokens-1."""
    rotary = model.model.rotary_emb
    device = device if device is not None else rotary.inv_freq.device
    pos = torch.arange(start, start + n_tokens, device=device)[None]  # [1, tokens]
    probe = torch.empty(0, dtype=torch.float32, device=device)
    with torch.autocast(device_type=torch.device(device).type, enabled=False):
        cos, sin = rotary(probe, pos)
    return cos[0].float(), sin[0].float()  # [tokens, head_dim]


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate k [..., tokens, head_dim] by positions whose tables are cos/sin [tokens, head_dim]."""
    return k * cos + rotate_half(k) * sin


def apply_rope_into(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                    scratch: torch.Tensor) -> torch.Tensor:
    """`apply_rope` written into `out` half by half, with no full-size temporary.

    The same products and sums in the same order (so the same bits): the first half is
    k1*cos1 - k2*sin1, the second k2*cos2 + k1*sin2. `scratch` holds one half [..., dim/2].
    """
    h = k.shape[-1] // 2
    k1, k2 = k[..., :h], k[..., h:]
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(k1, cos[:, :h], out=o1)
    o1.sub_(torch.mul(k2, sin[:, :h], out=scratch))
    torch.mul(k2, cos[:, h:], out=o2)
    o2.add_(torch.mul(k1, sin[:, h:], out=scratch))
    return out


def strip_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` with the same tables: a rotation by the negative angle."""
    return k * cos - rotate_half(k) * sin


class RopeCache:
    """Per-model cos/sin tables, grown on demand and sliced per length (no recomputation per call)."""

    def __init__(self, model):
        self.model = model
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, n_tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < n_tokens or (device is not None and self.cos.device != torch.device(device)):
            n = max(n_tokens, 2 * (self.cos.shape[0] if self.cos is not None else 0), 64)
            self.cos, self.sin = rope_tables(self.model, n, device=device)
        return self.cos[:n_tokens], self.sin[:n_tokens]
