"""The recipe's orchestration: the learning-rate grid, resumable cells, the cell ledger and the summary.

No tensor maths here: every number comes from a stage report (train.json, benchmark.json,
ifeval.json), and every stage runs as its own process (`run_stage`).

Learning-rate grid
  Rates sit on a half-decade lattice around a centre c: step k (an integer) is the rate
  c·10^(k/2), rounded to 3 significant digits (1e-4, 3.16e-4, 1e-3, ...). Steps are
  integers so that grid membership, edges and extensions never compare floats. A grid of
  n rates holds the steps k - (n-1)//2 for k in 0..n-1: centred for odd n (5: -2..2),
  the centre and the step above it for n = 2.
  Selection: the step with the lowest final validation KL (train.json
  results.distilled_val_kl, measured on the validation split). Nothing else is read: the
  test split never takes part in the choice. A non-finite KL (a diverged run) counts as
  +inf; ties go to the step nearest the centre, then to the lower rate.
  Edges: while the winner is the lowest (highest) step of the grid, one step beyond it is
  added and trained, so the chosen rate ends up with a measured neighbour on both sides,
  or the number of extensions reaches its cap (reported as `cap_hit`).

Cells
  A cell is one run of one stage script with fixed flags. Its key is the sha256 of its
  stage, flags and input hashes (data, code, model identities, upstream maps). The ledger
  (`recipe-state.json`, written atomically after every change) records each cell's key,
  status, report path and report sha256. A cell counts as finished only when the ledger
  says "done" under the same key AND its report and output files are still there with
  the recorded hash. On `--resume`, a cell the ledger holds under another key is refused,
  naming what changed; an unfinished cell is run again with the stage's own resume flag,
  so an interrupted training continues from its newest checkpoint.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..eval.stats import mean_se
from ..io import atomic_write_json, read_json, sha256_file, sha256_json, to_jsonable
from .report import fmt_pm, fmt_table
from .resume import ResumeRefused, diff

LEDGER_FILE = "recipe-state.json"
LEDGER_FORMAT = 1
SELECTION_METRIC = "distilled_val_kl"  # train.json results key: final validation KL of the distilled maps


class StageFailed(RuntimeError):
    """A stage process that exited nonzero or wrote no report."""


# --------------------------------------------------------------------------- the learning-rate grid
def lr_for_step(center: float, step: int) -> float:
    """The rate `step` half-decades from `center`, rounded to 3 significant digits."""
    return float(f"{center * 10 ** (step / 2):.3g}")


def initial_steps(size: int) -> list[int]:
    if size < 1:
        raise ValueError(f"the learning-rate grid needs at least 1 rate (got {size})")
    return [k - (size - 1) // 2 for k in range(size)]


def _score(value: Any) -> float:
    """A validation KL as a sortable number: missing or non-finite (diverged) is +inf."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.inf
    return v if math.isfinite(v) else math.inf


def select_step(val_kl: dict[int, Any]) -> int:
    """The step with the lowest validation KL; ties go to the step nearest the centre, then the lower one."""
    if not val_kl:
        raise ValueError("no learning rate has a validation KL to choose from")
    best = min(val_kl, key=lambda k: (_score(val_kl[k]), abs(k), k))
    if _score(val_kl[best]) == math.inf:
        raise ValueError("every learning rate in the grid diverged or has no validation KL; "
                         "lower --lr-center or check the training reports")
    return best


def extension_steps(steps: Iterable[int], winner: int) -> list[int]:
    """Steps to add so that `winner` gets a neighbour beyond it; [] when it is interior."""
    steps = sorted(set(steps))
    out = []
    if winner == steps[0]:
        out.append(winner - 1)
    if winner == steps[-1]:
        out.append(winner + 1)
    return out


def search_lr(evaluate: Callable[[int], Any], size: int, max_extensions: int) -> dict[str, Any]:
    """Evaluate the initial grid, then extend past an edge winner until it is interior or the cap is hit.

    `evaluate(step)` returns the validation KL of the rate at `step` (it runs or resumes a cell).
    Returns the steps in evaluation order, their KLs, the winner, the extensions made and
    whether the cap stopped the search with the winner still on an edge.
    """
    if max_extensions < 0:
        raise ValueError(f"max_extensions must be ≥ 0 (got {max_extensions})")
    val_kl: dict[int, Any] = {}
    order: list[int] = []
    todo = initial_steps(size)
    extensions = 0
    while True:
        for k in todo:
            if k not in val_kl:
                val_kl[k] = evaluate(k)
                order.append(k)
        winner = select_step(val_kl)
        todo = extension_steps(val_kl, winner)
        if not todo:
            return {"order": order, "val_kl": val_kl, "winner": winner, "extensions": extensions, "cap_hit": False}
        if extensions == max_extensions:
            return {"order": order, "val_kl": val_kl, "winner": winner, "extensions": extensions, "cap_hit": True}
        extensions += 1


# --------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    name: str  # ledger entry name, e.g. "train/lr1.00e-04-s42"
    stage: str  # train, benchmark or ifeval
    script: str  # stage script path
    flags: dict[str, Any]  # the stage's flags: value, True for a bare switch, a list for several values
    report: str  # the report the stage writes last; its presence (with the recorded hash) marks the cell done
    inputs: dict[str, Any]  # input hashes: data, code, model identities, upstream maps
    outputs: tuple[str, ...] = ()  # other files the cell must leave behind (maps), checked on resume
    extra: tuple[str, ...] = ()  # raw pass-through arguments, appended as given
    resume_flag: str | None = None  # the stage's flag to continue an interrupted run (train, ifeval: --resume)
    fresh_flag: str | None = None  # the stage's flag to recompute rather than reuse (benchmark: --force)
    before: Callable[[], None] | None = field(default=None, compare=False)  # runs just before the stage, not hashed

    @property
    def key(self) -> str:
        return sha256_json({"stage": self.stage, "script": Path(self.script).name, "flags": self.flags,
                            "extra": list(self.extra), "inputs": self.inputs})

    def argv(self, resume: bool) -> list[str]:
        """The command line after the interpreter: script, flags, pass-through args, then resume/fresh."""
        out = [str(self.script)]
        for flag, value in self.flags.items():
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(str, value)]
            else:
                out += [flag, str(value)]
        out += list(self.extra)
        if resume and self.resume_flag:
            out.append(self.resume_flag)
        if not resume and self.fresh_flag:
            out.append(self.fresh_flag)
        return out


# --------------------------------------------------------------------------- the ledger
class Ledger:
    """recipe-state.json: the recipe's settings and one entry per cell, rewritten atomically on every change."""

    def __init__(self, path: str | Path, config: dict[str, Any], resume: bool):
        self.path = Path(path)
        config = to_jsonable(config)
        old = None
        if resume and self.path.is_file():
            try:
                old = read_json(self.path)
            except ValueError as e:
                raise ResumeRefused(f"{self.path} is not valid JSON ({e}); move it away and start a fresh recipe "
                                    "(drop --resume)") from e
            if old.get("format") != LEDGER_FORMAT:
                raise ResumeRefused(f"{self.path} has ledger format {old.get('format')}, not {LEDGER_FORMAT}; "
                                    "start a fresh recipe (drop --resume) or use another --run")
            changed = diff(old.get("config"), config)
            if changed:
                raise ResumeRefused("refusing to resume: settings changed: " + "; ".join(changed)
                                    + f" (recorded in {self.path}); re-run with the original settings, "
                                    "drop --resume to start over, or use another --run")
        self.state = old or {"format": LEDGER_FORMAT, "config": config, "created_unix": time.time(), "cells": {}}
        self.state.setdefault("invocations", []).append({"started_unix": time.time(), "resume": resume})
        self.save()

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.state["cells"]

    def save(self) -> None:
        atomic_write_json(self.path, self.state)

    def check(self, cell: Cell) -> tuple[str, str]:
        """("done" | "run", why). Raises ResumeRefused when the ledger holds the cell under another key."""
        entry = self.cells.get(cell.name)
        if entry is None:
            return "run", "new"
        if entry["key"] != cell.key:
            changed = diff({"flags": entry.get("flags"), "extra": entry.get("extra"), "inputs": entry.get("inputs")},
                           {"flags": cell.flags, "extra": list(cell.extra), "inputs": cell.inputs})
            raise ResumeRefused(f"refusing to resume: cell {cell.name} was recorded with other inputs or settings: "
                                + "; ".join(changed or ["its key differs"])
                                + "; restore them, drop --resume to start a fresh recipe, or use another --run")
        if entry["status"] != "done":
            return "run", f"interrupted while {entry['status']}"
        report = Path(cell.report)
        if not report.is_file():
            return "run", f"its report {report} is missing"
        if sha256_file(report) != entry.get("report_sha256"):
            return "run", f"its report {report} changed since the cell finished"
        missing = [o for o in cell.outputs if not Path(o).is_file()]
        if missing:
            return "run", f"its output {missing[0]} is missing"
        return "done", "finished with the same key"

    def start(self, cell: Cell) -> None:
        old = self.cells.get(cell.name, {})
        self.cells[cell.name] = {
            "stage": cell.stage, "key": cell.key, "status": "running", "flags": cell.flags, "extra": list(cell.extra),
            "inputs": cell.inputs, "report": str(cell.report), "outputs": list(cell.outputs),
            "started_unix": time.time(), "runs": old.get("runs", 0) + 1 if old.get("key") == cell.key else 1,
        }
        self.save()

    def fail(self, cell: Cell, error: str) -> None:
        self.cells[cell.name].update(status="failed", error=error, failed_unix=time.time())
        self.save()

    def finish(self, cell: Cell, wall_time_s: float) -> None:
        self.cells[cell.name].update(status="done", report_sha256=sha256_file(cell.report), finished_unix=time.time(),
                                     wall_time_s=wall_time_s)
        self.cells[cell.name].pop("error", None)
        self.save()


# --------------------------------------------------------------------------- running cells
def run_stage(argv: Sequence[str], report: str | Path) -> dict[str, Any]:
    """Run one stage script in this interpreter as a subprocess, then read the report it wrote last."""
    proc = subprocess.run([sys.executable, *argv])
    if proc.returncode != 0:
        raise StageFailed(f"{Path(argv[0]).name} exited with status {proc.returncode} (its output is above)")
    if not Path(report).is_file():
        raise StageFailed(f"{Path(argv[0]).name} exited cleanly but wrote no {report}")
    return read_json(report)


def run_in_process(argv: Sequence[str], report: str | Path) -> dict[str, Any]:
    """Run a stage script's main() in this interpreter (no start-up cost per cell), then read its report."""
    import importlib

    script = Path(argv[0])
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    module = importlib.import_module(script.stem)
    try:
        module.main(list(argv[1:]))
    except SystemExit as e:
        if e.code not in (0, None):
            raise StageFailed(f"{script.name} exited with {e.code!r}") from None
    if not Path(report).is_file():
        raise StageFailed(f"{script.name} exited cleanly but wrote no {report}")
    return read_json(report)


class Cells:
    """Runs cells through a ledger: finished cells are read back, the rest are run (and recorded)."""

    def __init__(self, ledger: Ledger, resume: bool, runner: Callable[[Sequence[str], Path], dict] = run_stage,
                 say: Callable[[str], None] = print):
        self.ledger, self.resume, self.runner, self.say = ledger, resume, runner, say
        self.log: list[dict[str, Any]] = []  # this invocation: one entry per cell asked for

    def ensure(self, cell: Cell) -> dict[str, Any]:
        state, why = self.ledger.check(cell)
        if state == "done":
            self.say(f"[recipe] {cell.name}: finished earlier, key {cell.key[:12]}… matches: skipped")
            self.log.append({"cell": cell.name, "action": "skipped (finished)"})
            return read_json(cell.report)
        # Under --resume a stage continues what it had begun (a training from its newest checkpoint);
        # a fresh recipe starts every stage fresh.
        argv = cell.argv(resume=self.resume)
        self.say(f"[recipe] {cell.name}: running ({why}): python {' '.join(argv)}")
        if cell.before is not None:
            cell.before()
        self.ledger.start(cell)
        t0 = time.time()
        try:
            report = self.runner(argv, Path(cell.report))
        except StageFailed as e:
            self.ledger.fail(cell, str(e))
            raise
        self.ledger.finish(cell, time.time() - t0)
        self.log.append({"cell": cell.name, "action": "ran", "reason": why, "wall_time_s": time.time() - t0})
        return report


def copy_file(src: str | Path, dst: str | Path) -> None:
    """Copy a file into place atomically (a temp file renamed over `dst`); nothing when `src` is absent."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.copy.tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


# --------------------------------------------------------------------------- input hashes
def data_hash(folder: str | Path) -> dict[str, Any]:
    """The prepared data's identity: its manifest's sha256 (which vouches for every split file), or,
    with no manifest, the sha256 of each JSONL file in the folder."""
    folder = Path(folder)
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return {"manifest_sha256": sha256_file(manifest)}
    files = {p.name: sha256_file(p) for p in sorted(folder.glob("*.jsonl"))}
    if not files:
        raise ValueError(f"{folder} holds no prepared data (no manifest.json, no *.jsonl); "
                         "prepare it first (python paper_data.py --profile ...) or pass --data")
    return {"files": files}


# --------------------------------------------------------------------------- reading stage reports
def train_metrics(report: dict) -> dict[str, float]:
    r = report.get("results", {})
    return {k: r.get(k) for k in ("distilled_val_kl", "closed_form_val_kl")}


BENCH_ARM_METRICS = ("kl_token_mean", "perplexity", "top1_agreement", "nll_delta_vs_native_target")


def benchmark_metrics(report: dict) -> dict[str, float]:
    """Per-arm quality metrics, plus the median-based timing speedups averaged over timed contexts."""
    res = report.get("results", {})
    out: dict[str, float] = {}
    for arm, m in res.get("quality", {}).get("arms", {}).items():
        for name in BENCH_ARM_METRICS:
            out[f"{arm}.{name}"] = m.get(name)
        out[f"{arm}.kl_conversation_mean"] = (m.get("kl_conversation") or {}).get("mean")
    contexts = (res.get("timing") or {}).get("contexts") or []
    for path in sorted({p for c in contexts for p in c.get("speedup", {})}):
        xs = [c["speedup"][path] for c in contexts if path in c.get("speedup", {})]
        out[f"timing.speedup.{path}"] = sum(xs) / len(xs)
    return out


def ifeval_metrics(report: dict) -> tuple[dict[str, float], dict[str, dict]]:
    """(item-level means per path and metric, the same with their item-level SE and n)."""
    means, full = {}, {}
    for path, s in report.get("results", {}).get("paths", {}).items():
        for name, v in s.items():
            if isinstance(v, dict) and "mean" in v:
                means[f"{path}.{name}"] = v["mean"]
                full[f"{path}.{name}"] = v
    for comp, metrics in report.get("results", {}).get("comparison", {}).items():
        for name, v in metrics.items():
            if isinstance(v, dict) and "delta_points" in v:
                means[f"{comp}.{name}.delta_points"] = v["delta_points"]
    return means, full


def across_seeds(per_seed: dict[Any, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict]]:
    """{stage: {metric: mean_se over seeds}} for every metric that every seed reports as a finite number."""
    out: dict[str, dict[str, dict]] = {}
    seeds = list(per_seed)
    if not seeds:
        return out
    for stage in per_seed[seeds[0]]:
        names = per_seed[seeds[0]][stage]
        for name in names:
            xs = [per_seed[s].get(stage, {}).get(name) for s in seeds]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs):
                out.setdefault(stage, {})[name] = mean_se([float(x) for x in xs])
    return out


# --------------------------------------------------------------------------- the summary
def _fmt(s: dict | None, scale: float = 1.0) -> str:
    return fmt_pm(s, scale, ".4g", ".2g")


HEADLINE = (  # (stage, metric, label, scale) rows of the per-seed table
    ("train", "distilled_val_kl", "validation KL, distilled (nats/token)", 1.0),
    ("benchmark", "distilled.kl_token_mean", "test KL/token, distilled", 1.0),
    ("benchmark", "closed_form.kl_token_mean", "test KL/token, closed form", 1.0),
    ("benchmark", "control.kl_token_mean", "test KL/token, control", 1.0),
    ("benchmark", "distilled.top1_agreement", "test top-1 agreement, distilled", 1.0),
    ("benchmark", "distilled.nll_delta_vs_native_target", "test ΔNLL vs native target, distilled", 1.0),
    ("benchmark", "timing.speedup.source_cache_handoff", "speedup, cache handoff vs re-prefill", 1.0),
    ("ifeval", "translated.prompt_level_strict_acc", "IFEval prompt strict %, translated", 100.0),
    ("ifeval", "translated.inst_level_strict_acc", "IFEval instruction strict %, translated", 100.0),
    ("ifeval", "native_target.prompt_level_strict_acc", "IFEval prompt strict %, native target", 100.0),
    ("ifeval", "translated_vs_native_target.prompt_level_strict_acc.delta_points",
     "IFEval prompt strict Δ points (translated − native)", 1.0),
)


def summary_markdown(run: str, results: dict[str, Any], cells: list[dict[str, Any]], plot_name: str) -> str:
    search, text = results["lr_search"], [f"# recipe: {run}\n\n"]
    text.append(f"{results['pair']} ({results['direction']}), profile {results['profile']}; "
                f"seeds {', '.join(map(str, results['seeds']))}.\n\n## Learning-rate search (validation split only)\n\n")
    rows = [[c["lr"], c["step"], c["val_kl"], c["closed_form_val_kl"], "← chosen" if c["lr"] == search["chosen_lr"] else ""]
            for c in sorted(search["cells"], key=lambda c: c["step"])]
    text.append(fmt_table(["lr", "step", "val KL (distilled)", "val KL (closed form)", ""], rows))
    text.append(f"\nChosen rate: **{search['chosen_lr']:g}** (lowest final validation KL; centre {search['center']:g}, "
                f"{search['extensions']} extension(s) of at most {search['max_extensions']}).")
    if search["cap_hit"]:
        text.append(" **The winner is still at an edge of the grid: the extension cap was hit**; "
                    "raise --max-extensions or move --lr-center.")
    text.append(f"\n\n![validation KL against learning rate]({plot_name})\n")
    native = results.get("native", {})
    if native:
        text.append("\n## Native rows\n\n")
        rows = [[f"benchmark {arm}", m.get("kl_token_mean"), m.get("top1_agreement"), m.get("perplexity")]
                for arm, m in native.get("benchmark", {}).items()]
        if rows:
            text.append(fmt_table(["row", "test KL/token", "top-1", "ppl"], rows) + "\n")
        rows = [[f"IFEval {p}", _fmt(s.get("prompt_level_strict_acc"), 100), _fmt(s.get("inst_level_strict_acc"), 100)]
                for p, s in native.get("ifeval", {}).items()]
        if rows:
            text.append(fmt_table(["row", "prompt strict %", "instruction strict %"], rows))
    seeds = [str(s) for s in results["seeds"]]
    per_seed, agg = results["per_seed"], results["across_seeds"]
    rows = []
    for stage, metric, label, scale in HEADLINE:
        vals = [per_seed.get(s, {}).get(stage, {}).get(metric) for s in seeds]
        if all(v is None for v in vals):
            continue
        rows.append([label, *[None if v is None else scale * v for v in vals], _fmt(agg.get(stage, {}).get(metric), scale)])
    text.append(f"\n## Seeds at lr {search['chosen_lr']:g} (test split; mean ± SE across seeds)\n\n")
    text.append(fmt_table(["metric", *[f"seed {s}" for s in seeds], "mean ± SE"], rows))
    text.append("\nIFEval: each seed's item-level mean (prompts, or instructions); ± is the SE across seeds.\n")
    text.append("\n## Cells\n\n")
    text.append(fmt_table(["cell", "stage", "this run", "key", "runs", "wall s", "report"],
                          [[c["cell"], c["stage"], c["action"], c["key"][:12], c["runs"], c["wall_time_s"],
                            "/".join(Path(c["report"]).parts[-2:])]
                           for c in cells], ".3g"))
    return "".join(text)
