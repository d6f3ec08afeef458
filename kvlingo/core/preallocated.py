"""A preallocated KV cache on transformers' public cache interface (`Cache`, `CacheLayerMixin`).

The whole model's K/V live in two tensors [layers, kv_heads, capacity, head_dim]; layer l
owns the slice [l:l+1] ([1, kv_heads, capacity, head_dim], transformers' per-layer layout).
`length` tokens are filled. A forward's `update` writes the new tokens' K/V in place at
[length, length + new) and hands attention views of [0, length + new), so attention reads
exactly the real tokens: no concatenation (DynamicCache copies the whole cache in every
layer at every step), no padded capacity under a mask (what StaticCache attends over).

A translator writes a context straight in through `context(n)`, then `set_length(n)`.

Deferred values (`defer_values`): when every translated value is an affine map of source
values (`ValueMaps`: head-wise, cross-head, cross-layer and low-rank maps alike), a context's
translated values never need to exist. For target layer l and KV head j, the value at token
t is v_t = x_t W + b, where x_t concatenates the source values head j reads (source layers s,
source heads h). Attention is linear in the values, so for any attention weights p over the
context,

    Σ_t p_t (x_t W + b) = (Σ_t p_t x_t) W + (Σ_t p_t) b,    Σ_t p_t x_t = [Σ_t p_t v_src[t, s, h]] over (s, h)

and the target can attend over the source's own values and map each query row's mix: a new
turn's few rows instead of every context token (a low-rank W = D U applies D, then U, to the
mix). A layer then holds the context's keys (translated) and, for the context, views of the
source's values of the layers it reads and its map; the values of tokens after it (the new
turn, generation) are the target's own, kept from row 0 of the value buffer on.
`attention.deferred_attention` reads both. Such a cache only works with that attention
(`cache.run_with_cache` switches to it): `values` holds the target's own rows only, and
transformers' attention refuses keys and values of different lengths.

Capacity is a hint: a layer that would overflow moves to buffers twice as large (the first
overflowing step pays one copy), so generation of unknown length stays correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .arch import head_dim


class PreallocatedLayer(CacheLayerMixin):
    is_compileable = False  # the filled length is a Python int (shapes are fixed per call)
    is_croppable = True
    is_sliding = False

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int = 0):
        super().__init__()
        self.key_buffer = key_buffer  # [1, kv_heads, capacity, head_dim]
        self.value_buffer = value_buffer  # [1, kv_heads, capacity, head_dim]
        self.device = key_buffer.device
        self.is_initialized = True
        self.deferred: Deferred | None = None  # the context's values as the source's plus the maps
        self.set_length(length)

    @property
    def offset(self) -> int:
        """Tokens whose values are deferred: the value buffer's row 0 is token `offset`."""
        return 0 if self.deferred is None else self.deferred.tokens

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[2]

    def set_length(self, n: int) -> None:
        if not self.offset <= n <= self.capacity:
            raise ValueError(
                f"cache length {n} outside {self.offset}..{self.capacity}"
                + (" (the first tokens' values are deferred)" if self.offset else "")
            )
        self.length = n
        self.keys = self.key_buffer[:, :, :n]  # what transformers and callers read: the filled part
        self.values = self.value_buffer[:, :, : n - self.offset]

    def defer(self, deferred: Deferred | None) -> None:
        """Hold the first `deferred.tokens` tokens' values as the source's plus the maps (None: no
        deferral), and mark exactly those tokens filled."""
        self.deferred = deferred
        self.set_length(self.offset)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the buffers exist from construction

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.capacity)
        for name, filled in (("key_buffer", self.length), ("value_buffer", self.length - self.offset)):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], size, old.shape[3]))
            new[:, :, :filled].copy_(old[:, :, :filled])
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value states [1, kv_heads, new, head_dim] → views of the filled K/V including them."""
        end, offset = self.length + key_states.shape[-2], self.offset
        if end > self.capacity:
            self._grow(end)
        self.key_buffer[:, :, self.length : end].copy_(key_states)
        self.value_buffer[:, :, self.length - offset : end - offset].copy_(value_states)
        self.set_length(end)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset): the filled tokens plus the new ones

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows when full, as a DynamicLayer does

    def reset(self) -> None:
        self.defer(None)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.set_length(max(0, self.length + tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the preallocated cache is batch-one: no beam search")

    def offload(self):
        raise NotImplementedError("the preallocated cache stays on its device")


@dataclass(frozen=True)
class ValueMaps:
    """A translator's values as affine maps of the source's values (`Translator.value_maps`): for target
    layer l and KV head j,

        v[l, j] = x[l, j] · weight[l, j] + bias[l, j]            (x[l, j] · down[l] · weight[l, j] + bias[l, j])

    where x[l, j] concatenates, over the source layers `layers[l]` in order and, within each, the source
    heads head j reads (head j alone when `per_head`, else every source head in order), those heads'
    values: its width, the mix width, is k · d_s (per head) or k · source kv_heads · d_s."""

    layers: tuple[tuple[int, ...], ...]  # [target layers][k]: the source layers each target layer reads
    per_head: bool  # target head j reads source head j alone (head-wise maps); else every source head
    weight: torch.Tensor  # [target layers, target kv_heads, mix width (or down's rank), d_out], FP32
    bias: torch.Tensor  # [target layers, target kv_heads, d_out], FP32
    down: torch.Tensor | None = None  # [target layers, mix width, rank], FP32: a low-rank map's first factor
    # A token term, v[l, j] += u · token_weight[l, j], for the first token_weight.shape[0] target layers, where u
    # is a per-token input the caller gives with the capture (the token features through the family's
    # down-projection: kvlingo.core.families.tokeninput); attention mixes u as it mixes the source's values.
    token_weight: torch.Tensor | None = None  # [token layers, target kv_heads, token width, d_out], FP32


@dataclass
class Deferred:
    """One layer's context values, deferred: views of the source's values it reads and the map that translates them."""

    sources: tuple[torch.Tensor, ...]  # k × [source kv_heads, tokens, d_s]: the source's values of the layers read
    per_head: bool  # target head j reads source head j alone (`ValueMaps.per_head`)
    weight: torch.Tensor  # [kv_heads, mix width or rank, d_out], FP32
    bias: torch.Tensor  # [kv_heads, d_out], FP32
    down: torch.Tensor | None = None  # [mix width, rank], FP32, or None (a full-rank map)
    token_input: torch.Tensor | None = None  # [tokens, token width]: the per-token input of a token term
    token_weight: torch.Tensor | None = None  # [kv_heads, token width, d_out], FP32: its map

    @property
    def tokens(self) -> int:
        return self.sources[0].shape[1]


class PreallocatedCache(Cache):
    """A model's cache of one conversation: [layers, kv_heads, capacity, head_dim] keys and values."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int = 0):
        if key_buffer.shape != value_buffer.shape or key_buffer.dim() != 4:
            raise ValueError(
                f"key/value buffers {tuple(key_buffer.shape)} / {tuple(value_buffer.shape)} must both be "
                "[layers, kv_heads, capacity, head_dim]"
            )
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        super().__init__(
            layers=[
                PreallocatedLayer(key_buffer[i : i + 1], value_buffer[i : i + 1], length)
                for i in range(key_buffer.shape[0])
            ]
        )

    @classmethod
    def empty(cls, model, capacity: int, dtype: torch.dtype | None = None, device=None) -> PreallocatedCache:
        """Unfilled buffers for `model` with room for `capacity` tokens (in the model's dtype and device)."""
        cfg = model.config
        p = next(model.parameters())
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max(1, capacity), head_dim(cfg))
        keys = torch.empty(shape, dtype=dtype or p.dtype, device=device or p.device)
        return cls(keys, torch.empty_like(keys))

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    def set_length(self, n: int) -> None:
        """Mark the first n tokens of every layer as filled (after writing them through `context`)."""
        for layer in self.layers:
            layer.set_length(n)

    @property
    def deferred(self) -> bool:
        """Whether the context's values are deferred (see the module docstring)."""
        return any(layer.deferred is not None for layer in self.layers)

    def fill(self, n: int) -> None:
        """Mark the first n tokens of every layer filled, with their values in the value buffer (no deferral)."""
        for layer in self.layers:
            layer.defer(None)
            layer.set_length(n)

    def defer_values(
        self, values: torch.Tensor, maps: ValueMaps, token_input: torch.Tensor | None = None, native_layers: int = 0
    ) -> None:
        """The context's values as the source's `values` [source layers, source kv_heads, tokens, d_s]
        and `maps` (`ValueMaps`: the layers each target layer reads are kept as views, never copied);
        the context's keys are written through `context(tokens)` first. Marks those tokens filled.

        `token_input` [tokens, token width]: the per-token input of the maps' token term (`maps.token_weight`).
        The first `native_layers` layers keep the values written through `context(tokens)` (the target's own
        layer 0 under the exact:0 refresh), deferring nothing."""
        L, H, d = len(self.layers), self.key_buffer.shape[1], self.key_buffer.shape[3]
        if values.dim() != 4:
            raise ValueError(f"deferred values {tuple(values.shape)} must be [source layers, kv_heads, tokens, d_in]")
        S, Hs, n, ds = values.shape
        k = len(maps.layers[0]) if maps.layers else 0
        mix = k * ds * (1 if maps.per_head else Hs)
        width = mix if maps.down is None else maps.down.shape[-1]
        wrong = []
        if len(maps.layers) != L or any(len(ls) != k or not all(0 <= s < S for s in ls) for ls in maps.layers):
            wrong.append(f"the maps read {len(maps.layers)} layer lists, not {L} of {k} source layers below {S}")
        if maps.per_head and Hs != H:
            wrong.append(f"per-head maps need {H} source KV heads, not {Hs}")
        if maps.down is not None and tuple(maps.down.shape[:2]) != (L, mix):
            wrong.append(f"down {tuple(maps.down.shape)} is not [{L}, {mix}, rank]")
        if tuple(maps.weight.shape) != (L, H, width, d) or tuple(maps.bias.shape) != (L, H, d):
            wrong.append(
                f"maps {tuple(maps.weight.shape)} / {tuple(maps.bias.shape)} are not [{L}, {H}, {width}, {d}] "
                f"/ [{L}, {H}, {d}]"
            )
        tokens = 0 if maps.token_weight is None else maps.token_weight.shape[0]
        if tokens and (
            token_input is None or token_input.shape[0] != n or token_input.shape[1] != maps.token_weight.shape[2]
        ):
            got = None if token_input is None else tuple(token_input.shape)
            wrong.append(f"the token term needs an input [{n}, {maps.token_weight.shape[2]}], got {got}")
        if wrong:
            raise ValueError(
                f"deferred values {tuple(values.shape)} and their maps do not fit this cache: " + "; ".join(wrong)
            )
        if n > self.capacity:
            raise ValueError(f"{n} deferred tokens exceed the capacity {self.capacity}")
        for i, layer in enumerate(self.layers):
            if i < native_layers:  # its values are the target's own, already written
                layer.defer(None)
                layer.set_length(n)
                continue
            token = i < tokens
            layer.defer(
                Deferred(
                    tuple(values[s] for s in maps.layers[i]),
                    maps.per_head,
                    maps.weight[i],
                    maps.bias[i],
                    None if maps.down is None else maps.down[i],
                    token_input if token else None,
                    maps.token_weight[i] if token else None,
                )
            )

    def context(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of the first n token slots: (keys, values), each [layers, kv_heads, n, head_dim].

        Valid until a layer grows; views of the whole-model buffers, so strided along layers and heads."""
        if n > self.capacity or any(
            layer.key_buffer.data_ptr() != self.key_buffer[i].data_ptr() for i, layer in enumerate(self.layers)
        ):
            raise ValueError(
                f"context({n}) needs the original buffers with room for {n} tokens "
                f"(capacity {self.capacity}; a layer may have grown)"
            )
        return self.key_buffer[:, :, :n], self.value_buffer[:, :, :n]
