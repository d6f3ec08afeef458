"""A preallocated KV cache on transformers' public cache interface (`Cache`, `CacheLayerMixin`).

The whole model's K/V live in two tensors [layers, kv_heads, capacity, head_dim]; layer l
owns the slice [l:l+1] ([1, kv_heads, capacity, head_dim], transformers' per-layer layout).
`length` tokens are filled. A forward's `update` writes the new tokens' K/V in place at
[length, length + new) and hands attention views of [0, length + new), so attention reads
exactly the real tokens: no concatenation (DynamicCache copies the whole cache in every
layer at every step), no padded capacity under a mask (what StaticCache attends over).

A translator writes a context straight in through `context(n)`, then `set_length(n)`.
Capacity is a hint: a layer that would overflow moves to buffers twice as large (the first
overflowing step pays one copy), so generation of unknown length stays correct.
"""

from __future__ import annotations

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
        self.set_length(length)

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[2]

    def set_length(self, n: int) -> None:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"cache length {n} outside 0..{self.capacity}")
        self.length = n
        self.keys = self.key_buffer[:, :, :n]  # what transformers and callers read: the filled part
        self.values = self.value_buffer[:, :, :n]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the buffers exist from construction

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.capacity)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], size, old.shape[3]))
            new[:, :, :self.length].copy_(old[:, :, :self.length])
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value states [1, kv_heads, new, head_dim] → views of the filled K/V including them."""
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self.key_buffer[:, :, self.length:end].copy_(key_states)
        self.value_buffer[:, :, self.length:end].copy_(value_states)
        self.set_length(end)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset): the filled tokens plus the new ones

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows when full, as a DynamicLayer does

    def reset(self) -> None:
        self.set_length(0)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.set_length(max(0, self.length + tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the preallocated cache is batch-one: no beam search")

    def offload(self):
        raise NotImplementedError("the preallocated cache stays on its device")


class PreallocatedCache(Cache):
    """A model's cache of one conversation: [layers, kv_heads, capacity, head_dim] keys and values."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int = 0):
        if key_buffer.shape != value_buffer.shape or key_buffer.dim() != 4:
            raise ValueError(f"key/value buffers {tuple(key_buffer.shape)} / {tuple(value_buffer.shape)} must both be "
                             "[layers, kv_heads, capacity, head_dim]")
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        super().__init__(layers=[PreallocatedLayer(key_buffer[i:i + 1], value_buffer[i:i + 1], length)
                                 for i in range(key_buffer.shape[0])])

    @classmethod
    def empty(cls, model, capacity: int, dtype: torch.dtype | None = None, device=None) -> "PreallocatedCache":
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

    def context(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of the first n token slots: (keys, values), each [layers, kv_heads, n, head_dim].

        Valid until a layer grows; views of the whole-model buffers, so strided along layers and heads."""
        if n > self.capacity or any(layer.key_buffer.data_ptr() != self.key_buffer[i].data_ptr()
                                    for i, layer in enumerate(self.layers)):
            raise ValueError(f"context({n}) needs the original buffers with room for {n} tokens "
                             f"(capacity {self.capacity}; a layer may have grown)")
        return self.key_buffer[:, :, :n], self.value_buffer[:, :, :n]
