"""Switch cost against history length: re-reading a chat vs switching models by translating its cache.

A chat of each length is built by joining held-out (test split) conversations' token ids
(prefix then reply, in file order) and cropping; when the split holds too few tokens for the
longest length, the conversations are joined again from the start, and the report says so
(`chat.repeated`, `chat.passes`). For a length L the history is the first L tokens and the
new turn the next k (--new-turn-tokens). Two paths end at the new turn's first-token logits:

    re-reading  the target prefills history plus new turn (timing path target_reprefill)
    switching   an existing source cache of the history is translated, injected, and the
                target runs the new turn (timing path source_cache_handoff)

Each path is timed on its own (warm-ups, then trials; raw trials kept). Writes
RESULTS/RUN/switch.json (report, last), switch.md (the table, also printed) and switch.png
(median time against length, whiskers from the fastest to the slowest trial). The same
at real model shapes with random weights is `perf.py` (`make perf`).
Exit status: 1, after the files are written, when a CV exceeds --cv-limit and neither
--allow-cv nor the profile allows it; 2 when an input is refused.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvlingo.bench import timing
from kvlingo.bench.packing import packed
from kvlingo.core.handoff import as_ids
from kvlingo.errors import Refusal
from kvlingo.inputs.argtypes import whole
from kvlingo.inputs.data import open_prepared, read_split
from kvlingo.inputs.models import PairConfig, load_pair, pair_config_from_args
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import atomic_write_bytes, sha256_file
from kvlingo.records import resume
from kvlingo.records.paths import TRANSLATORS, check_outputs, default_data, make_command, run_paths
from kvlingo.records.report import Metric, Report, figure, figure_png, fmt_interval, fmt_table, publish
from kvlingo.records.saved import MANIFEST_FILE, load_translator
from kvlingo.stages.stage import add_refresh_arg, add_timing_args, lock_run, refusals_exit, stage_parser

SCRIPT = Path(__file__).resolve()
PATHS = {"re_reading": "target_reprefill", "switching": "source_cache_handoff"}


@dataclass(frozen=True)
class SwitchConfig:
    profile: str  # profile whose timing defaults apply
    run: str  # run name: translator from ARTIFACTS/RUN, report to RESULTS/RUN
    data: str  # prepared data folder; its test split supplies the chats
    translator: str  # which trained translator: distilled or closed_form
    lengths: tuple[int, ...]  # history lengths in tokens
    new_turn_tokens: int  # k: tokens of the new turn after the history
    timing_warmups: int  # untimed warm-up runs before each timed path
    timing_repeats: int  # timed trials per path and length
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run
    threads: int  # torch intra-op threads
    refresh: str  # the part of the translated history the target recomputes (kvlingo/core/refresh.py)
    pair: PairConfig  # the resolved pair


@dataclass
class SwitchResults:
    lengths: list  # per history length: both paths' trials, median, CV, and the speedup
    chat: dict  # how the chat was built from the test split (conversations used, passes, repeated)
    paths: dict  # label → timing path name
    checks: dict

    METRICS = (Metric("lengths.*.speedup", True, "median re-reading time / median switching time"),)


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
    return stream[:n_tokens], {
        "conversations_used": len(used),
        "ids": used,
        "passes": passes,
        "repeated": passes > 1,
        "split_tokens": sum(len(c["prefix_ids"]) + len(c["reply_ids"]) for c in convs),
    }


def plot(points: list[dict], title: str) -> bytes:
    """PNG of median time against history length for both paths; the error bars span the fastest and slowest
    timed trial (the caption says so, with the trial count)."""
    fig, ax = figure((6, 4))
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
    n = sorted({p["paths"][label]["n"] for p in points for label in PATHS})
    ax.legend(title=f"median of {'/'.join(map(str, n))} timed trials; bars: fastest to slowest trial", title_fontsize=8)
    return figure_png(fig)


@refusals_exit("switch_cost")
def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(
        __doc__,
        [
            "python switch_cost.py --profile pilot --run pilot-l2s --device cuda",
            "python switch_cost.py --profile pilot --run pilot-l2s --lengths 4000 8000",
        ],
        common=True,
        data=True,
    )
    parser.add_argument(
        "--translator", choices=TRANSLATORS, default="distilled", help="which trained translator translates"
    )
    parser.add_argument(
        "--lengths", type=whole(1), nargs="+", default=None, help="history lengths (tokens; default: the profile's)"
    )
    add_timing_args(parser)
    add_refresh_arg(parser)
    parser.add_argument(
        "--force", action="store_true", help="re-run even when a passed report with the same inputs exists"
    )
    args = parser.parse_args(argv)
    t_start = time.time()

    profile = get_profile(args.profile)
    lengths = tuple(sorted(set(args.lengths or profile.switch_lengths)))
    paths = run_paths(args)
    pair_cfg, tokenizer = pair_config_from_args(args)
    folder = paths.translator(args.translator)
    if not (folder / MANIFEST_FILE).is_file():
        other = "closed_form" if args.translator == "distilled" else "distilled"
        there = (paths.translator(other) / MANIFEST_FILE).is_file()  # suggested only when it exists
        raise Refusal(
            f"no trained translator at {folder}: run `{make_command('train', paths.run, args.profile, pair_cfg)}` "
            "first" + (f" (or pass --translator {other}, which this run has)" if there else "")
        )
    data_dir = Path(args.data) if args.data else default_data(profile.name)
    manifest = open_prepared(data_dir, pair_cfg)
    convs = read_split(data_dir, "test", "natural")
    cfg = SwitchConfig(
        profile=profile.name,
        run=paths.run,
        data=str(data_dir),
        translator=args.translator,
        lengths=lengths,
        new_turn_tokens=args.new_turn_tokens,
        timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
        timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
        cv_limit=args.cv_limit,
        allow_cv=args.allow_cv or profile.allow_cv,
        threads=timing.threads(),
        refresh=str(args.refresh),
        pair=pair_cfg,
    )
    inputs = {
        "test_split": {"path": str(data_dir / "test.natural.jsonl"), "sha256": manifest["files"]["test.natural.jsonl"]},
        args.translator: {"path": str(folder), "manifest_sha256": sha256_file(folder / MANIFEST_FILE)},
    }
    identity = resume.identity(cfg, inputs, pair_cfg.identities(), resume.code_hash(SCRIPT))
    key = resume.resume_key(identity)
    old = None if args.force else resume.finished(paths.report("switch"), key)
    if old is not None:
        print(f"{paths.report('switch')} is up to date (same config, inputs and code); --force re-runs it")
        return

    k = cfg.new_turn_tokens
    stream, chat = join_chat(convs, max(cfg.lengths) + k)
    if chat["repeated"]:
        print(
            f"note: the test split holds {chat['split_tokens']} tokens, fewer than {max(cfg.lengths) + k}; "
            f"its conversations were joined {chat['passes']} times over",
            file=sys.stderr,
        )
    check_outputs([paths.report("switch"), paths.beside("switch", ".md"), paths.beside("switch", ".png")])
    lock_run(paths.res, "switch")  # before the models load: also refuses a folder it cannot write
    pair = load_pair(pair_cfg, tokenizer)
    limit = min(pair.source.config.max_position_embeddings, pair.target.config.max_position_embeddings)
    if max(cfg.lengths) + k > limit:
        raise Refusal(
            f"--lengths up to {max(cfg.lengths)} plus {k} new tokens exceed the models' "
            f"max_position_embeddings {limit}; use shorter lengths"
        )
    translator = load_translator(folder, pair)[0]

    points, noisy = [], []
    trials = timing.Trials(cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
    options = timing.PathOptions(timing.mode_for(pair.cache), refresh=args.refresh)
    for n in tqdm(cfg.lengths, desc="lengths", file=sys.stderr):
        ids = as_ids(stream[: n + k], pair.device)  # [1, n + k]
        with packed(pair.target, on=options.mode == "optimised"):
            handoff = timing.HandoffPaths(
                pair.source, pair.target, translator, ids[:, :n], ids[:, n:], options, need=tuple(PATHS.values())
            )
            timed = timing.time_paths(handoff, list(PATHS.values()), trials)
        summaries = {label: timed[name] for label, name in PATHS.items()}  # trials interleaved round by round
        points.append(
            {
                "context_tokens": n,
                "new_turn_tokens": k,
                "paths": summaries,
                "speedup": timing.speedups(summaries, "re_reading")["switching"],
                "speedup_interval": timing.speedup_intervals(summaries, "re_reading")["switching"],
            }
        )
        noisy += timing.noisy_timings(summaries, f"{n}/")
        del handoff

    checks = timing.cv_checks(noisy, cfg.cv_limit, cfg.allow_cv)
    title = (
        f"{Path(str(pair.source_spec.name_or_path)).name} → {Path(str(pair.target_spec.name_or_path)).name}, "
        f"{pair_cfg.dtype}, {pair.device}, {cfg.threads} thread(s)"
    )
    plot_path = paths.beside("switch", ".png")
    atomic_write_bytes(plot_path, plot(points, title))
    results = SwitchResults(lengths=points, chat=chat, paths=PATHS, checks=checks)
    rows = [
        [
            p["context_tokens"],
            label,
            1e3 * s["median_s"],
            s["cv"],
            s["n"],
            "NOISY" if s["noisy"] else "",
            p["speedup"] if label == "switching" else None,
            fmt_interval(p["speedup_interval"]) if label == "switching" else "",
        ]
        for p in points
        for label, s in p["paths"].items()
    ]
    md = (
        f"## Switch cost ({title}; {cfg.timing_repeats} trials after {cfg.timing_warmups} warm-ups)\n"
        + ("(test conversations repeated to reach the longest length)\n" if chat["repeated"] else "")
        + fmt_table(["history tokens", "path", "median ms", "CV", "trials", "flag", "speedup", "95% interval"], rows)
        + timing.checks_line(checks)
    )
    report = Report(
        "switch_cost",
        config=cfg,
        inputs=inputs,
        results=results,
        metrics=SwitchResults.METRICS,
        n_samples={"lengths": len(points), "trials_per_path": cfg.timing_repeats},
        wall_time_s=time.time() - t_start,
        device=pair.device,
        dtype=pair_cfg.dtype,
        resume_key=key,
        files={plot_path.name: sha256_file(plot_path)},
    )
    publish(report, paths.report("switch"), None, md, checks=checks)


if __name__ == "__main__":
    main()
