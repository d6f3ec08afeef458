"""Physical limits of the handoff: each step's time floor from its FLOPs and bytes (a roofline).

A step cannot run faster than max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth). Steps
that run one after another add up. So, for a context of n tokens and a new turn of k:

    re-prefill   the target reads n + k tokens: every weight once, K/V written for n + k
                 tokens; dense FLOPs for n + k tokens, causal attention, one row of logits
    translation  the source's key features and values read, the maps read, the target's
                 K/V written; `flops_per_token` · n (values deferred: the keys' maps alone)
    new turn     the target reads k tokens: every weight once, the n-token cache read, k
                 tokens' K/V written; dense FLOPs for k tokens, attention of k queries over
                 n + k keys, one row of logits (values deferred: each query row mixes every
                 source value its head reads, then the value map maps the mix: `deferred_work`)

and the limit of the speedup is floor(re-prefill) / (floor(translation) + floor(new turn)).
The same floors tell how far each measured stage is from its own limit.

The peaks are an assumption about the device, recorded beside every figure: by default
measured here (`measure_peaks`: the best of a few large matmuls in the run dtype, and of a
large copy), or given (e.g. a datasheet's: H200 SXM, 4.8 TB/s HBM3e and about 790 TFLOP/s
dense BF16). Measured peaks are what this machine reaches with these kernels, so the limit
is one that the same libraries could approach; a shared CPU's are lower than an idle one's.

A probe is a few seconds of one matmul shape and can catch a slow moment or a shape the
library runs below its best, while a timed step is evidence too: a step that did F FLOPs and
moved B bytes in t seconds shows the device reaches at least F / t FLOP/s and B / t bytes/s.
`raise_to_reached` lifts measured peaks to the best such rate of a run's timed steps, so that
every floor of that run is a lower bound on what was timed. Given peaks are left as given.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..core.arch import head_dim
from ..core.cache import Part


def synchronize(device: str | torch.device) -> None:
    """Wait for queued device work so that a host clock reading covers it (a no-op on CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Peaks:
    flops_per_s: float  # dense matmul FLOP/s in the run dtype
    bytes_per_s: float  # memory bandwidth (bytes read + written per second)
    source: str  # how they were obtained: "measured ..." or "given"


def _best_seconds(fn, device, repeats: int = 3) -> float:
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(device, dtype: torch.dtype) -> Peaks:
    """The best of three large matmuls in `dtype` and three large copies on `device` (on the current threads)."""
    device = torch.device(device)
    gpu = device.type != "cpu"
    # A CPU's reduced-precision matmuls can be far slower than its FP32 ones: keep their probe small.
    n = 8192 if gpu else (2048 if dtype == torch.float32 else 512)
    with torch.inference_mode():
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        flops = 2 * n**3 / _best_seconds(lambda: a @ b, device)
        a = b = None  # free the probe's matrices before the copy's buffers
        src = torch.empty((1 << 30) if gpu else (1 << 28), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() / _best_seconds(lambda: dst.copy_(src), device)
    return Peaks(flops, bandwidth, f"measured on {device.type} ({torch.get_num_threads()} threads), {str(dtype)[6:]}")


# --------------------------------------------------------------------------- counts
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def weight_bytes(model) -> int:
    """Bytes of every parameter once (a tied LM head is the embedding, read once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes(model, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a `tokens`-long K/V cache of `model` in `dtype`."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * tokens * head_dim(c) * _element_size(dtype)


def forward_flops(model, q_tokens: int, cached_tokens: int) -> float:
    """FLOPs of a forward of q tokens after `cached_tokens`, keeping one row of logits: dense layers,
    causal attention (q queries over cached + q keys) and the LM head for one position."""
    c = model.config
    dense = sum(p.numel() for name, p in model.model.layers.named_parameters() if p.dim() == 2)
    attended = q_tokens * cached_tokens + q_tokens * (q_tokens + 1) / 2  # query-key pairs under the causal mask
    attention = 4.0 * c.num_hidden_layers * c.num_attention_heads * head_dim(c) * attended
    lm_head = 2.0 * c.vocab_size * c.hidden_size
    return 2.0 * dense * q_tokens + attention + lm_head


def layer0_work(target, n: int, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, bytes) of the target's exact layer 0 over n context tokens (the exact:0 refresh; a token-input
    translator's features are the same projections, computed once): k_proj and v_proj of each token
    (`layer0.flops_per_token`), reading its embedding row and the two projections. The K/V it writes are
    counted with the cache the translation writes; norms, RoPE and the FP32 features are not counted."""
    from ..core.layer0 import flops_per_token

    c, attn = target.config, target.model.layers[0].self_attn
    rows = n * c.hidden_size * _element_size(dtype)
    return flops_per_token(c) * n, rows + _bytes((attn.k_proj.weight, attn.v_proj.weight))


def step_floor(flops: float, nbytes: float, peaks: Peaks) -> dict:
    compute, memory = flops / peaks.flops_per_s, nbytes / peaks.bytes_per_s
    return {
        "flops": flops,
        "bytes": nbytes,
        "compute_s": compute,
        "memory_s": memory,
        "floor_s": max(compute, memory),
        "bound": "compute" if compute >= memory else "memory",
    }


def translation_flops(translator, n: int, defer_values: bool = False) -> float:
    """FLOPs of translating n context tokens; with the values deferred, the key maps' alone (and the values' token
    input, `Translator.deferred_token_input`, which is computed once per token)."""
    if not defer_values:
        return translator.flops_per_token() * n
    return (translator.flops_per_token(Part.KEYS) + translator.deferred_input_flops_per_token()) * n


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def deferred_work(
    translator, target, n: int, k: int, dtype: torch.dtype, feature_dtype: torch.dtype | None = None
) -> tuple[float, float]:
    """(FLOPs, bytes) a new turn of k tokens adds on a cache of n deferred context tokens, against one
    whose values are translated (`Translator.value_maps`; kvlingo.core.attention.deferred_attention).

    Per target layer, each of the q_heads · k query rows mixes the source values its KV head reads
    (the mix width: k_s source layers × (1 or every) source head × d_s) over the n context tokens
    instead of the target's d_t-wide values, then maps the mix (mix width × d_t, or through a rank r:
    mix width × r + r × d_t). The turn reads the source values of every layer each target layer reads
    instead of the target's context values, and the value maps. `dtype`: the target cache's;
    `feature_dtype`: the source values' (default `dtype`).
    """
    maps = translator.value_maps()
    c, g = target.config, translator.geometry
    rows = c.num_attention_heads * k  # query rows of one layer
    mix = maps.weight.shape[2] if maps.down is None else maps.down.shape[1]
    mapped = mix * maps.weight.shape[3] if maps.down is None else maps.down.shape[2] * (mix + maps.weight.shape[3])
    flops = 2.0 * c.num_hidden_layers * rows * (n * (mix - g.target_head_dim) + mapped)
    read = len(maps.layers) * len(maps.layers[0]) * g.source_kv_heads * n * g.source_head_dim
    nbytes = (
        read * _element_size(feature_dtype or dtype)
        - kv_bytes(target, n, dtype) / 2
        + _bytes((maps.weight, maps.bias, maps.down, maps.token_weight))
    )
    if maps.token_weight is not None:  # the token term: its input mixed over the context, then mapped, per layer
        layers, _, width, d = maps.token_weight.shape
        flops += 2.0 * layers * rows * (n * width + width * d)
        nbytes += n * width * 4  # the FP32 token input, read once per layer's turn
    return flops, nbytes


def deferral_saves(translator, target, n: int, k: int) -> bool:
    """Whether deferring the values does fewer FLOPs than translating them, for a new turn of k tokens
    on n context tokens: the value maps' translation against what the turn's attention adds."""
    return translator.flops_per_token(Part.VALUES) * n > deferred_work(translator, target, n, k, torch.float32)[0]


def handoff_work(
    source,
    target,
    translator,
    n: int,
    k: int,
    dtype: torch.dtype,
    feature_dtype: torch.dtype | None = None,
    defer_values: bool = False,
) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of re-prefill, translation and the new turn for a context of n tokens and a new turn of k.

    `dtype`: the models' (and caches') dtype; `feature_dtype`: what the translation reads (the
    capture's dtype; default `dtype`). `defer_values`: the translation maps keys only, and the new
    turn does `deferred_work` on top of its own.
    """
    g = translator.geometry
    feature_dtype = feature_dtype or dtype
    maps = translator.value_maps()
    reads = len(maps.layers[0]) if maps is not None else 1  # source layers each target layer's maps read
    source_features = g.target_layers * reads * g.source_kv_heads * n * g.source_head_dim * _element_size(feature_dtype)
    all_maps = _bytes(translator.parameters())
    new_turn_flops = forward_flops(target, k, n)
    new_turn_bytes = weight_bytes(target) + kv_bytes(target, n, dtype) + kv_bytes(target, k, dtype)
    if not defer_values:
        translation = (translation_flops(translator, n), 2 * source_features + all_maps + kv_bytes(target, n, dtype))
    else:
        key_maps = all_maps - _bytes((maps.weight, maps.bias, maps.down, maps.token_weight))
        translation = (
            translation_flops(translator, n, True),
            source_features + key_maps + kv_bytes(target, n, dtype) / 2,
        )
        extra_flops, extra_bytes = deferred_work(translator, target, n, k, dtype, feature_dtype)
        new_turn_flops += extra_flops
        new_turn_bytes += extra_bytes
    return {
        "reprefill": (forward_flops(target, n + k, 0), weight_bytes(target) + kv_bytes(target, n + k, dtype)),
        "translation": translation,
        "new_turn": (new_turn_flops, new_turn_bytes),
    }


def limits_at(work: dict[str, tuple[float, float]], peaks: Peaks) -> dict:
    """Each step's floor at `peaks` and the speedup limit floor(re-prefill) / (floor(translation) + floor(new turn))."""
    floors = {step: step_floor(flops, nbytes, peaks) for step, (flops, nbytes) in work.items()}
    handoff = floors["translation"]["floor_s"] + floors["new_turn"]["floor_s"]
    return {
        "peaks": asdict(peaks),
        **floors,
        "handoff_floor_s": handoff,
        "speedup_limit": floors["reprefill"]["floor_s"] / handoff,
    }


def raise_to_reached(
    peaks: Peaks, reached: list[tuple[str, float, float, float]], flops: bool = True, memory: bool = True
) -> Peaks:
    """`peaks` lifted to the best rate a timed step reached, where that is higher.

    `reached`: (label, FLOPs, bytes, seconds) of each timed step; a step's FLOPs / seconds and
    bytes / seconds are rates the device demonstrably sustained, so a peak below either is wrong
    for that run. `flops` / `memory`: which of the two peaks may be raised (a given peak is kept).
    The source names the probe's figures and the steps that raised them.
    """
    best_flops = max(((f / t, label) for label, f, _, t in reached if t > 0), default=(0.0, ""))
    best_bytes = max(((b / t, label) for label, _, b, t in reached if t > 0), default=(0.0, ""))
    flops_per_s, bytes_per_s, notes = peaks.flops_per_s, peaks.bytes_per_s, []
    if flops and best_flops[0] > flops_per_s:
        notes.append(f"FLOP/s raised from the probe's {flops_per_s / 1e12:.3g} T to what {best_flops[1]} reached")
        flops_per_s = best_flops[0]
    if memory and best_bytes[0] > bytes_per_s:
        notes.append(f"bandwidth raised from the probe's {bytes_per_s / 1e9:.3g} GB/s to what {best_bytes[1]} reached")
        bytes_per_s = best_bytes[0]
    return Peaks(flops_per_s, bytes_per_s, peaks.source + "".join(f"; {n}" for n in notes))
