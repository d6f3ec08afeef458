"""The switch-cost stage (switch_cost.py): switch cost against history length, re-reading a chat vs switching
models by translating its cache.

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
from typing import TYPE_CHECKING

from ..core.settings import Refresh
from ..errors import Refusal
from ..inputs.argtypes import whole
from ..inputs.flags import add_refresh_arg, add_timing_args
from ..records.paths import TRANSLATORS
from ..records.report import Metric
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig

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
    refresh: Refresh  # the part of the translated history the target recomputes (kvlingo/core/refresh.py)
    pair: PairConfig  # the resolved pair


@dataclass
class SwitchResults:
    lengths: list  # per history length: both paths' trials, median, CV, and the speedup
    chat: dict  # how the chat was built from the test split (conversations used, passes, repeated)
    paths: dict  # label → timing path name
    checks: dict

    METRICS = (Metric("lengths.*.speedup", True, "median re-reading time / median switching time"),)


class Switch(Stage):
    name = "switch_cost"
    script = "switch_cost.py"
    summary = "Switch cost against history length: re-reading a chat vs switching models by translating its cache."
    examples = (
        ".venv/bin/python switch_cost.py --profile pilot --run pilot-l2s --device cuda",
        ".venv/bin/python switch_cost.py --profile pilot --run pilot-l2s --lengths 4000 8000",
    )
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--translator", choices=TRANSLATORS, default="distilled", help="which trained translator translates"
        )
        p.add_argument(
            "--lengths", type=whole(1), nargs="+", default=None, help="history lengths (tokens; default: the profile's)"
        )
        add_timing_args(p)
        add_refresh_arg(p, default=None, what="the one the run's translator was trained under")
        p.add_argument(
            "--force", action="store_true", help="re-run even when a passed report with the same inputs exists"
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """The pair, the translator, the test split and the config; the resume key of this run."""
        from ..bench import timing
        from ..inputs.data import open_prepared, read_split
        from ..inputs.models import pair_config_from_args
        from ..inputs.profiles import get_profile
        from ..records.paths import default_data, run_paths

        args, self.t0 = self.args, time.time()
        profile = get_profile(args.profile)
        self.paths = run_paths(args)
        self.pair_cfg, self.tokenizer = pair_config_from_args(args)
        self.folder = self._translator_folder()
        if args.refresh is None:
            from ..records.saved import trained_refresh

            args.refresh = trained_refresh(self.folder)
        data_dir = Path(args.data) if args.data else default_data(profile.name)
        manifest = open_prepared(data_dir, self.pair_cfg, profile.name)
        self.convs = read_split(data_dir, "test", "natural")
        self.cfg = SwitchConfig(
            profile=profile.name,
            run=self.paths.run,
            data=str(data_dir),
            translator=args.translator,
            lengths=tuple(sorted(set(args.lengths or profile.switch_lengths))),
            new_turn_tokens=args.new_turn_tokens,
            timing_warmups=profile.timing_warmups if args.timing_warmups is None else args.timing_warmups,
            timing_repeats=profile.timing_repeats if args.timing_repeats is None else args.timing_repeats,
            cv_limit=args.cv_limit,
            allow_cv=args.allow_cv or profile.allow_cv,
            threads=timing.threads(),
            refresh=args.refresh,
            pair=self.pair_cfg,
        )
        self._identify(data_dir, manifest)

    def _translator_folder(self) -> Path:
        """The --translator folder of the run, refused when it holds no trained translator (naming the other one
        when the run has it)."""
        from ..records.paths import MANIFEST_FILE, make_command

        args, paths = self.args, self.paths
        folder = paths.translator(args.translator)
        if not (folder / MANIFEST_FILE).is_file():
            other = "closed_form" if args.translator == "distilled" else "distilled"
            there = (paths.translator(other) / MANIFEST_FILE).is_file()  # suggested only when it exists
            raise Refusal(
                f"no trained translator at {folder}: run "
                f"`{make_command('train', paths.run, args.profile, self.pair_cfg)}` first"
                + (f" (or pass --translator {other}, which this run has)" if there else "")
            )
        return folder

    def _identify(self, data_dir: Path, manifest: dict) -> None:
        """The inputs with their hashes, and the resume key they make with the config and the code."""
        from ..io import sha256_file
        from ..records import resume
        from ..records.paths import MANIFEST_FILE

        self.inputs = {
            "test_split": {
                "path": str(data_dir / "test.natural.jsonl"),
                "sha256": manifest["files"]["test.natural.jsonl"],
            },
            self.args.translator: {
                "path": str(self.folder),
                "manifest_sha256": sha256_file(self.folder / MANIFEST_FILE),
            },
        }
        identity = resume.identity(
            self.cfg, self.inputs, self.pair_cfg.identities(), resume.code_hash(self.script_path())
        )
        self.key = resume.resume_key(identity)

    def up_to_date(self) -> dict | None:
        from ..records import resume

        old = None if self.args.force else resume.finished(self.paths.report("switch"), self.key)
        if old is not None:
            print(f"{self.paths.report('switch')} is up to date (same config, inputs and code); --force re-runs it")
        return old

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        """The chat, the outputs checked and the run's lock taken, then the pair (its positions checked) and the
        translator."""
        from ..inputs.models import load_pair
        from ..records.paths import check_outputs
        from ..records.saved import load_translator

        cfg, paths, k = self.cfg, self.paths, self.cfg.new_turn_tokens
        self.stream, self.chat = join_chat(self.convs, max(cfg.lengths) + k)
        if self.chat["repeated"]:
            print(
                f"note: the test split holds {self.chat['split_tokens']} tokens, fewer than {max(cfg.lengths) + k}; "
                f"its conversations were joined {self.chat['passes']} times over",
                file=sys.stderr,
            )
        check_outputs([paths.report("switch"), paths.beside("switch", ".md"), paths.beside("switch", ".png")])
        lock_run(paths.res, "switch")  # before the models load: also refuses a folder it cannot write
        self.pair = pair = load_pair(self.pair_cfg, self.tokenizer)
        limit = min(pair.source.config.max_position_embeddings, pair.target.config.max_position_embeddings)
        if max(cfg.lengths) + k > limit:
            raise Refusal(
                f"--lengths up to {max(cfg.lengths)} plus {k} new tokens exceed the models' "
                f"max_position_embeddings {limit}; use shorter lengths"
            )
        self.translator = load_translator(self.folder, pair)[0]

    # ------------------------------------------------------------------ run
    def run(self) -> tuple[list[dict], list[str]]:
        """Both paths timed at each history length: (one point per length, the noisy timings)."""
        from tqdm import tqdm

        from ..bench import timing
        from ..bench.packing import packed
        from ..core.handoff import as_ids

        cfg, pair, k = self.cfg, self.pair, self.cfg.new_turn_tokens
        points, noisy = [], []
        trials = timing.Trials(cfg.timing_warmups, cfg.timing_repeats, cfg.cv_limit)
        options = timing.PathOptions(timing.mode_for(pair.cache), refresh=cfg.refresh)
        for n in tqdm(cfg.lengths, desc="lengths", file=sys.stderr):
            ids = as_ids(self.stream[: n + k], pair.device)  # [1, n + k]
            with packed(pair.target, on=options.mode == "optimised"):
                handoff = timing.HandoffPaths(
                    pair.source,
                    pair.target,
                    self.translator,
                    ids[:, :n],
                    ids[:, n:],
                    options,
                    need=tuple(PATHS.values()),
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
        return points, noisy

    # ------------------------------------------------------------------ publish
    def publish(self, result: tuple[list[dict], list[str]]) -> dict:
        """switch.png, switch.md (printed) and switch.json last; exit 1 after them on a noisy timing not allowed."""
        from ..bench import timing
        from ..io import atomic_write_bytes, sha256_file
        from ..records.report import Report, publish

        points, noisy = result
        cfg, pair = self.cfg, self.pair
        checks = timing.cv_checks(noisy, cfg.cv_limit, cfg.allow_cv)
        title = (
            f"{Path(str(pair.source_spec.name_or_path)).name} → {Path(str(pair.target_spec.name_or_path)).name}, "
            f"{self.pair_cfg.dtype}, {pair.device}, {cfg.threads} thread(s)"
        )
        plot_path = self.paths.beside("switch", ".png")
        atomic_write_bytes(plot_path, plot(points, title))
        report = Report(
            "switch_cost",
            config=cfg,
            inputs=self.inputs,
            results=SwitchResults(lengths=points, chat=self.chat, paths=PATHS, checks=checks),
            metrics=SwitchResults.METRICS,
            n_samples={"lengths": len(points), "trials_per_path": cfg.timing_repeats},
            wall_time_s=time.time() - self.t0,
            device=pair.device,
            dtype=self.pair_cfg.dtype,
            resume_key=self.key,
            files={plot_path.name: sha256_file(plot_path)},
        )
        md = switch_markdown(points, title, cfg, self.chat["repeated"], checks)
        return publish(report, self.paths.report("switch"), None, md, checks=checks)


# --------------------------------------------------------------------------- the chat, the table and the figure
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


def switch_markdown(points: list[dict], title: str, cfg: SwitchConfig, repeated: bool, checks: dict) -> str:
    """switch.md: both paths' median, CV and trials at each length, and the switching speedup."""
    from ..bench import timing
    from ..records.report import fmt_interval, fmt_table

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
    return (
        f"## Switch cost ({title}; {cfg.timing_repeats} trials after {cfg.timing_warmups} warm-ups)\n"
        + ("(test conversations repeated to reach the longest length)\n" if repeated else "")
        + fmt_table(["history tokens", "path", "median ms", "CV", "trials", "flag", "speedup", "95% interval"], rows)
        + timing.checks_line(checks)
    )


def plot(points: list[dict], title: str) -> bytes:
    """PNG of median time against history length for both paths; the error bars span the fastest and slowest
    timed trial (the caption says so, with the trial count)."""
    from ..records.report import figure, figure_png

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
