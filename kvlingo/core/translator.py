"""The translator interface, its folder format and the one loader.

A translator turns a source capture (`cache.Capture`) into the target's K/V, ready for
`cache.build_cache`. Every family (head-wise, cross-head, cross-layer, residual, ...) is a
`Translator` subclass that owns:

- its key space (`KeySpace`: what it reads from the source's keys, how its key output is
  finished into the target's cached keys) and therefore whether a capture needs pre-norm
  features (`needs_prenorm`);
- its state (an `nn.Module`: parameters and buffers, saved as `maps.safetensors`);
- its spec (`family`, `key_space` and its settings, saved in `manifest.json`);
- its cost (`flops_per_token`);
- `map(which, cap, layers)`: FP32 target features of keys (0) or values (1) for a run of
  target layers, differentiable; `map_into` the same written into a buffer.

Translation itself (`forward`) is shared: FP32 inside, rounded once to the output dtype.
With gradients on (distillation) all layers go through at once. Without, target layers go
in chunks written straight into the preallocated output, so extra memory stays near one copy
of the target cache plus one chunk of FP32 scratch. Callers never branch on the family.

Folder format: `maps.safetensors` (the state dict), then `manifest.json`, written last, so
its presence marks a complete translator. It records the family, key space, settings and
geometry, the sha256 of the maps file, and whatever provenance the writer adds (direction,
model identities, data and code hashes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..io import atomic_write_bytes, atomic_write_json, sha256_file
from .arch import head_dim
from .cache import Capture
from .keyspace import KeySpace

MAPS_FILE = "maps.safetensors"
MANIFEST_FILE = "manifest.json"
# FP32 temporaries per translation chunk: small on CPUs (cache locality), large on GPUs (fewer launches).
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "mps": 1 << 25, "cuda": 1 << 27}
FAMILIES: dict[str, type["Translator"]] = {}  # family name → class, filled by @family


class TranslatorError(ValueError):
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
    def of(cls, source_cfg, target_cfg) -> "Geometry":
        """From two model configs (or models)."""
        s, t = getattr(source_cfg, "config", source_cfg), getattr(target_cfg, "config", target_cfg)
        return cls(s.num_hidden_layers, s.num_key_value_heads, head_dim(s),
                   t.num_hidden_layers, t.num_key_value_heads, head_dim(t))

    @property
    def same_layout(self) -> bool:
        """Layer for layer and head for head the same shapes (what head-wise maps need)."""
        return (self.source_layers, self.source_kv_heads) == (self.target_layers, self.target_kv_heads)


def family(cls: type["Translator"]) -> type["Translator"]:
    """Class decorator: make a family loadable by its name."""
    FAMILIES[cls.family] = cls
    return cls


class Translator(nn.Module):
    family: ClassVar[str] = ""

    def __init__(self, geometry: Geometry, key_space: str = "prenorm"):
        super().__init__()
        self.geometry = geometry
        self.key_space = key_space
        self.space: KeySpace | None = None  # bound to a pair's models by `bind`

    # ------------------------------------------------------------------ what a family provides
    def settings(self) -> dict[str, Any]:
        """The family's own settings (beyond geometry and key space), JSON-able; saved in the manifest."""
        return {}

    def map(self, which: int, cap: Capture, layers: slice) -> torch.Tensor:
        """FP32 target features [n, target kv_heads, tokens, target head_dim] of target `layers`."""
        raise NotImplementedError

    def map_into(self, which: int, cap: Capture, layers: slice, out: torch.Tensor) -> None:
        out.copy_(self.map(which, cap, layers))

    def flops_per_token(self) -> float:
        """Multiply-adds × 2 per context token for keys and values together (norm and RoPE excluded)."""
        raise NotImplementedError

    @classmethod
    def from_spec(cls, geometry: Geometry, key_space: str, settings: dict[str, Any]) -> "Translator":
        return cls(geometry, key_space, **settings)

    # ------------------------------------------------------------------ closed form (linear families)
    # A linear family also provides fit_blocks() → (layers, blocks per layer, d_in, d_out),
    # design(which, cap) → [layers, blocks, tokens, d_in], block_targets(y), block_weights(w) and
    # set_solution(weight, bias) or solve_from(ne, ridge); a family without them is trained by
    # distillation only (see `linear`).
    needs_plan = False  # whether the closed form must rank source layers first (set_plan)

    @property
    def linear(self) -> bool:
        """Whether this family has a closed form."""
        return hasattr(self, "fit_blocks")

    def solve_from(self, ne, ridge) -> None:
        """Solve streamed normal equations (kvlingo.core.fit) into the parameters."""
        self.set_solution(*ne.solve(ridge))

    # ------------------------------------------------------------------ shared
    def spec(self) -> dict[str, Any]:
        return {"family": self.family, "key_space": self.key_space, "settings": self.settings(),
                "geometry": asdict(self.geometry)}

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def needs_prenorm(self) -> bool:
        return self.key_space == "prenorm"

    @property
    def device(self) -> torch.device:
        p = next(iter(self.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def bind(self, source, target) -> "Translator":
        """Attach the pair's RoPE tables and target k_norm (on this translator's device); returns self."""
        got = Geometry.of(source, target)
        if got != self.geometry:
            raise TranslatorError(f"this {self.family} translator has geometry {asdict(self.geometry)}, but the pair "
                                  f"has {asdict(got)}: it was made for another pair")
        self.space = KeySpace(self.key_space, source, target, device=self.device)
        return self

    def _apply(self, fn, *args, **kwargs):  # .to(device) moves the bound k_norm too
        out = super()._apply(fn, *args, **kwargs)
        if self.space is not None:
            self.space.to(self.device)
        return out

    def source(self, which: int, cap: Capture, layers=slice(None)) -> torch.Tensor:
        """FP32 source features of keys (0) or values (1) for source `layers`: [n, heads, tokens, d_in]."""
        return self.space.source_keys(cap, layers) if which == 0 else cap.values[layers].float()

    def translate_layers(self, cap: Capture, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 target keys and values for a run of target layers: [n, heads, tokens, head_dim] each."""
        with torch.autocast(device_type=cap.keys.device.type, enabled=False):
            yk = self.map(0, cap, layers)
            yv = self.map(1, cap, layers)
            return self.space.finish_keys(yk, layers), yv

    def chunk_layers(self, n_tokens: int, device, chunk_elements: int | None = None) -> int:
        """Target layers per chunk of the no-grad path."""
        if chunk_elements is None:
            chunk_elements = DEFAULT_CHUNK_ELEMENTS.get(torch.device(device).type, 1 << 24)
        g = self.geometry
        per_layer = g.target_kv_heads * n_tokens * g.target_head_dim
        return max(1, min(g.target_layers, chunk_elements // max(1, per_layer)))

    def forward(self, cap: Capture, out_dtype: torch.dtype | None = None, chunk_elements: int | None = None,
                target_layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate a capture: target (keys, values), each [target layers, kv_heads, tokens, head_dim]
        (only the target layers in `target_layers`, when given: a refresh computes the others natively)."""
        if self.space is None:
            raise RuntimeError("translator is not bound to a pair: call .bind(source, target) first")
        out_dtype = out_dtype or cap.keys.dtype
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            keys, values = self.translate_layers(cap, target_layers)
            return keys.to(out_dtype), values.to(out_dtype)
        g, T, device = self.geometry, cap.n_tokens, cap.values.device
        first, stop, _ = target_layers.indices(g.target_layers)
        H, d = g.target_kv_heads, g.target_head_dim
        step = self.chunk_layers(T, device, chunk_elements)
        keys = torch.empty(max(0, stop - first), H, T, d, dtype=out_dtype, device=device)
        values = torch.empty_like(keys)
        scratch = Scratch((step, H, T, d), device)
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            for start in range(first, stop, step):
                layers = slice(start, min(stop, start + step))
                out = slice(start - first, layers.stop - first)
                self._translate_into(cap, layers, keys[out], values[out], scratch)
        return keys, values

    def _translate_into(self, cap: Capture, layers: slice, k_out: torch.Tensor, v_out: torch.Tensor,
                        scratch: "Scratch") -> None:
        """The no-grad path of `translate_layers` for one chunk, written into the output.

        The same operations in the same order as `translate_layers` (so the same bits), but in
        place on buffers reused across chunks: the maps write into preallocated memory, the norm
        scales in place, RoPE writes each half straight into the output.
        """
        n = k_out.shape[0]
        yk = scratch.take("yk", n)  # [n, heads, tokens, d_out] FP32
        self.map_into(0, cap, layers, yk)
        self.space.finish_keys_into(yk, layers, k_out, scratch)
        if v_out.dtype == torch.float32:
            self.map_into(1, cap, layers, v_out)
        else:
            yv = scratch.take("yk", n)  # the key buffer is free again
            self.map_into(1, cap, layers, yv)
            v_out.copy_(yv)

    def scratch_chunks(self, out_dtype: torch.dtype) -> float:
        """FP32 layer chunks of scratch one no-grad translation holds: the maps' output, squares for the
        norm, half a chunk for RoPE, and a staging chunk when the output is not FP32."""
        return 2.5 + (0 if out_dtype == torch.float32 else 1)


class Scratch:
    """FP32 buffers for one translation, allocated once and reused by every layer chunk
    (fresh large allocations cost page faults on a CPU and allocator traffic on a GPU)."""

    def __init__(self, shape: tuple[int, int, int, int], device):
        self.shape = shape  # [layers per chunk, heads, tokens, dim]
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, n: int) -> torch.Tensor:
        if name not in self.buffers:
            shape = self.shape if name != "half" else (*self.shape[:3], self.shape[3] // 2)
            self.buffers[name] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self.buffers[name][:n]


# --------------------------------------------------------------------------- folders
def state_bytes(translator: Translator) -> bytes:
    """The bytes `save_translator` writes as maps.safetensors (so their sha256 is known before writing)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in translator.state_dict().items()})


def save_translator(folder: str | Path, translator: Translator, provenance: dict[str, Any]) -> Path:
    """maps.safetensors, then manifest.json (last: its presence marks a complete translator)."""
    folder = Path(folder)
    atomic_write_bytes(folder / MAPS_FILE, state_bytes(translator))
    manifest = {**provenance, **translator.spec(), "n_params": translator.n_params(),
                "maps_sha256": sha256_file(folder / MAPS_FILE)}
    atomic_write_json(folder / MANIFEST_FILE, manifest)
    return folder


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """A translator folder's manifest, after checking the maps file against its hash."""
    folder = Path(folder)
    mpath = folder / MANIFEST_FILE
    if not mpath.is_file():
        raise TranslatorError(f"{folder} holds no {MANIFEST_FILE}: not a complete translator; train it first "
                              "(make train RUN=...) or name a run that has one")
    manifest = json.loads(mpath.read_text())
    if manifest.get("family") not in FAMILIES:
        raise TranslatorError(f"{mpath}: unknown translator family {manifest.get('family')!r} "
                              f"(known: {', '.join(sorted(FAMILIES))}); it was written by other code")
    if not (folder / MAPS_FILE).is_file() or sha256_file(folder / MAPS_FILE) != manifest.get("maps_sha256"):
        raise TranslatorError(f"{folder / MAPS_FILE} does not match its manifest hash (damaged or replaced); "
                              "train it again")
    return manifest


def build(manifest: dict[str, Any]) -> Translator:
    """An untrained translator of the manifest's family, settings and geometry (state not loaded)."""
    cls = FAMILIES[manifest["family"]]
    return cls.from_spec(Geometry(**manifest["geometry"]), manifest["key_space"], manifest.get("settings", {}))


def load_state(folder: str | Path, manifest: dict[str, Any] | None = None, device="cpu") -> Translator:
    """A translator from a folder, state loaded, not bound to any models."""
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    translator = build(manifest)
    translator.load_state_dict(load_file(folder / MAPS_FILE), strict=True)
    return translator.to(device)


def check_expected(manifest: dict[str, Any], *, family: str | None = None, key_space: str | None = None,
                   direction: str | None = None, models: dict[str, Any] | None = None,
                   geometry: Geometry | None = None) -> None:
    """Refuse a translator made for another family, key space, direction, pair or geometry (TranslatorError
    naming the field, both values and the fix). Fields the manifest does not record are not compared."""
    if family is not None and manifest["family"] != family:
        raise TranslatorError(f"translator family is {manifest['family']!r}, this run asks for {family!r}; "
                              f"pass --family {manifest['family']} or train a {family} translator")
    if key_space is not None and manifest.get("key_space") != key_space:
        raise TranslatorError(f"translator key space is {manifest.get('key_space')!r}, this run asks for "
                              f"{key_space!r}; pass --key-space {manifest.get('key_space')} or train one in {key_space!r}")
    if direction and manifest.get("direction") not in (None, direction):
        raise TranslatorError(f"translator was trained for direction {manifest['direction']!r}, this run is "
                              f"{direction!r}; pass --direction {manifest['direction']} or train one for this direction")
    if geometry is not None and Geometry(**manifest["geometry"]) != geometry:
        raise TranslatorError(f"translator geometry {manifest['geometry']} does not fit this pair's "
                              f"{asdict(geometry)}: it was trained for another pair; check --large/--small/--direction")
    for role, ident in (models or {}).items():
        trained = manifest.get("models", {}).get(role)
        if trained is not None and trained != ident:
            raise TranslatorError(f"translator was trained for another {role} model ({trained}), not {ident}; "
                                  "use one trained for this pair")


def load_translator(folder: str | Path, pair, *, family: str | None = None,
                    key_space: str | None = None) -> tuple[Translator, dict[str, Any]]:
    """The one loader: a frozen translator from `folder`, checked against `pair` and bound to its models.

    `pair` is a `kvlingo.run.models.Pair` (anything with source, target, direction and
    `identities()`). Returns (translator, provenance: the manifest plus `path` and `manifest_sha256`).
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
        check_expected(manifest, family=family, key_space=key_space, direction=pair.direction,
                       models=pair.identities(), geometry=Geometry.of(pair.source, pair.target))
    except TranslatorError as err:
        raise TranslatorError(f"{folder}: {err}") from None
    device = next(pair.target.parameters()).device
    translator = load_state(folder, manifest, device).bind(pair.source, pair.target)
    translator.requires_grad_(False)
    info = {**manifest, "path": str(folder.resolve()), "manifest_sha256": sha256_file(folder / MANIFEST_FILE)}
    return translator, info


# The families register themselves on import; importing them here makes every family loadable by name
# wherever the interface is imported. (At the end: each family module imports the names above.)
from . import crosslayer, headwise, residual  # noqa: E402,F401
