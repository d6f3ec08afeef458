"""Key spaces: what a translator reads from the source's keys and what it must hand the target.

Values carry no RoPE and no norm: a translator reads and writes them as cached. Keys are
cached after k_norm (Qwen3; Llama and Qwen2 have none) and RoPE, so a translator works in
one of two key spaces:

- `prenorm`: the source's k_proj outputs (pre k_norm, pre RoPE; captured beside the cache)
  map to the target's k_proj outputs; the target's own k_norm (if it has one) and RoPE follow.
  Without a k_norm this is the pre-RoPE key.
- `cache`: the source's cached keys with the source's RoPE stripped map to the target's
  post-norm keys; the target's RoPE follows. Needs nothing beyond an ordinary cache.

`KeySpace` binds one of these to a pair's models: the RoPE tables of both (grown on demand)
and the target's k_norm. Every translator family owns one and goes through it, so no caller
ever branches on the key space.
"""

from __future__ import annotations

import torch

from . import arch, fused
from .cache import Capture
from .fused import strip_keys as fused_strip
from .norm import rms_norm, rms_norm_
from .rope import RopeCache, apply_rope, apply_rope_into, strip_rope
from .settings import KEY_SPACES  # noqa: F401  (re-exported)

# The target weights a key space reads (checkpoint names, a `model.` prefix or none): `prenorm` keys are finished
# with the target's own k_norm of every layer (`finish_keys`); `cache` keys need no target weight.
TARGET_WEIGHTS = {"prenorm": (r"(model\.)?layers\.\d+\.self_attn\.k_norm\.weight",), "cache": ()}


def read_weight_names(names, key_space: str) -> list[str]:
    """Of a checkpoint's tensor `names`, those the key space `key_space` reads of the target."""
    import re

    patterns = [re.compile(p) for p in TARGET_WEIGHTS[key_space]]
    return sorted(n for n in names if any(p.fullmatch(n) for p in patterns))


def k_norm_params(model) -> tuple[torch.Tensor | None, float]:
    """The model's per-layer k_norm weights [layers, head_dim] (FP32) and its epsilon; (None, 0.0) for
    a family without k_norm (Llama, Qwen2), whose pre-norm key is already the pre-RoPE key."""
    layers = model.model.layers
    if arch.k_norm(layers[0]) is None:
        return None, 0.0
    w = torch.stack([arch.k_norm(l).weight.detach().float() for l in layers])
    return w, arch.k_norm(layers[0]).variance_epsilon


class KeySpace:
    """One key space bound to a source and a target model."""

    def __init__(self, name: str, source, target, device=None):
        if name not in KEY_SPACES:
            raise ValueError(f"key space {name!r} is not one of {KEY_SPACES}")
        self.name = name
        self.source_rope = RopeCache(source)
        self.target_rope = RopeCache(target)
        w, eps = k_norm_params(target)
        self.k_norm_weight = (
            w if device is None or w is None else w.to(device)
        )  # [target layers, head_dim] FP32 or None
        self.k_norm_eps = eps

    @property
    def needs_prenorm(self) -> bool:
        """Whether a capture of the source must keep its pre-norm key features."""
        return self.name == "prenorm"

    def to(self, device) -> KeySpace:
        if self.k_norm_weight is not None:
            self.k_norm_weight = self.k_norm_weight.to(device)
        return self

    # ------------------------------------------------------------------ source side
    def source_keys(
        self, cap: Capture, layers=slice(None), dtype: torch.dtype = torch.float32, fused: bool = False
    ) -> torch.Tensor:
        """Source key inputs [layers, heads, tokens, d_in] in `dtype` (FP32 maths, one rounding) for the selected
        source layers. `fused`: the cache space's RoPE strip as one compiled kernel (`fused.strip_keys`, the same
        maths, not the same bits), where it runs."""
        if self.name == "prenorm":
            if cap.prenorm is None:
                raise ValueError(
                    "key space 'prenorm' needs the source's pre-norm key features; capture with want_prenorm=True"
                )
            return cap.prenorm[layers].to(dtype)
        keys = cap.keys[layers]
        cos, sin = self.source_rope.inverse(cap.n_tokens, device=keys.device)
        if fused:
            out = torch.empty(keys.shape, dtype=dtype, device=keys.device)
            if fused_strip(keys, cos, sin, out):
                return out
        return strip_rope(keys.float(), cos, sin).to(dtype)

    # ------------------------------------------------------------------ target side
    def target_keys(self, target_cap: Capture) -> torch.Tensor:
        """What a translator's key output should be for the target's own capture (the fit's targets)."""
        if self.name == "prenorm":
            return target_cap.prenorm.float()
        cos, sin = self.target_rope.inverse(target_cap.n_tokens, device=target_cap.keys.device)
        return strip_rope(target_cap.keys.float(), cos, sin)

    def finish_keys(self, yk: torch.Tensor, layers=slice(None)) -> torch.Tensor:
        """Translated key features [n, heads, tokens, d_out] of target `layers` → the target's cached keys."""
        if self.name == "prenorm" and self.k_norm_weight is not None:
            yk = rms_norm(yk, self.k_norm_weight[layers], self.k_norm_eps)
        cos, sin = self.target_rope(yk.shape[2], device=yk.device)
        return apply_rope(yk, cos, sin)

    def finish_keys_into(self, yk: torch.Tensor, layers: slice, k_out: torch.Tensor, scratch, start: int = 0) -> None:
        """`finish_keys` in place: yk (FP32 scratch) is normed in place and RoPE writes into k_out.

        The same operations in the same order as `finish_keys` (so the same bits). For a
        non-FP32 output, RoPE writes into one FP32 staging chunk that is rounded once.
        `start`: the position of yk's first token (a tile of a longer context).
        """
        n = yk.shape[0]
        if self.name == "prenorm" and self.k_norm_weight is not None:
            rms_norm_(yk, self.k_norm_weight[layers], self.k_norm_eps, scratch.take("sq", n))
        cos, sin = self.target_rope(start + yk.shape[2], device=yk.device)
        dest = k_out if k_out.dtype == torch.float32 else scratch.take("out", n)
        apply_rope_into(yk, cos[start:], sin[start:], dest, scratch.take("half", n))
        if dest is not k_out:
            k_out.copy_(dest)  # the one rounding to the output dtype

    def finish_keys_fused(
        self, yk: torch.Tensor, layers: slice, k_out: torch.Tensor, addend: torch.Tensor | None = None
    ) -> bool:
        """`finish_keys_into` of yk (+ `addend`) for a whole chunk as one compiled kernel (kvlingo.core.fused): the
        same maths, not the same bits. False when the kernel did not run (then the caller adds the addend and its
        eager finish writes the keys)."""
        norm = self.name == "prenorm" and self.k_norm_weight is not None
        cos, sin = self.target_rope(yk.shape[2], device=yk.device)
        weight = self.k_norm_weight[layers] if norm else None
        return fused.finish_keys(yk, weight, self.k_norm_eps, cos, sin, k_out, addend)
