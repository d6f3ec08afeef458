"""The store of source caches: what each engine computed, per conversation, for another engine to translate.

An engine's connector saves every request's K/V as it is computed (prompt, then each decoded
token), keyed by the token ids it covers. A request on another engine looks up the entry whose
ids share the longest prefix with its prompt. The store lives in the serving process: engines
share it when they run in one process (vLLM's `LLM` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`);
engines in separate processes each see only their own.

An entry is `exact` when every token in it was computed by its model from the conversation
itself; one whose request started from a translated or reused cache is not (its later tokens
attended to that cache), and is never offered as the model's own cache.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Entry:
    key: int  # unique within the process
    model: dict[str, Any]  # the computing model: `contract.ServedModel.to_dict()`
    exact: bool  # every token computed natively from the conversation (see the module docstring)
    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim], as cached (post k_norm, post RoPE)
    values: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    ids: torch.Tensor  # [capacity] token ids (long)
    n: int = 0  # tokens filled, 0..n-1 in position order
    done: bool = False  # its request finished: the entry no longer grows
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def write(self, start: int, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens [start, start + len(ids)) with K/V [layers, kv_heads, tokens, head_dim]; positions must follow on."""
        stop = start + len(ids)
        if start > self.n:
            raise ValueError(f"cache entry {self.key} holds {self.n} tokens; cannot write from position {start}")
        with self.lock:
            if stop > self.keys.shape[2]:
                self._grow(max(stop, 2 * self.keys.shape[2]))
            self.keys[:, :, start:stop] = keys
            self.values[:, :, start:stop] = values
            self.ids[start:stop] = torch.as_tensor(ids, dtype=torch.long)
            self.n = max(self.n, stop)

    def prefix(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [layers, kv_heads, n, head_dim] of its first n tokens (views)."""
        with self.lock:
            if n > self.n:
                raise ValueError(f"cache entry {self.key} holds {self.n} tokens, not {n}")
            return self.keys[:, :, :n], self.values[:, :, :n]

    def common_prefix(self, ids: torch.Tensor) -> int:
        """How many leading tokens of `ids` (long) this entry holds."""
        k = min(self.n, ids.numel())
        differ = torch.nonzero(self.ids[:k] != ids[:k])
        return int(differ[0]) if differ.numel() else k

    def _grow(self, capacity: int) -> None:
        L, H, _, d = self.keys.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty(L, H, capacity, d, dtype=old.dtype)
            new[:, :, : self.n] = old[:, :, : self.n]
            setattr(self, name, new)
        ids = torch.zeros(capacity, dtype=torch.long)
        ids[: self.n] = self.ids[: self.n]
        self.ids = ids


class Store:
    """Entries of every engine in this process, evicted oldest-first past `capacity_bytes` (finished ones first)."""

    def __init__(self, capacity_bytes: int = 8 << 30):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.active: dict[tuple[str, str], Entry] = {}  # (engine, request id) → its growing entry
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def entry_for(
        self,
        engine: str,
        request: str,
        model: dict[str, Any],
        exact: bool,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        tokens: int,
    ) -> Entry:
        """The growing entry of a request, made on its first save with room for `tokens`."""
        with self._lock:
            entry = self.active.get((engine, request))
            if entry is None:
                L, H, d = shape
                cap = max(tokens, 16)
                entry = Entry(
                    next(self._keys),
                    model,
                    exact,
                    torch.empty(L, H, cap, d, dtype=dtype),
                    torch.empty(L, H, cap, d, dtype=dtype),
                    torch.zeros(cap, dtype=torch.long),
                )
                self.active[(engine, request)] = entry
                self.entries[entry.key] = entry
            self.entries.move_to_end(entry.key)
            self._evict()
            return entry

    def finish(self, engine: str, request: str) -> None:
        with self._lock:
            entry = self.active.pop((engine, request), None)
            if entry is not None:
                entry.done = True

    def get(self, key: int) -> Entry | None:
        with self._lock:
            return self.entries.get(key)

    def lookup(self, ids: list[int]) -> list[tuple[Entry, int]]:
        """(entry, tokens of `ids` it holds) for every entry sharing at least one leading token, longest first."""
        want = torch.as_tensor(ids, dtype=torch.long)
        with self._lock:
            entries = list(self.entries.values())
        found = [(e, e.common_prefix(want)) for e in entries if e.n]
        return sorted([(e, c) for e, c in found if c], key=lambda ec: -ec[1])

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.active.clear()

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self.entries.values())
        for entry in sorted(self.entries.values(), key=lambda e: not e.done):  # finished first, oldest first
            if total <= self.capacity_bytes or len(self.entries) == 1:
                return
            if entry.done:
                total -= entry.nbytes
                del self.entries[entry.key]


STORE = Store()  # the process's store, shared by every engine's connector in it
