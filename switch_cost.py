"""Switch cost against history length: re-reading a chat vs switching models by translating its cache.

Usage:
    python switch_cost.py --data data/pilot --run pilot-l2s [--lengths 4000 8000] [--device cuda]

A chat of each length is built by joining held-out (test split) conversations' token ids
(prefix then reply, in file order) and cropping; when the split holds too few tokens for the
longest length, the conversations are joined again from the start, and the report says so
(`chat.repeated`, `chat.passes`). For a length L the history is the first L tokens and the
new turn the next k (--new-turn-tokens). Two paths end at the new turn's first-token logits:

    re-reading  the target prefills history plus new turn (timing path target_reprefill)
    switching   an existing source cache of the history is translated, injected, and the
                target runs the new turn (timing path source_cache_handoff)

Each path is timed on its own (warm-ups, then trials; raw trials kept). Writes
results/<run>/switch.json (report, last), switch.md (the table, also printed) and switch.png
(median time against length, whiskers from the fastest to the slowest trial).
Exit status: nonzero, after the files are written, when a CV exceeds --cv-limit and
--allow-cv is not given.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmark import finish, load_test_split, load_translator, maps_folders, profile_for, up_to_date
from kvlingo import timing
from kvlingo.handoff import as_ids
from kvlingo.maps import MANIFEST_FILE, Translator
from kvlingo.models import ModelSpec, add_pair_args, dtype_name, pair_from_args, resolve_device, resolve_dtype
from kvlingo.profiles import get_profile
from kvlingo.report import atomic_write_bytes, code_hash, figure_png, fmt_table, make_report, read_json, sha256_file, sha256_json

PATHS = {"re_reading": "target_reprefill", "switching": "source_cache_handoff"}


@dataclass(frozen=True)
class SwitchConfig:
    data: str  # prepared data folder (data/<profile>); its test split supplies the chats
    profile: str  # profile whose timing defaults apply
    run: str  # run name: maps from artifacts/<run>, report to results/<run>
    maps: str  # which trained maps translate: distilled or closed_form
    lengths: tuple[int, ...]  # history lengths in tokens
    new_turn_tokens: int  # k: tokens of the new turn after the history
    large: str  # larger model (Hub id[@rev] or folder)
    small: str  # smaller model
    direction: str  # l2s: large builds the cache, small continues
    device: str  # device the models run on
    dtype: str  # model dtype
    timing_warmups: int  # untimed warm-up runs before each timed path
    timing_repeats: int  # timed trials per path and length
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run


def join_chat(convs: list[dict], n_tokens: int) -> tuple[list[int], dict]:
    """The first `n_tokens` of the conversations' ids joined in order, repeating them if needed."""
    stream, used, passes = [], [], 0
    while len(stream) < n_tokens:
        passes += 1
        for c in convs:
            stream += c["prefix_ids"] + c["reply_ids"]
            if passes == 1:
                used.append(c["id"])
            if len(stream) >= n_tokens:
                break
    return stream[:n_tokens], {"conversations_used": len(used), "ids": used, "passes": passes,
                               "repeated": passes > 1, "split_tokens": sum(len(c["prefix_ids"]) + len(c["reply_ids"]) for c in convs)}


def plot(points: list[dict], title: str) -> bytes:
    """PNG of median time against history length for both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["context_tokens"] for p in points]
    for label in PATHS:
        med = [p["paths"][label]["median_s"] for p in points]
        lo = [m - p["paths"][label]["min_s"] for m, p in zip(med, points)]
        hi = [p["paths"][label]["max_s"] - m for m, p in zip(med, points)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label.replace("_", "-"))
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("time to first-token logits (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    return figure_png(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python switch_cost.py --data data/pilot --run pilot-l2s --device cuda\n"
               "  python switch_cost.py --data data/pilot --run pilot-l2s --lengths 4000 8000",
    )
    parser.add_argument("--data", default="data/pilot", help="prepared data folder (data/<profile>); its test split is joined into chats")
    parser.add_argument("--run", default=None, help="run name: reads artifacts/<run>/, writes results/<run>/ (required unless --random-weights)")
    parser.add_argument("--random-weights", action="store_true",
                        help="architecture-exact random Qwen3-1.7B/0.6B, random maps and random token ids: no data or maps "
                             "needed; writes results/perf/switch.json unless --out-dir")
    parser.add_argument("--random-arch", choices=("qwen3", "tiny"), default="qwen3", help="with --random-weights: real shapes or a 2-layer stand-in")
    parser.add_argument("--profile", default=None, help="profile for timing defaults (default: the --data folder's name)")
    parser.add_argument("--maps", choices=("distilled", "closed_form"), default="distilled", help="which trained maps translate")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000], help="history lengths (tokens)")
    parser.add_argument("--new-turn-tokens", type=int, default=16, help="k: tokens of the new turn after the history")
    parser.add_argument("--artifacts-dir", default=None, help="maps folder root (default artifacts/<run>)")
    parser.add_argument("--out-dir", default=None, help="report folder (default results/<run>)")
    parser.add_argument("--timing-warmups", type=int, default=None, help="untimed warm-ups per path (default: the profile's)")
    parser.add_argument("--timing-repeats", type=int, default=None, help="timed trials per path (default: the profile's)")
    parser.add_argument("--cv-limit", type=float, default=timing.CV_LIMIT, help="flag timings whose CV exceeds this")
    parser.add_argument("--allow-cv", action="store_true", help="do not fail the run on CV flags; they stay in the report")
    parser.add_argument("--force", action="store_true", help="re-run even when a passed report with the same inputs exists")
    add_pair_args(parser)
    args = parser.parse_args(argv)
    t_start = time.time()

    if min(args.lengths) < 1 or args.new_turn_tokens < 1:
        raise SystemExit("--lengths and --new-turn-tokens must be positive")
    if not args.run and not args.random_weights:
        parser.error("--run is required (the trained run), unless --random-weights")
    profile = get_profile(profile_for(args.data, args.profile))
    artifacts = Path(args.artifacts_dir or f"artifacts/{args.run}")
    out_dir = Path(args.out_dir or ("results/perf" if args.random_weights else f"results/{args.run}"))
    if args.random_weights:
        folder, convs, split_path = None, [], None
    else:
        other = "closed_form" if args.maps == "distilled" else "distilled"
        folder = maps_folders(artifacts, [args.maps], args.run, f" (or pass --maps {other})")[0][args.maps]
        convs, split_path = load_test_split(args.data, "natural")
    cfg = SwitchConfig(
        data=args.data, profile=profile.name, run=args.run, maps=args.maps, lengths=tuple(sorted(set(args.lengths))),
        new_turn_tokens=args.new_turn_tokens, large=args.large, small=args.small, direction=args.direction,
        device=args.device, dtype=args.dtype,
        timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
        timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
        cv_limit=args.cv_limit, allow_cv=args.allow_cv,
    )
    if args.random_weights:
        inputs = {"random_weights": args.random_arch, "code_sha256": code_hash(__file__, "benchmark.py")}
    else:
        inputs = {"test_split": {"path": str(split_path), "sha256": sha256_file(split_path)},
                  args.maps: {"path": str(folder), "maps_sha256": read_json(folder / MANIFEST_FILE)["maps_sha256"]},
                  "large": ModelSpec.parse(args.large).identity(), "small": ModelSpec.parse(args.small).identity(),
                  "code_sha256": code_hash(__file__, "benchmark.py")}
    resume_key = sha256_json({"config": asdict(cfg), "inputs": inputs})
    if not args.force and up_to_date(out_dir / "switch.json", resume_key):
        print(f"{out_dir / 'switch.json'} is up to date (same config, inputs and code); --force re-runs it")
        return

    k = cfg.new_turn_tokens
    if args.random_weights:
        from kvlingo.arch import random_maps, random_pair
        from kvlingo.perf import random_ids

        device = resolve_device(args.device)
        pair = random_pair(args.random_arch, args.direction, device,
                           resolve_dtype(args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")))
        stream = random_ids(pair.target.config.vocab_size, max(cfg.lengths) + k, 0, "cpu")[0].tolist()
        chat = {"random_token_ids": True, "repeated": False}
    else:
        stream, chat = join_chat(convs, max(cfg.lengths) + k)
        if chat["repeated"]:
            print(f"note: the test split holds {chat['split_tokens']} tokens, fewer than {max(cfg.lengths) + k}; "
                  f"its conversations were joined {chat['passes']} times over", file=sys.stderr)
        pair = pair_from_args(args)
    limit = min(pair.source.config.max_position_embeddings, pair.target.config.max_position_embeddings)
    if max(cfg.lengths) + k > limit:
        raise SystemExit(f"--lengths up to {max(cfg.lengths)} plus {k} new tokens exceed the models' "
                         f"max_position_embeddings {limit}; use shorter lengths")
    if args.random_weights:
        translator = Translator(random_maps(pair.source, pair.target), pair.source, pair.target)
    else:
        translator = load_translator(folder, pair)[0]

    points, noisy = [], []
    for n in tqdm(cfg.lengths, desc="lengths", file=sys.stderr):
        ids = as_ids(stream[:n + k], pair.device)  # [1, n + k]
        paths = timing.HandoffPaths(pair.source, pair.target, translator, ids[:, :n], ids[:, n:],
                                    need=tuple(PATHS.values()))
        summaries = {label: timing.time_paths(paths, [name], cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)[name]
                     for label, name in PATHS.items()}
        points.append({"context_tokens": n, "new_turn_tokens": k, "paths": summaries,
                       "speedup": summaries["re_reading"]["median_s"] / summaries["switching"]["median_s"]})
        noisy += timing.noisy_timings(summaries, f"{n}/")
        del paths

    failed = [] if not noisy or cfg.allow_cv else [f"CV > {cfg.cv_limit:g} in {', '.join(noisy)} (--allow-cv waives this)"]
    title = f"{Path(str(pair.source_spec.name_or_path)).name} → {Path(str(pair.target_spec.name_or_path)).name}, " \
            f"{dtype_name(pair.dtype)}, {pair.device}"
    atomic_write_bytes(out_dir / "switch.png", plot(points, title))
    results = {"lengths": points, "chat": chat, "plot": "switch.png", "maps": cfg.maps,
               "paths": PATHS, "checks": {"noisy_timings": noisy, "cv_allowed": cfg.allow_cv, "failed": failed,
                                          "passed": not failed}}
    rows = [[p["context_tokens"], label, 1e3 * s["median_s"], s["cv"], s["n"], "NOISY" if s["noisy"] else "",
             p["speedup"] if label == "switching" else None] for p in points for label, s in p["paths"].items()]
    md = (f"## Switch cost ({title}; {cfg.timing_repeats} trials after {cfg.timing_warmups} warm-ups)\n"
          + ("(test conversations repeated to reach the longest length)\n" if chat["repeated"] else "")
          + fmt_table(["history tokens", "path", "median ms", "CV", "trials", "flag", "speedup"], rows)
          + f"\nChecks: {'PASSED' if not failed else 'FAILED: ' + '; '.join(failed)}\n")
    report = make_report("switch_cost", config=cfg, inputs=inputs, results=results,
                         n_samples={"lengths": len(points), "trials_per_path": cfg.timing_repeats},
                         seeds=None, wall_time_s=time.time() - t_start, device=pair.device,
                         dtype=dtype_name(pair.dtype), resume_key=resume_key, plot_sha256=sha256_file(out_dir / "switch.png"))
    finish(out_dir, "switch", report, None, md)
    if failed:
        raise SystemExit("switch-cost checks failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
