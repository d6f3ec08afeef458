"""Where a handoff's error lives, layer by layer.

For one conversation, a translated cache (a translator under its refresh) and the target's own cache of the
same context, with the target continuing on the reply as every quality arm does (`cache.handoff_split`):

    full       KL(native ‖ the translated cache)                                   the handoff's error
    alone[l]   KL(native ‖ the target's own cache with layer l translated)         what layer l carries alone
    healed[l]  KL(native ‖ the translated cache with layer l the target's own)     removed[l] = full − healed[l]

summed over the reply tokens (KL per token in FP32, `kl.token_kl`). Across conversations, each layer's share
of the error is its mean alone[l] over the sum of those means (how the error would split if the layers did
not interact), and its mean removed[l] over the mean full KL (what making that one layer exact removes).
A layer the translator does not write (layer 0 under exact:0) carries none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..core.cache import handoff_split
from ..core.handoff import as_ids, capture_source, continue_target, device_of, translate
from ..core.kl import token_kl
from .stats import mean_se


def _kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    v = min(ref.shape[-1], logits.shape[-1])
    return float(token_kl(ref[:, :v], logits[:, :v]).sum())


@torch.no_grad()
def layer_errors(source, target, translator, conv: dict, out_dtype, refresh=None, kind: str = "preallocated") -> dict:
    """{"n_tokens", "full", "alone": [L], "healed": [L]}: KL sums over one conversation's reply tokens."""
    device = device_of(target)
    context, new, _ = handoff_split(conv["prefix_ids"], conv["reply_ids"])
    new_t = as_ids(new, device)
    own = capture_source(target, context, kind=kind)
    own_k, own_v = own.keys.to(out_dtype), own.values.to(out_dtype)  # [L, kv_heads, T, head_dim]
    ref = continue_target(target, (own_k, own_v), new_t, kind).logits[0].float()
    keys, values = translate(source, translator, context, out_dtype, refresh=refresh, target=target, kind=kind)

    def kl(k: torch.Tensor, v: torch.Tensor) -> float:
        return _kl(ref, continue_target(target, (k, v), new_t, kind).logits[0].float())

    alone, healed = [], []
    for layer in range(keys.shape[0]):
        k, v = own_k.clone(), own_v.clone()
        k[layer], v[layer] = keys[layer], values[layer]
        alone.append(kl(k, v))
        k, v = keys.clone(), values.clone()
        k[layer], v[layer] = own_k[layer], own_v[layer]
        healed.append(kl(k, v))
    return {"n_tokens": len(new), "full": kl(keys, values), "alone": alone, "healed": healed}


def summarize(rows: Sequence[dict]) -> dict:
    """Per layer: mean alone and removed KL per reply token (± SE over conversations), and their shares."""
    n_layers = len(rows[0]["alone"])
    per_token = lambda r, x: x / r["n_tokens"]  # noqa: E731
    full = mean_se([per_token(r, r["full"]) for r in rows])
    layers = []
    for layer in range(n_layers):
        alone = mean_se([per_token(r, r["alone"][layer]) for r in rows])
        removed = mean_se([per_token(r, r["full"] - r["healed"][layer]) for r in rows])
        layers.append({"layer": layer, "alone_kl": alone, "removed_kl": removed})
    total_alone = sum(layer["alone_kl"]["mean"] for layer in layers)
    for layer in layers:
        layer["alone_share"] = layer["alone_kl"]["mean"] / total_alone if total_alone > 0 else math.nan
        layer["removed_share"] = layer["removed_kl"]["mean"] / full["mean"] if full["mean"] > 0 else math.nan
    tokens = sum(r["n_tokens"] for r in rows)
    return {"n_conversations": len(rows), "n_tokens": tokens, "full_kl": full, "layers": layers}


def where(summary: dict, top: int = 3) -> list[int]:
    """The layers carrying the largest share of the error alone, largest first."""
    ranked = sorted(summary["layers"], key=lambda x: -x["alone_share"] if math.isfinite(x["alone_share"]) else 0)
    return [x["layer"] for x in ranked[:top]]
