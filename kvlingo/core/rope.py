"""RoPE: strip a model's rotation from its cached keys, and apply another model's.

cos/sin come from each model's own `rotary_emb` module (its `inv_freq` buffer, its
schedule), evaluated in FP32 with autocast off. Those tables already carry the schedule's
attention scaling s (transformers multiplies cos and sin by `attention_scaling`: yarn's
0.1·ln(factor) + 1, longrope's sqrt(1 + ln(factor)/ln(original length)), 1 elsewhere), so a
cached key is s·R(θ)k. Applying a target's tables therefore gives exactly what the target
would cache, and the strip tables are the apply tables divided by s², the inverse of s·R(θ)
(for s = 1 they are the apply tables themselves, bit for bit). In BF16 the model rotates in
BF16; we strip and re-apply in FP32 and round once at the end (doing it all in BF16 loses far
more than one rounding).

Schedules (`rope_parameters["rope_type"]`): default, linear, llama3 and yarn fix their
frequencies when the model is built. longrope switches between its short and long factors by
the length of each forward (longer than `original_max_position_embeddings` or not), so its
tables are kept per regime and a capture of n tokens is stripped with the regime a prefill of n
tokens used (a cache grown by decoding across that length mixes the regimes; the suite's source
caches are single prefills). dynamic (NTK) rescales the frequencies with the longest sequence seen so far, so
a cached key's rotation depends on the model's history: refused (`schedule_refusal`).

tests/core/test_rope.py and tests/core/test_keyspace.py hold every schedule's round trip (strip,
re-apply) to its bound against transformers' own rotation, in FP32 and BF16.
"""

from __future__ import annotations

import torch

# Schedules whose cos/sin at a position are fixed once the model is built (longrope: per regime).
STATIC_SCHEDULES = ("default", "linear", "llama3", "yarn", "longrope")


def schedule_refusal(rope_parameters: dict | None) -> str | None:
    """Why a RoPE schedule cannot be stripped and re-applied exactly (naming the fix), or None."""
    rope = dict(rope_parameters or {})
    kind = rope.get("rope_type", "default")
    if "dynamic" in kind:
        return (
            f"RoPE schedule {kind!r} rescales its frequencies with the longest sequence the model has seen, so "
            "a cached key's rotation depends on the sequence length and cannot be stripped exactly; use a static "
            "schedule (rope_type 'linear' or 'yarn' with the same factor) or remove the rope scaling"
        )
    if kind not in STATIC_SCHEDULES:
        return (
            f"RoPE schedule {kind!r} is not supported (supported: {', '.join(STATIC_SCHEDULES)}); "
            "use a model whose rope_parameters use one of those"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return (
            f"partial rotary embedding (partial_rotary_factor={rope['partial_rotary_factor']}) is not "
            "supported: keys are rotated over the whole head_dim; use a model with partial_rotary_factor 1"
        )
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def rope_tables(model, n_tokens: int, start: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 (cos, sin) of shape [tokens, head_dim] for positions start..start+n_tokens-1, as the model
    applies them (attention scaling included; longrope's regime that of a forward ending there)."""
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


def apply_rope_into(
    k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
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
    """A rotation by the negative angle: the inverse of `apply_rope` with the same unit tables. Scaled
    tables (attention scaling s ≠ 1) are undone by `RopeCache.inverse`'s tables (divided by s²)."""
    return k * cos - rotate_half(k) * sin


class RopeCache:
    """Per-model apply and strip tables, grown on demand and sliced per length (no recomputation per call).

    `cache(n)` gives the (cos, sin) [n, head_dim] a prefill of n tokens applied; `cache.inverse(n)`
    the tables that undo them (`strip_rope` with these is the exact inverse of `apply_rope` with those).
    """

    def __init__(self, model):
        rope = getattr(model.config, "rope_parameters", None) or {}
        refusal = schedule_refusal(rope)
        if refusal:
            raise ValueError(refusal)
        self.model = model
        self.scaling = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))  # s: cached keys are s·R(θ)k
        # longrope's regime switch: tables for n tokens differ on either side of this length
        self.switch = int(rope["original_max_position_embeddings"]) if rope.get("rope_type") == "longrope" else None
        self.tables: dict[bool, tuple[torch.Tensor, ...]] = {}  # long regime? → (cos, sin, strip cos, strip sin)

    def _tables(self, n_tokens: int, device) -> tuple[torch.Tensor, ...]:
        long = self.switch is not None and n_tokens > self.switch
        have = self.tables.get(long)
        if (
            have is None
            or have[0].shape[0] < n_tokens
            or (device is not None and have[0].device != torch.device(device))
        ):
            n = max(n_tokens, 2 * (have[0].shape[0] if have is not None else 0), 64)
            if self.switch is not None and not long:
                n = min(n, self.switch)  # a longer table would be the long regime's
            cos, sin = rope_tables(self.model, n, device=device)
            inv = 1.0 / self.scaling**2
            have = (cos, sin, cos, sin) if self.scaling == 1.0 else (cos, sin, cos * inv, sin * inv)
            self.tables[long] = have
        return have

    def __call__(self, n_tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin, _, _ = self._tables(n_tokens, device)
        return cos[:n_tokens], sin[:n_tokens]

    def inverse(self, n_tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Strip tables [n, head_dim]: `strip_rope(k, *inverse(n))` undoes `apply_rope(k, *self(n))`."""
        _, _, cos, sin = self._tables(n_tokens, device)
        return cos[:n_tokens], sin[:n_tokens]
