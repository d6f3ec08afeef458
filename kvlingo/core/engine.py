"""The no-grad translation engine: target layers in chunks, written straight into the output.

With gradients on (distillation) a translator maps every layer at once in FP32 and rounds once
to the output dtype (`Translator.translate_layers`). Without, target layers go in chunks, so
extra memory stays near one copy of the target cache plus one chunk of scratch, reused by every
chunk; the output can be a preallocated cache's context (`out=cache.context(n)`), so the
translation is the cache build.

Precisions of the no-grad path (`PRECISIONS`):

- `fp32` (the default): FP32 maths, rounded once to the output dtype: the same bits as the
  gradient path on every device, so scores reproduce across CPU and GPU.
- `fused`: FP32 maths, with the keys' norm and RoPE as one compiled kernel per chunk
  (kvlingo.core.fused), which also adds a map's second term (the token input's token term) on its
  way. Keys within `fused.TOLERANCE` (relative) of `fp32`, values identical.
  Chunks too small to be worth a compile, and machines where compiling fails, run the `fp32`
  finish.
- `fast`: the maps' matmuls take their inputs in the run dtype (BF16 or FP16; TF32 for an FP32
  run on CUDA) with FP32 accumulation; keys are normed and rotated in FP32 from the matmul's
  output and rounded once. A BF16 run is within `FAST_BF16_TOLERANCE` of `fp32`. A family opts in
  with `fast_paths = True`; the others run `fp32` maths.
- `fast-fused`: `fast`, with the keys' norm and RoPE as the compiled kernel, reading the
  matmul's output in the run dtype.

The translations of stages and of `kvlingo.Relay` run `fp32`; the optimised timing mode
(kvlingo.bench.timing) picks the others.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .cache import Part
from .settings import PRECISIONS  # noqa: F401  (re-exported)

DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "mps": 1 << 25, "cuda": 1 << 24}  # FP32 temporaries per chunk of layers
TILE_ELEMENTS = {"cpu": 1 << 18}  # elements of a token tile of the keys' norm and RoPE (cache-sized); untiled elsewhere

FAST = ("fast", "fast-fused")  # the maps' matmuls in the run dtype
FUSED = ("fused", "fast-fused")  # the keys' norm and RoPE as one compiled kernel
# How far the `fast` path in BF16 may be from the `fp32` path (both rounded to BF16), in units of the
# largest |output| of the `fp32` path, per target layer: the maps rounded to BF16 (relative 2^-9 each)
# and the matmul's output rounded once more before the final rounding both paths share. The measured
# gap is at most 0.0076 on the tiny pair, where the `fp32` path's own rounding is up to 0.0036.
FAST_BF16_TOLERANCE = 2.0**-6


@contextmanager
def matmul_precision(device, precision: str):
    """On CUDA under `fast`: TF32 for FP32 matmuls and FP32 accumulation for BF16/FP16 ones; elsewhere nothing."""
    if torch.device(device).type != "cuda" or precision not in FAST:
        yield
        return
    fp32_before = torch.get_float32_matmul_precision()
    reduced = torch.backends.cuda.matmul
    bf16_before, fp16_before = (
        reduced.allow_bf16_reduced_precision_reduction,
        reduced.allow_fp16_reduced_precision_reduction,
    )
    torch.set_float32_matmul_precision("high")
    reduced.allow_bf16_reduced_precision_reduction = reduced.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(fp32_before)
        reduced.allow_bf16_reduced_precision_reduction = bf16_before
        reduced.allow_fp16_reduced_precision_reduction = fp16_before


def compute_dtype(translator, out_dtype: torch.dtype, precision: str) -> torch.dtype:
    """dtype the maps' inputs and matmuls take on the no-grad path."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    fast = precision in FAST and translator.fast_paths and out_dtype in (torch.bfloat16, torch.float16)
    return out_dtype if fast else torch.float32


def chunk_layers(translator, n_tokens: int, device, chunk_elements: int | None = None) -> int:
    """Target layers per chunk."""
    if chunk_elements is None:
        chunk_elements = DEFAULT_CHUNK_ELEMENTS.get(torch.device(device).type, 1 << 24)
    g = translator.geometry
    per_layer = g.target_kv_heads * n_tokens * g.target_head_dim
    return max(1, min(g.target_layers, chunk_elements // max(1, per_layer)))


def chunk_tokens(translator, n_tokens: int, device, step: int = 1) -> int:
    """Tokens per tile of the keys' norm and RoPE in a chunk of `step` layers: on a CPU few enough that a
    tile's half-dozen passes stay in cache instead of going to memory each time; elsewhere all of them."""
    elements = TILE_ELEMENTS.get(torch.device(device).type)
    per_token = step * translator.geometry.target_kv_heads * translator.geometry.target_head_dim
    return max(1, min(n_tokens, elements // per_token)) if elements else max(1, n_tokens)


def scratch_chunks(translator, out_dtype: torch.dtype, precision: str = "fp32", tile_fraction: float = 1.0) -> float:
    """FP32 layer chunks of scratch one translation holds: the maps' output, the matmul's output in the
    compute dtype when that is narrower, and per token tile (`tile_fraction` of a chunk) squares for the
    norm, half for RoPE and a staging tile when the output is not FP32."""
    compute = compute_dtype(translator, out_dtype, precision)
    low = 0 if compute == torch.float32 else torch.empty(0, dtype=compute).element_size() / 4
    return 1 + low + tile_fraction * (1.5 + (0 if out_dtype == torch.float32 else 1))


def translate(
    translator,
    cap,
    out_dtype: torch.dtype | None = None,
    chunk_elements: int | None = None,
    target_layers: slice = slice(None),
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    precision: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Translator.forward`: target (keys, values), each [target layers, kv_heads, tokens, head_dim]."""
    if translator.space is None:
        raise RuntimeError("translator is not bound to a pair: call .bind(source, target) first")
    g, T, device = translator.geometry, cap.n_tokens, cap.values.device
    first, stop, _ = target_layers.indices(g.target_layers)
    L, H, d = max(0, stop - first), g.target_kv_heads, g.target_head_dim
    if out is not None and (out[0].shape != (L, H, T, d) or (out[1] is not None and out[1].shape != (L, H, T, d))):
        raise ValueError(
            f"out {tuple(out[0].shape)} / {None if out[1] is None else tuple(out[1].shape)} must "
            f"both be [{L}, {H}, {T}, {d}]"
        )
    out_dtype = out[0].dtype if out is not None else (out_dtype or cap.keys.dtype)
    if torch.is_grad_enabled() and any(p.requires_grad for p in translator.parameters()):
        keys, values = translator.translate_layers(cap, target_layers)
        if out is None:
            return keys.to(out_dtype), values.to(out_dtype)
        out[0].copy_(keys)
        if out[1] is not None:
            out[1].copy_(values)
        return out
    precision = precision or "fp32"
    compute = compute_dtype(translator, out_dtype, precision)
    step = chunk_layers(translator, T, device, chunk_elements)
    tile = chunk_tokens(translator, T, device, step)
    if out is None:
        keys = torch.empty(L, H, T, d, dtype=out_dtype, device=device)
        values = torch.empty_like(keys)
    else:
        keys, values = out
    scratch = Scratch((step, H, T, d), device, tile)
    with (
        torch.no_grad(),
        torch.autocast(device_type=device.type, enabled=False),
        matmul_precision(device, precision),
        translator.computing(compute, precision in FUSED),
    ):
        for start in range(first, stop, step):
            layers = slice(start, min(stop, start + step))
            rows = slice(start - first, layers.stop - first)
            _translate_into(
                translator,
                cap,
                layers,
                keys[rows],
                None if values is None else values[rows],
                scratch,
                precision in FUSED,
            )
    return keys, values


def _translate_into(
    translator, cap, layers: slice, k_out: torch.Tensor, v_out: torch.Tensor | None, scratch: Scratch, fuse_keys: bool
) -> None:
    """`translate_layers` for one chunk, written into the output.

    In FP32 maths, the same operations in the same order as `translate_layers` (so the same
    bits), but in place on buffers reused across chunks: the maps write into preallocated
    memory, the norm scales in place, RoPE writes each half straight into the output. A family
    without `fast_paths` maps into contiguous scratch, which is then copied into the output.
    Under a compute dtype below FP32, the key map's output is widened once for norm and RoPE.
    With `fuse_keys`, norm and RoPE run as one compiled kernel over the chunk (when it runs).
    """
    n, compute, T = k_out.shape[0], translator._compute, k_out.shape[2]
    space = translator.space
    key_map = scratch.take("yk" if compute == torch.float32 else "low", n, compute)  # [n, heads, tokens, d_out]
    if fuse_keys:  # a map's second term (the token input's) goes to the compiled finish, which adds it
        addend = translator.map_keys_into(cap, layers, key_map)
        done = space.finish_keys_fused(key_map, layers, k_out, addend)
        if not done and addend is not None:
            key_map.add_(addend)  # the eager finish below: the sum `map_into` writes, the same bits
    else:
        translator.map_into(Part.KEYS, cap, layers, key_map)
        done = False
    if not done:
        yk = key_map
        if compute != torch.float32:  # widened once for the FP32 norm and RoPE
            yk = scratch.take("yk", n)
            yk.copy_(key_map)
        for begin in range(0, T, scratch.tile):  # per-token norm and RoPE, tile by tile: the same bits
            end = min(T, begin + scratch.tile)
            scratch.tokens = end - begin
            space.finish_keys_into(yk[:, :, begin:end], layers, k_out[:, :, begin:end], scratch, start=begin)
    if v_out is None:  # keys only: the values stay deferred
        return
    if v_out.dtype == compute and (v_out.is_contiguous() or (translator.fast_paths and rows_per_head(v_out))):
        translator.map_into(Part.VALUES, cap, layers, v_out)  # straight into the output (a cache's layout)
    else:
        yv = scratch.take("yk", n) if compute == torch.float32 else scratch.take("low", n, compute)
        translator.map_into_via(Part.VALUES, cap, layers, v_out, yv)  # the key buffers are free again


def rows_per_head(t: torch.Tensor) -> bool:
    """Whether t [layers, heads, tokens, dim] holds each head's token rows contiguously and its layers and heads
    as one run of heads (a cache's context view): what a batched matmul writes in place. A token-major layout
    ([layers, tokens, heads, dim] underneath, an engine's cache) is not: a matmul into it would compute into a
    temporary and copy, so the values go through scratch and one copy per chunk instead."""
    L, H, T, d = t.shape
    return t.stride(-1) == 1 and (T == 1 or t.stride(2) == d) and (L == 1 or t.stride(0) == H * t.stride(1))


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
        return buf[:n] if whole else buf[:n, :, : self.tokens]
