"""Benchmark a trained translator on the held-out test split: reply quality, native controls, timing.

Usage:
    python benchmark.py --data data/pilot --run pilot-l2s [--large ID|PATH --small ID|PATH --device cuda]

Reads artifacts/<run>/{closed_form,distilled}/ (from `make train`) and the test split of
`--data`; writes results/<run>/benchmark.json (the report; written last),
benchmark.rows.jsonl (one row per test conversation: every arm's sums and both native
controls) and benchmark.md (the summary tables, also printed).

Quality arms (kvlingo/quality.py): native source, native target (the reference), closed-form,
distilled, control (the maps on another conversation's cache of the same length) and
no-context (the target reads only the last prefix token and the reply; the floor).
Native controls (kvlingo/controls.py): reconstruction and identity round trip, per test
conversation, in every dtype of --control-dtypes. Timing (kvlingo/timing.py): four paths
to the first-token logits of a new turn (context = prefix[:-k], new turn = the last k
prefix tokens) on the --timing-conversations longest test prefixes.

Exit status: nonzero, after every file is written, when a native control fails or a timing's
CV exceeds --cv-limit (the CV screen is waived by --allow-cv; the flags stay in the report).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvlingo import controls, quality, timing
from kvlingo.data import SplitIntegrityError, split_path, verify_split
from kvlingo.handoff import as_ids
from kvlingo.maps import MANIFEST_FILE, Translator
from kvlingo.maps import load_translator as load_translator_for
from kvlingo.models import ModelSpec, add_pair_args, dtype_name, load_model, pair_from_args, resolve_dtype
from kvlingo.profiles import PROFILES, get_profile
from kvlingo.report import (atomic_write_bytes, atomic_write_json, atomic_write_jsonl, atomic_write_text, code_hash,
                            figure_png, fmt_table, make_report, read_json, read_jsonl, sha256_file, sha256_json)

MAPS = ("closed_form", "distilled")  # artifact folders under artifacts/<run>/, also the arm names


@dataclass(frozen=True)
class BenchmarkConfig:
    data: str  # prepared data folder (data/<profile>)
    profile: str  # profile whose timing defaults apply
    run: str  # run name: maps come from artifacts/<run>, the report goes to results/<run>
    variant: str  # test-split variant scored: natural or packed
    limit: int | None  # score only the first N test conversations (None: all of them)
    large: str  # larger model (Hub id[@rev] or folder)
    small: str  # smaller model
    direction: str  # l2s: large builds the cache, small continues
    device: str  # device the models run on
    dtype: str  # model dtype of the quality arms and the timing
    skipped_maps: tuple[str, ...]  # maps arms left out because their artifact is missing (--skip-missing-maps)
    control_dtypes: tuple[str, ...]  # dtypes the native controls run in
    tolerance_scale: float  # every control tolerance is multiplied by this (1 = as justified in controls.py)
    new_turn_tokens: int  # k: timed contexts are prefix[:-k], the new turn is prefix[-k:]
    timing_conversations: int  # timed contexts: the test conversations with the longest prefixes
    timing_warmups: int  # untimed warm-up runs before each timed path
    timing_repeats: int  # timed trials per path
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run


# --------------------------------------------------------------------------- inputs (shared with switch_cost.py)
def profile_for(data: str, name: str | None) -> str:
    """--profile, else the data folder's name when it is a profile, else pilot."""
    return name or (Path(data).name if Path(data).name in PROFILES else "pilot")


def load_test_split(data: str, variant: str, limit: int | None = None) -> tuple[list[dict], Path]:
    """Test rows of a prepared data folder, checked against its manifest first."""
    path = split_path(data, "test", variant)
    if not path.is_file():
        raise SystemExit(f"{path} not found: prepare the data first (make prepare PROFILE=...), or point --data at it")
    try:
        verify_split(data)
    except SplitIntegrityError as err:
        raise SystemExit(str(err)) from err
    rows = read_jsonl(path)[:limit]
    bad = [r["id"] for r in rows if len(r["prefix_ids"]) < 2 or not r["reply_ids"]]
    if bad:
        raise SystemExit(f"{path}: {len(bad)} rows have a prefix under 2 tokens or an empty reply (first: {bad[0]}); "
                         "re-run the data stage")
    return rows, path


def maps_folders(artifacts: Path, names, run: str, stop_hint: str | None = "") -> tuple[dict[str, Path], list[str]]:
    """The complete maps folders among `names`, and the names missing. A missing folder stops the
    run with an error that ends in `stop_hint`, unless `stop_hint` is None (missing is allowed)."""
    found = {name: artifacts / name for name in names if (artifacts / name / MANIFEST_FILE).is_file()}
    missing = [name for name in names if name not in found]
    if missing and stop_hint is not None:
        raise SystemExit(
            f"no trained maps at {', '.join(str(artifacts / m) for m in missing)} ({MANIFEST_FILE} missing): "
            f"run `make train RUN={run}` first{stop_hint}"
        )
    return found, missing


def load_translator(folder: Path, pair) -> tuple[Translator, dict]:
    """Maps from an artifact folder, checked against the loaded pair, as a Translator."""
    models = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
    try:
        return load_translator_for(folder, pair.source, pair.target, pair.direction, models)
    except ValueError as err:
        raise SystemExit(str(err)) from err


def finish(out_dir: Path, stem: str, report: dict, rows: list[dict] | None, summary_md: str) -> None:
    """Rows and summary first, the report last (its presence marks a finished stage); then print."""
    if rows is not None:
        atomic_write_jsonl(out_dir / f"{stem}.rows.jsonl", rows)
        report["rows_sha256"] = sha256_file(out_dir / f"{stem}.rows.jsonl")
    atomic_write_text(out_dir / f"{stem}.md", summary_md)
    atomic_write_json(out_dir / f"{stem}.json", report)
    print(summary_md)
    print(f"wrote {out_dir / f'{stem}.json'}")


def up_to_date(path: Path, key: str) -> bool:
    """A passed report with the same resume key (config, inputs, code) exists."""
    try:
        old = read_json(path)
    except (OSError, ValueError):
        return False
    return old.get("resume_key") == key and old.get("results", {}).get("checks", {}).get("passed") is True


# --------------------------------------------------------------------------- summary tables
def fmt_pm(s: dict, fmt: str = ".4g") -> str:
    return f"{s['mean']:{fmt}} ± {s['se']:{fmt}}"


def timing_table(contexts: list[dict]) -> str:
    rows = []
    for c in contexts:
        for name, s in c["paths"].items():
            rows.append([c["id"][:12], c["context_tokens"], name, 1e3 * s["median_s"], s["cv"],
                         c["speedup"].get(name, 1.0), "NOISY" if s["noisy"] else ""])
        for name, s in c.get("breakdown", {}).items():
            rows.append([c["id"][:12], c["context_tokens"], f"  └ {name}", 1e3 * s["median_s"], s["cv"], None,
                         "NOISY" if s["noisy"] else ""])
    return fmt_table(["context", "tokens", "path", "median ms", "CV", "speedup", "flag"], rows)


def summary_markdown(results: dict, dtype: str) -> str:
    q = results["quality"]
    arm_rows = [[arm, m["kl_token_mean"], fmt_pm(m["kl_conversation"]), m["perplexity"], m["top1_agreement"],
                 m["nll_delta_vs_native_target"], m["n_conversations"], m["n_tokens"]] for arm, m in q["arms"].items()]
    text = [f"## Benchmark quality ({dtype}; KL(native target ‖ arm) over reply tokens)\n",
            fmt_table(["arm", "KL/token", "KL/conv ± SE", "ppl", "top-1", "ΔNLL", "convs", "tokens"], arm_rows),
            f"control: {q['control_maps']} maps on another test conversation's source cache of the same length; "
            f"no_context: {q['no_context']} (the floor)."
            + (f" Skipped (maps missing): {', '.join(q['skipped_maps'])}." if q["skipped_maps"] else "") + "\n"]
    if q["paired"]:
        text += ["\nPaired t-tests on per-conversation mean NLL (a − b):\n",
                 fmt_table(["a vs b", "mean diff", "SE", "t", "p", "n"],
                           [[k, v["mean_diff"], v["se"], v["t"], v["p"], v["n"]] for k, v in q["paired"].items()])]
    ctl = [[d, name, f"{c[name]['passed']}/{c[name]['n']}", c[name]["worst_max_abs_dlogit"], c[name]["worst_margin"]]
           for d, c in results["controls"].items() for name in ("reconstruction", "identity")]
    text += ["\nNative controls (pass count; worst max |Δlogit|; worst margin = bound − Δ):\n",
             fmt_table(["dtype", "control", "passed", "worst |Δlogit|", "worst margin"], ctl, ".3g")]
    if results.get("timing"):
        t = results["timing"]
        text += [f"\nTiming ({t['maps']} maps, {t['repeats']} trials after {t['warmups']} warm-ups; "
                 f"speedup = median target_reprefill / median path):\n", timing_table(t["contexts"])]
    checks = results["checks"]
    text += [f"\nChecks: {'PASSED' if checks['passed'] else 'FAILED: ' + '; '.join(checks['failed'])}\n"]
    return "".join(text)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python benchmark.py --data data/pilot --run pilot-l2s --device cuda\n"
               "  python benchmark.py --data data/demo --run demo-l2s --large runs/large --small runs/small "
               "--dtype float32 --timing-repeats 8",
    )
    parser.add_argument("--data", default="data/pilot", help="prepared data folder (data/<profile>); its test split is scored")
    parser.add_argument("--run", default=None, help="run name: reads artifacts/<run>/, writes results/<run>/ (required unless --random-weights)")
    parser.add_argument("--profile", default=None, help="profile for timing defaults (default: the --data folder's name)")
    parser.add_argument("--variant", choices=("natural", "packed"), default="natural", help="test-split variant to score")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N test conversations")
    parser.add_argument("--artifacts-dir", default=None, help="maps folder root (default artifacts/<run>)")
    parser.add_argument("--out-dir", default=None, help="report folder (default results/<run>)")
    parser.add_argument("--skip-missing-maps", action="store_true",
                        help="leave out the closed-form/distilled rows whose maps are missing instead of stopping")
    parser.add_argument("--control-dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="dtypes the native controls run in (default: both)")
    parser.add_argument("--tolerance-scale", type=float, default=1.0,
                        help="multiply every control tolerance (1: as justified in kvlingo/controls.py; "
                             "a negative value forces every control to fail, to test the exit path)")
    parser.add_argument("--new-turn-tokens", type=int, default=16, help="k: timed context = prefix[:-k], new turn = prefix[-k:]")
    parser.add_argument("--timing-conversations", type=int, default=1,
                        help="time the paths on the N test conversations with the longest prefixes (0: no timing)")
    parser.add_argument("--timing-warmups", type=int, default=None, help="untimed warm-ups per path (default: the profile's)")
    parser.add_argument("--timing-repeats", type=int, default=None, help="timed trials per path (default: the profile's)")
    parser.add_argument("--cv-limit", type=float, default=timing.CV_LIMIT, help="flag timings whose CV exceeds this")
    parser.add_argument("--allow-cv", action="store_true",
                        help="do not fail the run on CV flags (e.g. on a shared CPU); they stay in the report")
    parser.add_argument("--force", action="store_true", help="re-run even when a passed report with the same inputs exists")
    perf = parser.add_argument_group("speed at real shapes (make perf)")
    perf.add_argument("--random-weights", action="store_true",
                      help="time architecture-exact random Qwen3-1.7B/0.6B and random maps at --lengths (no data, no maps); "
                           "writes OUT_DIR/perf.json (default results/perf)")
    perf.add_argument("--random-arch", choices=("qwen3", "tiny"), default="qwen3",
                      help="qwen3: the real shapes; tiny: a 2-layer stand-in for smoke tests")
    perf.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths (tokens) for --random-weights")
    perf.add_argument("--key-space", choices=("prenorm", "cache"), default="prenorm", help="maps key space for --random-weights")
    perf.add_argument("--strict-cv", action="store_true",
                      help="with --random-weights on a CPU, fail on CV flags (by default they are only reported there)")
    add_pair_args(parser)
    args = parser.parse_args(argv)
    t_start = time.time()
    if args.random_weights:
        return perf_main(args, t_start)
    if not args.run:
        parser.error("--run is required (the trained run to benchmark), unless --random-weights")

    # ----------------------------------------------------------------------- inputs
    profile = get_profile(profile_for(args.data, args.profile))
    artifacts = Path(args.artifacts_dir or f"artifacts/{args.run}")
    out_dir = Path(args.out_dir or f"results/{args.run}")
    folders, missing = maps_folders(artifacts, MAPS, args.run, None if args.skip_missing_maps else
                                    " (or pass --skip-missing-maps to leave those rows out)")
    convs, test_file = load_test_split(args.data, args.variant, args.limit)
    if len(convs) < 2:
        raise SystemExit(f"{test_file} holds {len(convs)} usable conversation(s); the control arm needs at least 2")
    cfg = BenchmarkConfig(
        data=args.data, profile=profile.name, run=args.run, variant=args.variant, limit=args.limit,
        large=args.large, small=args.small, direction=args.direction, device=args.device, dtype=args.dtype,
        skipped_maps=tuple(missing), control_dtypes=tuple(dtype_name(resolve_dtype(d)) for d in args.control_dtypes),
        tolerance_scale=args.tolerance_scale, new_turn_tokens=args.new_turn_tokens,
        timing_conversations=args.timing_conversations,
        timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
        timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
        cv_limit=args.cv_limit, allow_cv=args.allow_cv,
    )
    inputs = {
        "test_split": {"path": str(test_file), "sha256": sha256_file(test_file)},
        **{name: {"path": str(f), "maps_sha256": read_json(f / MANIFEST_FILE)["maps_sha256"]} for name, f in folders.items()},
        "large": ModelSpec.parse(args.large).identity(), "small": ModelSpec.parse(args.small).identity(),
        "code_sha256": code_hash(__file__),
    }
    resume_key = sha256_json({"config": asdict(cfg), "inputs": inputs})
    if not args.force and up_to_date(out_dir / "benchmark.json", resume_key):
        print(f"{out_dir / 'benchmark.json'} is up to date (same config, inputs and code); --force re-runs it")
        print((out_dir / "benchmark.md").read_text() if (out_dir / "benchmark.md").exists() else "")
        return

    pair = pair_from_args(args)
    translators = {name: load_translator(f, pair)[0] for name, f in folders.items()}
    control_maps = "distilled" if "distilled" in translators else ("closed_form" if translators else None)

    # ----------------------------------------------------------------------- quality
    pairing = quality.control_contexts(convs)
    rows = []
    for conv, ctl in zip(tqdm(convs, desc="quality", file=sys.stderr), pairing):
        arms = quality.score_conversation(pair.source, pair.target, translators, control_maps, conv,
                                          ctl["context_ids"], pair.dtype)
        rows.append({"id": conv["id"], "context_tokens": len(conv["prefix_ids"]) - 1,
                     "reply_tokens": len(conv["reply_ids"]),
                     "control_pairing": {"ids": ctl["ids"], "kind": ctl["kind"], "maps": control_maps},
                     "arms": arms, "controls": {}})
    quality_results = {**quality.summarize(rows), "control_maps": control_maps, "skipped_maps": missing,
                       "no_context": "the target reads prefix[-1] + reply[:-1] with no cache"}

    # ----------------------------------------------------------------------- native controls
    control_results = {}
    for dname in cfg.control_dtypes:
        dtype = resolve_dtype(dname)
        model = pair.target if dtype == pair.dtype else load_model(pair.target_spec, pair.device, dtype)
        tol = controls.tolerances_for(dtype).scaled(cfg.tolerance_scale)
        for conv, row in zip(tqdm(convs, desc=f"controls {dname}", file=sys.stderr), rows):
            row["controls"][dname] = controls.native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol)
        control_results[dname] = {"tolerances": asdict(tol),
                                  **controls.summarize_controls([r["controls"][dname] for r in rows])}
        del model

    # ----------------------------------------------------------------------- timing
    timing_results, noisy = None, []
    k = cfg.new_turn_tokens
    timed = sorted((c for c in convs if len(c["prefix_ids"]) > k), key=lambda c: (-len(c["prefix_ids"]), c["id"]))
    timed = timed[:cfg.timing_conversations]
    if cfg.timing_conversations and not timed:
        raise SystemExit(f"no test prefix is longer than --new-turn-tokens {k}; lower it")
    if timed and control_maps is not None:
        contexts = []
        for conv in tqdm(timed, desc="timing", file=sys.stderr):
            ids = as_ids(conv["prefix_ids"], pair.device)  # [1, prefix]; tokenisation stays out of the clock
            paths = timing.HandoffPaths(pair.source, pair.target, translators[control_maps], ids[:, :-k], ids[:, -k:])
            summaries = timing.time_paths(paths, timing.PATHS, cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
            breakdown = timing.time_breakdown(paths, cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
            contexts.append({"id": conv["id"], "context_tokens": ids.shape[1] - k, "new_turn_tokens": k,
                             "paths": summaries, "speedup": timing.speedups(summaries),
                             "breakdown": breakdown})  # the stages of source_cache_handoff
            noisy += timing.noisy_timings(summaries, f"{conv['id'][:12]}/") + \
                timing.noisy_timings(breakdown, f"{conv['id'][:12]}/source_cache_handoff/")
            del paths
        timing_results = {"maps": control_maps, "key_space": translators[control_maps].maps.key_space,
                          "warmups": cfg.timing_warmups, "repeats": cfg.timing_repeats, "cv_limit": cfg.cv_limit,
                          "new_turn_tokens": k, "contexts": contexts}

    # ----------------------------------------------------------------------- checks and report
    failed = [f"{d} {name} control: {c[name]['passed']}/{c[name]['n']} passed" for d, c in control_results.items()
              for name in ("reconstruction", "identity") if not c[name]["all_passed"]]
    controls_passed = not failed
    if noisy and not cfg.allow_cv:
        failed.append(f"CV > {cfg.cv_limit:g} in {', '.join(noisy)} (--allow-cv waives this)")
    results = {"quality": quality_results, "controls": control_results, "timing": timing_results,
               "checks": {"controls_passed": controls_passed, "noisy_timings": noisy, "cv_allowed": cfg.allow_cv,
                          "failed": failed, "passed": not failed}}
    report = make_report(
        "benchmark", config=cfg, inputs=inputs, results=results,
        n_samples={"conversations": len(rows), "reply_tokens": sum(r["reply_tokens"] for r in rows),
                   "timing_contexts": len(timing_results["contexts"]) if timing_results else 0},
        seeds=None, wall_time_s=time.time() - t_start, device=pair.device, dtype=dtype_name(pair.dtype),
        resume_key=resume_key, rows_file="benchmark.rows.jsonl",
    )
    finish(out_dir, "benchmark", report, rows, summary_markdown(results, dtype_name(pair.dtype)))
    if failed:
        raise SystemExit("benchmark checks failed: " + "; ".join(failed))


# --------------------------------------------------------------------------- make perf
def perf_main(args, t_start: float) -> None:
    """Four timing paths and the switch cost at real shapes with random weights: results/perf/perf.json."""
    from kvlingo.arch import random_maps, random_pair
    from kvlingo.models import resolve_device
    from kvlingo.perf import perf_at_length

    device = resolve_device(args.device)
    dtype_arg = args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    # A CPU takes minutes per long prefill: fewer trials there (the GPU defaults are the profile's),
    # and its CV flags are reported without failing the run unless --strict-cv.
    profile = get_profile(args.profile or "pilot")
    on_cpu = device == "cpu"
    warmups = args.timing_warmups if args.timing_warmups is not None else (1 if on_cpu else profile.timing_warmups)
    repeats = args.timing_repeats if args.timing_repeats is not None else (3 if on_cpu else profile.timing_repeats)
    args.allow_cv = args.allow_cv or (on_cpu and not args.strict_cv)
    out_dir = Path(args.out_dir or "results/perf")
    k = args.new_turn_tokens
    print(f"building random {args.random_arch} pair ({args.direction}, {dtype_arg}, {device})...", file=sys.stderr)
    pair = random_pair(args.random_arch, args.direction, device, resolve_dtype(dtype_arg))
    limit = pair.target.config.max_position_embeddings
    if max(args.lengths) + k > limit:
        raise SystemExit(f"--lengths up to {max(args.lengths)} + {k} exceed max_position_embeddings {limit}")
    translator = Translator(random_maps(pair.source, pair.target, args.key_space), pair.source, pair.target)
    points = []
    for n in tqdm(sorted(set(args.lengths)), desc="lengths", file=sys.stderr):
        points.append(perf_at_length(pair.source, pair.target, translator, n, k, warmups, repeats, args.cv_limit))
    noisy = [f"{p['context_tokens']}/{name}" for p in points for name in p["noisy"]]
    failed = [] if not noisy or args.allow_cv else [f"CV > {args.cv_limit:g} in {', '.join(noisy)} (--allow-cv waives this)"]
    config = {"arch": args.random_arch, "source": pair.source_spec.name_or_path, "target": pair.target_spec.name_or_path,
              "direction": args.direction, "device": device, "dtype": dtype_arg, "key_space": args.key_space,
              "lengths": sorted(set(args.lengths)), "new_turn_tokens": k, "warmups": warmups, "repeats": repeats,
              "cv_limit": args.cv_limit, "allow_cv": args.allow_cv, "threads": torch.get_num_threads()}
    switch = [{"context_tokens": p["context_tokens"], "re_reading_s": p["paths"]["target_reprefill"]["median_s"],
               "switching_s": p["paths"]["source_cache_handoff"]["median_s"],
               "speedup": p["speedup"]["source_cache_handoff"]} for p in points]
    results = {"lengths": points, "switch_cost": switch, "plot": "perf.png",
               "checks": {"noisy_timings": noisy, "cv_allowed": args.allow_cv, "failed": failed, "passed": not failed}}
    md = perf_markdown(config, points) + f"\nChecks: {'PASSED' if not failed else 'FAILED: ' + '; '.join(failed)}\n"
    atomic_write_bytes(out_dir / "perf.png", perf_plot(points, f"{config['source']} → {config['target']}, {dtype_arg}, {device}"))
    report = make_report("perf", config=config, inputs={"code_sha256": code_hash(__file__)}, results=results,
                         n_samples={"lengths": len(points), "trials_per_path": repeats}, seeds=[0],
                         wall_time_s=time.time() - t_start, device=device, dtype=dtype_arg)
    finish(out_dir, "perf", report, None, md)
    if failed:
        raise SystemExit("perf checks failed: " + "; ".join(failed))


def perf_markdown(config: dict, points: list[dict]) -> str:
    rows = []
    for p in points:
        for name, s in p["paths"].items():
            rows.append([p["context_tokens"], name, 1e3 * s["median_s"], s["cv"], "NOISY" if s["noisy"] else "",
                         p["speedup"].get(name)])
    stages = [[p["context_tokens"], *(1e3 * p["breakdown"][st]["median_s"] for st in timing.STAGES),
               p["translation_gflops_per_s"], p["speedup"]["source_cache_handoff"],
               p["ceiling"]["reprefill_over_translation"], p["ceiling"]["reprefill_over_translation_plus_new_turn"],
               p["memory"]["ratio_to_cache"]] for p in points]
    return (f"## Handoff speed: {config['source']} → {config['target']} (random weights), {config['dtype']}, "
            f"{config['device']}, {config['repeats']} trials after {config['warmups']} warm-up(s)\n\n"
            + fmt_table(["context", "path", "median ms", "CV", "flag", "speedup vs re-prefill"], rows)
            + "\n### Where the existing-source handoff's time goes\n\n"
            + fmt_table(["context", "translate ms", "build cache ms", "new turn ms", "translate GFLOP/s",
                         "speedup", "ceiling (translation)", "ceiling (+ new turn)", "peak mem / cache"], stages))


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


if __name__ == "__main__":
    main()
