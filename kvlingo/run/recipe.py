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
  (`recipe-state.json`, kvlingo.run.ledger: locked, atomic, shared by concurrent cells) records
  each cell's key, status, report path and report sha256. A cell counts as finished only when the ledger
  says "done" under the same key AND its report and output files are still there with
  the recorded hash. On `--resume`, a cell the ledger holds under another key is refused,
  naming what changed; an unfinished cell is run again with the stage's own resume flag,
  so an interrupted training continues from its newest checkpoint.

Levels
  Cells that do not depend on each other run together (`Cells.ensure_all`), through a launcher
  (kvlingo.run.launch: one at a time or concurrent local processes, or SLURM job arrays): the
  native rows, then the closed form, then each round of the learning-rate grid, then the other
  seeds' training, then every evaluation of every seed. A level ends when all its cells have;
  the next is built from their reports.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..eval.stats import mean_se
from ..io import atomic_write_json, read_json, sha256_file, sha256_json
from .launch import CellJob, LocalLauncher, StageFailed, run_stage
from .ledger import LEDGER_FILE, Ledger, entry_of  # noqa: F401  (LEDGER_FILE: re-exported for the stages)
from .report import fmt_pm, fmt_table

SELECTION_METRIC = "distilled_val_kl"  # train.json results key: final validation KL of the distilled maps


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


def search_lr(evaluate: Callable[[list[int]], list[Any]], size: int, max_extensions: int) -> dict[str, Any]:
    """Evaluate the initial grid, then extend past an edge winner until it is interior or the cap is hit.

    `evaluate(steps)` returns the validation KLs of the rates at `steps` (it runs or resumes their
    cells, which do not depend on each other: together, where a launcher allows).
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
        new = [k for k in todo if k not in val_kl]
        for k, v in zip(new, evaluate(new)):
            val_kl[k] = v
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


# --------------------------------------------------------------------------- running cells
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
    """Runs cells through the ledger and a launcher: finished cells are read back, the rest are run,
    a dependency level at a time (`ensure_all`), and each records itself in the ledger."""

    def __init__(self, ledger: Ledger, resume: bool, runner: Callable[[Sequence[str], Path], dict] = run_stage,
                 say: Callable[[str], None] = print, launcher=None, logs: str | Path | None = None):
        self.ledger, self.resume, self.say = ledger, resume, say
        self.runner = None if runner is run_stage else runner  # None: each cell is a stage process
        self.launcher = launcher if launcher is not None else LocalLauncher(say=say)
        self.logs = Path(logs) if logs is not None else ledger.path.parent / "logs"
        self.log: list[dict[str, Any]] = []  # this invocation: one entry per cell asked for

    def ensure(self, cell: Cell) -> dict[str, Any]:
        return self.ensure_all([cell])[0]

    def ensure_here(self, cell: Cell, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A cell computed by `compute()` in this process rather than by a stage script (a timing a stage
        makes itself), recorded in the ledger like any other: finished with the same key, its report is read
        back and nothing runs; otherwise `compute()`'s result is written atomically as the report, then
        marked done. Either way the caller gets the report as read from disk, so a resumed run and the run
        that made it see the same values."""
        state, why = self.ledger.check(cell)
        if state == "done":
            return self._read_back(cell)
        self.say(f"[recipe] {cell.name}: running here ({why})")
        self.ledger.start(cell.name, entry_of(cell))
        t0 = time.time()
        try:
            result = compute()
        except BaseException as err:  # an interrupt too: the entry says failed, and a resume runs it again
            self.ledger.fail(cell.name, f"{type(err).__name__}: {err}")
            raise
        atomic_write_json(cell.report, result)
        wall = time.time() - t0
        self.ledger.finish(cell.name, cell.report, wall)
        self.log.append({"cell": cell.name, "action": "ran", "reason": why, "wall_time_s": wall})
        return read_json(cell.report)

    def _read_back(self, cell: Cell) -> dict[str, Any]:
        """The report of a cell the ledger holds as finished under the same key (nothing runs)."""
        self.say(f"[recipe] {cell.name}: finished earlier, key {cell.key[:12]}… matches: skipped")
        self.log.append({"cell": cell.name, "action": "skipped (finished)"})
        return read_json(cell.report)

    def job(self, cell: Cell) -> CellJob:
        log = str(self.logs / f"{cell.name}.log") if self.launcher.writes_logs else None
        return CellJob(cell.name, entry_of(cell), tuple(cell.argv(resume=self.resume)), tuple(cell.argv(resume=True)),
                       str(cell.report), str(self.ledger.path), log, self.launcher.nproc if cell.stage == "train" else 1,
                       runner=self.runner)

    def ensure_all(self, cells: Sequence[Cell]) -> list[dict[str, Any]]:
        """Every cell's report, in order; the unfinished ones run together (they must not depend on each other).

        Raises StageFailed naming every cell of the level that failed, with its log, once all have ended."""
        reports: dict[str, dict] = {}
        todo: list[tuple[Cell, str]] = []
        for cell in cells:
            state, why = self.ledger.check(cell)
            if state == "done":
                reports[cell.name] = self._read_back(cell)
            else:
                todo.append((cell, why))
        if not todo:
            return [reports[c.name] for c in cells]
        jobs = []
        for cell, why in todo:
            # Under --resume a stage continues what it had begun (a training from its newest checkpoint);
            # a fresh recipe starts every stage fresh.
            job = self.job(cell)
            self.say(f"[recipe] {cell.name}: queued ({why}): {' '.join(job.resume_argv if self.resume else job.argv)}"
                     + (f" > {job.log}" if job.log else ""))
            if cell.before is not None:
                cell.before()
            jobs.append(job)
        t0 = time.time()
        outcomes = self.launcher.run(jobs)
        self.ledger.refresh()
        failed = []
        for (cell, why), out in zip(todo, outcomes):
            if out.report is None:
                failed.append(f"{cell.name}: {out.error}" + (f" [log: {out.log}]" if out.log and out.log not in out.error
                                                             else ""))
                continue
            reports[cell.name] = out.report
            self.log.append({"cell": cell.name, "action": "ran", "reason": why, "wall_time_s": time.time() - t0})
        if failed:
            raise StageFailed(f"{len(failed)} of {len(todo)} cell(s) failed: " + "; ".join(failed))
        return [reports[c.name] for c in cells]


def stage_flags(profile: str, pair, artifacts: str, results: str) -> dict[str, str]:
    """The flags every cell's stage gets from the driver: its profile, pair, output roots and the KV cache kind
    this process was given (--cache), so a cell runs what its driver was asked to."""
    from ..core.cache import default_kind

    return {"--profile": profile, "--large": pair.large, "--small": pair.small, "--direction": pair.direction,
            "--device": pair.device, "--dtype": pair.dtype, "--cache": default_kind(), "--artifacts": artifacts,
            "--results": results}


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
