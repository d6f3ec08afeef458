"""The benchmark stage (benchmark.py): a trained translator on the held-out test split: reply quality, native
controls, timing.

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

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.settings import Refresh
from ..errors import Refusal
from ..inputs.argtypes import whole
from ..inputs.flags import add_refresh_arg, add_timing_args
from ..records.report import Metric
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


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
    refresh: Refresh  # the part of each translated context the target recomputes (kvlingo/core/refresh.py)
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


class Benchmark(Stage):
    name = "benchmark"
    script = "benchmark.py"
    summary = "Benchmark a trained translator on the held-out test split: reply quality, native controls, timing."
    examples = (
        ".venv/bin/python benchmark.py --profile pilot --run pilot-l2s --device cuda",
        ".venv/bin/python benchmark.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32 --timing-repeats 8",
    )
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--variant", choices=("natural", "packed"), default="natural", help="test-split variant to score"
        )
        p.add_argument("--limit", type=whole(1), default=None, help="score only the first N test conversations")
        p.add_argument(
            "--split",
            choices=("test", "validation", "train"),
            default="test",
            help="the split scored: test (claims; benchmark.json), validation (choices, e.g. an "
            "ablation's; benchmark-validation.json) or train (the maps' own conversations: their overfit, "
            "with --limit; benchmark-train.json)",
        )
        p.add_argument(
            "--skip-missing",
            action="store_true",
            help="leave out the closed-form/distilled rows whose translator is missing instead of stopping",
        )
        p.add_argument(
            "--control-dtypes",
            nargs="+",
            default=["bfloat16", "float32"],
            choices=("bfloat16", "float32", "none"),
            help="dtypes the native controls run in (default: both; none: skip them, e.g. in an ablation)",
        )
        p.add_argument(
            "--tolerance-scale",
            type=float,
            default=1.0,
            help="multiply every control tolerance (1: as justified in kvlingo/eval/controls.py; "
            "a negative value forces every control to fail, to test the exit path)",
        )
        add_timing_args(p)
        add_refresh_arg(p, default=None, what="the one the run's translator was trained under")
        p.add_argument(
            "--timing-conversations",
            type=whole(0),
            default=1,
            help="time the paths on the N test conversations with the longest prefixes (0: no timing)",
        )
        p.add_argument(
            "--force", action="store_true", help="re-run even when a passed report with the same inputs exists"
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """The pair, the translators, the split and the config; the resume key of this run."""
        from ..core.settings import Refresh
        from ..inputs.data import open_prepared, read_split
        from ..inputs.models import pair_config_from_args
        from ..inputs.profiles import get_profile
        from ..records.paths import TRANSLATORS, default_data, make_command, run_paths
        from ..records.saved import trained_refresh

        args, self.t0 = self.args, time.time()
        profile = get_profile(args.profile)
        self.paths = paths = run_paths(args)
        self.pair_cfg, self.tokenizer = pair_config_from_args(args)
        self.folders, self.missing = paths.translators(TRANSLATORS)
        if self.missing and not args.skip_missing:
            raise Refusal(
                f"no trained translator at {', '.join(str(paths.translator(m)) for m in self.missing)} "
                f"(manifest.json missing): run `{make_command('train', paths.run, args.profile, self.pair_cfg)}` "
                "first (or pass --skip-missing to leave those rows out)"
            )
        if args.refresh is None:
            args.refresh = trained_refresh(*self.folders.values()) if self.folders else Refresh.parse("none")
        data_dir = Path(args.data) if args.data else default_data(profile.name)
        manifest = open_prepared(data_dir, self.pair_cfg, profile.name)
        self.convs = read_split(data_dir, args.split, args.variant, limit=args.limit)
        if len(self.convs) < 2:
            raise Refusal(
                f"the {args.split} split holds {len(self.convs)} usable conversation(s); the control arm needs 2"
            )
        self.report_name = "benchmark" if args.split == "test" else f"benchmark-{args.split}"
        self.cfg = benchmark_config(args, profile, paths.run, data_dir, tuple(self.missing), self.pair_cfg)
        self.timed = timed_conversations(self.convs, self.cfg)
        self._identify(data_dir, manifest)

    def _identify(self, data_dir: Path, manifest: dict) -> None:
        """The inputs with their hashes, and the resume key they make with the config and the code."""
        from ..io import sha256_file
        from ..records import resume
        from ..records.paths import MANIFEST_FILE

        split_file = f"{self.args.split}.{self.args.variant}.jsonl"
        self.inputs = {
            f"{self.args.split}_split": {"path": str(data_dir / split_file), "sha256": manifest["files"][split_file]},
            **{
                name: {"path": str(f), "manifest_sha256": sha256_file(f / MANIFEST_FILE)}
                for name, f in self.folders.items()
            },
        }
        identity = resume.identity(
            self.cfg, self.inputs, self.pair_cfg.identities(), resume.code_hash(self.script_path())
        )
        self.key = resume.resume_key(identity)

    def up_to_date(self) -> dict | None:
        from ..records import resume

        report = self.paths.report(self.report_name)
        old = None if self.args.force else resume.finished(report, self.key)
        if old is not None:
            print(f"{report} is up to date (same config, inputs and code); --force re-runs it")
            md = self.paths.beside(self.report_name, ".md")
            print(md.read_text() if md.exists() else "")
        return old

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        from ..inputs.models import load_pair
        from ..records.paths import check_outputs
        from ..records.saved import load_translator

        name, paths = self.report_name, self.paths
        check_outputs([paths.report(name), paths.beside(name, ".rows.jsonl"), paths.beside(name, ".md")])
        lock_run(paths.res, name)  # before the models load: also refuses a folder it cannot write
        self.pair = load_pair(self.pair_cfg, self.tokenizer)
        self.translators = {kind: load_translator(f, self.pair)[0] for kind, f in self.folders.items()}
        self.control_name = (
            "distilled" if "distilled" in self.translators else ("closed_form" if self.translators else None)
        )

    # ------------------------------------------------------------------ run
    def run(self) -> tuple[list[dict], BenchmarkResults]:
        """Every arm's quality, the native controls in each dtype, and the timed handoff: (rows, results)."""
        from ..bench import timing

        rows, quality_results = self._quality()
        control_results = self._controls(rows)
        timing_results, noisy = self._timing()
        failed = [
            f"{d} {name} control: {c[name]['passed']}/{c[name]['n']} passed"
            for d, c in control_results.items()
            for name in ("reconstruction", "identity")
            if not c[name]["all_passed"]
        ]
        checks = {
            "controls_passed": not failed,
            **timing.cv_checks(noisy, self.cfg.cv_limit, self.cfg.allow_cv, failed),
        }
        return rows, BenchmarkResults(
            quality=quality_results, controls=control_results, timing=timing_results, checks=checks
        )

    def _quality(self) -> tuple[list[dict], dict]:
        """One row per conversation with every arm's sums, and their summary."""
        from tqdm import tqdm

        from ..eval import quality

        pair, control_name = self.pair, self.control_name
        pairing = quality.control_contexts(self.convs)
        rows = []
        for conv, ctl in zip(tqdm(self.convs, desc="quality", file=sys.stderr), pairing):
            arms = quality.score_conversation(
                pair.source,
                pair.target,
                self.translators,
                control_name,
                conv,
                ctl["context_ids"],
                pair.dtype,
                self.cfg.refresh,
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
        return rows, {
            **quality.summarize(rows),
            "control_translator": control_name,
            "skipped": self.missing,
            "no_context": "the target reads prefix[-1] + reply[:-1] with no cache",
        }

    def _controls(self, rows: list[dict]) -> dict:
        """The native controls of every conversation in each dtype of --control-dtypes (into `rows`), summarised."""
        from dataclasses import asdict

        from tqdm import tqdm

        from ..eval import controls
        from ..inputs.models import load_model, resolve_dtype

        pair, out = self.pair, {}
        for dname in self.cfg.control_dtypes:
            dtype = resolve_dtype(dname)
            model = pair.target if dtype == pair.dtype else load_model(pair.target_spec, pair.device, dtype)
            tol = controls.tolerances_for(dtype).scaled(self.cfg.tolerance_scale)
            for conv, row in zip(tqdm(self.convs, desc=f"controls {dname}", file=sys.stderr), rows):
                row["controls"][dname] = controls.native_controls(
                    model, conv["prefix_ids"], conv["reply_ids"], tol, pair.cache
                )
            out[dname] = {
                "tolerances": asdict(tol),
                **controls.summarize_controls([r["controls"][dname] for r in rows]),
            }
            del model
        return out

    def _timing(self) -> tuple[dict | None, list]:
        """The four paths and the handoff's breakdown on each timed context: (timing results or None, noisy)."""
        from tqdm import tqdm

        from ..bench import timing

        if not self.timed or self.control_name is None:
            return None, []
        cfg, noisy, contexts = self.cfg, [], []
        trials = timing.Trials(cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
        options = timing.PathOptions(timing.mode_for(self.pair.cache), refresh=cfg.refresh)
        for conv in tqdm(self.timed, desc="timing", file=sys.stderr):
            context, flagged = time_context(self.pair, self.translators[self.control_name], conv, cfg, trials, options)
            contexts.append(context)
            noisy += flagged
        return {
            "translator": self.control_name,
            "key_space": self.translators[self.control_name].key_space,
            "warmups": cfg.timing_warmups,
            "repeats": cfg.timing_repeats,
            "cv_limit": cfg.cv_limit,
            "threads": timing.threads(),
            "new_turn_tokens": cfg.new_turn_tokens,
            "contexts": contexts,
        }, noisy

    # ------------------------------------------------------------------ publish
    def publish(self, result: tuple[list[dict], BenchmarkResults]) -> dict:
        """benchmark.rows.jsonl, benchmark.md (printed) and benchmark.json last; exit 1 after them on a failed check."""
        from ..records.report import Report, publish

        rows, results = result
        timing_results = results.timing
        report = Report(
            "benchmark",
            config=self.cfg,
            inputs=self.inputs,
            results=results,
            metrics=BenchmarkResults.METRICS,
            n_samples={
                "conversations": len(rows),
                "reply_tokens": sum(r["reply_tokens"] for r in rows),
                "timing_contexts": len(timing_results["contexts"]) if timing_results else 0,
            },
            wall_time_s=time.time() - self.t0,
            device=self.pair.device,
            dtype=self.pair_cfg.dtype,
            resume_key=self.key,
        )
        md = summary_markdown(results, self.pair_cfg.dtype, self.cfg.refresh)
        return publish(report, self.paths.report(self.report_name), rows, md, checks=results.checks)


# --------------------------------------------------------------------------- the config and the timed contexts
def benchmark_config(args, profile, run: str, data_dir: Path, missing: tuple[str, ...], pair_cfg) -> BenchmarkConfig:
    """The run's BenchmarkConfig: the flags given, else the profile's timing defaults."""
    from ..inputs.models import dtype_name, resolve_dtype

    return BenchmarkConfig(
        profile=profile.name,
        run=run,
        data=str(data_dir),
        variant=args.variant,
        limit=args.limit,
        skipped_translators=missing,
        control_dtypes=tuple(dtype_name(resolve_dtype(d)) for d in args.control_dtypes if d != "none"),
        tolerance_scale=args.tolerance_scale,
        new_turn_tokens=args.new_turn_tokens,
        timing_conversations=args.timing_conversations,
        timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
        timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
        cv_limit=args.cv_limit,
        allow_cv=args.allow_cv or profile.allow_cv,
        refresh=args.refresh,
        pair=pair_cfg,
        split=args.split,
    )


def timed_conversations(convs: list[dict], cfg: BenchmarkConfig) -> list[dict]:
    """The --timing-conversations conversations with the longest prefixes (longer than the new turn), refused
    when timing is asked for and no prefix is long enough."""
    k = cfg.new_turn_tokens
    timed = sorted((c for c in convs if len(c["prefix_ids"]) > k), key=lambda c: (-len(c["prefix_ids"]), c["id"]))
    timed = timed[: cfg.timing_conversations]
    if cfg.timing_conversations and not timed:
        raise Refusal(f"no test prefix is longer than --new-turn-tokens {k}; lower it")
    return timed


def time_context(pair, translator, conv: dict, cfg: BenchmarkConfig, trials, options) -> tuple[dict, list]:
    """One timed context: the four paths and the stages of source_cache_handoff, with their noisy timings."""
    from ..bench import timing
    from ..bench.packing import packed
    from ..core.handoff import as_ids

    k = cfg.new_turn_tokens
    ids = as_ids(conv["prefix_ids"], pair.device)  # [1, prefix]; tokenisation stays out of the clock
    with packed(pair.target, on=options.mode == "optimised"):
        paths = timing.HandoffPaths(pair.source, pair.target, translator, ids[:, :-k], ids[:, -k:], options)
        summaries = timing.time_paths(paths, timing.PATHS, trials)
        breakdown = timing.time_breakdown(paths, trials)
    del paths
    context = {
        "id": conv["id"],
        "context_tokens": ids.shape[1] - k,
        "new_turn_tokens": k,
        "paths": summaries,
        "speedup": timing.speedups(summaries),
        "speedup_interval": timing.speedup_intervals(summaries),
        "breakdown": breakdown,  # the stages of source_cache_handoff
    }
    noisy = timing.noisy_timings(summaries, f"{conv['id'][:12]}/") + timing.noisy_timings(
        breakdown, f"{conv['id'][:12]}/source_cache_handoff/"
    )
    return context, noisy


# --------------------------------------------------------------------------- summary tables
def timing_table(contexts: list[dict]) -> str:
    from ..records.report import fmt_interval, fmt_table

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


def quality_table(q: dict) -> str:
    from ..records.report import fmt_pm, fmt_table

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
    headers = [
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
    ]
    return fmt_table(headers, arm_rows)


def summary_markdown(results: BenchmarkResults, dtype: str, refresh: Any = "none") -> str:
    from ..bench import timing
    from ..eval.context import THRESHOLD as ctx_threshold
    from ..records.report import fmt_table

    q = results.quality
    text = [
        f"## Benchmark quality ({dtype}; KL(native target ‖ arm) over reply tokens"
        + (f"; refresh {refresh}" if str(refresh) != "none" else "")
        + ")\n",
        quality_table(q),
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
