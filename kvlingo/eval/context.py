"""Metrics on the reply tokens the context decides, and on what attention reads from the cache.

KL per reply token averages over tokens that do not depend on the conversation (the template,
"Answer:", the words around a fact), so it can fall while the facts are still lost. These
metrics look where the facts are:

- **context change** c_t = KL(native target ‖ the target with no context) at each reply
  position: how much the conversation changes the native prediction there. The no-context
  prediction is the benchmark's no-context arm (the target reads only the last prefix token and
  the reply). On the toy world c_t is bimodal (about half the reply tokens under 0.1 nat, most
  of the rest above 1), so the context tokens are those with c_t > `THRESHOLD`.
- **context KL** and **context top-1**: KL(native ‖ arm) and argmax agreement over the context
  tokens only; **context-weighted KL** Σ c_t KL_t / Σ c_t over every reply token (the
  quantity context-weighted distillation, kvlingo.train.objectives, minimises).
- **attention-output agreement**: the cosine between each target layer's attention-block output
  (its o_proj output) at each reply position on the native cache and on the arm's cache,
  averaged over layers and positions: what the continuation actually reads from the cache,
  where KL only sees the end of the network.

Per conversation these are sums (`score`, `attention_agreement`), and `summarize` reports
token-weighted means and per-conversation means ± SE with their n.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.kl import token_kl, top1_agreement
from .stats import mean_se

THRESHOLD = 1.0  # nats of KL(native ‖ no context) above which a reply token counts as decided by the context


def context_change(ref: torch.Tensor, bare: torch.Tensor) -> torch.Tensor:
    """c_t = KL(ref ‖ bare) per position [tokens] (vocabularies cropped to the shorter), FP32."""
    v = min(ref.shape[-1], bare.shape[-1])
    return token_kl(ref[:, :v], bare[:, :v])


def score(ref: torch.Tensor, logits: torch.Tensor, change: torch.Tensor, threshold: float = THRESHOLD) -> dict:
    """Sums over the reply of one conversation: context KL and top-1 over the tokens with change > threshold,
    and the change-weighted KL over all of them."""
    v = min(ref.shape[-1], logits.shape[-1])
    kl = token_kl(ref[:, :v], logits[:, :v])
    top1 = top1_agreement(ref[:, :v], logits[:, :v])
    mask = change > threshold
    return {
        "ctx_kl_sum": kl[mask].sum().item(),
        "ctx_top1_sum": top1[mask].sum().item(),
        "ctx_n_tokens": int(mask.sum()),
        "wkl_sum": (change * kl).sum().item(),
        "w_sum": change.sum().item(),
    }


def attention_agreement(native: Sequence[torch.Tensor], arm: Sequence[torch.Tensor]) -> dict:
    """Σ over layers and positions of cos(native attention output, the arm's), and the count."""
    if len(native) != len(arm):
        raise ValueError(f"{len(native)} native layer outputs against {len(arm)} of the arm")
    cos = torch.stack([torch.nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(native, arm)])
    return {"attn_cos_sum": cos.sum().item(), "attn_n": int(cos.numel())}


def summarize(items: Sequence[dict]) -> dict:
    """The context metrics of an arm over conversations (rows holding `score` and `attention_agreement` sums);
    empty when the rows hold none."""
    if not items or "ctx_n_tokens" not in items[0]:
        return {}
    n_ctx = sum(a["ctx_n_tokens"] for a in items)
    with_ctx = [a for a in items if a["ctx_n_tokens"]]
    out = {
        "context_threshold_nats": THRESHOLD,
        "context_tokens": n_ctx,
        "context_kl_token_mean": sum(a["ctx_kl_sum"] for a in items) / n_ctx if n_ctx else float("nan"),
        "context_kl_conversation": mean_se([a["ctx_kl_sum"] / a["ctx_n_tokens"] for a in with_ctx]),
        "context_top1": sum(a["ctx_top1_sum"] for a in items) / n_ctx if n_ctx else float("nan"),
        "context_top1_conversation": mean_se([a["ctx_top1_sum"] / a["ctx_n_tokens"] for a in with_ctx]),
        "context_weighted_kl": (sum(a["wkl_sum"] for a in items) / w)
        if (w := sum(a["w_sum"] for a in items))
        else float("nan"),
    }
    if "attn_n" in items[0]:
        out["attention_cosine"] = mean_se([a["attn_cos_sum"] / a["attn_n"] for a in items])
    return out
