"""Distillation objectives aimed at the reply tokens the context decides.

Plain distillation averages KL(native target ‖ translated) over every reply token, and most
reply tokens do not depend on the conversation (the template, "Answer:", the words around a
fact); the few that do (the number, the name, the rule) are where a translated cache fails.

- **Context weighting** (`context_weight` = α in [0, 1]). Each reply position's KL is weighted by
  how much the context changes the native prediction there, c_t = KL(native ‖ native without
  the context), the same quantity `kvlingo.eval.context` thresholds to pick context tokens:

      loss = mean_t [(1 − α) + α · c_t / mean_t(c)] · KL_t

  (α = 0 is plain distillation; the weights keep a mean of 1, so α does not rescale the loss.)
  The no-context prediction is the target reading only the last prefix token and the reply,
  the benchmark's no-context arm: one extra forward over the reply.
- **On-policy distillation** (`onpolicy` = λ, generalized knowledge distillation): a share λ of
  the conversations is scored on a reply the target samples (temperature 1) from the
  translated cache itself, rather than on the data set's reply, so the translator learns on
  the states its own errors lead to; the loss on that reply is the same KL to the native target
  reading the true context. Which conversations go on-policy is a fixed, evenly spread schedule
  over their position in the data order (`onpolicy_at`), and the sampling draws from torch's
  global RNG, whose state checkpoints keep, so a resumed run samples what an uninterrupted one does.
"""

from __future__ import annotations

import math

import torch

from ..core.cache import handoff_split
from ..core.handoff import as_ids, device_of, translate
from ..core.kl import token_kl


def context_change(target, new: list[int], native_logits: torch.Tensor) -> torch.Tensor:
    """c_t = KL(native ‖ the target reading `new` with no context) per position [len(new)], FP32, no grad."""
    with torch.no_grad():
        bare = target(input_ids=as_ids(new, device_of(target)), use_cache=False).logits[0]
        v = min(bare.shape[-1], native_logits.shape[-1])
        return token_kl(native_logits[:, :v], bare[:, :v])


def context_weights(change: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 − α) + α · c / mean(c): per-position weights of mean 1 (uniform where the context changes nothing)."""
    mean = change.mean()
    if alpha == 0 or not mean > 0:
        return torch.ones_like(change)
    return (1 - alpha) + alpha * change / mean


def onpolicy_at(index: int, share: float) -> bool:
    """Whether the conversation at position `index` of the data order is scored on-policy: ⌊(i+1)λ⌋ > ⌊iλ⌋, so
    exactly ⌊nλ⌋ of any first n are, evenly spread (λ = 0.5: every second one)."""
    return share > 0 and math.floor((index + 1) * share + 1e-9) > math.floor(index * share + 1e-9)


@torch.no_grad()
def onpolicy_row(
    source,
    target,
    translator,
    row: dict,
    dtype: torch.dtype,
    refresh=None,
    max_new_tokens: int | None = None,
    eos_ids: set[int] | None = None,
    temperature: float = 1.0,
    kind: str = "preallocated",
) -> dict:
    """`row` with its reply replaced by one the target samples on the translated cache of prefix[:-1] (the
    handoff's convention, a cache of `kind`), up to the data reply's length (or `max_new_tokens`), its stop token
    kept."""
    context, _, _ = handoff_split(row["prefix_ids"], row["reply_ids"])
    cap = max_new_tokens or len(row["reply_ids"])
    kv = translate(source, translator, context, dtype, refresh=refresh, target=target, kind=kind)
    from ..core.cache import build_cache, run_with_cache

    device = device_of(target)
    cache = build_cache(target, *kv, kind=kind, room=cap + 1)
    x, out_ids = as_ids(row["prefix_ids"][-1:], device), []
    for _ in range(cap):
        out, _ = run_with_cache(target, x, cache=cache)
        cache = out.cache
        probs = torch.softmax(out.logits[0, -1].float() / temperature, -1)
        nxt = int(torch.multinomial(probs, 1))
        out_ids.append(nxt)
        if eos_ids and nxt in eos_ids:
            break
        x = torch.tensor([[nxt]], device=device)
    return {**row, "reply_ids": out_ids, "onpolicy": True}
