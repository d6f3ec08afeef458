"""References and random inputs for the maths tests: transformers' own split execution and cache, textbook
least squares, F.kl_div, random ids and random head-wise maps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlingo.core.cache import Capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding is at most half of this, relatively


def random_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def split_reference(model, prefix, new):
    """Ordinary split execution through transformers: prefill, then continue on its own cache."""
    with torch.no_grad():
        first = model(input_ids=prefix, use_cache=True)
        return model(input_ids=new, cache=first.cache, use_cache=True).logits[0]


def transformers_split(model, prefix, new):
    """transformers' own path: a prefill, then the new tokens on its DynamicCache with its sdpa attention."""
    with torch.no_grad():
        first = model(input_ids=prefix, use_cache=True)
        return model(input_ids=new, cache=first.cache, use_cache=True).logits[0]


def random_maps(source, target, seed: int = 0, key_space: str = "prenorm") -> Headwise:
    maps = Headwise(Geometry.of(source, target), key_space).bind(source, target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        maps.weight.normal_(0, 0.3, generator=g)
        maps.bias.normal_(0, 0.1, generator=g)
    return maps.requires_grad_(False)


def fake_capture(g: Geometry, tokens: int, seed: int = 0) -> Capture:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.source_layers, g.source_kv_heads, tokens, g.source_head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(g.source_layers, g.source_kv_heads, tokens, g.source_head_dim, generator=gen, dtype=torch.float64)
    return Capture(keys=x, values=v, prenorm=x, logits=torch.empty(0))


def lstsq_blocks(x, y, w=None, ridge=0.0):
    """Per-block textbook least squares on [x, 1], rows scaled by √w, ridge as extra rows (bias not shrunk)."""
    L, B, T, d = x.shape
    out = torch.zeros(L, B, d + 1, y.shape[-1], dtype=torch.float64)
    for l in range(L):
        for b in range(B):
            a, t = torch.cat([x[l, b], torch.ones(T, 1, dtype=torch.float64)], 1), y[l, b]
            if w is not None:
                s = w[l, b].sqrt()[:, None]
                a, t = a * s, t * s
            if ridge:
                a = torch.cat([a, torch.eye(d + 1, dtype=torch.float64)[:d] * ridge**0.5])
                t = torch.cat([t, torch.zeros(d, t.shape[1], dtype=torch.float64)])
            out[l, b] = torch.linalg.lstsq(a, t).solution
    return out


def own_cache(model, ids):
    """transformers' own forward into a DynamicCache (no kvlingo code on the path): [layers] of (keys, values)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def tiny_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 320, (1, n), generator=torch.Generator().manual_seed(seed))


def kl_ref(p_logits, q_logits):
    """KL(P ‖ Q) per row by F.kl_div (input log Q, target log P)."""
    return F.kl_div(
        torch.log_softmax(q_logits.double(), -1),
        torch.log_softmax(p_logits.double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
