"""The settings of a handoff as typed values, parsed once at the edge and passed to where they take effect.

    Part       a half of a KV cache: the keys or the values (indexes every [2, ...] tensor of a family)
    Geometry   the cache shapes on both sides of a translator
    Refresh    what the target recomputes natively on top of a translation (parsed from "exact:0", "tail:64", ...)
    Option     one setting of a translator family: its training flag, its default, its help
    Variant    named settings of a family worth comparing (a row of `make ablate`)
    Family     what a family is without its maps: name, options, variants, what it reads

No torch here: a stage builds its flags and parses them from these before any heavy import. The maps
themselves (kvlingo.core.translator and the families' `maps` modules) and what a refresh runs
(kvlingo.core.refresh) import them. Reports write each through `to_json` (kvlingo.io.to_jsonable).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ..errors import Refusal

DIRECTIONS = ("l2s", "s2l")  # l2s: the large model builds the cache and the small one continues; s2l the reverse
CACHE_KINDS = ("preallocated", "dynamic")  # the target's cache in a handoff; the first is the default (--cache)
KEY_SPACES = ("prenorm", "cache")  # what key maps read and write (kvlingo.core.keyspace)
PRECISIONS = ("fp32", "fused", "fast", "fast-fused")  # a translation's arithmetic (kvlingo.core.engine)


class Part(IntEnum):
    """A half of a KV cache: the keys or the values. Its value indexes the leading [2, ...] axis of every
    family's parameters and of the closed form's statistics."""

    KEYS = 0
    VALUES = 1


PARTS = (Part.KEYS, Part.VALUES)


# --------------------------------------------------------------------------- shapes
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
            _head_dim(s),
            t.num_hidden_layers,
            t.num_key_value_heads,
            _head_dim(t),
        )

    @property
    def same_layout(self) -> bool:
        """Layer for layer and head for head the same shapes (what head-wise maps need)."""
        return (self.source_layers, self.source_kv_heads) == (self.target_layers, self.target_kv_heads)

    @property
    def target_width(self) -> int:
        """The target's KV width per layer: kv_heads · head_dim (1,024 for Qwen3-0.6B and 1.7B)."""
        return self.target_kv_heads * self.target_head_dim


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def half_target_width(geometry: Geometry) -> int:
    """Half the target's KV width (32 on the toy pairs, 512 on Qwen3-1.7B ↔ 0.6B)."""
    return geometry.target_width // 2


def quarter_target_width(geometry: Geometry) -> int:
    """A quarter of the target's KV width (16 on the toy pairs, 256 on Qwen3-1.7B ↔ 0.6B)."""
    return geometry.target_width // 4


def eighth_target_width(geometry: Geometry) -> int:
    """An eighth of the target's KV width (8 on the toy pairs, 128 on Qwen3-1.7B ↔ 0.6B)."""
    return geometry.target_width // 8


def half_target_layers(geometry: Geometry) -> int:
    """The first half of the target's layers (2 of the toy pair's 4, 14 of Qwen3's 28)."""
    return max(1, geometry.target_layers // 2)


# --------------------------------------------------------------------------- refresh
REFRESH_KINDS = ("none", "tail", "layers", "select", "layer", "exact")


class RefreshError(Refusal, ValueError):
    """A refresh setting that cannot be parsed or applied."""


@dataclass(frozen=True)
class Refresh:
    """What the target recomputes natively on top of a translated context (kvlingo.core.refresh):

    none       pure translation
    tail:W     the target prefills the last W context tokens itself (W: a count or a percentage)
    layers:K   the target's first K layers native for the whole context (K: a count or a percentage)
    select:R   the fraction R of tokens whose translation deviates most at layer 0, recomputed
    layer:l    a diagnostic: the target's own K/V at layer l alone
    exact:0    the target's own layer 0 from the token ids alone (one projection per token)
    """

    kind: str = "none"  # one of REFRESH_KINDS
    amount: float = 0.0  # tokens (tail), layers (layers), fraction (select); with `relative`, a fraction
    relative: bool = False  # tail/layers given as a percentage of the context / of the layers

    @classmethod
    def parse(cls, text: str | Refresh | None) -> Refresh:
        if isinstance(text, Refresh):
            return text
        if not text or text == "none":
            return cls()
        m = re.fullmatch(r"(tail|layers|select|layer|exact):([0-9.]+)(%?)", text.strip())
        if not m:
            raise RefreshError(
                f"refresh {text!r} is not none, tail:W, layers:K, select:R, layer:l or exact:0 "
                "(W and K: a count or a percentage such as 10%; R: a fraction in [0, 1]; "
                "l: a target layer index)"
            )
        kind, value, pct = m.group(1), float(m.group(2)), bool(m.group(3))
        if kind == "select":
            value = value / 100 if pct else value
            if not 0 <= value <= 1:
                raise RefreshError(f"select:{m.group(2)}{m.group(3)}: the fraction must be within [0, 1]")
            return cls(kind, value)
        if kind == "exact" and (pct or value != 0):
            raise RefreshError(
                f"{text}: only layer 0 is computed from the token ids alone (every later layer reads "
                "the context); give exact:0"
            )
        if kind == "layer" and (pct or value != int(value)):
            raise RefreshError(f"{text}: layer:l takes the index of one target layer, such as layer:0")
        if pct:
            if value > 100:
                raise RefreshError(f"{text}: a percentage above 100")
            return cls(kind, value / 100, True)
        if value != int(value):
            raise RefreshError(f"{text}: {kind} counts whole {'tokens' if kind == 'tail' else 'layers'}")
        return cls(kind, value)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.relative:
            return f"{self.kind}:{100 * self.amount:g}%"
        return f"{self.kind}:{self.amount:g}" if self.kind == "select" else f"{self.kind}:{int(self.amount)}"

    def to_json(self) -> str:
        """How reports and configs write it: its text, which `parse` reads back."""
        return str(self)

    @property
    def active(self) -> bool:
        """Whether the target recomputes anything (every kind but none)."""
        return self.kind != "none"

    def tail_tokens(self, n_tokens: int) -> int:
        w = round(self.amount * n_tokens) if self.relative else int(self.amount)
        return min(max(w, 0), n_tokens)

    def native_layers(self, n_layers: int) -> int:
        k = round(self.amount * n_layers) if self.relative else int(self.amount)
        if k > n_layers:
            raise RefreshError(f"layers:{k} but the target has {n_layers} layers")
        return max(k, 0)

    def own_layers(self, n_layers: int) -> tuple[int, ...]:
        """The target layers a handoff under this setting takes from the target itself for the whole context (exact:0:
        layer 0; layers:K: the first K): no translator's output reaches them."""
        if self.kind == "exact":
            return (0,)
        if self.kind == "layers":
            return tuple(range(self.native_layers(n_layers)))
        return ()

    def layer_index(self, n_layers: int) -> int:
        layer = int(self.amount)
        if layer >= n_layers:
            raise RefreshError(f"layer:{layer} but the target's layers are 0..{n_layers - 1}")
        return layer

    def check_layers(self, n_layers: int) -> None:
        """Refuse (RefreshError, with the fix) a layers:K or layer:l setting a target of `n_layers` layers cannot
        take, before any work: applying it would fail only on the first conversation."""
        try:
            if self.kind == "layers":
                self.native_layers(n_layers)
            elif self.kind == "layer":
                self.layer_index(n_layers)
        except RefreshError as err:
            raise RefreshError(
                f"refresh {err}; give layers:K with K ≤ {n_layers} (or a percentage), or layer:l with l < {n_layers}"
            ) from None

    def selected_count(self, n_tokens: int) -> int:
        return min(n_tokens, round(self.amount * n_tokens))


# --------------------------------------------------------------------------- families
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
    depth_scaled: bool = False  # a count of target layers: carried in proportion to the target's depth
    source_layers: bool = False  # a count of source layers: capped at the source's depth at other shapes
    base: bool = False  # names the linear family beside which this one works; its settings come from the same flags

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag under (what `Family.settings_from` reads)."""
        return self.flag_name[2:].replace("-", "_")

    def default_for(self, geometry: Geometry | None) -> Any:
        return _at(self.default, geometry, self.name)


def _at(value: Any, geometry: Geometry | None, name: str) -> Any:
    """`value`, or, for a function of the shapes, its value at `geometry`."""
    if callable(value):
        if geometry is None:
            raise ValueError(f"{name} depends on the pair's shapes; give a geometry")
        return value(geometry)
    return value


@dataclass(frozen=True)
class Variant:
    """Named settings of a family worth comparing: a row of `make ablate` (kvlingo.stages.ablation)."""

    name: str  # also the row's run folder; unique across the families
    flags: dict = field(default_factory=dict)  # option values by flag dest (`Option.dest`); the rest: defaults
    note: str = ""  # what the row tests
    refresh: str = "none"  # the refresh it is trained and evaluated under (exact:0: the target's own layer 0)
    default_run: bool = True  # trained by a plain `make ablate` (the others with --settings)
    train_flags: tuple[str, ...] = ()  # training flags beside the family's (objectives, regularisation)


@dataclass(frozen=True)
class Family:
    """What a translator family is, without its maps: the one declaration every flag, setting, default, ablation
    row and cost of the family is made from. Its maps (an nn.Module) are `maps`, imported on first use."""

    name: str  # the name saved in manifests and given to --family
    summary: str  # one line: what its maps read and write
    maps: str  # "module:Class" of its maps
    options: tuple[Option, ...] = ()  # its settings, in the order its flags are listed
    variants: tuple[Variant, ...] = ()  # named settings worth comparing
    linear: bool = True  # a closed form (least squares); a linear family may sit beside a residual or token input
    reads_layer0: bool = False  # its maps read the target's layer-0 projections of the token ids, counted in its cost

    def translator(self) -> type:
        """The family's maps (a `kvlingo.core.translator.Translator` subclass)."""
        module, _, name = self.maps.partition(":")
        return getattr(importlib.import_module(module), name)

    def from_spec(self, geometry: Geometry, key_space: str, settings: dict[str, Any]):
        return self.translator().from_spec(geometry, key_space, settings)

    def settings_from(
        self, flags: dict[str, Any], geometry: Geometry | None, families: Mapping[str, Family]
    ) -> dict[str, Any]:
        """The family's settings from flag values (by `Option.dest`; None or absent: the option's default, which may
        need the pair's `geometry`). A `base` option names a linear family of `families` (kvlingo.core.families)
        whose own settings come from the same flags; an option absent and without default (a key rank: the rank's)
        is left out."""
        out: dict[str, Any] = {}
        for option in self.options:
            value = flags.get(option.dest)
            value = _at(option.default if value is None else value, geometry, option.name)
            if value is None:
                continue
            if option.base:
                base = families.get(value)
                if base is None or not base.linear or value == self.name:
                    linear = ", ".join(sorted(n for n, f in families.items() if f.linear))
                    raise FamilyError(f"{self.name} sits on a linear family ({linear}), not {value!r}")
                value = {"family": value, "settings": base.settings_from(flags, geometry, families)}
            out[option.name] = value
        return out

    def carry(
        self,
        settings: dict[str, Any],
        width_ratio: float,
        families: Mapping[str, Family],
        source_layers: int | None = None,
        depth_ratio: float = 1.0,
    ) -> dict[str, Any]:
        """Settings carried to other shapes: what the maps derive from data (a layer plan) dropped, the ranks scaled
        by `width_ratio` (the ratio of the target KV widths, so that half the width stays half), counts of target
        layers by `depth_ratio`, counts of source layers capped at `source_layers` (the other source's depth), and
        a base family's settings (a family of `families`) carried alike."""
        out = {}
        for option in self.options:
            if option.name not in settings:
                continue
            value = settings[option.name]
            if option.width_scaled and value:
                value = max(1, round(value * width_ratio))
            elif option.depth_scaled and value:
                value = max(1, round(value * depth_ratio))
            elif option.source_layers and source_layers is not None:
                value = min(value, source_layers)
            elif option.base and isinstance(value, dict):
                base = families[value["family"]]
                value = {
                    **value,
                    "settings": base.carry(
                        value.get("settings", {}), width_ratio, families, source_layers, depth_ratio
                    ),
                }
            out[option.name] = value
        return out


class FamilyError(Refusal, ValueError):
    """A family, variant or family setting that does not exist or does not fit."""
