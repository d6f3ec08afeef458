"""Handoff speed at real model shapes with random weights: four timing paths, where the time goes, ceilings.

Timing does not depend on weight values, so architecture-exact random Qwen3-1.7B / 0.6B
(kvlingo/eval/shapes.py; --large/--small pick other preset shapes: Qwen3-4B/8B, Llama-3.2-1B/3B)
and random maps of a translator family (--family, built through the family registry) measure the
real shapes without any download. First, from parameter counts alone, the FLOP ceilings
(re-prefill FLOPs ÷ translation FLOPs) of every registered family at its default settings, with
the reason of each family that cannot map the pair; --flops-only stops there (seconds, nothing
built). Then, for each context length: re-prefill, the handoff from an existing source cache
(translate, build the cache, run a k-token new turn), the handoff with the source's prefill,
and the target continuing its own cache (raw trials, median, CV); the translation's
achieved GFLOP/s and peak extra memory; the speedup ceilings from FLOP counts.

Writes RESULTS/RUN/perf.json (default run "perf"), perf.md (the tables, also printed) and
perf.png; --flops-only writes perf-flops.json and .md instead. On a CPU the CV flags are
reported without failing the run unless --strict-cv.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvlingo.eval import timing
from kvlingo.eval.perf import perf_at_length
from kvlingo.core.translator import FAMILIES, Geometry, TranslatorError
from kvlingo.eval.shapes import RANDOM_PAIRS, arch_config, flop_ceiling, meta_model, preset_names, translator_at
from kvlingo.io import atomic_write_bytes, sha256_file
from kvlingo.run import resume
from kvlingo.run.models import DIRECTIONS, resolve_device, resolve_dtype
from kvlingo.run.paths import RunPaths
from kvlingo.run.profiles import get_profile
from kvlingo.run.report import Metric, Report, figure_png, fmt_table, publish
from kvlingo.run.stage import add_timing_args, refuse, refusals_exit, stage_parser
from kvlingo.toy.random import random_pair, random_translator

SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class PerfConfig:
    arch: str  # qwen3 (the real shapes) or tiny (a 2-layer stand-in for smoke tests)
    source: str  # the source's shape name
    target: str  # the target's shape name
    family: str  # translator family of the timed random maps (its default settings)
    flops_only: bool  # FLOP ceilings only: no model built, nothing timed
    direction: str  # l2s or s2l
    device: str  # resolved device
    dtype: str  # model dtype
    key_space: str  # the random maps' key space
    lengths: tuple[int, ...]  # context lengths in tokens
    new_turn_tokens: int  # k: tokens of the new turn
    warmups: int  # untimed warm-ups per path
    repeats: int  # timed trials per path
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run
    threads: int  # torch intra-op threads


@dataclass
class PerfResults:
    lengths: list  # per context length: paths, breakdown, speedups, GFLOP/s, FLOPs, ceilings, memory
    switch_cost: list  # re-reading vs switching per length
    checks: dict
    flop_ceilings: list  # per family and length: re-prefill and translation FLOPs and the ceilings they set

    METRICS = (Metric("lengths.*.speedup.source_cache_handoff", True,
                      "median re-prefill time / median handoff time from an existing source cache"),)


def parse_args(argv=None) -> argparse.Namespace:
    p = stage_parser(__doc__, ["python perf.py --device cuda --lengths 4096 8192 16384",
                               "python perf.py --device cpu --direction s2l --lengths 1024 2048",
                               "python perf.py --large Qwen/Qwen3-4B --small Qwen/Qwen3-0.6B --family crosslayer --flops-only"])
    p.add_argument("--arch", choices=sorted(RANDOM_PAIRS), default=None,
                   help="qwen3 (default): the real Qwen3-1.7B/0.6B shapes; tiny: a 2-layer stand-in for smoke tests")
    p.add_argument("--large", default=None, help=f"larger model's preset shape, with --small instead of --arch "
                   f"(one of: {', '.join(preset_names())})")
    p.add_argument("--small", default=None, help="smaller model's preset shape, with --large")
    p.add_argument("--family", choices=sorted(FAMILIES), default="headwise",
                   help="translator family of the random maps (default settings); head-wise maps need equal depth "
                   "and KV-head counts")
    p.add_argument("--flops-only", action="store_true",
                   help="print and write the FLOP ceilings of every family only (no timing)")
    p.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="l2s: large builds the cache, small continues")
    p.add_argument("--device", default="auto", help="cuda, mps, cpu or auto")
    p.add_argument("--dtype", default="auto", help="model dtype; auto: float32 on a CPU (its BF16 kernels are slow "
                   "for small steps), bfloat16 elsewhere")
    p.add_argument("--key-space", choices=("prenorm", "cache"), default="prenorm", help="the random maps' key space")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths (tokens)")
    add_timing_args(p, "1 on a CPU, else 5", "3 on a CPU, else 30")
    p.add_argument("--strict-cv", action="store_true", help="on a CPU, fail on CV flags (by default only reported there)")
    p.add_argument("--run", default="perf", help="results go to RESULTS/RUN/ (default perf)")
    p.add_argument("--results", default="results", help="results root")
    return p.parse_args(argv)


def perf_markdown(cfg: PerfConfig, points: list[dict]) -> str:
    rows = []
    for p in points:
        for name, s in p["paths"].items():
            rows.append([p["context_tokens"], name, 1e3 * s["median_s"], s["cv"], "NOISY" if s["noisy"] else "",
                         p["speedup"].get(name)])
    stages = [[p["context_tokens"], *(1e3 * p["breakdown"][st]["median_s"] for st in timing.STAGES),
               p["translation_gflops_per_s"], p["speedup"]["source_cache_handoff"],
               p["ceiling"]["reprefill_over_translation"], p["ceiling"]["reprefill_over_translation_plus_new_turn"],
               p["memory"]["ratio_to_cache"]] for p in points]
    return (f"## Handoff speed: {cfg.source} → {cfg.target} (random weights), {cfg.dtype}, {cfg.device}, "
            f"{cfg.threads} thread(s), {cfg.repeats} trials after {cfg.warmups} warm-up(s)\n\n"
            + fmt_table(["context", "path", "median ms", "CV", "flag", "speedup vs re-prefill"], rows)
            + "\n### Where the existing-source handoff's time goes\n\n"
            + fmt_table(["context", "translate ms", "build cache ms", "new turn ms", "translate GFLOP/s",
                         "speedup", "ceiling (translation)", "ceiling (+ new turn)", "peak mem / cache"], stages))


def family_ceilings(source: str, target: str, key_space: str, lengths, k: int) -> tuple[list[dict], dict[str, str]]:
    """FLOP ceilings of every registered family (default settings) at the preset shapes, per length, and
    {family: its refusal} for the families that cannot map this geometry. Nothing is allocated (meta device)."""
    target_meta = meta_model(target)
    rows, refused = [], {}
    for family in sorted(FAMILIES):
        try:
            maps = translator_at(family, {}, arch_config(source), arch_config(target), key_space)
        except TranslatorError as e:
            refused[family] = str(e)
            continue
        rows += [{"family": family, **flop_ceiling(target_meta, maps.flops_per_token(), n, k)} for n in lengths]
    return rows, refused


def flops_markdown(cfg: PerfConfig, geometry: Geometry, rows: list[dict], refused: dict[str, str]) -> str:
    g = geometry
    table = [[r["family"], r["context_tokens"], r["target_reprefill_dense"] / 1e9, r["translation"] / 1e9, r["new_turn_dense"] / 1e9,
              r["reprefill_over_translation"], r["reprefill_over_translation_plus_new_turn"]] for r in rows]
    return (f"## FLOP ceilings: {cfg.source} → {cfg.target} ({cfg.key_space} keys; layers × KV heads × head_dim "
            f"{g.source_layers}×{g.source_kv_heads}×{g.source_head_dim} → {g.target_layers}×{g.target_kv_heads}×"
            f"{g.target_head_dim}), each family at its default settings, new turn {cfg.new_turn_tokens} tokens\n\n"
            + fmt_table(["family", "context", "re-prefill GFLOP", "translation GFLOP", "new turn GFLOP",
                         "ceiling (translation)", "ceiling (+ new turn)"], table, floatfmt=".4g")
            + "".join(f"\n- {family}: cannot map this pair: {why}" for family, why in refused.items()))


def pair_names(args) -> tuple[str, str]:
    """(large, small) preset names from --large/--small or --arch; a refusal names what is missing."""
    if (args.large is None) != (args.small is None):
        refuse("perf", "give both --large and --small (preset shapes), or neither")
    if args.large is not None:
        if args.arch is not None:
            refuse("perf", f"--arch {args.arch} and --large/--small both name the pair; give one of them")
        for name in (args.large, args.small):
            try:
                arch_config(name)
            except KeyError as e:
                refuse("perf", f"{e.args[0]}; add its published config to kvlingo/eval/shapes.py")
        return args.large, args.small
    return RANDOM_PAIRS[args.arch or "qwen3"]


def perf_plot(points: list[dict], title: str) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [p["context_tokens"] for p in points]
    for name in timing.PATHS:
        ax.plot(xs, [p["paths"][name]["median_s"] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("median seconds to first-token logits")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return figure_png(fig)


@refusals_exit("perf")
def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    on_cpu = device == "cpu"
    profile = get_profile("pilot")  # the GPU defaults; a CPU takes minutes per long prefill, so fewer trials there
    k = args.new_turn_tokens
    large, small = pair_names(args)
    source, target = (large, small) if args.direction == "l2s" else (small, large)
    cfg = PerfConfig(
        arch=args.arch or ("preset" if args.large else "qwen3"), source=source, target=target, family=args.family,
        flops_only=args.flops_only, direction=args.direction, device=device, dtype=dtype,
        key_space=args.key_space, lengths=tuple(sorted(set(args.lengths))), new_turn_tokens=k,
        warmups=args.timing_warmups if args.timing_warmups is not None else (1 if on_cpu else profile.timing_warmups),
        repeats=args.timing_repeats if args.timing_repeats is not None else (3 if on_cpu else profile.timing_repeats),
        cv_limit=args.cv_limit, allow_cv=args.allow_cv or (on_cpu and not args.strict_cv), threads=timing.threads(),
    )
    paths = RunPaths(args.run, results_root=args.results)
    # FLOP ceilings from parameter counts (meta-device models), before any weights are allocated
    geometry = Geometry.of(arch_config(source), arch_config(target))
    limit = arch_config(target).max_position_embeddings
    if max(cfg.lengths) + k > limit:
        refuse("perf", f"--lengths up to {max(cfg.lengths)} + {k} exceed max_position_embeddings {limit}")
    ceilings, refused = family_ceilings(source, target, args.key_space, cfg.lengths, k)
    flops_md = flops_markdown(cfg, geometry, ceilings, refused)
    if args.flops_only:
        report = Report("perf", config=cfg, inputs={"code_sha256": resume.code_hash(SCRIPT)},
                        results=PerfResults(lengths=[], switch_cost=[], checks=timing.cv_checks([], cfg.cv_limit, True),
                                            flop_ceilings=ceilings),
                        metrics=(), n_samples={"lengths": len(cfg.lengths)}, seeds=[0],
                        wall_time_s=time.time() - t_start, device=device, dtype=dtype)
        publish(report, paths.report("perf-flops"), None, flops_md)
        return
    print(flops_md + "\n", flush=True)
    if args.family in refused:  # before the models are built
        refuse("perf", refused[args.family])
    print(f"building random {source} → {target} pair ({args.direction}, {dtype}, {device})...", file=sys.stderr)
    pair = random_pair(args.arch, args.direction, device, resolve_dtype(dtype), names=(large, small))
    translator = random_translator(pair.source, pair.target, args.key_space, family=args.family)
    points = [perf_at_length(pair.source, pair.target, translator, n, k, cfg.warmups, cfg.repeats, cfg.cv_limit)
              for n in tqdm(cfg.lengths, desc="lengths", file=sys.stderr)]
    noisy = [f"{p['context_tokens']}/{name}" for p in points for name in p["noisy"]]
    checks = timing.cv_checks(noisy, cfg.cv_limit, cfg.allow_cv)
    switch = [{"context_tokens": p["context_tokens"], "re_reading_s": p["paths"]["target_reprefill"]["median_s"],
               "switching_s": p["paths"]["source_cache_handoff"]["median_s"],
               "speedup": p["speedup"]["source_cache_handoff"]} for p in points]
    results = PerfResults(lengths=points, switch_cost=switch, checks=checks, flop_ceilings=ceilings)
    md = flops_md + "\n\n" + perf_markdown(cfg, points) + timing.checks_line(checks)
    plot = paths.beside("perf", ".png")
    atomic_write_bytes(plot, perf_plot(points, f"{cfg.source} → {cfg.target}, {dtype}, {device}"))
    report = Report("perf", config=cfg, inputs={"code_sha256": resume.code_hash(SCRIPT)}, results=results,
                    metrics=PerfResults.METRICS, n_samples={"lengths": len(points), "trials_per_path": cfg.repeats},
                    seeds=[0], wall_time_s=time.time() - t_start, device=device, dtype=dtype,
                    files={plot.name: sha256_file(plot)})
    publish(report, paths.report("perf"), None, md, checks=checks)


if __name__ == "__main__":
    main()
