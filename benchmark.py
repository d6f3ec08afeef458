"""Benchmark a trained translator on the held-out test split: reply quality, native controls, timing.

Reads ARTIFACTS/RUN/{closed_form,distilled}/ (from `make train`) and the test split of the
prepared data; writes RESULTS/RUN/benchmark.json (the report; written last),
benchmark.rows.jsonl (one row per test conversation: every arm's sums and both native
controls) and benchmark.md (the summary tables, also printed).

Quality arms (kvlingo/eval/quality.py): native source, native target (the reference),
closed-form, distilled, control (the translator on another conversation's cache of the same
length) and no-context (the target reads only the last prefix token and the reply; the floor).
Native controls (kvlingo/eval/controls.py): reconstruction and identity round trip, per test
conversation, in every dtype of --control-dtypes. Timing (kvlingo/bench/timing.py): four paths
to the first-token logits of a new turn (context = prefix[:-k], new turn = the last k prefix
tokens) on the --timing-conversations longest test prefixes.

Exit status: 1, after every file is written, when a native control fails or a timing's CV
exceeds --cv-limit (the CV screen is waived by --allow-cv or the profile; the flags stay in
the report); 2 when an input is refused (pair, data, translator), before anything is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvlingo.bench import timing
from kvlingo.bench.packing import packed
from kvlingo.core.handoff import as_ids
from kvlingo.errors import Refusal
from kvlingo.eval import controls, quality
from kvlingo.inputs.argtypes import whole
from kvlingo.inputs.data import open_prepared, read_split
from kvlingo.inputs.models import PairConfig, dtype_name, load_model, load_pair, pair_config_from_args, resolve_dtype
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import sha256_file
from kvlingo.records import resume
from kvlingo.records.paths import TRANSLATORS, check_outputs, default_data, make_command, run_paths
from kvlingo.records.report import Metric, Report, fmt_interval, fmt_pm, fmt_table, publish
from kvlingo.records.saved import MANIFEST_FILE, load_translator
from kvlingo.stages.stage import add_refresh_arg, add_timing_args, lock_run, refusals_exit, stage_parser

SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class BenchmarkConfig:
    profile: str  # profile whose timing defaults apply
    run: str  # run name: translators come from ARTIFACTS/RUN, the report goes to RESULTS/RUN
    data: str  # prepared data folder
    variant: str  # test-split variant scored: natural or packed
    limit: int | None  # score only the first N test conversations (None: all of them)
    skipped_translators: tuple[str, ...]  # translator arms left out because their folder is missing
    control_dtypes: tuple[str, ...]  # dtypes the native controls run in
    tolerance_scale: float  # every control tolerance is multiplied by this (1 = as justified in controls.py)
    new_turn_tokens: int  # k: timed contexts are prefix[:-k], the new turn is prefix[-k:]
    timing_conversations: int  # timed contexts: the test conversations with the longest prefixes
    timing_warmups: int  # untimed warm-up runs before each timed path
    timing_repeats: int  # timed trials per path
    cv_limit: float  # a timing with CV above this is flagged
    allow_cv: bool  # flagged timings do not fail the run
    refresh: str  # the part of each translated context the target recomputes (kvlingo/core/refresh.py)
    pair: PairConfig  # the resolved pair
    split: str = "test"  # the prepared split scored: test, validation (where choices are made) or train


@dataclass
class BenchmarkResults:
    quality: dict  # {"arms": {arm: metrics}, "paired": t-tests, "control_translator", ...}
    controls: dict  # {dtype: pass counts, worst values, tolerances}
    timing: dict | None  # four paths (raw trials, median, CV) and the handoff's breakdown per timed context
    checks: dict  # controls_passed, noisy timings, failed, passed

    METRICS = (
        Metric(
            "quality.arms.distilled.kl_token_mean", False, "KL(native target ‖ distilled arm) per reply token, nats"
        ),
        Metric(
            "quality.arms.distilled.top1_agreement",
            True,
            "fraction of reply positions whose argmax matches the native target's",
        ),
        Metric(
            "quality.arms.distilled.nll_delta_vs_native_target",
            False,
            "reply NLL minus the native target's, nats per token",
        ),
        Metric(
            "quality.arms.control.kl_token_mean",
            False,
            "the control arm's KL: what a translator that ignores its input would score",
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = stage_parser(
        __doc__,
        [
            "python benchmark.py --profile pilot --run pilot-l2s --device cuda",
            "python benchmark.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
            "--device cpu --dtype float32 --timing-repeats 8",
        ],
        common=True,
        data=True,
    )
    parser.add_argument(
        "--variant", choices=("natural", "packed"), default="natural", help="test-split variant to score"
    )
    parser.add_argument("--limit", type=whole(1), default=None, help="score only the first N test conversations")
    parser.add_argument(
        "--split",
        choices=("test", "validation", "train"),
        default="test",
        help="the split scored: test (claims; benchmark.json), validation (choices, e.g. an "
        "ablation's; benchmark-validation.json) or train (the maps' own conversations: their overfit, "
        "with --limit; benchmark-train.json)",
    )
    parser.add_argument(
        "--skip-missing",
        action="store_true",
        help="leave out the closed-form/distilled rows whose translator is missing instead of stopping",
    )
    parser.add_argument(
        "--control-dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=("bfloat16", "float32", "none"),
        help="dtypes the native controls run in (default: both; none: skip them, e.g. in an ablation)",
    )
    parser.add_argument(
        "--tolerance-scale",
        type=float,
        default=1.0,
        help="multiply every control tolerance (1: as justified in kvlingo/eval/controls.py; "
        "a negative value forces every control to fail, to test the exit path)",
    )
    add_timing_args(parser)
    add_refresh_arg(parser)
    parser.add_argument(
        "--timing-conversations",
        type=whole(0),
        default=1,
        help="time the paths on the N test conversations with the longest prefixes (0: no timing)",
    )
    parser.add_argument(
        "--force", action="store_true", help="re-run even when a passed report with the same inputs exists"
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# --------------------------------------------------------------------------- summary tables
def timing_table(contexts: list[dict]) -> str:
    rows = []
    for c in contexts:
        for name, s in c["paths"].items():
            rows.append(
                [
                    c["id"][:12],
                    c["context_tokens"],
                    name,
                    1e3 * s["median_s"],
                    s["cv"],
                    c["speedup"].get(name, 1.0),
                    fmt_interval(c.get("speedup_interval", {}).get(name)),
                    "NOISY" if s["noisy"] else "",
                ]
            )
        for name, s in c.get("breakdown", {}).items():
            rows.append(
                [
                    c["id"][:12],
                    c["context_tokens"],
                    f"  └ {name}",
                    1e3 * s["median_s"],
                    s["cv"],
                    None,
                    "",
                    "NOISY" if s["noisy"] else "",
                ]
            )
    return fmt_table(["context", "tokens", "path", "median ms", "CV", "speedup", "95% interval", "flag"], rows)


def summary_markdown(results: BenchmarkResults, dtype: str, refresh: str = "none") -> str:
    from kvlingo.eval.context import THRESHOLD as ctx_threshold

    q = results.quality
    arm_rows = [
        [
            arm,
            m["kl_token_mean"],
            fmt_pm(m["kl_conversation"]),
            m["perplexity"],
            m["top1_agreement"],
            m["nll_delta_vs_native_target"],
            m.get("context_kl_token_mean"),
            m.get("context_top1"),
            fmt_pm(m["attention_cosine"]) if "attention_cosine" in m else "",
            m["n_conversations"],
            m["n_tokens"],
        ]
        for arm, m in q["arms"].items()
    ]
    text = [
        f"## Benchmark quality ({dtype}; KL(native target ‖ arm) over reply tokens"
        + (f"; refresh {refresh}" if refresh != "none" else "")
        + ")\n",
        fmt_table(
            [
                "arm",
                "KL/token",
                "KL/conv ± SE",
                "ppl",
                "top-1",
                "ΔNLL",
                "context KL",
                "context top-1",
                "attn cos ± SE",
                "convs",
                "tokens",
            ],
            arm_rows,
        ),
        (
            f"control: {q['control_translator']} translator on another conversation's source cache of the same length; "
            if q["control_translator"]
            else "control: not scored (no translator in this run); "
        )
        + f"no_context: {q['no_context']} (the floor)."
        + (f" Skipped (translator missing): {', '.join(q['skipped'])}." if q["skipped"] else "")
        + " Context: the reply tokens whose native prediction the context moves by more than "
        f"{ctx_threshold} nat (kvlingo/eval/context.py); attn cos: each layer's attention output against the "
        "native cache's.\n",
    ]
    if q["paired"]:
        text += [
            "\nPaired t-tests on per-conversation mean NLL (a − b):\n",
            fmt_table(
                ["a vs b", "mean diff", "SE", "t", "p", "n"],
                [[k, v["mean_diff"], v["se"], v["t"], v["p"], v["n"]] for k, v in q["paired"].items()],
            ),
        ]
    ctl = [
        [d, name, f"{c[name]['passed']}/{c[name]['n']}", c[name]["worst_max_abs_dlogit"], c[name]["worst_margin"]]
        for d, c in results.controls.items()
        for name in ("reconstruction", "identity")
    ]
    text += [
        "\nNative controls (pass count; worst max |Δlogit|; worst margin = bound − Δ):\n",
        fmt_table(["dtype", "control", "passed", "worst |Δlogit|", "worst margin"], ctl, ".3g"),
    ]
    if results.timing:
        t = results.timing
        text += [
            f"\nTiming ({t['translator']} translator, {t['repeats']} trials after {t['warmups']} warm-ups, "
            f"{t['threads']} thread(s); speedup = median target_reprefill / median path):\n",
            timing_table(t["contexts"]),
        ]
    text += [timing.checks_line(results.checks)]
    return "".join(text)


# --------------------------------------------------------------------------- main
@refusals_exit("benchmark")
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.time()

    # ----------------------------------------------------------------------- inputs, checked before any work
    profile = get_profile(args.profile)
    paths = run_paths(args)
    pair_cfg, tokenizer = pair_config_from_args(args)
    folders, missing = paths.translators(TRANSLATORS)
    if missing and not args.skip_missing:
        raise Refusal(
            f"no trained translator at {', '.join(str(paths.translator(m)) for m in missing)} "
            f"(manifest.json missing): run `{make_command('train', paths.run, args.profile, pair_cfg)}` first "
            "(or pass --skip-missing to leave those rows out)"
        )
    data_dir = Path(args.data) if args.data else default_data(profile.name)
    manifest = open_prepared(data_dir, pair_cfg)
    convs = read_split(data_dir, args.split, args.variant, limit=args.limit)
    if len(convs) < 2:
        raise Refusal(f"the {args.split} split holds {len(convs)} usable conversation(s); the control arm needs 2")
    name = "benchmark" if args.split == "test" else f"benchmark-{args.split}"
    cfg = BenchmarkConfig(
        profile=profile.name,
        run=paths.run,
        data=str(data_dir),
        variant=args.variant,
        limit=args.limit,
        skipped_translators=tuple(missing),
        control_dtypes=tuple(dtype_name(resolve_dtype(d)) for d in args.control_dtypes if d != "none"),
        tolerance_scale=args.tolerance_scale,
        new_turn_tokens=args.new_turn_tokens,
        timing_conversations=args.timing_conversations,
        timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
        timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
        cv_limit=args.cv_limit,
        allow_cv=args.allow_cv or profile.allow_cv,
        refresh=str(args.refresh),
        pair=pair_cfg,
        split=args.split,
    )
    test_file = f"{args.split}.{args.variant}.jsonl"
    inputs = {
        f"{args.split}_split": {"path": str(data_dir / test_file), "sha256": manifest["files"][test_file]},
        **{name: {"path": str(f), "manifest_sha256": sha256_file(f / MANIFEST_FILE)} for name, f in folders.items()},
    }
    identity = resume.identity(cfg, inputs, pair_cfg.identities(), resume.code_hash(SCRIPT))
    key = resume.resume_key(identity)
    old = None if args.force else resume.finished(paths.report(name), key)
    if old is not None:
        print(f"{paths.report(name)} is up to date (same config, inputs and code); --force re-runs it")
        md = paths.beside(name, ".md")
        print(md.read_text() if md.exists() else "")
        return

    check_outputs([paths.report(name), paths.beside(name, ".rows.jsonl"), paths.beside(name, ".md")])
    lock_run(paths.res, name)  # before the models load: also refuses a folder it cannot write
    pair = load_pair(pair_cfg, tokenizer)
    translators = {name: load_translator(f, pair)[0] for name, f in folders.items()}
    control_name = "distilled" if "distilled" in translators else ("closed_form" if translators else None)

    # ----------------------------------------------------------------------- quality
    pairing = quality.control_contexts(convs)
    rows = []
    for conv, ctl in zip(tqdm(convs, desc="quality", file=sys.stderr), pairing):
        arms = quality.score_conversation(
            pair.source,
            pair.target,
            translators,
            control_name,
            conv,
            ctl["context_ids"],
            pair.dtype,
            args.refresh,
            pair.cache,
        )
        rows.append(
            {
                "id": conv["id"],
                "context_tokens": len(conv["prefix_ids"]) - 1,
                "reply_tokens": len(conv["reply_ids"]),
                "control_pairing": {"ids": ctl["ids"], "kind": ctl["kind"], "translator": control_name},
                "arms": arms,
                "controls": {},
            }
        )
    quality_results = {
        **quality.summarize(rows),
        "control_translator": control_name,
        "skipped": missing,
        "no_context": "the target reads prefix[-1] + reply[:-1] with no cache",
    }

    # ----------------------------------------------------------------------- native controls
    control_results = {}
    for dname in cfg.control_dtypes:
        dtype = resolve_dtype(dname)
        model = pair.target if dtype == pair.dtype else load_model(pair.target_spec, pair.device, dtype)
        tol = controls.tolerances_for(dtype).scaled(cfg.tolerance_scale)
        for conv, row in zip(tqdm(convs, desc=f"controls {dname}", file=sys.stderr), rows):
            row["controls"][dname] = controls.native_controls(
                model, conv["prefix_ids"], conv["reply_ids"], tol, pair.cache
            )
        control_results[dname] = {
            "tolerances": asdict(tol),
            **controls.summarize_controls([r["controls"][dname] for r in rows]),
        }
        del model

    # ----------------------------------------------------------------------- timing
    timing_results, noisy = None, []
    k = cfg.new_turn_tokens
    timed = sorted((c for c in convs if len(c["prefix_ids"]) > k), key=lambda c: (-len(c["prefix_ids"]), c["id"]))
    timed = timed[: cfg.timing_conversations]
    if cfg.timing_conversations and not timed:
        raise Refusal(f"no test prefix is longer than --new-turn-tokens {k}; lower it")
    if timed and control_name is not None:
        contexts = []
        trials = timing.Trials(cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
        options = timing.PathOptions(timing.mode_for(pair.cache), refresh=args.refresh)
        for conv in tqdm(timed, desc="timing", file=sys.stderr):
            ids = as_ids(conv["prefix_ids"], pair.device)  # [1, prefix]; tokenisation stays out of the clock
            with packed(pair.target, on=options.mode == "optimised"):
                paths_ = timing.HandoffPaths(
                    pair.source, pair.target, translators[control_name], ids[:, :-k], ids[:, -k:], options
                )
                summaries = timing.time_paths(paths_, timing.PATHS, trials)
                breakdown = timing.time_breakdown(paths_, trials)
            contexts.append(
                {
                    "id": conv["id"],
                    "context_tokens": ids.shape[1] - k,
                    "new_turn_tokens": k,
                    "paths": summaries,
                    "speedup": timing.speedups(summaries),
                    "speedup_interval": timing.speedup_intervals(summaries),
                    "breakdown": breakdown,
                }
            )  # the stages of source_cache_handoff
            noisy += timing.noisy_timings(summaries, f"{conv['id'][:12]}/") + timing.noisy_timings(
                breakdown, f"{conv['id'][:12]}/source_cache_handoff/"
            )
            del paths_
        timing_results = {
            "translator": control_name,
            "key_space": translators[control_name].key_space,
            "warmups": cfg.timing_warmups,
            "repeats": cfg.timing_repeats,
            "cv_limit": cfg.cv_limit,
            "threads": timing.threads(),
            "new_turn_tokens": k,
            "contexts": contexts,
        }

    # ----------------------------------------------------------------------- checks and report
    failed = [
        f"{d} {name} control: {c[name]['passed']}/{c[name]['n']} passed"
        for d, c in control_results.items()
        for name in ("reconstruction", "identity")
        if not c[name]["all_passed"]
    ]
    checks = {"controls_passed": not failed, **timing.cv_checks(noisy, cfg.cv_limit, cfg.allow_cv, failed)}
    results = BenchmarkResults(quality=quality_results, controls=control_results, timing=timing_results, checks=checks)
    report = Report(
        "benchmark",
        config=cfg,
        inputs=inputs,
        results=results,
        metrics=BenchmarkResults.METRICS,
        n_samples={
            "conversations": len(rows),
            "reply_tokens": sum(r["reply_tokens"] for r in rows),
            "timing_contexts": len(timing_results["contexts"]) if timing_results else 0,
        },
        wall_time_s=time.time() - t_start,
        device=pair.device,
        dtype=pair_cfg.dtype,
        resume_key=key,
    )
    publish(report, paths.report(name), rows, summary_markdown(results, pair_cfg.dtype, cfg.refresh), checks=checks)


if __name__ == "__main__":
    main()
