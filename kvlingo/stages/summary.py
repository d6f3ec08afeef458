"""The summary stage (summary.py): one page for a run: every arm's quality on the test split, its IFEval, ARC and
GSM8K accuracy, the handoff's speedup over re-prefill, and the evidence gate's verdict on the distilled maps, with a
figure.

Reads the run's reports under RESULTS/RUN/ and its translators' manifests under ARTIFACTS/RUN/;
writes RESULTS/RUN/summary.md (the page), summary.png (KL and task accuracy per arm, ±1 SE) and
summary.json (last: what each cell was read from, and the maps sha256 it scored). A cell is "—"
where no stage scored that arm (IFEval and the tasks score the native paths, the distilled
maps and, unless run with --no-controls, the control and no-context floors; the closed-form
maps are scored by the benchmark only). A task column reads its test-split reports (task-arc-test.json, ...)
where there are any, else those on all items, never the validation split's. A cell whose report scored other
maps than the run's translator now holds is marked "(other maps)", named under the table with the command that
scores the current maps, and left out of the figure and the gate. A run with no report is
refused, naming the runs that have some. Reports unchanged since the last summary: up to date.
"""

from __future__ import annotations

import math
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.settings import DIRECTIONS
from ..errors import Refusal
from ..inputs.flags import add_run_args
from ..inputs.profiles import PROFILES
from ..io import read_json, read_jsonl, sha256_file
from ..records.paths import MANIFEST_FILE, TRANSLATORS, RunPaths, make_command
from ..records.report import fmt_interval, fmt_pm, fmt_table, read_report
from .skeleton import Stage, say

ARMS = ("native_source", "native_target", "closed_form", "distilled", "control", "no_context")
LEGEND = {
    "native_source": "the source model reads the conversation itself",
    "native_target": "the target model reads the conversation itself: the reference (KL 0 by definition)",
    "closed_form": "the target continues from the source's cache translated by the closed-form maps",
    "distilled": "the same with the distilled maps: the run's translator",
    "control": "the distilled maps on another conversation's (item's) source cache: what maps that ignore "
    "their input would score",
    "no_context": "the target with no cache, from the context's last token alone: the floor",
}
TASKS = (
    ("ifeval", "IFEval strict prompt %", "prompt_level_strict_acc"),
    ("task-arc", "ARC %", "accuracy"),
    ("task-gsm8k", "GSM8K %", "accuracy"),
)
# The path of an IFEval or task report that stands for an arm; "translated" is the arm of the maps it used.
NATIVE_PATHS = ("native_source", "native_target", "no_context")
SPLITS = ("", "-test")  # the item splits a task column may read: all items, or the test half (where claims are made)


@dataclass(frozen=True)
class SummaryConfig:
    run: str  # the run summarised: RESULTS/RUN and ARTIFACTS/RUN
    results: str  # results root
    artifacts: str  # artifacts root


@dataclass
class Cell:
    text: str  # as shown in the table
    stat: dict | None = None  # mean ± SE (the figure's bar), None for a cell the figure leaves out
    report: str | None = None  # the report it was read from
    maps: dict | None = None  # {"translator", "manifest_sha256", "maps_sha256"} the cell scored; None: no maps
    stale: bool = False  # scored other maps than the run's translator now holds


class Summary(Stage):
    name = "summary"
    script = "summary.py"
    summary = (
        "One page for a run: every arm's quality on the test split, its IFEval, ARC and GSM8K accuracy, the\n"
        "handoff's speedup over re-prefill, and the evidence gate's verdict on the distilled maps, with a figure."
    )
    examples = (
        ".venv/bin/python summary.py --profile demo --direction l2s",
        ".venv/bin/python summary.py --run demo-l2s-recipe/lr1.00e-03-s42",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--profile", default="pilot", choices=sorted(PROFILES), help="profile (for the default run name)"
        )
        p.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="direction (for the default run name)")
        add_run_args(p)

    def check(self) -> None:
        """The run's reports and translators, read and checked (a run with none is refused); the resume key."""
        from ..records import resume
        from ..records.paths import run_paths

        self.paths = paths = run_paths(self.args)
        self.page = Page(paths.res, paths.art)
        if not self.page.reports and not (paths.res / "train.json").is_file():
            raise no_reports(paths)
        self.inputs = {
            "reports": {n: sha256_file(paths.res / f"{n}.json") for n in self.page.reports},
            "translators": self.page.now,
            "benchmark_rows": None  # the SEs' per-conversation sums, when the benchmark's sealed file is there
            if self.page.conversations is None
            else sha256_file(paths.res / "benchmark.rows.jsonl"),
        }
        self.key = resume.resume_key(
            resume.identity({"run": paths.run}, self.inputs, None, resume.code_hash(self.script_path()))
        )

    def up_to_date(self) -> dict | None:
        """summary.json when it was made from the same reports and translators (the page is shown again)."""
        from ..records import resume

        old = resume.up_to_date(self.paths.res / "summary.json", self.key)
        if old is not None:
            self._show((self.paths.res / "summary.md").read_text(), same=True)
        return old

    def run(self) -> dict[str, Any]:
        """The table, the gate's verdict, the page and its figure."""
        self.t0 = time.time()
        page, run = self.page, self.paths.run
        headers, table = page.rows()
        verdict, passed = page.verdict()
        return {
            "headers": headers,
            "table": table,
            "verdict": verdict,
            "passed": passed,
            "md": page_markdown(run, page, headers, table, verdict),
            "png": plot(page, headers, table, title_of(run, page.bench), verdict),
        }

    def publish(self, page: dict[str, Any]) -> dict:
        """summary.png, summary.md, then summary.json last; the page on stdout."""
        from ..io import atomic_write_bytes, atomic_write_text
        from ..records.report import Report

        res, paths = self.paths.res, self.paths
        atomic_write_bytes(res / "summary.png", page["png"])
        atomic_write_text(res / "summary.md", page["md"])
        cells = {
            arm: {
                h: {"text": c.text, "report": c.report, "maps": c.maps, "stale": c.stale}
                for h, c in zip(page["headers"][1:], cs)
            }
            for arm, cs in page["table"].items()
        }
        gate = {"verdict": page["verdict"], "passed": page["passed"]}
        report = Report(
            "summary",
            config=SummaryConfig(paths.run, paths.results_root, paths.artifacts_root),
            inputs=self.inputs,
            results={"cells": cells, "stale": self.page.stale, "evidence_gate": gate},
            n_samples={
                "reports": len(self.page.reports),
                **{  # the benchmark's, which the page's heading gives
                    k: self.page.bench["n_samples"][k]
                    for k in ("conversations", "reply_tokens")
                    if self.page.bench and k in self.page.bench.get("n_samples", {})
                },
            },
            wall_time_s=time.time() - self.t0,
            resume_key=self.key,
            files={n: sha256_file(res / n) for n in ("summary.md", "summary.png")},
        ).write(res / "summary.json")
        self._show(page["md"], same=False)
        return report

    def _show(self, md: str, same: bool) -> None:
        res = self.paths.res
        if same:
            print(f"{res / 'summary.md'} is up to date (same reports and translators)")
        print(md, end="")
        if "(other maps)" in md:
            say(
                "summary",
                "cells marked (other maps) scored maps the run no longer holds: re-run the stages named under the "
                "table",
            )
        print(f"page {res / 'summary.md'}, figure {res / 'summary.png'}")


def no_reports(paths: RunPaths) -> Refusal:
    """The refusal of a run with no report, naming the runs under the same root that have some."""
    others = [r for r in runs_with_reports(Path(paths.results_root)) if r != paths.run]
    return Refusal(
        f"{paths.res} holds no report: run {paths.run} has not run (or has another name); "
        + (
            f"runs with reports under {paths.results_root}: {', '.join(others[:8])}"
            + (f" and {len(others) - 8} more" if len(others) > 8 else "")
            + f"; summarise one with `make summary RUN={others[0]}`"
            if others
            else "no run under it has a report yet: run the stages first (make run, or make demo offline)"
        )
    )


def title_of(run: str, bench: dict | None) -> str:
    """The figure's title: the run and its pair, source → target (the run alone without a benchmark)."""
    pair = bench["config"]["pair"] if bench else None
    if not pair:
        return run
    ends = (pair["large"], pair["small"]) if pair["direction"] == "l2s" else (pair["small"], pair["large"])
    return f"{run}: {Path(ends[0]).name} → {Path(ends[1]).name} (source → target)"


# --------------------------------------------------------------------------- reading a run
def current_translators(art: Path) -> dict[str, dict]:
    """{kind: {"manifest_sha256", "maps_sha256"}} of the run's translators as they are now."""
    out = {}
    for kind in TRANSLATORS:
        manifest = art / kind / MANIFEST_FILE
        if manifest.is_file():
            out[kind] = {
                "manifest_sha256": sha256_file(manifest),
                "maps_sha256": read_json(manifest).get("maps_sha256"),
            }
    return out


def run_reports(res: Path) -> dict[str, dict]:
    """The reports a summary reads, by name: benchmark, and each of IFEval, ARC and GSM8K translated and native
    (ifeval, ifeval-native, task-arc-native, ...) on all items or on the test split (task-arc-test, ...). The
    validation split's reports are never read: settings are chosen on them (ablate.py), so they make no claim."""
    names = ["benchmark"] + [f"{stem}{n}{s}" for stem, _, _ in TASKS for n in ("", "-native") for s in SPLITS]
    return {n: read_report(res / f"{n}.json") for n in names if (res / f"{n}.json").is_file()}


def task_split(reports: dict[str, dict], stem: str) -> str:
    """The item split a task column reads, as a report-name suffix: "-test" when a translated or native report of
    `stem` has one, else "" (all items). One split per column, so that its arms are scored on the same items."""
    return "-test" if any(f"{stem}{n}-test" in reports for n in ("", "-native")) else ""


def bench_rows(res: Path, bench: dict | None) -> list[dict] | None:
    """benchmark.rows.jsonl (one row per test conversation) when it is the file the benchmark report sealed, or
    None: the per-conversation sums the token-weighted figures' SEs come from."""
    path = res / "benchmark.rows.jsonl"
    if bench is None or not path.is_file() or bench.get("files", {}).get(path.name) != sha256_file(path):
        return None
    return read_jsonl(path)


def token_weighted(rows: list[dict], arm: str, key: str) -> dict[str, float]:
    """Σ key / Σ n_tokens of an arm over conversations (KL or NLL per reply token), with its SE over the
    conversations (`stats.ratio_mean_se`: a conversation's tokens are not independent)."""
    from ..eval.stats import ratio_mean_se

    return ratio_mean_se([r["arms"][arm][key] for r in rows], [r["arms"][arm]["n_tokens"] for r in rows])


def runs_with_reports(results_root: Path) -> list[str]:
    """Runs under a results root that hold a training or benchmark report (nested runs too)."""
    found = {p.parent for name in ("train.json", "benchmark.json") for p in results_root.rglob(name)}
    return sorted(str(p.relative_to(results_root)) for p in found)


class Page:
    """The run's table: one row per arm, each cell read from one report and checked against the current maps."""

    def __init__(self, res: Path, art: Path):
        self.res, self.art = Path(res), Path(art)
        self.reports = run_reports(self.res)
        self.now = current_translators(self.art)
        self.bench = self.reports.get("benchmark")
        self.conversations = bench_rows(self.res, self.bench)  # benchmark.rows.jsonl, or None
        self.splits = {stem: task_split(self.reports, stem) for stem, _, _ in TASKS}
        self.stale: dict[str, dict[str, str]] = {}  # report name → {translator: which maps it scored}

    def scored(self, name: str, kind: str | None, manifest_sha: str | None, maps_sha: str | None) -> tuple[dict, bool]:
        """(the maps a cell of report `name` scored, whether they differ from the run's `kind` translator now)."""
        maps = {
            "translator": kind,
            "manifest_sha256": manifest_sha,
            "maps_sha256": maps_sha
            or (
                self.now.get(kind, {}).get("maps_sha256")
                if manifest_sha == self.now.get(kind, {}).get("manifest_sha256")
                else None
            ),
        }
        stale = kind is not None and manifest_sha != self.now.get(kind, {}).get("manifest_sha256")
        if stale:
            held = self.now.get(kind)
            self.stale.setdefault(name, {})[kind] = (
                f"scored {kind} maps with manifest {str(manifest_sha)[:12]}…, the run's {kind} "
                + (f"translator now has {held['manifest_sha256'][:12]}…" if held else "translator is gone")
            )
        return maps, stale

    def stale_in(self, name: str, kind: str | None) -> bool:
        """Whether report `name` scored other `kind` maps than the run now holds (its other translators aside)."""
        return kind in self.stale.get(name, {})

    def bench_cell(self, arm: str, metric: str) -> Cell:
        """A quality cell: mean ± SE (n conversations) of `metric` (kl_token_mean, kl_conversation, perplexity)."""
        a = self.bench["results"]["quality"]["arms"].get(arm) if self.bench else None
        if a is None:
            return Cell("—")
        kind = (
            arm
            if arm in TRANSLATORS
            else (self.bench["results"]["quality"].get("control_translator") if arm == "control" else None)
        )
        maps, stale = (
            self.scored("benchmark", kind, self.bench["inputs"].get(kind, {}).get("manifest_sha256"), None)
            if kind
            else (None, False)
        )
        n = a["n_conversations"]
        if metric == "kl_conversation":
            stat = a[metric]
        elif self.conversations is None:  # the report's figure; its SE needs the per-conversation sums
            stat = {"mean": a[metric], "se": float("nan"), "n": n}
        elif metric == "perplexity":  # exp of the NLL per token; SE by the delta method
            nll = token_weighted(self.conversations, arm, "nll_sum")
            stat = {"mean": a[metric], "se": a[metric] * nll["se"], "n": nll["n"]}
        else:
            stat = {**token_weighted(self.conversations, arm, "kl_sum"), "mean": a[metric]}
        fmt, se_fmt = (".3g", ".2g") if metric == "perplexity" else (".4f", ".4f")
        no_se = (
            ""
            if math.isfinite(stat["se"])
            else ", no SE" + (": benchmark.rows.jsonl missing or changed" if n > 1 else "")
        )
        text = fmt_pm(stat, 1.0, fmt, se_fmt) + f" (n={stat['n']}{no_se})" + (" (other maps)" if stale else "")
        figure_stat = stat if metric == "kl_conversation" and not stale else None
        return Cell(text, figure_stat, "benchmark.json", maps, stale)

    def task_cell(self, stem: str, metric: str, arm: str) -> Cell:
        split = self.splits[stem]
        for name in (f"{stem}{split}", f"{stem}-native{split}"):
            rep = self.reports.get(name)
            if rep is None:
                continue
            kind = rep["config"].get("translator")
            path = (
                arm
                if arm in NATIVE_PATHS
                else ("translated" if arm == kind else "control" if arm == "control" else None)
            )
            if path is None or path not in rep["results"].get("paths", {}):
                continue
            stat = rep["results"]["paths"][path][metric]
            maps, stale = None, False
            if path in ("translated", "control"):
                used = rep["inputs"].get("translator") or {}
                maps, stale = self.scored(
                    name, kind, rep["inputs"].get("translator_manifest_sha256"), used.get("maps_sha256")
                )
            text = fmt_pm(stat, 100.0, ".1f") + f" (n={stat['n']})" + (" (other maps)" if stale else "")
            return Cell(text, None if stale else stat, f"{name}.json", maps, stale)
        return Cell("—")

    def speed_cell(self, arm: str) -> Cell:
        """The handoff's median speedup over re-prefill with its 95% bootstrap interval, and NOISY where the
        benchmark flagged either path's timings (a ratio is as noisy as its noisier side)."""
        t = (self.bench or {}).get("results", {}).get("timing")
        if not t or not t.get("contexts") or arm != t["translator"]:  # the native target re-prefills: no speedup
            return Cell("—")
        context, path = t["contexts"][0], "source_cache_handoff"
        value, interval = context["speedup"][path], context.get("speedup_interval", {}).get(path)
        notes = [fmt_interval(interval, ".3g", "no interval")]
        if interval and interval[0] <= 1 <= interval[1]:
            notes.append("includes 1×")
        if any(context["paths"].get(p, {}).get("noisy") for p in ("target_reprefill", path)):
            notes.append("NOISY")
        stale = self.stale_in("benchmark", t["translator"])
        text = f"{value:.3g}× ({'; '.join(notes)})" + (" (other maps)" if stale else "")
        return Cell(text, None, "benchmark.json", stale=stale)

    def rows(self) -> tuple[list[str], dict[str, list[Cell]]]:
        headers = ["arm", "KL/token", "KL/conv ± SE", "reply ppl", *(t[1] for t in TASKS), "speedup vs re-prefill"]
        table = {}
        for arm in ARMS:
            table[arm] = [
                self.bench_cell(arm, "kl_token_mean"),
                self.bench_cell(arm, "kl_conversation"),
                self.bench_cell(arm, "perplexity"),
                *(self.task_cell(stem, metric, arm) for stem, _, metric in TASKS),
                self.speed_cell(arm),
            ]
        return headers, table

    def verdict(self) -> tuple[str, bool | None]:
        """(the evidence gate's verdict on the distilled maps, in words; passed, or None when not judged)."""
        from ..records.saved import EvidenceError, collect, judge

        if self.bench is None:
            return "not judged: the run has no benchmark report", None
        if self.stale_in("benchmark", "distilled"):
            return "not judged: the benchmark scored other maps than the run's distilled translator", None
        name = "ifeval" + self.splits["ifeval"]
        ifeval = self.reports.get(name) if name not in self.stale else None
        try:
            v = judge(collect(self.bench, "distilled", ifeval))
        except EvidenceError as e:
            return f"not judged: {e}", None
        if v.passed:
            return "PASSED (top-1 agreement, NLL Δ, beats the control, native controls)", True
        return "FAILED: " + "; ".join(v.failures), False


def summary_rows(res: str | Path, art: str | Path) -> tuple[list[str], list[list[str]]]:
    """The table as text: headers and one row per arm."""
    headers, table = Page(Path(res), Path(art)).rows()
    return headers, [[arm, *(c.text for c in cells)] for arm, cells in table.items()]


# --------------------------------------------------------------------------- the figure and the page
def plot(page: Page, headers: list[str], table: dict[str, list[Cell]], title: str, verdict: str) -> bytes:
    """KL per conversation (left) and task accuracy (right) per arm, bars with ±1 SE error bars."""
    import numpy as np

    from ..records.report import figure, figure_png

    fig, (kl, acc) = figure((11, 4.8), ncols=2)
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    shown = [a for a in ARMS if a != "native_target" and table[a][1].stat is not None]
    for i, arm in enumerate(shown):
        s = table[arm][1].stat
        kl.bar(
            i,
            s["mean"],
            yerr=s["se"] if math.isfinite(s["se"]) else 0,
            capsize=4,
            color=colors[arm],
        )
    kl.set_xticks(range(len(shown)), [a.replace("_", " ") for a in shown], rotation=20, fontsize=8)
    kl.set_ylabel("KL(native target ‖ arm), nats/token\n(mean over test conversations)")
    n = page.bench["n_samples"] if page.bench else {}
    kl.set_title(
        f"quality on the test split (n={n.get('conversations', '?')} conversations); native target = 0", fontsize=9
    )
    cols = [3 + t for t in range(len(TASKS))]  # the task columns among a row's cells
    arms = [a for a in ARMS if any(table[a][c].stat is not None for c in cols)]
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        bars = [(g, table[arm][c].stat) for g, c in enumerate(cols) if table[arm][c].stat is not None]
        acc.bar(
            [g + (j - (len(arms) - 1) / 2) * width for g, _ in bars],
            [100 * s["mean"] for _, s in bars],
            width,
            yerr=[100 * s["se"] if math.isfinite(s["se"]) else 0 for _, s in bars],
            capsize=3,
            color=colors[arm],
            label=arm.replace("_", " "),
        )
    ns = []
    for (_, name, _), c in zip(TASKS, cols):
        stat = next((table[a][c].stat for a in ARMS if table[a][c].stat is not None), None)
        ns.append(f"{name.split(' ')[0]}\n(n={stat['n']})" if stat else name.split(" ")[0])
    acc.set_xticks(np.arange(len(TASKS)), ns, fontsize=8)
    acc.set_xlim(-0.5, len(TASKS) - 0.5)
    acc.set_ylim(0, 100)
    acc.set_ylabel("accuracy (%)")
    acc.set_title("tasks after a prompt handoff (IFEval: strict prompt level)", fontsize=9)
    if not arms:
        acc.text(
            0.5,
            0.5,
            "not run: no IFEval or task report in this run\n"
            "(make ifeval-native ifeval; make task-native task TASK=gsm8k)",
            ha="center",
            va="center",
            fontsize=8,
            transform=acc.transAxes,
        )
    else:  # the task panel's colours (the KL panel names its arms under its bars)
        handles = {h.get_label(): h for h in acc.containers}
        order = [a.replace("_", " ") for a in ARMS if a.replace("_", " ") in handles]
        fig.legend([handles[a] for a in order], order, loc="lower center", ncol=len(order), fontsize=8, frameon=False)
    fig.suptitle(
        f"{title}\nerror bars: ±1 standard error; evidence gate on the distilled maps: "
        + textwrap.shorten(verdict, 110),
        fontsize=9,
    )
    return figure_png(fig, rect=(0, 0.06, 1, 1))


SHORT_CONTEXT = 1024  # a timed context shorter than this (tokens) says little about a handoff's speed at real use


def speed_caveat(bench: dict | None) -> str:
    """What the speedup column's context was, and a warning when it is too short (or the models too small) to
    speak for real shapes."""
    t = (bench or {}).get("results", {}).get("timing") or {}
    if not t.get("contexts"):
        return ""
    tokens, threads = t["contexts"][0].get("context_tokens"), t.get("threads")
    text = f" ({tokens} tokens, {threads} thread(s))"
    if tokens is not None and tokens < SHORT_CONTEXT:
        text += (
            f"; **a context under {SHORT_CONTEXT:,} tokens on a pair this size says little about a handoff's "
            "speed at real shapes**: `make perf` times the real ones (results/perf/perf.md)"
        )
    return text


def rescore_command(name: str, run: str, profile: str | None, pair: dict | None) -> str:
    """The make command that writes report `name` (benchmark, ifeval[-native][-test], task-T[-native][-test]) again
    for the run's current maps: its own target, the task named, and the test split where the report read it."""
    base, test = name.removesuffix("-test"), name.endswith("-test")
    if base.startswith("task-"):
        target = "task-native" if base.endswith("-native") else "task"
        extra = f" TASK={base.split('-')[1]} TASK_ARGS=" + ('"--resume --split test"' if test else "--resume")
    else:  # benchmark, ifeval, ifeval-native
        target, extra = base, ' IFEVAL_ARGS="--split test"' if test else ""
    return make_command(target, run, profile, pair) + extra


def page_markdown(run: str, page: Page, headers: list[str], table: dict[str, list[Cell]], verdict: str) -> str:
    bench = page.bench
    n = (
        f"{bench['n_samples']['conversations']} test conversations, {bench['n_samples']['reply_tokens']} reply tokens"
        if bench
        else "no benchmark report"
    )
    rows = [[arm, *(c.text for c in cells)] for arm, cells in table.items()]
    md = [f"## Summary of {run} ({n})\n", fmt_table(headers, rows)]
    maps = {}
    for cells in table.values():
        for c in cells:
            if c.maps and not c.stale:
                maps[c.maps["translator"]] = c.maps["maps_sha256"]
    if maps:
        md.append("\nMaps scored: " + "; ".join(f"{k} sha256 {v or '?'}" for k, v in sorted(maps.items())) + ".\n")
    if page.stale:
        md.append(
            "\n**Cells marked (other maps) are stale**: their report scored maps the run no longer holds "
            "(left out of the figure and the gate):\n"
        )
        pair, profile = bench and bench["config"].get("pair"), bench and bench["config"].get("profile")
        for name, whys in sorted(page.stale.items()):
            command = rescore_command(name, run, profile, pair)
            md.extend(f"- {name}.json {why}: `{command}`\n" for why in whys.values())
    md.append(f"\nEvidence gate on the distilled maps (kvlingo/records/saved.py): {verdict}\n")
    md.append("\nArms:\n" + "".join(f"- {arm}: {text}\n" for arm, text in LEGEND.items()))
    unsplit = {n.removesuffix("-native") for n in page.reports}
    read = {  # the split each task column read
        name.split(" ")[0]: "test split" if page.splits[stem] else "all items" if stem in unsplit else "no report"
        for stem, name, _ in TASKS
    }
    md.append(
        "\nEvery quality cell gives mean ± 1 standard error (n in the cell: test conversations for the benchmark's "
        "columns, items for the tasks'); a difference within two SE is a tie. KL/token and reply ppl are "
        "token-weighted over the reply tokens, their SE taken over conversations (benchmark.rows.jsonl; ppl's by "
        "the delta method); KL/conv is the mean of per-conversation KLs. Each task column reads one item split "
        "for all its arms: the test half where a report of it exists (where claims are made), else all items; "
        "validation reports are never read ("
        + ", ".join(f"{k}: {v}" for k, v in read.items())
        + "). Speedups are medians of the benchmark's timed trials on one context, with the 95% bootstrap "
        "interval of that ratio; an interval that includes 1× shows no speedup, and NOISY marks a context whose "
        "handoff or re-prefill timings the benchmark flagged" + speed_caveat(bench) + ".\n\n"
        "![KL and task accuracy per arm, ±1 SE](summary.png)\n"
    )
    return "".join(md)
