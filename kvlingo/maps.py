"""Head-wise affine maps and the translation of a source cache into a target cache.

One affine map per (K/V, layer, KV head), stored as two tensors:
    weight [2, layers, kv_heads, d_in, d_out]   (index 0 = keys, 1 = values)
    bias   [2, layers, kv_heads, d_out]
and applied to every layer and head at once with one batched matmul per K/V, never a
Python loop over heads.

Two key spaces:
- `prenorm`: source k_proj features → target k_proj features; the target's own k_norm and
  RoPE follow. Needs the source's pre-norm features, stored beside its cache.
- `cache`: source cached keys with the source RoPE stripped → target post-norm keys; the
  target's RoPE follows. Needs nothing beyond an ordinary cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .cache import Capture
from .report import atomic_write_bytes, atomic_write_json, sha256_file
from .rope import RopeCache, apply_rope, apply_rope_into, strip_rope

KEY_SPACES = ("prenorm", "cache")
MAPS_FILE = "maps.safetensors"
MANIFEST_FILE = "manifest.json"


class HeadwiseMaps(nn.Module):
    def __init__(self, n_layers: int, n_heads: int, d_in: int, d_out: int, key_space: str = "prenorm"):
        super().__init__()
        if key_space not in KEY_SPACES:
            raise ValueError(f"key_space {key_space!r} is not one of {KEY_SPACES}")
        self.key_space = key_space
        self.weight = nn.Parameter(torch.zeros(2, n_layers, n_heads, d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(2, n_layers, n_heads, d_out))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, L, H, d_in, d_out = self.weight.shape
        return L, H, d_in, d_out

    @classmethod
    def identity(cls, n_layers: int, n_heads: int, dim: int, key_space: str = "prenorm") -> "HeadwiseMaps":
        m = cls(n_layers, n_heads, dim, dim, key_space)
        with torch.no_grad():
            m.weight.copy_(torch.eye(dim).expand_as(m.weight))
        return m

    @classmethod
    def for_pair(cls, source, target, key_space: str = "prenorm") -> "HeadwiseMaps":
        s, t = source.config, target.config
        return cls(s.num_hidden_layers, s.num_key_value_heads, s.head_dim, t.head_dim, key_space)

    def apply_one(self, which: int, x: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """x [layers, heads, tokens, d_in] → [layers, heads, tokens, d_out] for keys (0) or values (1).

        `layers` selects which maps x belongs to (a chunk of consecutive layers).
        """
        return self.apply_one_into(which, x, layers, None)

    def apply_one_into(self, which: int, x: torch.Tensor, layers: slice, out: torch.Tensor | None) -> torch.Tensor:
        """`apply_one`, written into `out` [layers, heads, tokens, d_out] (FP32, contiguous) when given."""
        L, H, T, d_in = x.shape
        w = self.weight[which, layers].reshape(L * H, d_in, -1)  # [L*H, d_in, d_out]
        b = self.bias[which, layers].reshape(L * H, 1, -1)  # [L*H, 1, d_out]
        if out is None:
            return torch.baddbmm(b, x.reshape(L * H, T, d_in), w).view(L, H, T, -1)
        torch.baddbmm(b, x.reshape(L * H, T, d_in), w, out=out.view(L * H, T, -1))
        return out

    def forward(self, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply_one(0, xk), self.apply_one(1, xv)


# --------------------------------------------------------------------------- translation
def k_norm_params(model) -> tuple[torch.Tensor, float]:
    """The target's per-layer k_norm weights [layers, head_dim] (FP32) and its epsilon."""
    layers = model.model.layers
    w = torch.stack([l.self_attn.k_norm.weight.detach().float() for l in layers])
    return w, layers[0].self_attn.k_norm.variance_epsilon


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm over head_dim for x [layers, heads, tokens, dim], weight [layers, dim], in FP32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight[:, None, None, :] * x


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float, squares: torch.Tensor) -> torch.Tensor:
    """`rms_norm` in place on FP32 x (same operations, same bits); `squares` is x-sized scratch."""
    var = torch.pow(x, 2, out=squares).mean(-1, keepdim=True)
    x.mul_(torch.rsqrt(var.add_(eps)))
    return x.mul_(weight[:, None, None, :])


class Translator:
    """Source cache (a Capture) → target K/V, ready for `cache.build_cache`."""

    def __init__(self, maps: HeadwiseMaps, source, target):
        self.maps = maps
        self.source_rope = RopeCache(source)
        self.target_rope = RopeCache(target)
        w, eps = k_norm_params(target)
        self.k_norm_weight, self.k_norm_eps = w.to(maps.weight.device), eps

    def key_features(self, cap: Capture, layers: slice = slice(None)) -> torch.Tensor:
        """Source-side key inputs [layers, heads, tokens, d_in] in FP32, for the maps or the fit."""
        if self.maps.key_space == "prenorm":
            if cap.prenorm is None:
                raise ValueError("key space 'prenorm' needs the source's pre-norm key features; capture with want_prenorm=True")
            return cap.prenorm[layers].float()
        cos, sin = self.source_rope(cap.n_tokens, device=cap.keys.device)
        return strip_rope(cap.keys[layers].float(), cos, sin)

    def finish_keys(self, yk: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """Mapped keys → the target's cached keys (k_norm in prenorm space, then the target's RoPE)."""
        if self.maps.key_space == "prenorm":
            yk = rms_norm(yk, self.k_norm_weight[layers], self.k_norm_eps)
        cos, sin = self.target_rope(yk.shape[2], device=yk.device)
        return apply_rope(yk, cos, sin)

    def translate_layers(self, cap: Capture, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 target keys and values for a run of layers: [layers, heads, tokens, d_out] each."""
        with torch.autocast(device_type=cap.keys.device.type, enabled=False):
            yk = self.maps.apply_one(0, self.key_features(cap, layers), layers)
            yv = self.maps.apply_one(1, cap.values[layers].float(), layers)
            return self.finish_keys(yk, layers), yv

    def __call__(self, cap: Capture, out_dtype: torch.dtype | None = None,
                 chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate a capture: FP32 inside, rounded once to `out_dtype` at the end.

        With gradients on (distillation) all layers go through at once. Without, layers are
        processed in chunks of about `chunk_elements` values written straight into the
        preallocated output, so the extra memory stays near one copy of the target cache
        (plus one chunk of FP32 temporaries).
        """
        out_dtype = out_dtype or cap.keys.dtype
        if torch.is_grad_enabled() and self.maps.weight.requires_grad:
            keys, values = self.translate_layers(cap)
            return keys.to(out_dtype), values.to(out_dtype)  # [layers, heads, tokens, head_dim] each
        L, H, T, _ = cap.values.shape
        d_out = self.maps.shape[3]
        if chunk_elements is None:
            chunk_elements = DEFAULT_CHUNK_ELEMENTS.get(cap.values.device.type, 1 << 24)
        step = max(1, min(L, chunk_elements // max(1, H * T * d_out)))
        keys = torch.empty(L, H, T, d_out, dtype=out_dtype, device=cap.values.device)
        values = torch.empty_like(keys)
        scratch = _Scratch(step, H, T, d_out, cap.values.device)
        with torch.no_grad(), torch.autocast(device_type=cap.values.device.type, enabled=False):
            for start in range(0, L, step):
                layers = slice(start, min(L, start + step))
                self._translate_into(cap, layers, keys[layers], values[layers], scratch)
        return keys, values

    def _translate_into(self, cap: Capture, layers: slice, k_out: torch.Tensor, v_out: torch.Tensor,
                        scratch: "_Scratch") -> None:
        """The no-grad path of `translate_layers` for one chunk, written into the output.

        The same operations in the same order as `translate_layers` (so the same bits), but
        in place on buffers reused across chunks: the matmuls write into preallocated
        memory, the norm scales in place, RoPE writes each half straight into the output
        (FP32) or into one FP32 buffer rounded once into it (other dtypes). The functional
        path makes about five fresh full-size temporaries per key chunk; this makes none.
        """
        n = k_out.shape[0]
        yk = scratch.take("yk", n)  # [n, heads, tokens, d_out] FP32
        self.maps.apply_one_into(0, self.key_features(cap, layers), layers, yk)
        if self.maps.key_space == "prenorm":
            rms_norm_(yk, self.k_norm_weight[layers], self.k_norm_eps, scratch.take("sq", n))
        cos, sin = self.target_rope(yk.shape[2], device=yk.device)
        dest = k_out if k_out.dtype == torch.float32 else scratch.take("out", n)
        apply_rope_into(yk, cos, sin, dest, scratch.take("half", n))
        if dest is not k_out:
            k_out.copy_(dest)  # the one rounding to the output dtype
        if v_out.dtype == torch.float32:
            self.maps.apply_one_into(1, cap.values[layers].float(), layers, v_out)
        else:
            yv = scratch.take("yk", n)  # the key buffer is free again
            self.maps.apply_one_into(1, cap.values[layers].float(), layers, yv)
            v_out.copy_(yv)


class _Scratch:
    """FP32 buffers for one translation, allocated once and reused by every layer chunk
    (fresh large allocations cost page faults on a CPU and allocator traffic on a GPU)."""

    def __init__(self, step: int, heads: int, tokens: int, dim: int, device):
        self.shape = (step, heads, tokens, dim)
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, n: int) -> torch.Tensor:
        if name not in self.buffers:
            shape = self.shape if name != "half" else (*self.shape[:3], self.shape[3] // 2)
            self.buffers[name] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self.buffers[name][:n]


# FP32 temporaries per translation chunk: small on CPUs (cache locality), large on GPUs (fewer launches).
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "mps": 1 << 25, "cuda": 1 << 27}


def target_key_features(target_cap: Capture, key_space: str, target_rope: RopeCache) -> torch.Tensor:
    """What the maps should produce for keys: target pre-norm features, or post-norm keys with RoPE stripped."""
    if key_space == "prenorm":
        return target_cap.prenorm.float()
    cos, sin = target_rope(target_cap.n_tokens, device=target_cap.keys.device)
    return strip_rope(target_cap.keys.float(), cos, sin)


# --------------------------------------------------------------------------- saving
def save_maps(folder: str | Path, maps: HeadwiseMaps, manifest: dict[str, Any]) -> Path:
    """maps.safetensors, then manifest.json (written last: its presence marks a complete artifact)."""
    from safetensors.torch import save

    folder = Path(folder)
    blob = save({"weight": maps.weight.detach().cpu().contiguous(), "bias": maps.bias.detach().cpu().contiguous()})
    atomic_write_bytes(folder / MAPS_FILE, blob)
    L, H, d_in, d_out = maps.shape
    full = {
        **manifest,
        "key_space": maps.key_space,
        "shape": {"layers": L, "kv_heads": H, "d_in": d_in, "d_out": d_out},
        "maps_sha256": sha256_file(folder / MAPS_FILE),
    }
    atomic_write_json(folder / MANIFEST_FILE, full)
    return folder


def load_maps(folder: str | Path, device: str = "cpu") -> tuple[HeadwiseMaps, dict[str, Any]]:
    from safetensors.torch import load_file

    folder = Path(folder)
    mpath = folder / MANIFEST_FILE
    if not mpath.exists():
        raise FileNotFoundError(f"{folder} holds no {MANIFEST_FILE}: not a complete maps artifact; "
                                "train it first (make train RUN=...), or point --maps-dir at a maps folder")
    manifest = json.loads(mpath.read_text())
    digest = sha256_file(folder / MAPS_FILE)
    if digest != manifest["maps_sha256"]:
        raise ValueError(f"{folder / MAPS_FILE} does not match its manifest hash (damaged or replaced); re-run training")
    tensors = load_file(folder / MAPS_FILE)
    s = manifest["shape"]
    maps = HeadwiseMaps(s["layers"], s["kv_heads"], s["d_in"], s["d_out"], manifest["key_space"])
    with torch.no_grad():
        maps.weight.copy_(tensors["weight"])
        maps.bias.copy_(tensors["bias"])
    return maps.to(device), manifest


def check_maps_for_pair(manifest: dict[str, Any], shape: tuple[int, int, int, int], want_shape: tuple[int, int, int, int],
                        direction: str | None = None, models: dict[str, Any] | None = None,
                        key_space: str | None = None) -> None:
    """Refuse maps made for another pair, direction or key space (ValueError naming the field).

    `direction` and `models` ({"source": identity, "target": identity}) are compared when the
    manifest records them, as the training stage always does.
    """
    if tuple(shape) != tuple(want_shape):
        raise ValueError(f"maps have shape (layers, kv_heads, d_in, d_out)={tuple(shape)}, but this pair needs "
                         f"{tuple(want_shape)}: they were trained for another pair; check --large/--small/--direction")
    if direction and manifest.get("direction") not in (None, direction):
        raise ValueError(f"maps were trained for direction {manifest['direction']!r}, this run is {direction!r}; "
                         f"pass --direction {manifest['direction']} or train maps for this direction")
    if key_space is not None and manifest.get("key_space") != key_space:
        raise ValueError(f"maps use key space {manifest.get('key_space')!r}, this run asks for {key_space!r}; "
                         f"pass --key-space {manifest.get('key_space')} or train maps in {key_space!r}")
    for role, ident in (models or {}).items():
        trained = manifest.get("models", {}).get(role)
        if trained is not None and trained != ident:
            raise ValueError(f"maps were trained for another {role} model ({trained}), not {ident}; "
                             "use maps trained for this pair")


def load_translator(folder: str | Path, source, target, direction: str | None = None,
                    models: dict[str, Any] | None = None, key_space: str | None = None
                    ) -> tuple[Translator, dict[str, Any]]:
    """A frozen Translator from a maps artifact, checked against the pair; and its provenance
    (the manifest plus `path` and `manifest_sha256`)."""
    folder = Path(folder)
    device = next(target.parameters()).device
    maps, manifest = load_maps(folder, device=str(device))
    s, t = source.config, target.config
    want = (s.num_hidden_layers, s.num_key_value_heads, s.head_dim, t.head_dim)
    try:
        check_maps_for_pair(manifest, maps.shape, want, direction, models, key_space)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    maps.requires_grad_(False)
    info = {**manifest, "path": str(folder.resolve()), "manifest_sha256": sha256_file(folder / MANIFEST_FILE)}
    return Translator(maps, source, target), info
