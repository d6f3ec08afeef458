"""Handoff speed at one context length, in both timing modes: the four paths, where the time goes,
the translation's achieved GFLOP/s and memory, and the physical limit from FLOPs and bytes.

Used by perf.py (`make perf`) on architecture-exact random models (kvlingo.bench.random_pair):
timing does not depend on weight values, so this measures the real shapes offline. The two
modes (timing.MODES) share one set-up (the existing source capture and target cache), so they
time the same work; the optimised mode runs with the target's projections packed (`packing`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core import engine, fused
from ..core.handoff import can_defer_values, prefill
from ..core.translator import Translator
from . import packing, timing
from .roofline import Peaks, deferred_work, forward_flops, handoff_work, limits_at, translation_flops


def random_ids(vocab: int, n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g).to(device)  # [1, n]


def context_ids(target, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The random context [1, n] and new turn [1, k] `perf_at_length` times at length n."""
    ids = random_ids(target.config.vocab_size, n + k, seed + n, next(target.parameters()).device)
    return ids[:, :n], ids[:, n:]


def context_capture(source, target, n: int, k: int, prenorm: bool = True, seed: int = 0):
    """The source's capture of `context_ids`' context: what several translators' timings at length n share."""
    with torch.inference_mode():
        return prefill(source, context_ids(target, n, k, seed)[0], prenorm)


def translation_memory(
    translator: Translator, cap, out_dtype: torch.dtype, precision: str = "fp32", defer_values: bool = False
) -> dict:
    """Peak extra device memory of one translation, against one copy of the target cache.

    Measured with the CUDA allocator's peak counter; elsewhere the layer-chunked design's
    bound is reported instead (output + one chunk of temporaries), marked unmeasured.
    `defer_values`: the keys only are translated (the cache holds the source's values).
    """
    g, T = translator.geometry, cap.n_tokens
    L, H, d_out = g.target_layers, g.target_kv_heads, g.target_head_dim
    cache_bytes = 2 * L * H * T * d_out * torch.empty(0, dtype=out_dtype).element_size()
    output_bytes = cache_bytes // 2 if defer_values else cache_bytes
    device = cap.values.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = []  # the output is the cache being built: it stays alive until the peak is read
        with torch.inference_mode():
            if defer_values:
                keys = torch.empty(L, H, T, d_out, dtype=out_dtype, device=device)
                held.append(translator(cap, out_dtype, precision=precision, out=(keys, None)))
            else:
                held.append(translator(cap, out_dtype, precision=precision))
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        held.clear()
        return {
            "measured": True,
            "peak_extra_bytes": peak,
            "target_cache_bytes": cache_bytes,
            "ratio_to_cache": peak / cache_bytes,
        }
    step = engine.chunk_layers(translator, T, device)
    tile = engine.chunk_tokens(translator, T, device, step)
    n_chunks = engine.scratch_chunks(translator, out_dtype, precision, tile / T)  # scratch reused by every chunk
    temps = int(n_chunks * step * H * T * d_out * 4)
    output = "the keys of one target cache" if defer_values else "one target cache"
    return {
        "measured": False,
        "bound_extra_bytes": output_bytes + temps,
        "target_cache_bytes": cache_bytes,
        "ratio_to_cache": (output_bytes + temps) / cache_bytes,
        "note": f"not measured off CUDA: output ({output}) + {n_chunks:.3g} layer chunks of FP32 scratch",
    }


def time_mode(paths: timing.HandoffPaths, trials: timing.Trials, names=timing.PATHS) -> dict:
    """One row set: the paths, the existing-source handoff's stages, speedups and CV flags."""
    prefill_warmups = max(0, trials.warmups - 1)  # the shared set-up prefills stood in for their first warm-up
    per_path = {
        name: prefill_warmups if name in ("target_reprefill", "source_prefill_handoff") else trials.warmups
        for name in names
    }
    summaries = timing.time_paths(paths, names, trials, per_path)
    breakdown = timing.time_breakdown(paths, trials)
    return {
        "paths": summaries,
        "speedup": timing.speedups(summaries),
        "speedup_interval": timing.speedup_intervals(summaries),
        "breakdown": breakdown,
        "precision": paths.precision,
        "cache": paths.kind,
        "cuda_graphs": paths.graphed,
        "graph_errors": paths.graph_errors,
        "fused_keys": fused.status() if paths.precision in engine.FUSED else None,
        "packed_linear": packing.status(paths.target) if paths.optimised else None,  # None off a CPU
        "noisy": timing.noisy_timings(summaries) + timing.noisy_timings(breakdown, "source_cache_handoff/"),
    }


# vs_limit's ratio per step: (its name there, the step in the limit, where its timing sits in a row)
FLOOR_STEPS = (
    ("translate", "translation", ("breakdown", "translate")),
    ("new_turn", "new_turn", ("breakdown", "new_turn")),
    ("reprefill", "reprefill", ("paths", "target_reprefill")),
)
FLOOR_SLACK = 1e-9  # a floor set by the step itself is its own time to rounding: not below it


def below_floor(vs_limit: dict) -> dict[str, float]:
    """The steps whose median beat their floor (time / floor < 1): the peaks assumed (given too low, or
    measured without `roofline.raise_to_reached`) are below what those steps reached, so on that run the
    floors are not lower bounds. Where every floor is compute-bound the peak cancels from the limit;
    otherwise it does not."""
    return {
        name[: -len("_over_floor")]: ratio
        for name, ratio in vs_limit.items()
        if name.endswith("_over_floor") and ratio < 1.0 - FLOOR_SLACK
    }


def set_limit(point: dict, peaks: Peaks, work: dict[str, tuple[float, float]] | None = None) -> dict:
    """The point's physical limit at `peaks` and each row's timings against it (`vs_limit`), in place.

    `work`: each step's (FLOPs, bytes) (`roofline.handoff_work`); by default the counts of the
    point's existing limit, so a point can be measured against other peaks after the run.
    """
    if work is None:
        work = {step: (point["limit"][step]["flops"], point["limit"][step]["bytes"]) for _, step, _ in FLOOR_STEPS}
    limit = limits_at(work, peaks)
    for row in point["modes"].values():
        vs = {"speedup_fraction_of_limit": row["speedup"]["source_cache_handoff"] / limit["speedup_limit"]}
        for name, step, (part, key) in FLOOR_STEPS:
            vs[f"{name}_over_floor"] = row[part][key]["median_s"] / limit[step]["floor_s"]
        vs["below_floor"] = below_floor(vs)
        row["vs_limit"] = vs
    point["limit"] = limit
    return point


def reached(points: list[dict]) -> list[tuple[str, float, float, float]]:
    """(label, FLOPs, bytes, seconds) of every timed step with a floor, at its best trial: what the device
    demonstrably sustained in this run (for `roofline.raise_to_reached`)."""
    out = []
    for p in points:
        for mode, row in p["modes"].items():
            for name, step, (part, key) in FLOOR_STEPS:
                label = f"{name.replace('_', ' ')} at {p['context_tokens']:,} tokens ({mode})"
                out.append((label, p["limit"][step]["flops"], p["limit"][step]["bytes"], row[part][key]["min_s"]))
    return out


def translation_cost(source, target, translator: Translator, n: int, k: int, deferred: bool) -> dict:
    """What the family's maps cost against a re-prefill (FLOPs as the physical limit counts them: attention
    and one row of logits included): the translation of keys and values, of the keys alone, the work a
    new turn adds on deferred values, and the ceilings re-prefill ÷ translation (keys only, and as timed)."""
    reprefill = forward_flops(target, n + k, 0)
    both, keys = translation_flops(translator, n), translation_flops(translator, n, True)
    dtype = next(target.parameters()).dtype
    mix = deferred_work(translator, target, n, k, dtype)[0] if can_defer_values(translator) else None
    timed = keys if deferred else both
    return {
        "reprefill_flops": reprefill,
        "translation_flops": both,
        "key_translation_flops": keys,
        "deferred_new_turn_flops": mix,
        "deferred": deferred,
        "timed_translation_flops": timed,
        "share_of_reprefill": timed / reprefill,
        "ceiling": reprefill / timed,
        "key_ceiling": reprefill / keys,
    }


def perf_at_length(
    source,
    target,
    translator: Translator,
    n: int,
    k: int,
    trials: timing.Trials,
    options: timing.PathOptions = timing.PathOptions(),
    modes=timing.MODES,
    names=timing.PATHS,
    peaks: Peaks | None = None,
    seed: int = 0,
    cap=None,
) -> dict:
    """Time the paths `names` (re-prefill and the existing-source handoff at least) in each of `modes` for a
    random context of n tokens and a new turn of k tokens, the paths running as `options` say (its mode
    aside). The physical limit (at `peaks`) counts the work of the handoff the optimised rows run, and
    stays that of pure translation under a refresh.

    The set-up prefills (the existing source capture, the target's own cache) do the same
    work as one run of the source-prefill and re-prefill paths at this length, so they
    stand in for those paths' first warm-up: this saves two long prefills per length on a CPU.
    `cap`: the source's capture of this length's context (`context_capture`), shared by several
    translators' timings; made here when not given.
    """
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    context, new = context_ids(target, n, k, seed)
    names = [name for name in timing.PATHS if name in names]
    if not {"target_reprefill", "source_cache_handoff"} <= set(names):
        raise ValueError(f"paths {names} must include target_reprefill and source_cache_handoff")
    with torch.inference_mode():
        cap = cap if cap is not None else prefill(source, context, translator.needs_prenorm)
        own = prefill(target, context) if "target_cache_continue" in names else None
    rows = {}
    for mode in modes:
        with packing.packed(target, on=mode == "optimised"):
            paths = timing.HandoffPaths(
                source,
                target,
                translator,
                context,
                new,
                replace(options, mode=mode),
                need=tuple(names),
                source_capture=cap,
                target_kv=None if own is None else (own.keys, own.values),
            )
            rows[mode] = time_mode(paths, trials, names)
        rows[mode]["deferred_values"] = paths.defer_values
        rows[mode]["translation_gflops_per_s"] = (
            translation_flops(translator, n, paths.defer_values)
            / rows[mode]["breakdown"]["translate"]["median_s"]
            / 1e9
        )
        del paths
    deferred = any(row["deferred_values"] for row in rows.values())
    precision = timing.fast_precision(device, options.fuse_keys)
    point = {
        "context_tokens": n,
        "new_turn_tokens": k,
        "modes": rows,
        "cost": translation_cost(source, target, translator, n, k, deferred),
        "memory": translation_memory(translator, cap, dtype, precision, deferred),
        "noisy": [f"{mode}/{name}" for mode, row in rows.items() for name in row["noisy"]],
    }
    if peaks is not None:
        set_limit(point, peaks, handoff_work(source, target, translator, n, k, dtype, cap.values.dtype, deferred))
    del cap, own
    return point
