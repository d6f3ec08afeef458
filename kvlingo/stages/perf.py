"""The speed stage (perf.py): handoff speed at real model shapes with random weights, as transformers ships and
optimised, against the physical limit.

Timing does not depend on weight values, so architecture-exact random Qwen3-1.7B / 0.6B
(kvlingo/bench/shapes.py; --large/--small pick other preset shapes: Qwen3-4B/8B, Llama-3.2-1B/3B)
and random maps of a translator family measure the real shapes without any download. The family
is the pilot profile's default for the direction (kvlingo/inputs/profiles.py: what `make run` trains
on the real pair; its ranks carried to other shapes by the ratio of the target widths), or
--family with its own defaults; --k, --rank and --key-rank set either; --refresh times a handoff
that recomputes part of the context natively.

First, from parameter counts alone, the FLOP ceilings (re-prefill FLOPs ÷ translation FLOPs) of
every registered family at its default settings, with the reason of each family that cannot map
the pair; --flops-only stops there (seconds, nothing built). Then, at each context length and in
each mode (kvlingo/bench/timing.py: "shipped" = transformers' DynamicCache and sdpa attention,
FP32 translation maths, eager; "optimised" = a preallocated cache the translation writes into,
grouped-query attention without repeated K/V, the keys' norm and RoPE compiled into one kernel on
a CPU (--fuse-keys on: on CUDA too), the values left deferred on a CPU where the value maps are
linear in the source's values and that saves FLOPs (only the keys translated, attention mapping
each query row's mix of the source's values; --defer-values on: always, on CUDA too), the maps in
the run dtype and CUDA graphs on a GPU): re-prefill and the handoff from an existing source cache
(translate, build the cache, run a k-token new turn), and with --full or --paths the handoff with
the source's prefill and the target continuing its own cache (raw trials, median, CV); where the
handoff's time goes; what the maps cost against a re-prefill (the translation's share of its
FLOPs and the ceiling that sets, keys only when the values are deferred); the physical limit of
the speedup from FLOPs and bytes at the device's peaks (kvlingo/bench/roofline.py: given with
--peak-tflops/--peak-gbps, or measured here by a probe and then raised to the best rate any timed
step reached, so that every floor is a lower bound on what this run timed).

By default one length (4,096 tokens), the two paths of the speedup, optimised: minutes on a CPU.
--full sweeps 1,024 / 2,048 / 4,096 tokens, all four paths, both modes, and times every family
that maps the pair (at its default settings) at the longest length, optimised, each against
re-prefill (--families names others: `crosshead:key_rank=256`, `default`, ...).

--kernels also looks inside the optimised handoff at each length (kvlingo/bench/profile.py): its phases
(the translation, with the exact layer 0 and token features of the default translator; the new turn) and
the re-prefill, each under torch.profiler after warm-ups: the top kernels, the time per step, and the
achieved TFLOP/s and GB/s against the floors at the device's datasheet peaks (the run's own peaks on a
device the datasheet table does not name); written to profile.json and profile.md beside perf.json.

Writes RESULTS/RUN/perf.json (default run "perf", "perf-s2l" for s2l), perf.md (the tables, also
printed) and perf.png; --flops-only writes perf-flops.json and .md instead. On a CPU the CV flags
are reported without failing the run unless --strict-cv.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ..bench.shapes import RANDOM_PAIRS, arch_config, preset_names
from ..core.families import FAMILIES
from ..core.settings import DIRECTIONS, Geometry, Refresh
from ..errors import Refusal
from ..eval import stats
from ..inputs.argtypes import number, whole
from ..inputs.flags import add_family_args, add_refresh_arg, add_timing_args, family_flags
from ..inputs.profiles import get_profile
from ..records.report import Metric, fmt_interval, fmt_table, huge_pages
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..bench import timing
    from ..bench.roofline import Peaks

SWITCH = {"auto": None, "on": True, "off": False}  # --fuse-keys, --defer-values → None (the device's default) or a bool
# On a CPU a noisy timing gets extra trials up to 30 of them or 20 s in all: the handoff's steps
# get many, a long re-prefill no more than --timing-repeats.
CPU_MAX_REPEATS, CPU_MAX_SECONDS = 30, 20.0
QUICK_LENGTHS, FULL_LENGTHS = (4096,), (1024, 2048, 4096)
QUICK_PATHS = ("target_reprefill", "source_cache_handoff")  # the speedup's two ends
SETTING_TYPES = {"k": int, "rank": int, "key_rank": int, "hidden": int, "init_seed": int, "pairing": str, "base": str}
# kvlingo.bench.timing's PATHS, STAGES and MODES, named here without importing torch (tests/stages/test_perf.py checks
# they are the same), so that --help and a refused flag stay quick
PATHS = ("target_reprefill", "source_cache_handoff", "source_prefill_handoff", "target_cache_continue")
STAGES = ("translate", "build_cache", "new_turn")  # the pieces of source_cache_handoff, timed apart
MODES = ("shipped", "optimised")


def family_spec(text: str) -> dict:
    """FAMILY or FAMILY:KEY=VALUE,... (a family's settings at the timed shapes), or `default`."""
    name, _, rest = text.partition(":")
    if name != "default" and name not in FAMILIES:
        raise argparse.ArgumentTypeError(f"{name!r} is not a family ({', '.join(sorted(FAMILIES))}) or 'default'")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in SETTING_TYPES or not value:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r} is not KEY=VALUE with KEY one of {', '.join(SETTING_TYPES)}"
            )
        try:
            settings[key] = SETTING_TYPES[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: {key} takes a whole number") from None
    if "base" in settings:  # the residual family's base, at its own defaults
        settings["base"] = {"family": settings["base"], "settings": {}}
    return {"family": name, "settings": settings}


@dataclass(frozen=True)
class PerfConfig:
    arch: str  # qwen3 (the real shapes) or tiny (a 2-layer stand-in for smoke tests)
    source: str  # the source's shape name
    target: str  # the target's shape name
    family: str  # translator family of the timed random maps
    family_settings: dict  # its settings at the timed shapes
    family_from: str  # where the family comes from: the profile's default for the direction, or --family
    refresh: Refresh  # the handoff's refresh setting (kvlingo/core/refresh.py; none: pure translation)
    flops_only: bool  # FLOP ceilings only: no model built, nothing timed
    direction: str  # l2s or s2l
    device: str  # resolved device
    dtype: str  # model dtype
    key_space: str  # the random maps' key space
    full: bool  # the full sweep: three lengths, every path, every family
    lengths: tuple[int, ...]  # context lengths in tokens
    families: tuple[dict, ...]  # the second row set: {family, settings} timed at the longest length, optimised
    new_turn_tokens: int  # k: tokens of the new turn
    modes: tuple[str, ...]  # timing modes: shipped (as transformers ships) and/or optimised
    paths: tuple[str, ...]  # timed paths
    cuda_graphs: bool  # optimised mode on CUDA replays each path as a CUDA graph
    fuse_keys: str  # optimised mode's compiled key finish: auto (on a CPU, not on CUDA), on or off
    defer_values: str  # optimised mode leaves the values deferred (linear value maps, no refresh): auto (on a CPU
    # where that saves FLOPs), on or off
    warmups: int  # untimed warm-ups per path
    repeats: int  # timed trials per path (at least)
    max_repeats: int  # a path whose CV exceeds the limit gets more trials, up to this many
    max_seconds: float | None  # ... while its trials add up to less than this (None: no time cap)
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run
    threads: int  # torch intra-op threads
    peaks: dict  # device peaks the physical limit assumes: FLOP/s, bytes/s, where they come from, and the probe's
    profile: bool  # also profile the optimised handoff's phases per length (profile.json and profile.md)


@dataclass
class PerfResults:
    lengths: list  # per context length: per mode paths, breakdown, speedups, GFLOP/s; the limit; memory
    switch_cost: list  # re-reading vs switching per length and mode
    checks: dict
    flop_ceilings: list  # per family and length: re-prefill and translation FLOPs and the ceilings they set
    families: list  # the second row set: per family, a length's point (optimised) as `lengths` holds them

    METRICS = (
        Metric(
            "lengths.*.modes.optimised.speedup.source_cache_handoff",
            True,
            "median re-prefill time / median handoff time from an existing source cache, both optimised",
        ),
        Metric(
            "lengths.*.modes.shipped.speedup.source_cache_handoff",
            True,
            "the same with transformers' cache and attention as shipped",
        ),
        Metric(
            "lengths.*.limit.speedup_limit",
            True,
            "floor(re-prefill) / (floor(translation) + floor(new turn)) at the device's peaks",
        ),
    )


class Perf(Stage):
    name = "perf"
    script = "perf.py"
    summary = (
        "Handoff speed at real model shapes with random weights, as transformers ships and optimised, against the\n"
        "physical limit."
    )
    examples = (
        ".venv/bin/python perf.py --device cpu",
        ".venv/bin/python perf.py --device cpu --direction s2l --full",
        ".venv/bin/python perf.py --device cuda --lengths 4096 8192 16384",
        ".venv/bin/python perf.py --device cpu --families default crosshead:key_rank=256 headwise",
        ".venv/bin/python perf.py --device cpu --paths target_reprefill source_cache_handoff "
        "--peak-tflops 0.2 --peak-gbps 20",
        ".venv/bin/python perf.py --device cpu --family crosshead --refresh tail:5%",
        ".venv/bin/python perf.py --large Qwen/Qwen3-4B --small Qwen/Qwen3-0.6B --flops-only",
        ".venv/bin/python perf.py --device cuda --lengths 8192 16384 --kernels",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        add_shape_args(p)
        p.add_argument(
            "--lengths",
            type=whole(1),
            nargs="+",
            default=None,
            help=f"context lengths (tokens; default {QUICK_LENGTHS[0]}, "
            f"with --full {' '.join(map(str, FULL_LENGTHS))})",
        )
        add_timing_args(p, "1 on a CPU, else 5", "3 on a CPU, else 30")
        add_sweep_args(p)
        add_speed_args(p)
        p.add_argument(
            "--run", default=None, help="results go to RESULTS/RUN/ (default perf; perf-s2l for --direction s2l)"
        )
        p.add_argument("--results", default="results", help="results root")
        p.add_argument(
            "--kernels",
            action="store_true",
            help="also profile the optimised handoff's phases and the re-prefill at each length with "
            "torch.profiler (top kernels, time per step, TFLOP/s and GB/s against the floors): profile.json and "
            "profile.md beside perf.json",
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """The config (device, pair, family, lengths, modes, paths, trials), refused before anything is written
        when the paths leave out the speedup's ends or the lengths pass the target's positions."""
        from ..inputs.models import resolve_device
        from ..records.paths import RunPaths

        args, self.t_start = self.args, time.time()
        if args.kernels and args.flops_only:
            raise Refusal("--kernels profiles timed handoffs and --flops-only times nothing; give one of them")
        device = resolve_device(args.device)
        dtype = args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        self.large, self.small = pair_names(args)
        source, target = (self.large, self.small) if args.direction == "l2s" else (self.small, self.large)
        self.cfg = perf_config(args, device, dtype, source, target)
        self.paths = RunPaths(
            args.run or ("perf" if args.direction == "l2s" else f"perf-{args.direction}"), results_root=args.results
        )
        # FLOP ceilings from parameter counts (meta-device models), before any weights are allocated
        self.geometry = Geometry.of(arch_config(source), arch_config(target))
        limit = arch_config(target).max_position_embeddings
        if max(self.cfg.lengths) + self.cfg.new_turn_tokens > limit:
            raise Refusal(
                f"--lengths up to {max(self.cfg.lengths)} + {self.cfg.new_turn_tokens} exceed "
                f"max_position_embeddings {limit}"
            )

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        """The run's lock, the FLOP ceilings of every family (and, unless --flops-only, the families' settings
        checked at the timed shapes, the device's peaks, the random pair and its maps)."""
        from ..bench.random_pair import random_pair, random_translator
        from ..bench.timing import defer_values_here
        from ..inputs.models import resolve_dtype

        args, cfg = self.args, self.cfg
        # before the FLOP table and the timings (two timing runs would time each other)
        lock_run(self.paths.res, "perf")
        self.ceilings, refused = family_ceilings(
            cfg.source, cfg.target, args.key_space, cfg.lengths, cfg.new_turn_tokens
        )
        self.flops_md = flops_markdown(cfg, self.geometry, self.ceilings, refused)
        if args.flops_only:
            return
        print(self.flops_md + "\n", flush=True)
        families = second_row_set(args, cfg, refused, self.geometry)
        check_families(cfg, families)  # the families' settings at the timed shapes, before any model is built
        self.cfg = cfg = replace(cfg, families=families)
        self.probe = probe_peaks(args, cfg.device, cfg.dtype)
        print(
            f"building random {cfg.source} → {cfg.target} pair ({args.direction}, {cfg.dtype}, {cfg.device})...",
            file=sys.stderr,
        )
        self.pair = random_pair(
            args.arch or "qwen3", args.direction, cfg.device, resolve_dtype(cfg.dtype), names=(self.large, self.small)
        )
        self.translator = random_translator(
            self.pair.source, self.pair.target, args.key_space, family=cfg.family, settings=cfg.family_settings
        )
        try:  # --defer-values on with maps or a refresh that cannot: refused before anything is timed
            defer_values_here(self.translator, cfg.device, args.refresh, SWITCH[cfg.defer_values])
        except ValueError as e:
            raise Refusal(f"--defer-values on: {e}") from None

    # ------------------------------------------------------------------ run
    def run(self) -> PerfResults | None:
        """Every length in every mode, then the second row set; the limits at peaks no step beat (None with
        --flops-only: nothing is timed)."""
        from tqdm import tqdm

        from ..bench import timing
        from ..bench.roofline import raise_to_reached
        from ..bench.speed import perf_at_length, reached, set_limit

        args, cfg = self.args, self.cfg
        if args.flops_only:
            return None
        pair = self.pair
        trials = timing.Trials(cfg.warmups, cfg.repeats, cfg.cv_limit, cfg.max_repeats, cfg.max_seconds)
        options = timing.PathOptions(
            cuda_graphs=cfg.cuda_graphs,
            fuse_keys=SWITCH[cfg.fuse_keys],
            defer_values=SWITCH[cfg.defer_values],
            refresh=args.refresh,
        )
        k, peaks = cfg.new_turn_tokens, self.probe
        points = [
            perf_at_length(
                pair.source, pair.target, self.translator, n, k, trials, options, cfg.modes, cfg.paths, peaks
            )
            for n in tqdm(cfg.lengths, desc="lengths", file=sys.stderr)
        ]
        family_points = time_families(pair, cfg, cfg.families, trials, options, peaks)
        # measured peaks never stay below a rate this run's own steps reached (given ones are kept as given)
        peaks = raise_to_reached(
            self.probe, reached(points + family_points), flops=not args.peak_tflops, memory=not args.peak_gbps
        )
        self.kernel_profile = profile_lengths(pair, self.translator, cfg, options, peaks) if cfg.profile else None
        del self.translator
        for point in points + family_points:
            set_limit(point, peaks)
        self.cfg = cfg = replace(cfg, peaks={**asdict(peaks), "probe": asdict(self.probe)})
        noisy = [f"{p['context_tokens']}/{name}" for p in points for name in p["noisy"]]
        noisy += [f"{family_label(p['family'], p['settings'])}/{name}" for p in family_points for name in p["noisy"]]
        return PerfResults(
            lengths=points,
            switch_cost=switch_cost(points, cfg.modes),
            checks=timing.cv_checks(noisy, cfg.cv_limit, cfg.allow_cv),
            flop_ceilings=self.ceilings,
            families=family_points,
        )

    # ------------------------------------------------------------------ publish
    def publish(self, results: PerfResults | None) -> None:
        """perf.md and perf.png beside perf.json, the report last (--flops-only: perf-flops.json and .md)."""
        from ..bench import timing
        from ..io import atomic_write_bytes, sha256_file
        from ..records.report import publish

        cfg, paths = self.cfg, self.paths
        if results is None:
            results = flops_only_results(self.ceilings, cfg.cv_limit)
            report = self._report(results, (), {"lengths": len(cfg.lengths)})
            publish(report, paths.report("perf-flops"), None, self.flops_md)
            return
        md = (
            self.flops_md
            + "\n\n"
            + perf_markdown(cfg, results.lengths)
            + cost_markdown(cfg, results.lengths)
            + families_markdown(cfg, results.families)
            + timing.checks_line(results.checks)
        )
        plot = paths.beside("perf", ".png")
        title = f"{cfg.source} → {cfg.target}, {cfg.dtype}, {cfg.device}"
        atomic_write_bytes(plot, perf_plot(results.lengths, cfg.modes, title))
        files = {plot.name: sha256_file(plot)}
        if self.kernel_profile is not None:  # beside the report, before it (the report holds their hashes)
            from ..bench.profile import markdown as profile_markdown
            from ..io import atomic_write_json, atomic_write_text

            profile_md = profile_markdown(self.kernel_profile)
            for path in (
                atomic_write_json(paths.beside("profile", ".json"), self.kernel_profile),
                atomic_write_text(paths.beside("profile", ".md"), profile_md),
            ):
                files[path.name] = sha256_file(path)
            md += f"\nWhere the time goes, kernel by kernel: {paths.beside('profile', '.md').name} (--kernels).\n"
        n_samples = {"lengths": len(results.lengths), "trials_per_path": cfg.repeats}
        report = self._report(results, PerfResults.METRICS, n_samples, files)
        print(md[len(self.flops_md) :].lstrip("\n"))  # the FLOP table was printed before the timings
        if self.kernel_profile is not None:
            print("\n" + profile_md)
        publish(report, paths.report("perf"), None, md, echo=False, checks=results.checks)
        print(f"wrote {paths.report('perf')}")

    def _report(self, results: PerfResults, metrics, n_samples: dict, files: dict | None = None):
        from ..records import resume
        from ..records.report import Report

        cfg = self.cfg
        return Report(
            "perf",
            config=cfg,
            inputs={"code_sha256": resume.code_hash(self.script_path())},
            results=results,
            metrics=metrics,
            n_samples=n_samples,
            seeds=[0],
            wall_time_s=time.time() - self.t_start,
            device=cfg.device,
            dtype=cfg.dtype,
            files=files or {},
        )


# --------------------------------------------------------------------------- flags
def add_shape_args(p) -> None:
    """The pair's shapes and the random maps: --arch or --large/--small, the family, the refresh, the direction."""
    p.add_argument(
        "--arch",
        choices=sorted(RANDOM_PAIRS),
        default=None,
        help="qwen3 (default): the real Qwen3-1.7B/0.6B shapes; tiny: a 2-layer stand-in for smoke tests",
    )
    p.add_argument(
        "--large",
        default=None,
        help=f"larger model's preset shape, with --small instead of --arch (one of: {', '.join(preset_names())})",
    )
    p.add_argument("--small", default=None, help="smaller model's preset shape, with --large")
    add_family_args(p)  # the random maps' family and its options (default: the pilot profile's, at these shapes)
    p.add_argument(
        "--full",
        action="store_true",
        help="the full sweep: lengths 1024 2048 4096, all four paths, both modes and every family that maps "
        "the pair (--lengths, --paths, --modes, --families given win)",
    )
    p.add_argument(
        "--families",
        nargs="+",
        type=family_spec,
        default=None,
        metavar="FAMILY[:KEY=VALUE,...]",
        help="a second row set: these families' handoffs timed against re-prefill at the longest length, "
        "optimised, one after another ('default': the timed family; settings at the timed shapes, "
        "e.g. crosshead:key_rank=256 crosslayer:k=4,rank=512; default: none, every family with --full)",
    )
    add_refresh_arg(p, default=None, what="the profile's for the direction when --family is not given, else none")
    p.add_argument(
        "--flops-only", action="store_true", help="print and write the FLOP ceilings of every family only (no timing)"
    )
    p.add_argument(
        "--direction", choices=DIRECTIONS, default="l2s", help="l2s: large builds the cache, small continues"
    )
    p.add_argument("--device", default="auto", help="cuda, mps, cpu or auto")
    p.add_argument(
        "--dtype",
        default="auto",
        help="model dtype; auto: float32 on a CPU (BF16 is fast there only with "
        "AVX512-BF16 or AMX), bfloat16 elsewhere",
    )
    p.add_argument("--key-space", choices=("prenorm", "cache"), default="prenorm", help="the random maps' key space")


def add_sweep_args(p) -> None:
    """The extra trials of a noisy path, and what is timed: the modes, the paths."""
    p.add_argument(
        "--max-repeats",
        type=whole(1),
        default=None,
        help="trials go on past --timing-repeats while a path's CV exceeds --cv-limit, up to this many "
        f"(default: {CPU_MAX_REPEATS} on a CPU, 100 elsewhere)",
    )
    p.add_argument(
        "--max-seconds",
        type=number(at_least=0),
        default=None,
        help="those extra trials also stop once a path's trials add up to this many seconds, so cheap "
        f"steps get many and a long prefill only --timing-repeats (default: {CPU_MAX_SECONDS:g} on a "
        "CPU, no limit elsewhere; 0: no limit)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=None,
        help="row sets: shipped (transformers' DynamicCache and sdpa as shipped) and optimised (default: "
        "optimised; with --full both)",
    )
    p.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=None,
        help="paths to time (target_reprefill and source_cache_handoff at least, the default; all four with --full)",
    )


def add_speed_args(p) -> None:
    """How the optimised mode runs, the peaks of the physical limit, and whether CV flags fail a CPU run."""
    p.add_argument(
        "--no-cuda-graphs", action="store_true", help="optimised mode on CUDA: run eagerly, not as CUDA graphs"
    )
    p.add_argument(
        "--fuse-keys",
        choices=("auto", "on", "off"),
        default="auto",
        help="optimised mode: the translated keys' k_norm and RoPE as one compiled kernel (auto: on a CPU; "
        "on CUDA only with 'on', the fast-fused precision, not yet timed on a GPU by this suite)",
    )
    p.add_argument(
        "--defer-values",
        choices=("auto", "on", "off"),
        default="auto",
        help="optimised mode, value maps linear in the source's values, no refresh: translate the keys only "
        "and let attention map each query row's mix of the source's values (auto: on a CPU where that "
        "saves FLOPs; 'on' always, on CUDA too)",
    )
    p.add_argument(
        "--peak-tflops",
        type=number(above=0),
        default=None,
        help="the device's dense matmul TFLOP/s in the run dtype for the physical limit (default: measured)",
    )
    p.add_argument(
        "--peak-gbps",
        type=number(above=0),
        default=None,
        help="the device's memory bandwidth in GB/s for the physical limit (default: measured)",
    )
    p.add_argument(
        "--strict-cv", action="store_true", help="on a CPU, fail on CV flags (by default only reported there)"
    )


# --------------------------------------------------------------------------- the config
def perf_config(args, device: str, dtype: str, source: str, target: str) -> PerfConfig:
    """The run's config from the flags: on a CPU fewer trials (minutes per long prefill) and CV flags reported,
    not failed; elsewhere the pilot profile's timing; the family the profile's for the direction, or --family."""
    from ..bench.timing import threads

    on_cpu = device == "cpu"
    profile = get_profile("pilot")  # the GPU defaults; a CPU takes minutes per long prefill, so fewer trials there
    repeats = args.timing_repeats if args.timing_repeats is not None else (3 if on_cpu else profile.timing_repeats)
    chosen_paths = args.paths or (PATHS if args.full else QUICK_PATHS)
    if not {"target_reprefill", "source_cache_handoff"} <= set(chosen_paths):
        raise Refusal("--paths must include target_reprefill and source_cache_handoff (the speedup's two ends)")
    family, settings, family_from = timed_family(args, profile, source, target)
    if args.refresh is None:  # the default translator's own refresh (the target's exact layer 0, say)
        args.refresh = Refresh.parse(profile.refresh_for(args.direction) if args.family is None else "none")
    return PerfConfig(
        arch=args.arch or ("preset" if args.large else "qwen3"),
        source=source,
        target=target,
        family=family,
        family_settings=settings,
        family_from=family_from,
        refresh=args.refresh,
        flops_only=args.flops_only,
        direction=args.direction,
        device=device,
        dtype=dtype,
        key_space=args.key_space,
        full=args.full,
        lengths=tuple(sorted(set(args.lengths or (FULL_LENGTHS if args.full else QUICK_LENGTHS)))),
        families=(),
        new_turn_tokens=args.new_turn_tokens,
        modes=tuple(m for m in MODES if m in (args.modes or (MODES if args.full else ("optimised",)))),
        paths=tuple(n for n in PATHS if n in chosen_paths),
        cuda_graphs=device == "cuda" and not args.no_cuda_graphs,
        fuse_keys=args.fuse_keys,
        defer_values=args.defer_values,
        warmups=args.timing_warmups if args.timing_warmups is not None else (1 if on_cpu else profile.timing_warmups),
        repeats=repeats,
        max_repeats=max(repeats, args.max_repeats or (CPU_MAX_REPEATS if on_cpu else 100)),
        max_seconds=(args.max_seconds if args.max_seconds is not None else CPU_MAX_SECONDS if on_cpu else None) or None,
        cv_limit=args.cv_limit,
        allow_cv=args.allow_cv or (on_cpu and not args.strict_cv),
        threads=threads(),
        peaks={},  # measured once the FLOP-only path has returned
        profile=args.kernels,
    )


def check_families(cfg: PerfConfig, families) -> None:
    """The timed family and the second row set's, each built at the timed shapes on the meta device: a family
    that cannot map the pair is refused before any model is built."""
    from ..bench.shapes import translator_at
    from ..core.translator import TranslatorError

    for spec in ({"family": cfg.family, "settings": cfg.family_settings}, *families):
        try:
            translator_at(
                spec["family"], spec["settings"], arch_config(cfg.source), arch_config(cfg.target), cfg.key_space
            )
        except TranslatorError as e:
            raise Refusal(f"{family_label(spec['family'], spec['settings'])}: {e}") from None


def probe_peaks(args, device: str, dtype: str):
    """The device's peaks for the physical limit: as given (--peak-tflops, --peak-gbps), else measured by a probe."""
    from ..bench.roofline import Peaks, measure_peaks
    from ..inputs.models import resolve_dtype

    if args.peak_tflops and args.peak_gbps:
        return Peaks(args.peak_tflops * 1e12, args.peak_gbps * 1e9, "given (--peak-tflops, --peak-gbps)")
    got = measure_peaks(device, resolve_dtype(dtype))
    return Peaks(
        args.peak_tflops * 1e12 if args.peak_tflops else got.flops_per_s,
        args.peak_gbps * 1e9 if args.peak_gbps else got.bytes_per_s,
        got.source + (" (partly given)" if args.peak_tflops or args.peak_gbps else ""),
    )


def profile_lengths(pair, translator, cfg: PerfConfig, options: timing.PathOptions, peaks: Peaks) -> dict:
    """profile.json's content: every length's optimised handoff profiled (kvlingo.bench.profile), its floors at
    the device's datasheet peaks, or at this run's `peaks` on a device the datasheet table does not name."""
    from tqdm import tqdm

    from ..bench import profile

    name = profile.device_name(cfg.device)
    floors, datasheet = profile.floors_peaks(name, cfg.dtype, peaks)
    settings = profile.ProfileSettings()
    points = [
        profile.profile_at_length(
            pair.source, pair.target, translator, n, cfg.new_turn_tokens, options, floors, settings
        )
        for n in tqdm(cfg.lengths, desc="profile", file=sys.stderr)
    ]
    return profile.profile_report(cfg, name, floors, datasheet, settings, points)


def flops_only_results(ceilings: list[dict], cv_limit: float) -> PerfResults:
    from ..bench.timing import cv_checks

    return PerfResults(
        lengths=[], switch_cost=[], checks=cv_checks([], cv_limit, True), flop_ceilings=ceilings, families=[]
    )


def switch_cost(points: list[dict], modes) -> list[dict]:
    """Re-reading against switching, per length and mode: the two ends of the speedup."""
    return [
        {
            "context_tokens": p["context_tokens"],
            "mode": mode,
            "re_reading_s": p["modes"][mode]["paths"]["target_reprefill"]["median_s"],
            "switching_s": p["modes"][mode]["paths"]["source_cache_handoff"]["median_s"],
            "speedup": p["modes"][mode]["speedup"]["source_cache_handoff"],
            "speedup_interval": p["modes"][mode]["speedup_interval"]["source_cache_handoff"],
        }
        for p in points
        for mode in modes
    ]


# --------------------------------------------------------------------------- the tables
def perf_markdown(cfg: PerfConfig, points: list[dict]) -> str:
    """The timing tables: every path per length and mode, where the handoff's time goes, the physical limit."""
    rows, stages, limits = timing_rows(cfg, points)
    text = (
        perf_heading(cfg, points)
        + fmt_table(
            ["context", "mode", "path", "median ms", "CV", "trials", "flag", "speedup vs re-prefill", "95% interval"],
            rows,
        )
        + "\n\nThe interval: a percentile bootstrap of the ratio of medians over the two paths' raw trials "
        f"({stats.BOOTSTRAP_RESAMPLES:,} resamples, seed {stats.BOOTSTRAP_SEED}), as far as the trials alone "
        "move it; a run on a busier or quieter machine can still land outside it.\n"
        + "\n### Where the existing-source handoff's time goes\n\n"
        + fmt_table(
            [
                "context",
                "mode",
                "translate ms",
                "build cache ms",
                "new turn ms",
                "translate GFLOP/s",
                "speedup",
                "of limit",
                "translate / floor",
                "new turn / floor",
            ],
            stages,
        )
    )
    return text + (limits_markdown(cfg.peaks, limits, points) if limits else "")


def timing_rows(cfg: PerfConfig, points: list[dict]) -> tuple[list, list, list]:
    """(a row per path, a row of the handoff's pieces, a row of the limit's floors), per length and mode."""
    modes = [m for m in MODES if m in cfg.modes]
    rows, stages, limits = [], [], []
    for p in points:
        n = p["context_tokens"]
        for mode in modes:
            r = p["modes"][mode]
            for name, s in r["paths"].items():
                rows.append(
                    [
                        n,
                        mode,
                        name,
                        1e3 * s["median_s"],
                        s["cv"],
                        s["n"],
                        "NOISY" if s["noisy"] else "",
                        r["speedup"].get(name),
                        fmt_interval(r.get("speedup_interval", {}).get(name)),
                    ]
                )
            b, v = r["breakdown"], r.get("vs_limit", {})
            stages.append(
                [
                    n,
                    mode,
                    *(1e3 * b[st]["median_s"] for st in STAGES),
                    r["translation_gflops_per_s"],
                    r["speedup"]["source_cache_handoff"],
                    v.get("speedup_fraction_of_limit"),
                    v.get("translate_over_floor"),
                    v.get("new_turn_over_floor"),
                ]
            )
        if "limit" in p:
            lim = p["limit"]
            limits.append(
                [
                    n,
                    1e3 * lim["reprefill"]["floor_s"],
                    lim["reprefill"]["bound"],
                    1e3 * lim["translation"]["floor_s"],
                    lim["translation"]["bound"],
                    1e3 * lim["new_turn"]["floor_s"],
                    lim["new_turn"]["bound"],
                    lim["speedup_limit"],
                    p["memory"]["ratio_to_cache"],
                ]
            )
    return rows, stages, limits


def perf_heading(cfg: PerfConfig, points: list[dict]) -> str:
    """The timing section's title (pair, maps, dtype, device, threads, pages, trials) and what each row set ran."""
    return (
        f"## Handoff speed: {cfg.source} → {cfg.target} (random {family_label(cfg.family, cfg.family_settings)} "
        f"maps, {cfg.family_from}; refresh {cfg.refresh}), "
        f"{cfg.dtype}, {cfg.device}, "
        f"{cfg.threads} thread(s){huge_pages_note(cfg.device, huge_pages())}, ≥{cfg.repeats} trials "
        f"(≤{cfg.max_repeats} while CV > {cfg.cv_limit:g}"
        + (f" and a path's trials total < {cfg.max_seconds:g} s" if cfg.max_seconds else "")
        + ") "
        f"after {cfg.warmups} warm-up(s)\n\n"
        "Row sets: **shipped** = transformers' DynamicCache and sdpa attention as shipped, FP32 translation "
        "maths, eager; **optimised** = preallocated cache written by the translation, grouped-query attention "
        "without repeated K/V"
        + (", maps in the run dtype, CUDA graphs" if cfg.device == "cuda" else "")
        + fused_note(points)
        + packed_note(points)
        + deferred_note(points)
        + ".\n\n"
    )


def limits_markdown(peaks: dict, limits: list, points: list[dict]) -> str:
    """The physical limit's floors per length, and the steps that beat their floor (the peaks were too low)."""
    text = (
        "\n### Physical limit (floors from FLOPs and bytes)\n\n"
        f"Peaks assumed: {peaks['flops_per_s'] / 1e12:.3g} TFLOP/s, {peaks['bytes_per_s'] / 1e9:.3g} GB/s "
        f"({peaks['source']}). Floor = max(FLOPs / peak, bytes / bandwidth) per step; limit = "
        "floor(re-prefill) / (floor(translation) + floor(new turn)).\n\n"
        + fmt_table(
            [
                "context",
                "re-prefill floor ms",
                "bound",
                "translation floor ms",
                "bound",
                "new turn floor ms",
                "bound",
                "speedup limit",
                "peak mem / cache",
            ],
            limits,
        )
    )
    beaten = [
        f"{p['context_tokens']} {mode} {step} ({ratio:.2f}× its floor)"
        for p in points
        for mode, row in p["modes"].items()
        for step, ratio in row.get("vs_limit", {}).get("below_floor", {}).items()
    ]
    if beaten:
        text += (
            "\n\nFaster than their floor: the peaks assumed are below what these steps reached, so on this "
            "run the floors are not lower bounds (where every floor is compute-bound the peak cancels from "
            "the limit): " + "; ".join(beaten) + "."
        )
    return text


def huge_pages_note(device: str, hp: dict) -> str:
    """On a CPU: whether large tensors were on transparent huge pages (`report.huge_pages`, which every report's
    env records; the Makefile turns torch's request on)."""
    if device != "cpu":
        return ""
    if hp["torch_allocator"] and hp["kernel"] in ("always", "madvise"):
        return f", huge pages (THP_MEM_ALLOC_ENABLE=1, kernel {hp['kernel']})"
    if hp["kernel"] == "always":
        return ", huge pages (kernel always)"
    return (
        f", 4 KiB pages (THP_MEM_ALLOC_ENABLE={'1' if hp['torch_allocator'] else 'unset or 0'}, kernel {hp['kernel']})"
    )


def fused_note(points: list[dict]) -> str:
    """What the optimised rows did with the translated keys' norm and RoPE (kvlingo.core.fused), when they
    asked for the compiled kernel."""
    state = points[-1]["modes"].get("optimised", {}).get("fused_keys") if points else None  # the process's totals
    if not state:
        return ""
    if state["failure"]:
        return f", the keys' norm and RoPE eager (the compiled kernel could not be built: {state['failure']})"
    if not state["compiled_shapes"]:
        return (
            f", the keys' norm and RoPE eager (every chunk under {state['min_elements']:,} elements, too small "
            "to pay for a compile)"
        )
    return (
        f", the keys' norm and RoPE as one compiled kernel ({state['compiled_shapes']} shape(s)"
        + (f"; {state['skipped_chunks']} chunk(s) past the shape limit eager" if state["skipped_chunks"] else "")
        + ")"
    )


def deferred_note(points: list[dict]) -> str:
    """Whether the optimised rows left the values deferred (kvlingo.core.preallocated), which the limit then counts."""
    if not any(p["modes"].get("optimised", {}).get("deferred_values") for p in points):
        return ""
    return (
        ", the values deferred (only the keys translated; attention maps the source's values per query row; "
        "the physical limit and the memory column count this handoff's work)"
    )


def packed_note(points: list[dict]) -> str:
    """What the optimised rows did with the target's projections on a CPU (kvlingo.bench.packing)."""
    state = points[-1]["modes"].get("optimised", {}).get("packed_linear") if points else None
    if not state:
        return ""
    if state["failure"]:
        return f", projections unpacked (oneDNN packing failed: {state['failure']})"
    if not state["packed_layers"]:
        from ..core.linear import MIN_WEIGHT

        return f", projections unpacked (every weight under {MIN_WEIGHT:,} elements)"
    return (
        f", projections on oneDNN-packed weights (a second copy: target {state['packed_layers']} layers, "
        f"{state['packed_bytes'] / 2**30:.2f} GiB)"
    )


def family_ceilings(source: str, target: str, key_space: str, lengths, k: int) -> tuple[list[dict], dict[str, str]]:
    """FLOP ceilings of every registered family (default settings) at the preset shapes, per length, and
    {family: its refusal} for the families that cannot map this geometry. Nothing is allocated (meta device)."""
    from ..bench.shapes import flop_ceiling, meta_model, translator_at
    from ..core.translator import TranslatorError

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
    table = [
        [
            r["family"],
            r["context_tokens"],
            r["target_reprefill_dense"] / 1e9,
            r["translation"] / 1e9,
            r["new_turn_dense"] / 1e9,
            r["reprefill_over_translation"],
            r["reprefill_over_translation_plus_new_turn"],
        ]
        for r in rows
    ]
    return (
        f"## FLOP ceilings: {cfg.source} → {cfg.target} ({cfg.key_space} keys; layers × KV heads × head_dim "
        f"{g.source_layers}×{g.source_kv_heads}×{g.source_head_dim} → {g.target_layers}×{g.target_kv_heads}×"
        f"{g.target_head_dim}), each family at its default settings, new turn {cfg.new_turn_tokens} tokens\n\n"
        + fmt_table(
            [
                "family",
                "context",
                "re-prefill GFLOP",
                "translation GFLOP",
                "new turn GFLOP",
                "ceiling (translation)",
                "ceiling (+ new turn)",
            ],
            table,
            floatfmt=".4g",
        )
        + "\nDense FLOPs (`shapes.prefill_flops`): 2 × parameters × tokens, the tied LM head on every token, "
        "attention not counted; a timed run's physical limit counts attention and one row of logits instead.\n"
        + "".join(f"\n- {family}: cannot map this pair: {why}" for family, why in refused.items())
    )


def pair_names(args) -> tuple[str, str]:
    """(large, small) preset names from --large/--small or --arch; a refusal names what is missing."""
    if (args.large is None) != (args.small is None):
        raise Refusal("give both --large and --small (preset shapes), or neither")
    if args.large is not None:
        if args.arch is not None:
            raise Refusal(f"--arch {args.arch} and --large/--small both name the pair; give one of them")
        for name in (args.large, args.small):
            try:
                arch_config(name)
            except KeyError as e:
                raise Refusal(f"{e.args[0]}; add its published config to kvlingo/bench/shapes.py") from None
        return args.large, args.small
    return RANDOM_PAIRS[args.arch or "qwen3"]


def perf_plot(points: list[dict], modes: tuple[str, ...], title: str) -> bytes:
    """Median time against context length per path and mode; at a single length, one bar per path and mode."""
    from ..records.report import figure, figure_png

    fig, ax = figure((6.4, 4.2))
    if len(points) == 1:
        bars = [
            (f"{name} ({mode})", s["median_s"])
            for mode in MODES
            if mode in modes
            for name, s in points[0]["modes"][mode]["paths"].items()
        ]
        ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="C0")
        ax.set_xlabel(f"median seconds to first-token logits, {points[0]['context_tokens']}-token context")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(title, fontsize=9)
        return figure_png(fig)
    xs = [p["context_tokens"] for p in points]
    for mode, style in zip(MODES, ("--", "-")):
        if mode not in modes:
            continue
        for i, name in enumerate(PATHS):
            if name not in points[0]["modes"][mode]["paths"]:
                continue
            ax.plot(
                xs,
                [p["modes"][mode]["paths"][name]["median_s"] for p in points],
                style,
                marker="o",
                color=f"C{i}",
                label=f"{name} ({mode})",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("median seconds to first-token logits")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    return figure_png(fig)


def family_label(family: str, settings: dict) -> str:
    """A family and the settings that set its cost, e.g. `crosslayer k=4 rank=512`."""
    shown = {k: v for k, v in settings.items() if k in ("k", "rank", "key_rank", "hidden")}
    if isinstance(settings.get("base"), dict):
        shown["base"] = family_label(settings["base"]["family"], settings["base"].get("settings", {}))
    return " ".join([family, *(f"{k}={v}" for k, v in shown.items())])


def timed_family(args, profile, source: str, target: str) -> tuple[str, dict, str]:
    """(family, settings at the timed shapes, where they come from): --family at its own defaults, or the
    profile's default for the direction, its shape-dependent settings (a rank of half the target's width) taken
    at the timed shapes and k capped at the source's depth; --k, --rank, --key-rank and --token-rank win."""
    from ..bench.shapes import real_settings
    from ..train.config import resolve_family

    flags = family_flags(args)
    src, tgt = arch_config(source), arch_config(target)
    geometry = Geometry.of(src, tgt)
    family, settings = resolve_family(profile, args.direction, args.family, flags, geometry)
    if args.family is not None:
        return family, settings, "--family"
    # the profile's default, its k capped at the timed source's depth
    return (
        family,
        real_settings(family, settings, 1.0, src.num_hidden_layers),
        f"the {profile.name} profile's {args.direction} default",
    )


def second_row_set(args, cfg: PerfConfig, refused: dict[str, str], geometry) -> tuple[dict, ...]:
    """The families timed at the longest length: --families as given ('default': the timed family), or with
    --full every family that maps the pair at its default settings but the timed one's."""
    from ..train.config import family_settings

    if args.families is not None:
        return tuple(
            {"family": cfg.family, "settings": cfg.family_settings} if f["family"] == "default" else f
            for f in args.families
        )
    if not args.full:
        return ()
    specs = [{"family": f, "settings": family_settings(f, {}, geometry)} for f in sorted(FAMILIES) if f not in refused]
    return tuple(s for s in specs if (s["family"], s["settings"]) != (cfg.family, cfg.family_settings))


def time_families(
    pair, cfg: PerfConfig, families, trials: timing.Trials, options: timing.PathOptions, peaks: Peaks
) -> list[dict]:
    """Each family's optimised handoff against re-prefill at the longest length, one family after another
    (their maps and caches do not all fit at once), from one source capture."""
    from tqdm import tqdm

    from ..bench.random_pair import random_translator
    from ..bench.speed import context_capture, perf_at_length
    from ..core.handoff import can_defer_values

    if not families:
        return []
    n, k = max(cfg.lengths), cfg.new_turn_tokens
    cap = context_capture(pair.source, pair.target, n, k, cfg.key_space == "prenorm")
    out = []
    for spec in tqdm(families, desc="families", file=sys.stderr):
        maps = random_translator(
            pair.source, pair.target, cfg.key_space, family=spec["family"], settings=spec["settings"]
        )
        able = can_defer_values(maps, refresh=options.refresh)
        mine = replace(options, defer_values=options.defer_values if able else False)
        point = perf_at_length(
            pair.source, pair.target, maps, n, k, trials, mine, ("optimised",), QUICK_PATHS, peaks, cap=cap
        )
        out.append({**spec, **point})
        del maps
    return out


def cost_markdown(cfg: PerfConfig, points: list[dict]) -> str:
    """What the timed maps cost against a re-prefill, per length: the translation's share of its FLOPs, the
    ceiling that sets (keys only when the values are deferred), and how far the optimised speedup is from it."""
    rows = []
    for p in points:
        c, row = p["cost"], p["modes"].get("optimised")
        speedup = row["speedup"]["source_cache_handoff"] if row else None
        rows.append(
            [
                p["context_tokens"],
                "keys (values deferred)" if c["deferred"] else "keys and values",
                c["timed_translation_flops"] / 1e9,
                c["translation_flops"] / 1e9,
                c["key_translation_flops"] / 1e9,
                None if c["deferred_new_turn_flops"] is None else c["deferred_new_turn_flops"] / 1e9,
                c["reprefill_flops"] / 1e9,
                100 * c["share_of_reprefill"],
                c["ceiling"],
                c["key_ceiling"],
                speedup,
                None if speedup is None else c["key_ceiling"] / speedup,
            ]
        )
    return (
        f"\n### What the maps cost: {family_label(cfg.family, cfg.family_settings)} ({cfg.family_from})\n\n"
        "FLOPs as the physical limit counts them (attention and one row of logits included). The ceiling is "
        "re-prefill ÷ the translation as timed; the keys-only ceiling, re-prefill ÷ the key maps' FLOPs, is what "
        "no handoff of these maps can beat; the new turn's extra work on deferred values is on top of it.\n\n"
        + fmt_table(
            [
                "context",
                "translated",
                "timed GFLOP",
                "keys + values GFLOP",
                "keys GFLOP",
                "deferred new turn adds GFLOP",
                "re-prefill GFLOP",
                "% of re-prefill",
                "ceiling",
                "keys-only ceiling",
                "optimised speedup",
                "keys-only ceiling / speedup",
            ],
            rows,
            floatfmt=".4g",
        )
    )


def families_markdown(cfg: PerfConfig, points: list[dict]) -> str:
    if not points:
        return ""
    rows = []
    for p in points:
        r, c, v = p["modes"]["optimised"], p["cost"], p["modes"]["optimised"].get("vs_limit", {})
        rows.append(
            [
                family_label(p["family"], p["settings"]),
                "deferred" if r["deferred_values"] else "translated",
                1e3 * r["paths"]["target_reprefill"]["median_s"],
                1e3 * r["paths"]["source_cache_handoff"]["median_s"],
                r["speedup"]["source_cache_handoff"],
                fmt_interval(r["speedup_interval"]["source_cache_handoff"]),
                1e3 * r["breakdown"]["translate"]["median_s"],
                1e3 * r["breakdown"]["new_turn"]["median_s"],
                100 * c["share_of_reprefill"],
                c["key_ceiling"],
                p["limit"]["speedup_limit"],
                v.get("translate_over_floor"),
                v.get("new_turn_over_floor"),
            ]
        )
    return (
        f"\n\n### Other families at {max(cfg.lengths):,} tokens (optimised, each against its own re-prefill "
        "trials, interleaved with its handoff's)\n\n"
        + fmt_table(
            [
                "family",
                "values",
                "re-prefill ms",
                "handoff ms",
                "speedup",
                "95% interval",
                "translate ms",
                "new turn ms",
                "% of re-prefill",
                "keys-only ceiling",
                "limit",
                "translate / floor",
                "new turn / floor",
            ],
            rows,
        )
    )
