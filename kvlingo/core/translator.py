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

Translation itself (`forward`) is shared. With gradients on (distillation) all layers go
through at once, in FP32, rounded once to the output dtype. Without, target layers go in
chunks written straight into the output, so extra memory stays near one copy of the target
cache plus one chunk of scratch; the output can be a preallocated cache's context
(`out=cache.context(n)`), so the translation is the cache build. Callers never branch on the
family.

Precision of the no-grad path (`PRECISIONS`):

- `fp32` (the default): FP32 maths, rounded once to the output dtype: the same bits as the
  gradient path on every device, so scores reproduce across CPU and GPU; what the exactness
  tests check.
- `fused`: what the optimised handoff runs on a CPU (`fast_precision`): FP32 maths, with the
  keys' norm and RoPE as one compiled kernel per chunk (kvlingo.core.fused) instead of a
  dozen eager passes. Not the same bits: keys within `fused.TOLERANCE` (relative) of `fp32`,
  values identical. Chunks too small to be worth a compile, and machines where compiling
  fails, run the `fp32` finish. On CUDA the kernel is Triton's; on other devices `fused` is
  `fp32`.
- `fast`: what the optimised handoff runs on CUDA (`fast_precision`). The maps' matmuls take
  their inputs in the run dtype (BF16 or FP16; TF32 tensor cores for an FP32 run) with FP32
  accumulation; values come out of the matmul straight into the cache, keys are normed and
  rotated in FP32 from the matmul's output and rounded once. Against `fp32`, a BF16 run
  differs by a few BF16 roundings (`FAST_BF16_TOLERANCE`). A family opts in with
  `fast_paths = True` (its `map_into` then takes compute-dtype features and strided
  outputs); the others run `fp32` maths.
- `fast-fused`: `fast`, with the keys' norm and RoPE as one compiled kernel (kvlingo.core.fused)
  that reads the matmul's output in the run dtype once and writes the cache once, in place of
  the FP32 staging and a dozen eager passes over it. Opt-in (`fast_precision(device,
  fuse_keys=True)`; `perf.py --fuse-keys on`): on CUDA the kernel is Triton's, which this suite
  has not yet timed, so it is not the default until a GPU run shows it helps. Within
  `FAST_BF16_TOLERANCE` of `fp32` as `fast` is, and within `fused.TOLERANCE` plus one rounding
  of `fast` itself.

Folder format: `maps.safetensors` (the state dict), then `manifest.json`, written last, so
its presence marks a complete translator. It records the family, key space, settings and
geometry, the sha256 of the maps file, and whatever provenance the writer adds (direction,
model identities, data and code hashes).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..io import DamagedFile, atomic_write_bytes, atomic_write_json, read_json, sha256_file
from .arch import head_dim
from .cache import Capture
from .keyspace import KEY_SPACES, KeySpace

MAPS_FILE = "maps.safetensors"
MANIFEST_FILE = "manifest.json"
# FP32 temporaries per translation chunk of layers: small on CPUs (cache locality); on GPUs large enough
# for few launches and small enough that the scratch stays well under one target cache.
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "mps": 1 << 25, "cuda": 1 << 24}
# Elements of a token tile of the keys' norm and RoPE (FP32; about 1 MB on a CPU); untiled elsewhere.
TILE_ELEMENTS = {"cpu": 1 << 18}
FAMILIES: dict[str, type["Translator"]] = {}  # family name → class, filled by @family
PRECISIONS = ("fp32", "fused", "fast", "fast-fused")
FAST = ("fast", "fast-fused")  # the maps' matmuls in the run dtype
FUSED = ("fused", "fast-fused")  # the keys' norm and RoPE as one compiled kernel
# How far the `fast` path in BF16 may be from the `fp32` path (both rounded to BF16), in units of the
# largest |output| of the `fp32` path, per target layer. The fast path rounds the maps to BF16
# (relative 2^-9 each; its inputs are BF16 already in a BF16 run, or rounded once from the FP32
# strip in the cache key space) and the matmul's output once more before the final rounding that
# both paths share: a few BF16 roundings of a dot product's terms. Measured on the tiny pair over
# 5 seeds: at most 0.0054 (keys, prenorm), 0.0076 (keys, cache key space), 0.0046 (values), where
# the `fp32` path's own single rounding is up to 0.0036: the bound leaves a factor of 2.
FAST_BF16_TOLERANCE = 2.0**-6


def fast_precision(device, fuse_keys: bool | None = None) -> str:
    """The precision an optimised handoff translates in: `fast` on CUDA (tensor cores), `fused` on a CPU
    (FP32 maths, the keys' finish compiled), `fp32` elsewhere. A CPU run's models are FP32, so its
    translation stays in FP32 maths too: on a CPU with AVX512_BF16 (a 2-core AMD EPYC) the maps'
    [8 × 4,096 × 128]·[128 × 128] batched matmul ran 2.3–2.8× faster in BF16 than in FP32, but that
    would give the handoff a precision its FP32 re-prefill baseline does not get.
    `fuse_keys` True or False asks for the compiled finish or not (CUDA: `fast-fused` or `fast`; CPU:
    `fused` or `fp32`); None takes the default above."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "fast-fused" if fuse_keys else "fast"
    if kind == "cpu":
        return "fp32" if fuse_keys is False else "fused"
    return "fp32"


@contextmanager
def matmul_precision(device, precision: str):
    """On CUDA under `fast`: TF32 for FP32 matmuls and FP32 accumulation for BF16/FP16 ones; elsewhere nothing."""
    if torch.device(device).type != "cuda" or precision not in FAST:
        yield
        return
    fp32_before = torch.get_float32_matmul_precision()
    reduced = torch.backends.cuda.matmul
    bf16_before, fp16_before = reduced.allow_bf16_reduced_precision_reduction, reduced.allow_fp16_reduced_precision_reduction
    torch.set_float32_matmul_precision("high")
    reduced.allow_bf16_reduced_precision_reduction = reduced.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(fp32_before)
        reduced.allow_bf16_reduced_precision_reduction = bf16_before
        reduced.allow_fp16_reduced_precision_reduction = fp16_before


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
    # True when map_into reads `source` features in the compute dtype, takes parameters through
    # `cast`, and writes strided outputs (a cache's context view): then the `fast` path applies.
    fast_paths: ClassVar[bool] = False

    def __init__(self, geometry: Geometry, key_space: str = "prenorm"):
        super().__init__()
        self.geometry = geometry
        self.key_space = key_space
        self.space: KeySpace | None = None  # bound to a pair's models by `bind`
        self._compute = torch.float32  # dtype of map inputs on the running no-grad path
        self._fuse_keys = False  # the running no-grad path finishes keys with kvlingo.core.fused
        self._casts: dict = {}  # (parameter id, dtype) → (version, data pointer, cast copy)

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

    def value_maps(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight [layers, kv_heads, d_in, d_out], bias [layers, kv_heads, d_out]), FP32 and detached, when
        every target value is one affine map of the same layer and KV head's source value; then a handoff
        may leave the values deferred (kvlingo.core.preallocated). None for any other family."""
        return None

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
        """Source features of keys (0) or values (1) for source `layers`: [n, heads, tokens, d_in], in FP32
        (in the compute dtype while a `fast` translation runs)."""
        if which == 1:
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

    def compute_dtype(self, out_dtype: torch.dtype, precision: str) -> torch.dtype:
        """dtype the maps' inputs and matmuls take on the no-grad path."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
        fast = precision in FAST and self.fast_paths and out_dtype in (torch.bfloat16, torch.float16)
        return out_dtype if fast else torch.float32

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

    def chunk_tokens(self, n_tokens: int, device, step: int = 1) -> int:
        """Tokens per tile of the keys' norm and RoPE in a chunk of `step` layers: on a CPU few enough that a
        tile's half-dozen passes stay in cache instead of going to memory each time (one layer at 4,096
        tokens on the shared 2-core machine, one thread: 44 ms untiled, 23 ms in 256-token tiles; the
        whole translation about 8% faster); elsewhere all of them."""
        elements = TILE_ELEMENTS.get(torch.device(device).type)
        per_token = step * self.geometry.target_kv_heads * self.geometry.target_head_dim
        return max(1, min(n_tokens, elements // per_token)) if elements else max(1, n_tokens)

    def forward(self, cap: Capture, out_dtype: torch.dtype | None = None, chunk_elements: int | None = None,
                target_layers: slice = slice(None), out: tuple[torch.Tensor, torch.Tensor] | None = None,
                precision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate a capture: target (keys, values), each [target layers, kv_heads, tokens, head_dim].

        `target_layers`: only these target layers (a refresh computes the others natively).
        `out`: (keys, values) to write into instead of fresh tensors, e.g. a preallocated cache's
        `context(tokens)` (their dtype is the output dtype; shaped for `target_layers`); values None
        translates the keys only (a handoff whose values stay deferred, `value_maps`). `precision`:
        `fp32` (None) or `fast` (see the module docstring). With gradients on, always FP32 maths.
        """
        if self.space is None:
            raise RuntimeError("translator is not bound to a pair: call .bind(source, target) first")
        g, T, device = self.geometry, cap.n_tokens, cap.values.device
        first, stop, _ = target_layers.indices(g.target_layers)
        L, H, d = max(0, stop - first), g.target_kv_heads, g.target_head_dim
        if out is not None and (out[0].shape != (L, H, T, d) or (out[1] is not None and out[1].shape != (L, H, T, d))):
            raise ValueError(f"out {tuple(out[0].shape)} / {None if out[1] is None else tuple(out[1].shape)} must "
                             f"both be [{L}, {H}, {T}, {d}]")
        out_dtype = out[0].dtype if out is not None else (out_dtype or cap.keys.dtype)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            keys, values = self.translate_layers(cap, target_layers)
            if out is None:
                return keys.to(out_dtype), values.to(out_dtype)
            out[0].copy_(keys)
            if out[1] is not None:
                out[1].copy_(values)
            return out
        precision = precision or "fp32"
        compute = self.compute_dtype(out_dtype, precision)
        step = self.chunk_layers(T, device, chunk_elements)
        tile = self.chunk_tokens(T, device, step)
        if out is None:
            keys = torch.empty(L, H, T, d, dtype=out_dtype, device=device)
            values = torch.empty_like(keys)
        else:
            keys, values = out
        scratch = Scratch((step, H, T, d), device, tile)
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False), \
                matmul_precision(device, precision), self._computing(compute, precision in FUSED):
            for start in range(first, stop, step):
                layers = slice(start, min(stop, start + step))
                rows = slice(start - first, layers.stop - first)
                self._translate_into(cap, layers, keys[rows], None if values is None else values[rows], scratch)
        return keys, values

    @contextmanager
    def _computing(self, dtype: torch.dtype, fuse_keys: bool = False):
        self._compute, self._fuse_keys = dtype, fuse_keys
        try:
            yield
        finally:
            self._compute, self._fuse_keys = torch.float32, False

    def _translate_into(self, cap: Capture, layers: slice, k_out: torch.Tensor, v_out: torch.Tensor | None,
                        scratch: "Scratch") -> None:
        """The no-grad path of `translate_layers` for one chunk, written into the output.

        In FP32 maths, the same operations in the same order as `translate_layers` (so the same
        bits), but in place on buffers reused across chunks: the maps write into preallocated
        memory, the norm scales in place, RoPE writes each half straight into the output. A family
        without `fast_paths` maps into contiguous scratch, which is then copied into the output.
        Under a compute dtype below FP32, the key map's output is widened once for norm and RoPE.
        Under `fused` and `fast-fused`, norm and RoPE run as one compiled kernel over the chunk (when
        it runs), reading the key map's output in the compute dtype.
        """
        n, compute, T = k_out.shape[0], self._compute, k_out.shape[2]
        key_map = scratch.take("yk" if compute == torch.float32 else "low", n, compute)  # [n, heads, tokens, d_out]
        self.map_into(0, cap, layers, key_map)
        if not (self._fuse_keys and self.space.finish_keys_fused(key_map, layers, k_out)):
            yk = key_map
            if compute != torch.float32:  # widened once for the FP32 norm and RoPE
                yk = scratch.take("yk", n)
                yk.copy_(key_map)
            for begin in range(0, T, scratch.tile):  # per-token norm and RoPE, tile by tile: the same bits
                end = min(T, begin + scratch.tile)
                scratch.tokens = end - begin
                self.space.finish_keys_into(yk[:, :, begin:end], layers, k_out[:, :, begin:end], scratch, start=begin)
        if v_out is None:  # keys only: the values stay deferred
            return
        if v_out.dtype == compute and (self.fast_paths or v_out.is_contiguous()):
            self.map_into(1, cap, layers, v_out)  # straight into the output (a cache's layout)
        else:
            yv = scratch.take("yk", n) if compute == torch.float32 else scratch.take("low", n, compute)
            self.map_into(1, cap, layers, yv)  # the key buffers are free again
            v_out.copy_(yv)

    def scratch_chunks(self, out_dtype: torch.dtype, precision: str = "fp32", tile_fraction: float = 1.0) -> float:
        """FP32 layer chunks of scratch one no-grad translation holds: the maps' output, the matmul's
        output in the compute dtype when that is narrower, and per token tile (`tile_fraction` of a
        chunk) squares for the norm, half for RoPE and a staging tile when the output is not FP32."""
        compute = self.compute_dtype(out_dtype, precision)
        low = 0 if compute == torch.float32 else torch.empty(0, dtype=compute).element_size() / 4
        return 1 + low + tile_fraction * (1.5 + (0 if out_dtype == torch.float32 else 1))


class Scratch:
    """Buffers for one translation (FP32 unless named otherwise), allocated once and reused by every
    layer chunk (fresh large allocations cost page faults on a CPU and allocator traffic on a GPU)."""

    WHOLE = ("yk", "low")  # the maps' outputs span every token of the chunk; the rest, one tile

    def __init__(self, shape: tuple[int, int, int, int], device, tile: int | None = None):
        self.shape = shape  # [layers per chunk, heads, tokens, dim]
        self.device = device
        self.tile = tile or shape[2]  # tokens per tile of the keys' norm and RoPE
        self.tokens = self.tile  # tokens of the tile being finished (the last one may be shorter)
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Buffer `name` for n layers: [n, heads, tokens, dim] for the maps' outputs, [n, heads, tile tokens,
        dim] for the others (dim/2 for "half")."""
        whole = name in self.WHOLE
        if name not in self.buffers:
            L, H, T, d = self.shape
            shape = (L, H, T if whole else self.tile, d // 2 if name == "half" else d)
            self.buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        buf = self.buffers[name]
        if buf.dtype != dtype:
            raise ValueError(f"scratch {name!r} is {buf.dtype}, asked for {dtype}")
        return buf[:n] if whole else buf[:n, :, :self.tokens]


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


def read_manifest(folder: str | Path, name: str = MANIFEST_FILE) -> dict[str, Any]:
    """A translator folder's manifest (`name`: manifest.json, or an export's config.json), after checking the
    maps file against its hash."""
    folder = Path(folder)
    mpath = folder / name
    if not mpath.is_file():
        raise TranslatorError(f"{folder} holds no {name}: not a complete translator; train it first "
                              "(make train RUN=...) or name a run that has one")
    try:
        manifest = read_json(mpath)
    except DamagedFile as e:
        raise TranslatorError(f"{e.problem}: the translator folder is damaged; train or export it again") from None
    if manifest.get("family") not in FAMILIES:
        raise TranslatorError(f"{mpath}: unknown translator family {manifest.get('family')!r} "
                              f"(known: {', '.join(sorted(FAMILIES))}); it was written by other code")
    if not (folder / MAPS_FILE).is_file() or sha256_file(folder / MAPS_FILE) != manifest.get("maps_sha256"):
        raise TranslatorError(f"{folder / MAPS_FILE} does not match its manifest hash in {name} (damaged or replaced); "
                              "train or export it again")
    try:
        check_state(folder / MAPS_FILE, build(manifest, device="meta"))
    except TranslatorError as err:
        raise TranslatorError(f"{mpath}: {err}; it was written by other code or edited: train or export it again") from None
    return manifest


def build(manifest: dict[str, Any], device: str | torch.device | None = None) -> Translator:
    """An untrained translator of the manifest's family, settings and geometry (state not loaded); on
    device="meta" nothing is allocated. A spec that does not build one (a field missing or of the wrong
    kind, settings the family does not take) is refused with a TranslatorError naming it."""
    cls = FAMILIES[manifest["family"]]
    geometry, fields = manifest.get("geometry"), list(Geometry.__dataclass_fields__)
    if not (isinstance(geometry, dict) and sorted(geometry) == sorted(fields)
            and all(type(geometry[f]) is int and geometry[f] > 0 for f in fields)):
        raise TranslatorError(f"geometry {geometry!r} is not {{{', '.join(fields)}}} as positive integers")
    if manifest.get("key_space") not in KEY_SPACES:
        raise TranslatorError(f"key space {manifest.get('key_space')!r} is not one of {', '.join(KEY_SPACES)}")
    settings = manifest.get("settings", {})
    if not isinstance(settings, dict):
        raise TranslatorError(f"settings {settings!r} are not a mapping of the {cls.family} family's options")
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return cls.from_spec(Geometry(**geometry), manifest["key_space"], settings)
    except (TypeError, ValueError) as err:
        raise TranslatorError(f"settings {settings} do not build a {cls.family} translator ({err})") from None


def check_state(path: Path, translator: Translator) -> None:
    """Refuse (TranslatorError) a safetensors file whose tensor names, shapes or dtypes are not `translator`'s
    state (read from the file's header alone: nothing is loaded)."""
    from safetensors import SafetensorError, safe_open

    expected = {k: (tuple(v.shape), v.dtype) for k, v in translator.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise TranslatorError(f"{path.name} is not a readable safetensors file ({err})") from None
    names = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}  # safetensors' names of the dtypes
    wrong = [f"missing {k}" for k in expected if k not in found] + [f"unexpected {k}" for k in found if k not in expected]
    wrong += [f"{k} is {found[k][1]} {list(found[k][0])}, not {names.get(dt, dt)} {list(shape)}"
              for k, (shape, dt) in expected.items() if k in found and found[k] != (shape, names.get(dt, dt))]
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise TranslatorError(f"{path.name} does not hold this {translator.family} translator's state ({shown})")


def load_state(folder: str | Path, manifest: dict[str, Any] | None = None, device="cpu") -> Translator:
    """A translator from a folder, state loaded, not bound to any models."""
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    translator = build(manifest)
    state = load_file(folder / MAPS_FILE)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise TranslatorError(f"{folder / MAPS_FILE}: {', '.join(bad[:4])} hold NaN or infinite values; train or "
                              "export the maps again (a run whose loss diverged writes such maps)")
    translator.load_state_dict(state, strict=True)
    return translator.to(device)


def same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two model identities name one model: local folders by their weights digest alone (a copied
    or moved folder holds the same model), Hub models by id and revision."""
    if "weights_sha256" in a and "weights_sha256" in b:
        return a["weights_sha256"] == b["weights_sha256"]
    return a == b


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
        if trained is not None and not same_model(trained, ident):
            raise TranslatorError(f"translator was trained for another {role} model ({trained}), not {ident}; "
                                  "use one trained for this pair")


def load_translator(folder: str | Path, pair, *, family: str | None = None, key_space: str | None = None,
                    manifest_file: str = MANIFEST_FILE) -> tuple[Translator, dict[str, Any]]:
    """The one loader: a frozen translator from `folder`, checked against `pair` and bound to its models.

    `pair` is a `kvlingo.run.models.Pair` (anything with source, target, direction and
    `identities()`). `manifest_file` names the file holding the spec (an exported folder's is
    config.json). Returns (translator, provenance: the manifest plus `path` and `manifest_sha256`).
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder, manifest_file)
        check_expected(manifest, family=family, key_space=key_space, direction=pair.direction,
                       models=pair.identities(), geometry=Geometry.of(pair.source, pair.target))
    except TranslatorError as err:
        raise TranslatorError(f"{folder}: {err}") from None
    device = next(pair.target.parameters()).device
    translator = load_state(folder, manifest, device).bind(pair.source, pair.target)
    translator.requires_grad_(False)
    info = {**manifest, "path": str(folder.resolve()), "manifest_sha256": sha256_file(folder / manifest_file)}
    return translator, info


# The families register themselves on import; importing them here makes every family loadable by name
# wherever the interface is imported. (At the end: each family module imports the names above.)
from . import crosslayer, headwise, residual, tokeninput  # noqa: E402,F401
