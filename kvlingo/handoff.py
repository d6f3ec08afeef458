"""The handoff itself: the source reads a context, its cache is translated, the target goes on.

Shared by every stage that scores or times a handoff (benchmark, IFEval, tasks).
"""

from __future__ import annotations

import torch

from .cache import build_cache, capture, run_with_cache
from .maps import Translator


def as_ids(ids, device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)[None]  # [1, tokens]


@torch.no_grad()
def translated_cache(source, translator: Translator, context_ids, out_dtype: torch.dtype):
    """Source prefill of `context_ids`, then translation: target-layout (keys, values)."""
    device = next(source.parameters()).device
    cap = capture(source, as_ids(context_ids, device), want_prenorm=translator.maps.key_space == "prenorm", logits_to_keep=1)
    return translator(cap, out_dtype)


@torch.no_grad()
def native_cache(model, context_ids):
    """The model's own cache of `context_ids` (keys, values)."""
    device = next(model.parameters()).device
    cap = capture(model, as_ids(context_ids, device), want_prenorm=False, logits_to_keep=1)
    return cap.keys, cap.values


@torch.no_grad()
def greedy_generate(model, new_ids, kv: tuple[torch.Tensor, torch.Tensor] | None = None, max_new_tokens: int = 64,
                    eos_ids: set[int] | None = None) -> tuple[list[int], bool]:
    """Greedy decoding of up to `max_new_tokens` after `new_ids`, on top of an optional injected cache.

    Returns (generated ids without the stop token, hit_cap). `new_ids` must be non-empty:
    its last position yields the first generated token.
    """
    device = next(model.parameters()).device
    cache = build_cache(model, *kv) if kv is not None else None
    x = as_ids(new_ids, device)
    out_ids: list[int] = []
    eos_ids = eos_ids or set()
    for _ in range(max_new_tokens):
        out, _ = run_with_cache(model, x, cache=cache)
        cache = out.cache
        nxt = int(out.logits[0, -1].argmax())
        if nxt in eos_ids:
            return out_ids, False
        out_ids.append(nxt)
        x = torch.tensor([[nxt]], device=device)
    return out_ids, True


def stop_ids(tokenizer) -> set[int]:
    """Token ids that end an assistant turn."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.add(i)
    return {i for i in ids if i is not None}
