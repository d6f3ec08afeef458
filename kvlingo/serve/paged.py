"""Writing K/V into a vLLM engine's paged cache through its own writer, and reading them back.

An attention layer's cache is one tensor whose layout belongs to the backend (on the CPU,
[blocks, kv_heads, block_size, 2·head_dim] with each (block, head) tile holding K in an
ISA-specific arrangement, then V). Nothing here assumes it:

- `write` hands K/V [tokens, kv_heads, head_dim] and their slots to the layer's own
  `impl.do_kv_cache_update`, the call the engine makes for its own tokens.
- `Reader` learns where that writer puts each element of a block: it writes known codes
  into a one-block scratch cache (each code split into base-256 digits, exact in every float
  dtype a cache uses), reads back where each landed, and keeps the gather index. It then
  checks the round trip on random K/V bit for bit and refuses a layout that is not a
  permutation (an FP8 cache, for one).

Slots are vLLM's: slot = block_id · block_size + offset in the block.
"""

from __future__ import annotations

import torch

DIGIT = 256  # codes are written one base-256 digit at a time: 1..256 are exact in BF16, FP16 and FP32


class LayoutError(RuntimeError):
    """A cache layout the reader cannot invert (not a permutation of the written elements)."""


def slots(block_ids: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Slots of token positions [start, stop) of a request whose block table is `block_ids`."""
    pos = torch.arange(start, stop)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def write(layer, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, kv_cache=None) -> None:
    """keys/values [tokens, kv_heads, head_dim] (the cache's dtype) into their slots, by the backend's writer."""
    cache = layer.kv_cache if kv_cache is None else kv_cache
    layer.impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), cache, slot_mapping)


class Reader:
    """Reads K/V of given slots out of caches laid out as one layer's (same block size, heads, head_dim, dtype)."""

    def __init__(self, layer, kv_heads: int, head_dim: int, block_size: int):
        cache = layer.kv_cache
        self.shape, self.dtype = tuple(cache.shape), cache.dtype
        self.kv_heads, self.head_dim, self.block_size = kv_heads, head_dim, block_size
        self.tile = cache[0].numel()  # elements of one block
        self.index = self._probe(layer)  # [2, block_size, kv_heads, head_dim]: element → position in a block's tile
        self._check(layer)

    def matches(self, cache: torch.Tensor, block_size: int) -> bool:
        return tuple(cache.shape[1:]) == self.shape[1:] and cache.dtype == self.dtype and block_size == self.block_size

    def read(self, cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [tokens, kv_heads, head_dim] held in `slot_mapping`'s slots."""
        flat = cache.view(cache.shape[0], -1)  # [blocks, tile]
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        rows = blocks[:, None, None]
        return flat[rows, self.index[0][offsets]], flat[rows, self.index[1][offsets]]

    # ------------------------------------------------------------------ learning the layout
    def _scratch(self) -> torch.Tensor:
        return torch.zeros((1, *self.shape[1:]), dtype=self.dtype)

    def _probe(self, layer) -> torch.Tensor:
        B, H, d = self.block_size, self.kv_heads, self.head_dim
        n = 2 * B * H * d
        codes = torch.arange(n).view(2, B, H, d)
        where = torch.zeros(self.tile, dtype=torch.long)  # tile position → code
        place = 1
        while True:  # one base-256 digit of every code per pass
            scratch = self._scratch()
            digit = (codes // place) % DIGIT + 1  # 1..256; 0 marks a place nothing was written to
            write(layer, digit[0].to(self.dtype), digit[1].to(self.dtype), torch.arange(B), scratch)
            got = scratch.view(-1).to(torch.float64).round().long()
            written = got > 0
            where += (got - 1).clamp(min=0) * place
            if place * DIGIT >= n:
                break
            place *= DIGIT
        positions = torch.nonzero(written).view(-1)
        found = where[positions]
        if positions.numel() != n or torch.unique(found).numel() != n:
            raise LayoutError(
                f"the cache writer put {n} elements into {positions.numel()} places "
                f"({torch.unique(found).numel()} distinct codes): not a layout this reader inverts"
            )
        index = torch.empty(n, dtype=torch.long)
        index[found] = positions
        return index.view(2, B, H, d)

    def _check(self, layer) -> None:
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(self.block_size, self.kv_heads, self.head_dim, generator=g).to(self.dtype) for _ in "kv")
        scratch = self._scratch()
        where = torch.arange(self.block_size)
        write(layer, k, v, where, scratch)
        rk, rv = self.read(scratch, where)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise LayoutError("reading back random K/V through the learned layout did not return them bit for bit")
