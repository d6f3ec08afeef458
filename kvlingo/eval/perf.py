"""Handoff speed at one context length: the four timing paths, where the time goes, the
translation's achieved GFLOP/s and memory, and the speedup ceiling from FLOP counts.

Used by perf.py (`make perf`) on architecture-exact random models: timing does not depend
on weight values, so this measures the real shapes offline.
"""

from __future__ import annotations

import torch

from ..core.translator import Translator
from . import timing
from .shapes import prefill_flops


def random_ids(vocab: int, n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g).to(device)  # [1, n]


def translation_memory(translator: Translator, cap, out_dtype: torch.dtype) -> dict:
    """Peak extra device memory of one translation, against one copy of the target cache.

    Measured with the CUDA allocator's peak counter; elsewhere the layer-chunked design's
    bound is reported instead (output + one chunk of FP32 temporaries), marked unmeasured.
    """
    g, T = translator.geometry, cap.n_tokens
    L, H, d_out = g.target_layers, g.target_kv_heads, g.target_head_dim
    cache_bytes = 2 * L * H * T * d_out * torch.empty(0, dtype=out_dtype).element_size()
    device = cap.values.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = []  # the output is the cache being built: it stays alive until the peak is read
        with torch.inference_mode():
            held.append(translator(cap, out_dtype))
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        held.clear()
        return {"measured": True, "peak_extra_bytes": peak, "target_cache_bytes": cache_bytes,
                "ratio_to_cache": peak / cache_bytes}
    step = translator.chunk_layers(T, device)
    n_chunks = translator.scratch_chunks(out_dtype)  # FP32 scratch reused by every chunk
    temps = int(n_chunks * step * H * T * d_out * 4)
    return {"measured": False, "bound_extra_bytes": cache_bytes + temps, "target_cache_bytes": cache_bytes,
            "ratio_to_cache": (cache_bytes + temps) / cache_bytes,
            "note": f"not measured off CUDA: output (one target cache) + {n_chunks:g} layer chunks of FP32 scratch"}


def perf_at_length(source, target, translator: Translator, n: int, k: int, warmups: int, repeats: int,
                   cv_limit: float = timing.CV_LIMIT, seed: int = 0) -> dict:
    """Time the four paths for a random context of n tokens and a new turn of k tokens.

    The set-up prefills (the existing source capture, the target's own cache) do the same
    work as one run of the source-prefill and re-prefill paths at this length, so they
    stand in for those paths' first warm-up: this saves two long prefills per length on a CPU.
    """
    device = next(target.parameters()).device
    ids = random_ids(target.config.vocab_size, n + k, seed + n, device)
    paths = timing.HandoffPaths(source, target, translator, ids[:, :n], ids[:, n:])
    prefill_warmups = max(0, warmups - 1)
    summaries = {}
    for name in timing.PATHS:
        w = prefill_warmups if name in ("target_reprefill", "source_prefill_handoff") else warmups
        summaries[name] = timing.summarize(timing.run_trials(paths.path(name), device, w, repeats), cv_limit)
    breakdown = timing.time_breakdown(paths, warmups, repeats, cv_limit)
    tr_flops = translator.flops_per_token() * n
    reprefill = prefill_flops(target, n + k)
    new_turn = prefill_flops(target, k)
    memory = translation_memory(translator, paths.source_capture, paths.out_dtype)
    del paths
    return {
        "context_tokens": n, "new_turn_tokens": k, "paths": summaries, "speedup": timing.speedups(summaries),
        "breakdown": breakdown,
        "translation_gflops_per_s": tr_flops / breakdown["translate"]["median_s"] / 1e9,
        "flops": {"translation": tr_flops, "target_reprefill_dense": reprefill, "new_turn_dense": new_turn},
        # The first ceiling counts translation only; the second adds the new-turn step a handoff also runs.
        "ceiling": {"reprefill_over_translation": reprefill / tr_flops,
                    "reprefill_over_translation_plus_new_turn": reprefill / (tr_flops + new_turn)},
        "memory": memory,
        "noisy": timing.noisy_timings(summaries) + timing.noisy_timings(breakdown, "source_cache_handoff/"),
    }
