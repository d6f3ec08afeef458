"""The translator interface: what a family's maps provide, and what every family shares.

A translator turns a source capture (`cache.Capture`) into the target's K/V, ready for
`cache.build_cache`. Each family (head-wise, cross-head, cross-layer, residual, token input) lives
in its own package under kvlingo/core/families: a declaration (`settings.Family`: its options,
variants and what it reads; no torch, so flags parse without it) and its maps, a `Translator`
subclass that provides (the abstract methods below, shapes in their docstrings):

- its state (an `nn.Module`: parameters and buffers, saved as maps.safetensors) and `settings()`;
- `map(part, cap, layers)`: FP32 target features of the keys or the values (`Part`) of a run of
  target layers, differentiable; `map_into` the same written into a buffer;
- its cost (`flops_per_token`, of keys and values apart or together);
- its key space (`KeySpace`: what it reads from the source's keys, how its key output is finished into
  the target's cached keys), and so whether a capture needs pre-norm features.

A family with a closed form is a `LinearFamily`: it also lays its maps out as least-squares
blocks (kvlingo.train.closed_form fits them). Translation itself (`forward`) is shared: with
gradients on, every layer at once in FP32; without, the chunked engine (kvlingo.core.engine).
The folder format and the one loader are kvlingo.records.saved. Callers never branch on the family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import Refusal
from . import engine
from .cache import Capture
from .keyspace import KeySpace
from .preallocated import ValueMaps
from .settings import PARTS, Geometry, Part  # noqa: F401  (re-exported for the families)


class TranslatorError(Refusal, ValueError):
    """A translator folder that is incomplete, damaged, or made for another pair, family or key space."""


class Translator(nn.Module, ABC):
    """A family's maps from a source's cache to a target's (see the module docstring)."""

    family: ClassVar[str] = ""  # its declaration's name (kvlingo.core.families.FAMILIES)
    # True when map_into reads `source` features in the compute dtype, takes parameters through
    # `cast`, and writes strided outputs (a cache's context view): then the engine's `fast` path applies.
    fast_paths: ClassVar[bool] = False

    def __init__(self, geometry: Geometry, key_space: str = "prenorm"):
        super().__init__()
        self.geometry = geometry
        self.key_space = key_space
        self.space: KeySpace | None = None  # bound to a pair's models by `bind`
        self._compute = torch.float32  # dtype of map inputs while the engine runs
        self._fused = False  # while the engine runs `fused`: the source keys' RoPE stripped by the compiled kernel
        self._casts: dict = {}  # (parameter id, dtype) → (version, data pointer, cast copy)

    # ------------------------------------------------------------------ what a family provides
    def settings(self) -> dict[str, Any]:
        """The family's own settings (beyond geometry and key space), JSON-able; saved in the manifest."""
        return {}

    @abstractmethod
    def map(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        """FP32 target features of the keys or the values (`part`) of target `layers`:
        [n layers, target kv_heads, tokens, target head_dim] (keys before the target's norm and RoPE)."""

    def map_into(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor) -> None:
        """`map` written into `out` [n layers, target kv_heads, tokens, target head_dim] (maybe strided)."""
        out.copy_(self.map(part, cap, layers))

    def map_into_via(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """`map_into` for an `out` that the maps cannot write in place (token-major, an engine's cache, or another
        dtype): into `scratch` (contiguous, `out`'s shape, the compute dtype), then copied. A family may write part
        of it in place."""
        self.map_into(part, cap, layers, scratch)
        out.copy_(scratch)

    def map_keys_into(self, cap: Capture, layers: slice, out: torch.Tensor) -> torch.Tensor | None:
        """The key map in two terms, for the engine's compiled finish: the first written into `out`, the second
        returned (of `out`'s shape) for the finish to add on its way, or None when `out` holds the whole map.
        `out` + the second term is `map`'s sum. A family whose map is one term writes it all (`map_into`)."""
        self.map_into(Part.KEYS, cap, layers, out)
        return None

    @abstractmethod
    def flops_per_token(self, part: Part | None = None) -> float:
        """Multiply-adds × 2 per context token of the key or value maps (`part`), or of both (None); norm
        and RoPE excluded."""

    def flops_per_token_without(self, own_layers: Sequence[int] = ()) -> float:
        """`flops_per_token` of a handoff that translates every target layer but `own_layers` (those it takes from
        the target itself: `Refresh.own_layers`). A family whose layers cost the same each; one whose layers differ
        (token features at chosen layers) counts its own."""
        L = self.geometry.target_layers
        return self.flops_per_token() * (L - len(set(own_layers))) / L

    def value_maps(self) -> ValueMaps | None:
        """Every target value as an affine map of source values (`preallocated.ValueMaps`, FP32 and
        detached), for a family whose value maps are linear in the source's values; then a handoff may
        leave the values deferred (kvlingo.core.preallocated). None for any other family."""
        return None

    def deferred_token_input(self, cap: Capture) -> torch.Tensor | None:
        """The per-token input of the value maps' token term (`ValueMaps.token_weight`) for a capture: [tokens,
        width]; None for a family without one."""
        return None

    def deferred_input_flops_per_token(self) -> float:
        """FLOPs per context token of `deferred_token_input` (0 for a family without one)."""
        return 0.0

    @classmethod
    def from_spec(cls, geometry: Geometry, key_space: str, settings: dict[str, Any]) -> Translator:
        return cls(geometry, key_space, **settings)

    # ------------------------------------------------------------------ shared
    def spec(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "key_space": self.key_space,
            "settings": self.settings(),
            "geometry": asdict(self.geometry),
        }

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def reads_layer0(self) -> bool:
        """Whether the maps read the target's layer-0 features of the token ids (its declaration says)."""
        from .families import FAMILIES

        return FAMILIES[self.family].reads_layer0

    @property
    def needs_prenorm(self) -> bool:
        return self.key_space == "prenorm"

    @property
    def device(self) -> torch.device:
        p = next(iter(self.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def bind(self, source, target) -> Translator:
        """Attach the pair's RoPE tables and target k_norm (on this translator's device); returns self."""
        got = Geometry.of(source, target)
        if got != self.geometry:
            raise TranslatorError(
                f"this {self.family} translator has geometry {asdict(self.geometry)}, but the pair "
                f"has {asdict(got)}: it was made for another pair"
            )
        self.space = KeySpace(self.key_space, source, target, device=self.device)
        return self

    def use_space(self, space: KeySpace) -> None:
        """Read source keys through `space`: this translator and every translator inside it (a composite family's
        base), which shares its key space."""
        for m in self.modules():
            if isinstance(m, Translator):
                m.space = space

    def _apply(self, fn, *args, **kwargs):  # .to(device) moves the bound k_norm too
        out = super()._apply(fn, *args, **kwargs)
        if self.space is not None:
            self.space.to(self.device)
        return out

    def source(self, part: Part, cap: Capture, layers=slice(None)) -> torch.Tensor:
        """Source features of the keys or the values (`part`) of source `layers`: [n, heads, tokens, d_in], in
        FP32 (in the compute dtype while a `fast` translation runs)."""
        if part == Part.VALUES:
            return cap.values[layers].to(self._compute)
        return self.space.source_keys(cap, layers, dtype=self._compute, fused=self._fused)

    def cast(self, p: torch.Tensor) -> torch.Tensor:
        """A parameter in the compute dtype (itself in FP32); the cast copy is kept until the parameter changes."""
        dtype = self._compute
        if p.dtype == dtype:
            return p
        key = (id(p), dtype)
        hit = self._casts.get(key)
        if hit is None or hit[0] != p._version or hit[1] != p.data_ptr():
            hit = (p._version, p.data_ptr(), p.detach().to(dtype))
            self._casts[key] = hit
        return hit[2]

    @contextmanager
    def computing(self, dtype: torch.dtype, fused: bool = False):
        """`source` and `cast` hand the maps their inputs in `dtype` inside the block (the engine's `fast` path);
        `fused`: `source` strips the keys' RoPE with the compiled kernel (`fused.strip_keys`). For this translator
        and every translator inside it (a composite family's base)."""
        inner = [m for m in self.modules() if isinstance(m, Translator)]
        for m in inner:
            m._compute, m._fused = dtype, fused
        try:
            yield
        finally:
            for m in inner:
                m._compute, m._fused = torch.float32, False

    def translate_layers(self, cap: Capture, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 target keys and values for a run of target layers: [n, heads, tokens, head_dim] each."""
        with torch.autocast(device_type=cap.keys.device.type, enabled=False):
            yk = self.map(Part.KEYS, cap, layers)
            yv = self.map(Part.VALUES, cap, layers)
            return self.space.finish_keys(yk, layers), yv

    def forward(
        self,
        cap: Capture,
        out_dtype: torch.dtype | None = None,
        chunk_elements: int | None = None,
        target_layers: slice = slice(None),
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        precision: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate a capture: target (keys, values), each [target layers, kv_heads, tokens, head_dim].

        `target_layers`: only these target layers (a refresh computes the others natively).
        `out`: (keys, values) to write into instead of fresh tensors, e.g. a preallocated cache's
        `context(tokens)` (their dtype is the output dtype; shaped for `target_layers`); values None
        translates the keys only (a handoff whose values stay deferred, `value_maps`). `precision`:
        one of `engine.PRECISIONS` (None: fp32). With gradients on, always FP32 maths.
        """
        return engine.translate(self, cap, out_dtype, chunk_elements, target_layers, out, precision)


class LinearFamily(Translator):
    """A family with a closed form: its maps are least-squares blocks of one shape each
    (kvlingo.train.closed_form streams their normal equations and solves them in FP64)."""

    needs_plan: ClassVar[bool] = False  # whether the closed form must rank source layers first (`set_plan`)

    @abstractmethod
    def fit_blocks(self) -> tuple[int, int, int, int]:
        """(layers, blocks per layer, d_in, d_out) of the least-squares blocks."""

    @abstractmethod
    def design(self, part: Part, cap: Capture) -> torch.Tensor:
        """Regression inputs of the keys or the values per block: [layers, blocks, tokens, d_in]."""

    @abstractmethod
    def block_targets(self, y: torch.Tensor) -> torch.Tensor:
        """Target features [layers, heads, tokens, d] laid out per block: [layers, blocks, tokens, d_out]."""

    @abstractmethod
    def block_weights(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """Per-position weights [layers, heads, tokens] laid out per block (None: uniform)."""

    def set_plan(self, layers: torch.Tensor) -> None:
        """The ranked source layers per target layer (families whose `needs_plan`)."""
        raise NotImplementedError(f"the {self.family} family has no layer plan")

    def set_solution(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """The FP64 solution per block into the FP32 maps (a family that solves otherwise overrides `solve_from`)."""
        raise NotImplementedError(f"the {self.family} family solves its blocks in solve_from")

    def solve_from(self, ne, ridge) -> None:
        """Solve streamed normal equations (kvlingo.core.fit) into the parameters."""
        self.set_solution(*ne.solve(ridge))

    @property
    def chooses_layers(self) -> bool:
        """Whether the closed form chooses where the inputs go before solving (`choose_from`: held-out conversations,
        so --ridge auto)."""
        return False

    def choose_from(self, fit, held_out, ridge, native_layers: tuple[int, ...] = ()) -> dict | None:
        """Before `solve_from`, a family that chooses where its inputs go chooses on `held_out`'s conversations (fit on
        `fit`'s; `held_out` None without --ridge auto), never among `native_layers` (target layers the handoff takes
        from the target itself), and returns its choice for the fit's statistics; None here."""
        return None
