"""One page for a run: every arm's quality on the test split, its IFEval, ARC and GSM8K accuracy, the
handoff's speedup over re-prefill, and the evidence gate's verdict on the distilled maps, with a figure.

Reads the run's reports under RESULTS/RUN/ and its translators' manifests under ARTIFACTS/RUN/;
writes RESULTS/RUN/summary.md (the page), summary.png (KL and task accuracy per arm, ±1 SE) and
summary.json (last: what each cell was read from, and the maps sha256 it scored). A cell is "—"
where no stage scored that arm (IFEval and the tasks score the native paths, the distilled
maps and, unless run with --no-controls, the control and no-context floors; the closed-form
maps are scored by the benchmark only). A cell whose report scored other maps than the run's
translator now holds is marked "(other maps)", named under the table with the command that
scores the current maps, and left out of the figure and the gate. A run with no report is
refused, naming the runs that have some. Reports unchanged since the last summary: up to date.
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from kvlingo.errors import Refusal
from kvlingo.inputs.models import DIRECTIONS
from kvlingo.inputs.profiles import PROFILES
from kvlingo.io import atomic_write_bytes, atomic_write_text, read_json, sha256_file
from kvlingo.records import resume
from kvlingo.records.paths import TRANSLATORS, RunPaths, add_run_args, make_command, run_paths
from kvlingo.records.report import Report, figure, figure_png, fmt_pm, fmt_table, read_report
from kvlingo.records.saved import MANIFEST_FILE, EvidenceError, collect, judge
from kvlingo.stages.stage import StageParser, refusals_exit, say

SCRIPT = Path(__file__).resolve()
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
    """The reports a summary reads, by name (benchmark, ifeval, ifeval-native, task-arc[-native], ...)."""
    names = ["benchmark", "ifeval", "ifeval-native"] + [
        f"task-{t}{n}" for t in ("arc", "gsm8k") for n in ("", "-native")
    ]
    return {n: read_report(res / f"{n}.json") for n in names if (res / f"{n}.json").is_file()}


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
        self.stale: dict[str, str] = {}  # report name → which maps it scored

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
            self.stale[name] = f"scored {kind} maps with manifest {str(manifest_sha)[:12]}…, the run's {kind} " + (
                f"translator now has {held['manifest_sha256'][:12]}…" if held else "translator is gone"
            )
        return maps, stale

    def bench_cell(self, arm: str, metric: str, fmt) -> Cell:
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
        value = a[metric]
        text = fmt(value) + (" (other maps)" if stale else "")
        return Cell(text, None if stale or not isinstance(value, dict) else value, "benchmark.json", maps, stale)

    def task_cell(self, stem: str, metric: str, arm: str) -> Cell:
        for name in (stem, f"{stem}-native"):
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
        t = (self.bench or {}).get("results", {}).get("timing")
        if not t or not t.get("contexts"):
            return Cell("—")
        sp = t["contexts"][0]["speedup"]
        value = {t["translator"]: sp["source_cache_handoff"], "native_target": sp["target_cache_continue"]}.get(arm)
        stale = arm == t["translator"] and "benchmark" in self.stale
        return (
            Cell("—")
            if value is None
            else Cell(f"{value:.1f}×" + (" (other maps)" if stale else ""), None, "benchmark.json", stale=stale)
        )

    def rows(self) -> tuple[list[str], dict[str, list[Cell]]]:
        headers = ["arm", "KL/token", "KL/conv ± SE", "reply ppl", *(t[1] for t in TASKS), "speedup vs re-prefill"]
        table = {}
        for arm in ARMS:
            table[arm] = [
                self.bench_cell(arm, "kl_token_mean", lambda v: f"{v:.4f}"),
                self.bench_cell(arm, "kl_conversation", lambda v: fmt_pm(v, 1.0, ".4f")),
                self.bench_cell(arm, "perplexity", lambda v: f"{v:.3g}"),
                *(self.task_cell(stem, metric, arm) for stem, _, metric in TASKS),
                self.speed_cell(arm),
            ]
        return headers, table

    def verdict(self) -> tuple[str, bool | None]:
        """(the evidence gate's verdict on the distilled maps, in words; passed, or None when not judged)."""
        if self.bench is None:
            return "not judged: the run has no benchmark report", None
        if "benchmark" in self.stale:
            return "not judged: the benchmark scored other maps than the run's distilled translator", None
        ifeval = self.reports.get("ifeval") if "ifeval" not in self.stale else None
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
            label=arm.replace("_", " "),
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
    acc.set_ylabel("accuracy (%)")
    acc.set_title("tasks after a prompt handoff (IFEval: strict prompt level)", fontsize=9)
    handles = {h.get_label(): h for ax in (kl, acc) for h in ax.containers}
    order = [a.replace("_", " ") for a in ARMS if a.replace("_", " ") in handles]
    fig.legend([handles[a] for a in order], order, loc="lower center", ncol=len(order), fontsize=8, frameon=False)
    fig.suptitle(
        f"{title}\nerror bars: ±1 standard error; evidence gate on the distilled maps: "
        + textwrap.shorten(verdict, 110),
        fontsize=9,
    )
    return figure_png(fig, rect=(0, 0.06, 1, 1))


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
        for name, why in sorted(page.stale.items()):
            target = "benchmark" if name == "benchmark" else "ifeval" if name == "ifeval" else "task"
            extra = f" TASK={name.split('-')[1]} TASK_ARGS=--resume" if target == "task" else ""
            md.append(f"- {name}.json {why}: `{make_command(target, run, profile, pair)}{extra}`\n")
    md.append(f"\nEvidence gate on the distilled maps (kvlingo/records/saved.py): {verdict}\n")
    md.append("\nArms:\n" + "".join(f"- {arm}: {text}\n" for arm, text in LEGEND.items()))
    md.append(
        "\nKL/conv, the task accuracies and the figure give mean ± 1 standard error (n in each cell); a "
        "difference within two SE is a tie. Speedups are medians of the benchmark's timed trials on one "
        "context.\n\n![KL and task accuracy per arm, ±1 SE](summary.png)\n"
    )
    return "".join(md)


def write_summary(paths: RunPaths) -> tuple[str, bool]:
    """Write summary.md, summary.png and summary.json for run `paths` unless they are up to date with its
    reports and translators; (the page, whether it was up to date)."""
    res, art = paths.res, paths.art
    page = Page(res, art)
    if not page.reports and not (res / "train.json").is_file():
        others = [r for r in runs_with_reports(Path(paths.results_root)) if r != paths.run]
        raise Refusal(
            f"{res} holds no report: run {paths.run} has not run (or has another name); "
            + (
                f"runs with reports under {paths.results_root}: {', '.join(others[:8])}"
                + (f" and {len(others) - 8} more" if len(others) > 8 else "")
                + f"; summarise one with `make summary RUN={others[0]}`"
                if others
                else "no run under it has a report yet: run the stages first (make run, or make demo offline)"
            )
        )
    inputs = {"reports": {n: sha256_file(res / f"{n}.json") for n in page.reports}, "translators": page.now}
    key = resume.resume_key(resume.identity({"run": paths.run}, inputs, None, resume.code_hash(SCRIPT)))
    old = resume.up_to_date(res / "summary.json", key)
    if old is not None:
        return (res / "summary.md").read_text(), True
    t0 = time.time()
    headers, table = page.rows()
    verdict, passed = page.verdict()
    md = page_markdown(paths.run, page, headers, table, verdict)
    pair = page.bench["config"]["pair"] if page.bench else None
    ends = (
        (pair["large"], pair["small"])
        if pair and pair["direction"] == "l2s"
        else pair and (pair["small"], pair["large"])
    )
    title = f"{paths.run}: {Path(ends[0]).name} → {Path(ends[1]).name} (source → target)" if pair else paths.run
    atomic_write_bytes(res / "summary.png", plot(page, headers, table, title, verdict))
    atomic_write_text(res / "summary.md", md)
    cells = {
        arm: {
            h: {"text": c.text, "report": c.report, "maps": c.maps, "stale": c.stale} for h, c in zip(headers[1:], cs)
        }
        for arm, cs in table.items()
    }
    Report(
        "summary",
        config=SummaryConfig(paths.run, paths.results_root, paths.artifacts_root),
        inputs=inputs,
        results={"cells": cells, "stale": page.stale, "evidence_gate": {"verdict": verdict, "passed": passed}},
        n_samples={"reports": len(page.reports)},
        wall_time_s=time.time() - t0,
        resume_key=key,
        files={n: sha256_file(res / n) for n in ("summary.md", "summary.png")},
    ).write(res / "summary.json")
    return md, False


@refusals_exit("summary")
def main(argv=None) -> None:
    ap = StageParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python summary.py --profile demo --direction l2s\n"
        "  python summary.py --run demo-l2s-recipe/lr1.00e-03-s42",
    )
    ap.add_argument("--profile", default="pilot", choices=sorted(PROFILES), help="profile (for the default run name)")
    ap.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="direction (for the default run name)")
    add_run_args(ap)
    paths = run_paths(ap.parse_args(argv))
    md, same = write_summary(paths)
    if same:
        print(f"{paths.res / 'summary.md'} is up to date (same reports and translators)")
    print(md, end="")
    if "(other maps)" in md:
        say(
            "summary",
            "cells marked (other maps) scored maps the run no longer holds: re-run the stages named under the table",
        )
    print(f"page {paths.res / 'summary.md'}, figure {paths.res / 'summary.png'}")


if __name__ == "__main__":
    main()
