"""The translated keys' finish (the target's k_norm, then its RoPE) as one compiled kernel.

The `fp32` path (`KeySpace.finish_keys_into`) runs the norm and RoPE in the target model's own
operations and order, about a dozen elementwise passes per token tile, so a translation of a
model's own keys comes back bit for bit. The `fused` precision (kvlingo.core.engine) runs the
same maths as one torch.compile (inductor) kernel that reads the maps' output once and writes
the cache once. A family whose key map is a sum written in two steps (the token-input maps: the
base's maps, then the token term) hands the second term to the kernel, which adds it on the way
(`Translator.map_keys_into`), so the sum is never written on its own. It is not the same bits:
inductor sums the squares of the norm in its own order; `TOLERANCE` bounds the difference. Values
are not touched.

The kernel also takes the key map's output in a narrower dtype (the `fast-fused` precision: BF16
or FP16 matmuls), widening it inside the kernel, so the FP32 staging copy is never written; on
CUDA torch.compile builds it with Triton.

The source side has its kernel too (`strip_keys`): the cached keys' RoPE stripped with the source's
schedule, read in the cache's dtype and written in the maps' input dtype in one pass, where the eager
strip widens, rotates in five passes and narrows again.

Each shape compiles once (`dynamic=False`: dynamic-shape kernels ran slower), so the kernel only
takes chunks of `MIN_ELEMENTS` or more and at most `MAX_SHAPES` shapes per process (torch's own
recompile limit is 8). Compiling needs a C++ compiler; where it fails, or past those limits,
`finish_keys` returns False, the caller runs the `fp32` finish, and `status()` says why.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

from .norm import rms_norm

MIN_ELEMENTS = 1 << 20  # elements per chunk below which the eager finish runs (no compile for small chunks)
MAX_SHAPES = 6  # distinct shapes compiled per process (torch's recompile limit is 8)
TOLERANCE = 2.0**-20  # max |fused - fp32| / max |fp32 key| per chunk (measured at most 2.8e-7 at the real shapes)
DEVICES = ("cpu", "cuda")  # inductor's C++ and Triton back ends
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the key map may write (widened in the kernel)

_state: dict = {"kernels": {}, "shapes": {}, "failure": None, "skipped": 0}  # kernels and shapes by kernel name


def _finish(
    yk: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    addend: torch.Tensor | None = None,
) -> None:
    """yk [n, heads, tokens, d] (FP32, or narrower: widened here), plus `addend` of its shape where given (a
    family's term still to be summed, such as the token-input maps' token term); weight [n, d] (None: no k_norm);
    cos/sin [tokens, d] → out (any dtype).

    The norm is `keyspace.rms_norm` itself. RoPE is written half by half, as `rope.apply_rope_into`
    computes it (k1·cos1 - k2·sin1, k2·cos2 + k1·sin2; the same values as `apply_rope`), which compiles
    to a faster kernel than `apply_rope`'s rotate_half with the same bits."""
    yk = yk.float() if addend is None else yk.float() + addend.float()
    out.copy_(_rope_halves(yk if weight is None else rms_norm(yk, weight, eps), cos, sin))


def _rope_halves(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of y [..., tokens, d] by the tables cos/sin [tokens, d], half by half (traced into each kernel):
    (y1·cos1 − y2·sin1, y2·cos2 + y1·sin2), written over a [..., 2, d/2] view as y·cos + swap(y)·(∓1·sin). The
    same bits (a − b·s = a + b·(−s) exactly), but one pointwise pass: a concatenation of the halves is
    materialised in FP32 by inductor's CPU kernels and copied again, about twice the time at Qwen3's shapes."""
    h = y.shape[-1] // 2
    halves = y.unflatten(-1, (2, h))  # [..., tokens, 2, h]
    sign = torch.tensor([-1.0, 1.0], dtype=sin.dtype, device=sin.device).view(2, 1)
    c, s = cos.unflatten(-1, (2, h)), sin.unflatten(-1, (2, h)) * sign
    return (halves * c + halves.flip(-2) * s).flatten(-2)


def finish_keys(
    yk: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    addend: torch.Tensor | None = None,
) -> bool:
    """Norm (when `weight` is given) and RoPE of yk (+ `addend`) into `out` as one compiled kernel. True when it
    ran; False (the caller then sums and writes every key itself) for a chunk off a CPU or CUDA device, not in a
    float dtype, under `MIN_ELEMENTS`, past `MAX_SHAPES`, or after a compile failure."""
    if yk.device.type not in DEVICES or yk.dtype not in DTYPES or yk.numel() < MIN_ELEMENTS or _state["failure"]:
        return False
    if addend is not None and (addend.shape != yk.shape or addend.dtype not in DTYPES):
        return False
    key = (
        yk.device.type,
        yk.dtype,
        tuple(yk.shape),
        tuple(yk.stride()),
        tuple(out.stride()),
        out.dtype,
        weight is None,
        eps,
        tuple(cos.stride()),
        None if addend is None else (addend.dtype, tuple(addend.stride())),
    )
    return _run("finish", _finish, key, yk, weight, eps, cos, sin, out, addend)


def _strip(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """keys [n, heads, tokens, d] as cached (any float dtype) with RoPE stripped by the inverse tables cos/sin
    [tokens, d] → out (any dtype): `rope.strip_rope` is RoPE with the sine negated (a separate function from
    `_finish`, so that each kernel has its own compiled shapes)."""
    out.copy_(_rope_halves(keys.float(), cos, -sin))


def strip_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> bool:
    """`rope.strip_rope` of the cached `keys` into `out` (the maps' input dtype) as one compiled kernel. True when
    it ran; False (the caller strips eagerly) under the same conditions as `finish_keys`."""
    if keys.device.type not in DEVICES or keys.dtype not in DTYPES or keys.numel() < MIN_ELEMENTS or _state["failure"]:
        return False
    key = (keys.device.type, keys.dtype, tuple(keys.shape), tuple(keys.stride()), tuple(out.stride()), out.dtype)
    return _run("strip", _strip, key + (tuple(cos.stride()),), keys, cos, sin, out)


def _run(name: str, fn, key: tuple, *args) -> bool:
    """Run kernel `name` (`fn` compiled once per process, one shape per distinct `key`): True when it ran."""
    shapes = _state["shapes"].setdefault(name, set())
    new = key not in shapes  # this call compiles
    if new and len(shapes) >= MAX_SHAPES:
        _state["skipped"] += 1
        return False
    kernel = _state["kernels"].get(name)
    if kernel is None:
        kernel = _state["kernels"][name] = torch.compile(fn, dynamic=False)
    try:
        with _quiet_cuda_probe() if new else nullcontext():
            kernel(*args)
    except Exception as err:  # no C++ compiler, or inductor cannot build the kernel: the eager path runs
        _state["failure"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return False
    shapes.add(key)
    return True


@contextmanager
def _quiet_cuda_probe():
    """Compiling a CPU kernel makes torch's extension builder look for CUDA and warn when it finds none;
    on a CPU run that warning says nothing, so it is held back for the call."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def status() -> dict:
    """What the fused finish did in this process: shapes compiled, chunks left to the eager finish past
    `MAX_SHAPES`, and why compiling failed (None when it did not)."""
    return {
        "compiled_shapes": sum(len(v) for v in _state["shapes"].values()),
        "compiled_by_kernel": {k: len(v) for k, v in _state["shapes"].items()},
        "skipped_chunks": _state["skipped"],
        "failure": _state["failure"],
        "min_elements": MIN_ELEMENTS,
    }


def reset() -> None:
    """Forget compiled kernels, shapes and any failure (tests)."""
    torch.compiler.reset()
    _state.update(kernels={}, shapes={}, failure=None, skipped=0)
