"""The translator interface: what every family is, declares and provides, and the registry that loads one by name.

A translator turns a source capture (`cache.Capture`) into the target's K/V, ready for
`cache.build_cache`. Every family (head-wise, cross-head, cross-layer, residual, token input) is a
`Translator` subclass registered with `@family`. It declares, in its own module:

- `options`: its settings, each an `Option` (flag, default, help; a default may depend on the pair's
  shapes, as a rank of half the target's KV width does). The training flags, a run's settings
  (`settings_from`), the profiles' defaults and the settings carried to other shapes (`carry`) are
  made from them, so no code outside the module lists a family's settings;
- `variants`: named settings worth comparing (`Variant`), the rows of `make ablate`;

and provides (the abstract methods below, shapes in their docstrings):

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
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import Refusal
from . import engine
from .arch import head_dim
from .cache import PARTS, Capture, Part  # noqa: F401  (Part and PARTS: re-exported for the families)
from .keyspace import KeySpace
from .preallocated import ValueMaps

FAMILIES: dict[str, type[Translator]] = {}  # family name → class, filled by @family


class TranslatorError(Refusal, ValueError):
    """A translator folder that is incomplete, damaged, or made for another pair, family or key space."""


@dataclass(frozen=True)
class Geometry:
    """The cache shapes on both sides of a translator."""

    source_layers: int
    source_kv_heads: int
    source_head_dim: int
    target_layers: int
    target_kv_heads: int
    target_head_dim: int

    @classmethod
    def of(cls, source_cfg, target_cfg) -> Geometry:
        """From two model configs (or models)."""
        s, t = getattr(source_cfg, "config", source_cfg), getattr(target_cfg, "config", target_cfg)
        return cls(
            s.num_hidden_layers,
            s.num_key_value_heads,
            head_dim(s),
            t.num_hidden_layers,
            t.num_key_value_heads,
            head_dim(t),
        )

    @property
    def same_layout(self) -> bool:
        """Layer for layer and head for head the same shapes (what head-wise maps need)."""
        return (self.source_layers, self.source_kv_heads) == (self.target_layers, self.target_kv_heads)

    @property
    def target_width(self) -> int:
        """The target's KV width per layer: kv_heads · head_dim (1,024 for Qwen3-0.6B and 1.7B)."""
        return self.target_kv_heads * self.target_head_dim


@dataclass(frozen=True)
class Option:
    """One setting of a family: its settings key, its training flag, its default and its help."""

    name: str  # the key in the family's settings, e.g. "rank"
    help: str  # one line of the training flag's --help
    default: Any = None  # a value, or a function of the Geometry (a rank of half the target width)
    type: Callable[[str], Any] = int  # what parses the flag's text
    flag: str = ""  # the training flag; default --NAME, underscores as dashes
    choices: tuple = ()  # the values the flag takes, if a fixed set
    minimum: int | None = None  # the least whole number the flag takes (a count or a rank)
    width_scaled: bool = False  # a rank: carried to other shapes in proportion to the target's KV width
    base: bool = False  # the name of a linear family beside which this one works; its settings come from the same flags

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag under (what `settings_from` reads)."""
        return self.flag_name[2:].replace("-", "_")

    def default_for(self, geometry: Geometry | None) -> Any:
        if callable(self.default):
            if geometry is None:
                raise ValueError(f"{self.name}'s default depends on the pair's shapes; give a geometry")
            return self.default(geometry)
        return self.default


def half_target_width(geometry: Geometry) -> int:
    """A rank of half the target's KV width (32 on the toy pair, 512 on Qwen3-1.7B ↔ 0.6B)."""
    return geometry.target_width // 2


def quarter_target_width(geometry: Geometry) -> int:
    """A rank of a quarter of the target's KV width (16 on the toy pair, 256 on Qwen3-1.7B ↔ 0.6B)."""
    return geometry.target_width // 4


@dataclass(frozen=True)
class Variant:
    """Named settings of a family worth comparing: a row of `make ablate` (kvlingo.stages.ablation)."""

    name: str  # also the row's run folder
    flags: dict = field(default_factory=dict)  # option values by flag dest (`Option.dest`); the rest: defaults
    note: str = ""  # what the row tests
    refresh: str = "none"  # the refresh it is trained and evaluated under (exact:0: the target's own layer 0)
    default_run: bool = True  # trained by a plain `make ablate` (the others with --settings)
    train_flags: tuple[str, ...] = ()  # training flags beside the family's (objectives, regularisation)


def family(cls: type[Translator]) -> type[Translator]:
    """Class decorator: make a family loadable by its name."""
    FAMILIES[cls.family] = cls
    return cls


class Translator(nn.Module, ABC):
    """A family's maps from a source's cache to a target's (see the module docstring)."""

    family: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()  # its settings (`Option`), in the order its flags are listed
    variants: ClassVar[tuple[Variant, ...]] = ()  # named settings worth comparing (`make ablate`'s rows)
    # True when the maps read the target's layer-0 projections of the token ids (kvlingo.core.layer0): a handoff then
    # computes them whatever its refresh, and its cost counts them.
    reads_layer0: ClassVar[bool] = False
    # True when map_into reads `source` features in the compute dtype, takes parameters through
    # `cast`, and writes strided outputs (a cache's context view): then the engine's `fast` path applies.
    fast_paths: ClassVar[bool] = False

    def __init__(self, geometry: Geometry, key_space: str = "prenorm"):
        super().__init__()
        self.geometry = geometry
        self.key_space = key_space
        self.space: KeySpace | None = None  # bound to a pair's models by `bind`
        self._compute = torch.float32  # dtype of map inputs while the engine runs
        self._casts: dict = {}  # (parameter id, dtype) → (version, data pointer, cast copy)

    # ------------------------------------------------------------------ what a family declares
    @classmethod
    def settings_from(cls, flags: dict[str, Any], geometry: Geometry | None = None) -> dict[str, Any]:
        """The family's settings from flag values (by `Option.dest`; None or absent: the option's default, which
        may need the pair's `geometry`). A `base` option names a linear family whose own settings come from
        the same flags."""
        out: dict[str, Any] = {}
        for option in cls.options:
            value = flags.get(option.dest)
            value = option.default_for(geometry) if value is None else value
            if callable(value):  # a variant's value that depends on the shapes (a rank of half the width)
                value = value(geometry)
            if value is None:  # an option whose absence means something (a key rank: the rank's)
                continue
            if option.base:
                if value not in FAMILIES or not issubclass(FAMILIES[value], LinearFamily) or value == cls.family:
                    linear = ", ".join(sorted(n for n, c in FAMILIES.items() if issubclass(c, LinearFamily)))
                    raise TranslatorError(f"{cls.family} sits on a linear family ({linear}), not {value!r}")
                value = {"family": value, "settings": FAMILIES[value].settings_from(flags, geometry)}
            out[option.name] = value
        return out

    @classmethod
    def carry(cls, settings: dict[str, Any], width_ratio: float, source_layers: int | None = None) -> dict[str, Any]:
        """Settings carried to other shapes: what `settings()` derives from data (a layer plan) dropped, the ranks
        scaled by `width_ratio` (the ratio of the target KV widths, so that half the width stays half), and a
        base family's settings carried alike. `source_layers` (the other source's depth) caps a count of them."""
        out = {}
        for option in cls.options:
            if option.name not in settings:
                continue
            value = settings[option.name]
            if option.width_scaled and value:
                value = max(1, round(value * width_ratio))
            elif option.base and isinstance(value, dict):
                base = FAMILIES[value["family"]]
                value = {**value, "settings": base.carry(value.get("settings", {}), width_ratio, source_layers)}
            out[option.name] = value
        return out

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

    @abstractmethod
    def flops_per_token(self, part: Part | None = None) -> float:
        """Multiply-adds × 2 per context token of the key or value maps (`part`), or of both (None); norm
        and RoPE excluded."""

    def value_maps(self) -> ValueMaps | None:
        """Every target value as an affine map of source values (`preallocated.ValueMaps`, FP32 and
        detached), for a family whose value maps are linear in the source's values; then a handoff may
        leave the values deferred (kvlingo.core.preallocated). None for any other family."""
        return None

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
        return self.space.source_keys(cap, layers, dtype=self._compute)

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
    def computing(self, dtype: torch.dtype):
        """`source` and `cast` hand the maps their inputs in `dtype` inside the block (the engine's `fast` path)."""
        self._compute = dtype
        try:
            yield
        finally:
            self._compute = torch.float32

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
