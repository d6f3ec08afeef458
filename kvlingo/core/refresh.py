"""Refresh: recompute part of a translated context natively, on top of the translated rest.

Translation is cheap and approximate; re-prefill is exact and slow. A refresh setting picks a
point between them:

    none        pure translation
    tail:W      translate the first T−W context tokens; the target prefills the last W itself,
                attending to the translated cache of the others
    layers:K    the target computes its first K layers natively for the whole context (a forward
                stopped before layer K); the translator supplies layers K..L−1
    select:R    the fraction R of context tokens whose translated cache deviates most from the
                target's own is recomputed: deviation measured at the target's first layer
                (whose K/V needs only the embeddings, so it is cheap to compute exactly), then
                the chosen tokens run through all layers at their true positions, attending
                causally to the translated cache of the others (a 4-D attention mask and
                position ids, through transformers' public forward)
    layer:l     a diagnostic rather than a saving: the target's own K/V at layer l alone (it needs
                the target's layers 0..l natively), the translator's everywhere else; a sweep over l
                shows which layers carry the translation's damage (`frontier.py` reports it)
    exact:0     the target's own layer-0 K/V computed from the token ids alone (kvlingo.core.layer0:
                one projection per token, the same bits as its cache), the translator's elsewhere;
                refused for an architecture whose first layer is not context-free

W and K are counts, or a percentage of the context / of the target's layers (`tail:10%`,
`layers:25%`). The result is always the target's full cache [layers, kv_heads, T, head_dim],
in position order, so everything after a handoff is unchanged.

Costs (`refresh_flops`): dense FLOPs (2 × parameters touched per token) plus attention
(4 × query heads × head_dim per query-key pair) of what the target recomputes, and the
translator's FLOPs for what it translates; `kvlingo.bench.shapes` prices them at the real shapes.
"""

from __future__ import annotations

import math

import torch

from .arch import head_dim
from .cache import Capture, build_cache, capture
from .settings import REFRESH_KINDS as KINDS  # noqa: F401  (re-exported)
from .settings import Refresh, RefreshError  # noqa: F401  (re-exported)


# --------------------------------------------------------------------------- native parts
class _Stop(Exception):
    pass


def native_prefix_cache(target, ids: torch.Tensor, n_layers: int):
    """The target's own DynamicCache of ids [1, T] with its first n_layers filled: a forward stopped before
    layer n_layers (the later layers are never computed)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    layers = target.model.layers
    hook = None
    if n_layers < len(layers):

        def stop(_module, _args):
            raise _Stop

        hook = layers[n_layers].register_forward_pre_hook(stop)
    try:
        with torch.no_grad():
            target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    except _Stop:
        pass
    finally:
        if hook is not None:
            hook.remove()
    return cache


def native_prefix_layers(target, ids: torch.Tensor, n_layers: int):
    """The target's own cache of ids [1, T] for its first n_layers only (`native_prefix_cache`, stacked).

    Returns (keys, values), each [n_layers, kv_heads, T, head_dim] (None, None for no layers).
    """
    if n_layers == 0:
        return None, None
    return _stack(native_prefix_cache(target, ids, n_layers), n_layers)


def selection_mask(selected: list[int], kept: list[int], device) -> torch.Tensor:
    """Bool attention mask [1, 1, n_sel, n_kept + n_sel]: query at position p sees keys at positions ≤ p.

    Keys are the kept (translated) tokens followed by the selected ones, in that order.
    """
    q = torch.tensor(selected, device=device)
    kv = torch.tensor(kept + selected, device=device)
    return (kv[None, :] <= q[:, None])[None, None]


def refreshed_kv(
    source,
    target,
    translator,
    context_ids,
    refresh: Refresh,
    out_dtype=None,
    cap: Capture | None = None,
    kind: str = "preallocated",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's cache of `context_ids` under `refresh`: (keys, values) [layers, kv_heads, T, head_dim].
    `kind`: the cache of the source's prefill and of a whole-context native prefill."""
    device = next(target.parameters()).device
    ids = context_ids if torch.is_tensor(context_ids) else torch.as_tensor(list(context_ids), device=device)[None]
    T = ids.shape[1]
    if cap is None:
        with torch.no_grad():
            cap = capture(source, ids, want_prenorm=translator.needs_prenorm, logits_to_keep=1, kind=kind)
    if refresh.kind == "none":
        return translator(cap, out_dtype)
    if refresh.kind == "tail":
        return _tail(target, translator, cap, ids, refresh.tail_tokens(T), out_dtype, kind)
    L = target.config.num_hidden_layers
    if refresh.kind == "layers":
        k = refresh.native_layers(L)
        if k == 0:
            return translator(cap, out_dtype)
        return _with_native_layers(translator, cap, out_dtype, slice(0, k), native_prefix_cache(target, ids, k))
    if refresh.kind == "layer":
        l = refresh.layer_index(L)
        return _with_native_layers(translator, cap, out_dtype, slice(l, l + 1), native_prefix_cache(target, ids, l + 1))
    if refresh.kind == "exact":
        return _with_exact_layer0(target, translator, cap, ids, out_dtype)
    return _select(target, translator, cap, ids, refresh.selected_count(T), out_dtype, kind)


def _with_native_layers(translator, cap: Capture, out_dtype, native: slice, own):
    """The target's full cache with its layers `native` copied from `own` (the target's own cache, those layers
    filled) and every other layer translated straight into the result (the translator never computes the native
    layers, and each native layer is copied once, from the cache into the result)."""
    g = translator.geometry
    dtype = out_dtype or cap.keys.dtype
    keys = torch.empty(
        g.target_layers, g.target_kv_heads, cap.n_tokens, g.target_head_dim, dtype=dtype, device=cap.values.device
    )
    values = torch.empty_like(keys)
    for part in (slice(0, native.start), slice(native.stop, g.target_layers)):
        if part.start < part.stop:
            translator(cap, target_layers=part, out=(keys[part], values[part]))
    for l in range(native.start, native.stop):
        keys[l].copy_(own.layers[l].keys[0])
        values[l].copy_(own.layers[l].values[0])
    return keys, values


def _with_exact_layer0(target, translator, cap: Capture, ids: torch.Tensor, out_dtype):
    """The target's full cache with layer 0 from its token ids (`layer0.ContextFree`) and the others translated
    (differentiably when gradients are on: distillation under this setting)."""
    from .layer0 import ContextFree, NotContextFree

    try:
        k0, v0 = ContextFree(target).kv(ids[0])  # [kv_heads, T, head_dim] each
    except NotContextFree as err:
        raise RefreshError(f"refresh exact:0: {err}") from None
    rest = slice(1, translator.geometry.target_layers)
    dtype = out_dtype or cap.keys.dtype
    if torch.is_grad_enabled() and any(p.requires_grad for p in translator.parameters()):
        keys, values = translator(cap, dtype, target_layers=rest)
        return torch.cat([k0[None].to(dtype), keys]), torch.cat([v0[None].to(dtype), values])
    keys = torch.empty(translator.geometry.target_layers, *k0.shape, dtype=dtype, device=k0.device)
    values = torch.empty_like(keys)
    if rest.start < rest.stop:
        translator(cap, target_layers=rest, out=(keys[rest], values[rest]))
    keys[0].copy_(k0)
    values[0].copy_(v0)
    return keys, values


def _tail(target, translator, cap: Capture, ids: torch.Tensor, w: int, out_dtype, kind: str):
    T = ids.shape[1]
    if w == 0:
        return translator(cap, out_dtype)
    head = T - w
    if head == 0:  # everything natively: the target's own prefill
        with torch.no_grad():
            own = capture(target, ids, want_prenorm=False, logits_to_keep=1, kind=kind)
        return own.keys, own.values
    sliced = Capture(
        cap.keys[:, :, :head],
        cap.values[:, :, :head],
        None if cap.prenorm is None else cap.prenorm[:, :, :head],
        cap.logits,
        None if cap.ids is None else cap.ids[:head],
    )
    keys, values = translator(sliced, out_dtype)
    with torch.no_grad():
        out = target(
            input_ids=ids[:, head:],
            cache=build_cache(target, keys, values, kind="dynamic"),
            use_cache=True,
            logits_to_keep=1,
        )
    return _stack(out.cache)


def _select(target, translator, cap: Capture, ids: torch.Tensor, n_sel: int, out_dtype, kind: str):
    keys, values = translator(cap, out_dtype)
    T = ids.shape[1]
    if n_sel == 0:
        return keys, values
    if n_sel == T:  # every token recomputed: the target's own prefill
        return _tail(target, translator, cap, ids, T, out_dtype, kind)
    nk, nv = native_prefix_layers(target, ids, 1)  # the target's own layer 0: embeddings → K/V
    dev = (nk.float() - keys[:1].float()).pow(2).sum((0, 1, 3)) + (nv.float() - values[:1].float()).pow(2).sum(
        (0, 1, 3)
    )
    selected = sorted(dev.topk(n_sel).indices.tolist())  # [n_sel] positions, by deviation
    chosen = set(selected)
    kept = [t for t in range(T) if t not in chosen]
    cache = build_cache(target, keys[:, :, kept], values[:, :, kept], kind="dynamic")
    device = ids.device
    with torch.no_grad():
        out = target(
            input_ids=ids[:, selected],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            position_ids=torch.tensor([selected], device=device),
            attention_mask=selection_mask(selected, kept, device),
        )
    k_all, v_all = _stack(out.cache)  # kept tokens, then selected ones
    order = torch.tensor(kept + selected, device=device).argsort()
    return k_all[:, :, order], v_all[:, :, order]


def _stack(cache, n_layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A DynamicCache's first n_layers (all by default) as (keys, values) [layers, kv_heads, T, head_dim]."""
    layers = cache.layers[:n_layers]
    return torch.stack([layer.keys[0] for layer in layers]), torch.stack([layer.values[0] for layer in layers])


# --------------------------------------------------------------------------- cost
def forward_flops(cfg, n_query: int, n_keys: int, layers: int | None = None, lm_head: bool = False) -> float:
    """FLOPs of `layers` decoder layers (all by default) for n_query tokens attending to n_keys keys each (on
    average): 2 × the layer parameters per token, plus 4 × query heads × head_dim per query-key pair."""
    L = cfg.num_hidden_layers if layers is None else layers
    h, d, Hq, Hkv, ff = (
        cfg.hidden_size,
        head_dim(cfg),
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    )
    per_layer = h * Hq * d * 2 + h * Hkv * d * 2 + 3 * h * ff  # q, o; k, v; gate, up, down
    dense = 2.0 * L * per_layer * n_query
    attention = 4.0 * L * Hq * d * n_query * n_keys
    head = 2.0 * h * cfg.vocab_size if lm_head else 0.0
    return dense + attention + head


def refresh_flops(refresh: Refresh, source_cfg, target_cfg, translator, T: int) -> dict:
    """FLOPs of a handoff of a T-token context under `refresh`, and of re-prefilling it, at these configs.
    `translator`: the translator at these configs (`flops_per_token_without` prices the layers it translates), or
    its FLOPs per token when every layer costs the same."""
    tcfg = target_cfg
    reprefill = forward_flops(tcfg, T, (T + 1) / 2, lm_head=True)
    L = tcfg.num_hidden_layers

    def per_token(own: tuple[int, ...] = ()) -> float:  # FLOPs per token of translating every layer but `own`
        if isinstance(translator, (int, float)):
            return translator * (L - len(own)) / L
        return translator.flops_per_token_without(own)

    if refresh.kind == "tail":
        w = refresh.tail_tokens(T)
        native = forward_flops(tcfg, w, T - w + (w + 1) / 2)
        translated = per_token() * (T - w)
    elif refresh.kind == "layers":
        k = refresh.native_layers(L)
        native = forward_flops(tcfg, T, (T + 1) / 2, layers=k)
        translated = per_token(refresh.own_layers(L)) * T
    elif refresh.kind == "layer":  # the native forward must reach layer l; one layer less to translate
        l = refresh.layer_index(L)
        native = forward_flops(tcfg, T, (T + 1) / 2, layers=l + 1)
        translated = per_token((l,)) * T
    elif refresh.kind == "exact":  # layer 0 from the token ids: k_proj and v_proj per token
        from .layer0 import flops_per_token

        native = flops_per_token(tcfg) * T
        translated = per_token(refresh.own_layers(L)) * T
    elif refresh.kind == "select":
        n = refresh.selected_count(T)
        layer0 = 2.0 * tcfg.hidden_size * tcfg.num_key_value_heads * tcfg.head_dim * 2 * T  # k and v of layer 0
        native = forward_flops(tcfg, n, (T + 1) / 2) + (layer0 if n else 0.0)
        translated = per_token() * T
    else:
        native, translated = 0.0, per_token() * T
    total = native + translated
    return {
        "native_flops": native,
        "translate_flops": translated,
        "handoff_flops": total,
        "reprefill_flops": reprefill,
        "fraction_of_reprefill": total / reprefill,
        "ceiling_speedup": reprefill / total if total else math.inf,
    }
