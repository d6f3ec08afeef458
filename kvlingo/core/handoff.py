"""The handoff, written once: the source reads a context, its cache is translated, the target goes on.

    capture_source  the source prefills the context (keeping pre-norm key features when a
                    translator needs them, and only the last position's logits)
    translate       capture → translator → target-layout (keys, values)
    translate_to_cache  capture → translator → the target's cache, ready for a new turn: on a
                    preallocated cache the translator writes straight into it (no copy), or,
                    with value maps linear in the source's values, writes the keys and leaves
                    the values deferred
    continue_target the target runs new tokens on top of injected (keys, values) or a cache
    greedy_generate the target (or any model) decodes greedily on top of an injected cache
    attention_outputs  each layer's attention-block output at a turn's positions, while active
                    (distillation's attention term and the benchmark's attention agreement)

The cache kind (`cache.CACHE_KINDS`: preallocated by default, or transformers' DynamicCache
as shipped) is one argument of each; a stage passes its pair config's (`PairConfig.cache`).

Every stage that scores, times, trains or generates after a handoff (benchmark, controls,
timing, distillation, IFEval, tasks) calls these; none re-assembles the steps itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import torch

from .cache import Capture, build_cache, capture, continue_from, empty_cache, run_with_cache


def as_ids(ids, device) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)[None]  # [1, tokens]


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def prefill(model, ids: torch.Tensor, want_prenorm: bool = False, kind: str = "preallocated") -> Capture:
    """A prefill as a real handoff runs it: `cache.capture` of ids [1, T], keeping the last position's logits only."""
    return capture(model, ids, want_prenorm=want_prenorm, logits_to_keep=1, kind=kind)


def capture_source(source, context_ids, translators: Iterable = (), kind: str = "preallocated") -> Capture:
    """The source's capture of `context_ids` (a sequence or a [1, T] tensor), with pre-norm key
    features when any of `translators` needs them."""
    ids = context_ids if torch.is_tensor(context_ids) else as_ids(context_ids, device_of(source))
    with torch.no_grad():
        return prefill(source, ids, want_prenorm=any(t.needs_prenorm for t in translators), kind=kind)


def translate(
    source,
    translator,
    context_ids=None,
    out_dtype: torch.dtype | None = None,
    cap: Capture | None = None,
    refresh=None,
    target=None,
    precision: str | None = None,
    kind: str = "preallocated",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-layout (keys, values) of a context: from an existing source capture `cap`, or a fresh
    prefill of `context_ids`. Differentiable in the translator's parameters when gradients are on.

    `refresh` (kvlingo.core.refresh.Refresh) has the `target` recompute part of the context
    natively on top of the translated rest; it needs the context's token ids.
    `precision`: the translation's (`engine.PRECISIONS`; None: fp32). `kind`: the cache of the
    source's prefill (and of the target's native part under a refresh).
    """
    if cap is None:
        cap = capture_source(source, context_ids, [translator], kind)
    if refreshing(refresh):
        from .refresh import refreshed_kv

        if target is None or context_ids is None:
            raise ValueError("a refresh needs the target model and the context's token ids")
        return refreshed_kv(source, target, translator, context_ids, refresh, out_dtype, cap, kind)
    return translator(cap, out_dtype, precision=precision)


def refreshing(refresh) -> bool:
    return refresh is not None and refresh.kind != "none"


def can_defer_values(translator, kind: str = "preallocated", refresh=None) -> bool:
    """Whether a handoff with `translator` can leave the context's values deferred: a family whose value
    maps are affine in the source's values and token features (`Translator.value_maps`: head-wise,
    cross-head, cross-layer, token input), a preallocated cache, and no refresh but exact:0 (whose layer 0
    is the target's own, values and all)."""
    return kind == "preallocated" and not _other_refresh(refresh) and translator.value_maps() is not None


def _exact_layer0(refresh) -> bool:
    return refresh is not None and refresh.kind == "exact"


def _other_refresh(refresh) -> bool:
    """A refresh that needs the target's own forward over the context (every kind but none and exact:0)."""
    return refreshing(refresh) and not _exact_layer0(refresh)


def translate_to_cache(
    source,
    target,
    translator,
    context_ids=None,
    cap: Capture | None = None,
    room: int = 0,
    kind: str = "preallocated",
    out_dtype: torch.dtype | None = None,
    into=None,
    precision: str | None = None,
    refresh=None,
    defer_values: bool = False,
):
    """The target's cache of a context translated from the source, with `room` free token slots after it.

    Preallocated (the default kind): the translator writes the context straight into the cache's
    buffers (`into`, an unfilled `cache.empty_cache` of enough capacity, or a fresh one), so no
    copy follows; under exact:0 it writes layers 1.. and layer 0 is the target's own, from the
    token ids, written in place. Dynamic: `translate`, then a DynamicCache around its output, as
    shipped. Under any other refresh (`translate`), the assembled (keys, values) are copied into a
    cache of `kind`.

    `defer_values` (where `can_defer_values`): only the keys are translated; the cache keeps the
    source's values and the value maps, which its attention applies to each query row's mix of
    them (kvlingo.core.preallocated). The logits are the translated cache's to rounding.
    """
    if defer_values and not can_defer_values(translator, kind, refresh):
        raise ValueError(
            f"a {translator.family} translator cannot defer values here (it needs value maps affine in "
            "the source's values, a preallocated cache and no refresh but exact:0); leave defer_values off"
        )
    if cap is None:
        cap = capture_source(source, context_ids, [translator], kind)
    out_dtype = out_dtype or next(target.parameters()).dtype
    if _other_refresh(refresh) or (_exact_layer0(refresh) and kind != "preallocated"):
        kv = translate(source, translator, context_ids, out_dtype, cap, refresh, target, precision, kind)
        return build_cache(target, *kv, kind=kind, room=room)  # assembled, then one copy into the cache
    if kind != "preallocated":
        return build_cache(target, *translator(cap, out_dtype, precision=precision), kind="dynamic")
    n = cap.n_tokens
    cache = into if into is not None else empty_cache(target, n, room, out_dtype, cap.values.device)
    keys, values = cache.context(n)
    own = 1 if _exact_layer0(refresh) else 0  # target layers the target computes itself (layer 0, from the ids)
    rest = slice(own, translator.geometry.target_layers)
    if own:
        from .layer0 import exact_kv

        projections = translator.layer0_projections(cap) if translator.reads_layer0 else None  # computed once
        exact_kv(target, context_ids if context_ids is not None else cap.ids, keys[0], values[0], projections)
    if defer_values:
        translator(cap, out_dtype, out=(keys[rest], None), target_layers=rest, precision=precision)  # keys only
        cache.defer_values(cap.values, translator.value_maps(), translator.deferred_token_input(cap), own)
    else:
        translator(cap, out_dtype, out=(keys[rest], values[rest]), target_layers=rest, precision=precision)
        cache.fill(n)
    return cache


def continue_target(target, kv, new_ids, kind: str = "preallocated", **kwargs):
    """The target's forward of `new_ids` on a fresh cache holding kv = (keys, values), or on a ready cache
    (from `translate_to_cache`); positions continue after it."""
    ids = new_ids if torch.is_tensor(new_ids) else as_ids(new_ids, device_of(target))
    if isinstance(kv, tuple):
        return continue_from(target, kv[0], kv[1], ids, kind=kind, **kwargs)
    out, _ = run_with_cache(target, ids, cache=kv, **kwargs)
    return out


@torch.no_grad()
def greedy_generate(
    model,
    new_ids: Sequence[int],
    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_new_tokens: int = 64,
    eos_ids: set[int] | None = None,
    kind: str = "preallocated",
    cache=None,
) -> tuple[list[int], bool]:
    """Greedy decoding of up to `max_new_tokens` after `new_ids`, on top of an optional injected cache
    (kv = (keys, values)) or a ready `cache` (from `translate_to_cache`; it grows as it is used).

    Returns (generated ids without the stop token, hit_cap). `new_ids` must be non-empty:
    its last position yields the first generated token.
    """
    device = device_of(model)
    room = len(new_ids) + max_new_tokens
    if cache is not None and kv is not None:
        raise ValueError("give kv or a ready cache, not both")
    if kv is not None:
        cache = build_cache(model, *kv, kind=kind, room=room)
    x = as_ids(new_ids, device)
    out_ids: list[int] = []
    eos_ids = eos_ids or set()
    for _ in range(max_new_tokens):
        out, _ = run_with_cache(model, x, cache=cache, kind=kind, room=room)
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


@contextmanager
def attention_outputs(model, last: int, into: list):
    """Collect each layer's attention-block output at the last `last` positions, in FP32, while active
    ([last, hidden] each, appended to `into` in layer order; differentiable where the forward is)."""
    hooks = [
        layer.self_attn.register_forward_hook(lambda _m, _i, out: into.append(out[0][0, -last:].float()))
        for layer in model.model.layers
    ]
    try:
        yield into
    finally:
        for h in hooks:
            h.remove()
