"""Cells: one run of one stage script with fixed flags, resumable by key, run a dependency level at a time.

No tensor maths here: every number comes from a stage report, and every stage runs as its own
process (kvlingo.stages.launch) or, for the toy world's small cells, in this interpreter
(`run_in_process`). The recipe, the ablation and the frontier are built of cells.

A cell's key is the sha256 of its stage, flags and input hashes (data, code, model identities,
upstream maps). The ledger (kvlingo.stages.ledger: locked, atomic, shared by concurrent cells)
records each cell's key, status, report path and report sha256. A cell counts as finished only
when the ledger says "done" under the same key AND its report and output files are still there
with the recorded hash. On `--resume`, a cell the ledger holds under another key is refused,
naming what changed; an unfinished cell is run again with the stage's own resume flag, so an
interrupted training continues from its newest checkpoint. Cells that do not depend on each
other run together (`Cells.ensure_all`) through a launcher: one at a time, concurrent local
processes, or SLURM job arrays.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import atomic_write_json, read_json, sha256_file, sha256_json
from .launch import CellJob, LocalLauncher, StageFailed, run_stage
from .ledger import LEDGER_FILE, Ledger, entry_of  # noqa: F401  (re-exported for the stages)


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
        return sha256_json(
            {
                "stage": self.stage,
                "script": Path(self.script).name,
                "flags": self.flags,
                "extra": list(self.extra),
                "inputs": self.inputs,
            }
        )

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
    """Run a stage's `main` (kvlingo.stages.registry: the stage whose script is argv[0]) in this interpreter, no
    start-up cost per cell, then read its report."""
    from .registry import by_script

    script = Path(argv[0])
    try:
        by_script(script).stage.main(list(argv[1:]))
    except SystemExit as e:
        if e.code not in (0, None):
            raise StageFailed(f"{script.name} exited with {e.code!r}") from None
    if not Path(report).is_file():
        raise StageFailed(f"{script.name} exited cleanly but wrote no {report}")
    return read_json(report)


class Cells:
    """Runs cells through the ledger and a launcher: finished cells are read back, the rest are run,
    a dependency level at a time (`ensure_all`), and each records itself in the ledger."""

    def __init__(
        self,
        ledger: Ledger,
        resume: bool,
        runner: Callable[[Sequence[str], Path], dict] = run_stage,
        say: Callable[[str], None] = print,
        launcher=None,
        logs: str | Path | None = None,
    ):
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
        self.say(
            f"[recipe] {cell.name}: up to date (finished with the same key {cell.key[:12]}…; its report is unchanged)"
        )
        self.log.append({"cell": cell.name, "action": "skipped (finished)"})
        return read_json(cell.report)

    def job(self, cell: Cell) -> CellJob:
        log = str(self.logs / f"{cell.name}.log") if self.launcher.writes_logs else None
        return CellJob(
            cell.name,
            entry_of(cell),
            tuple(cell.argv(resume=self.resume)),
            tuple(cell.argv(resume=True)),
            str(cell.report),
            str(self.ledger.path),
            log,
            self.launcher.nproc if cell.stage == "train" else 1,
            runner=self.runner,
        )

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
            self.say(
                f"[recipe] {cell.name}: queued ({why}): {' '.join(job.resume_argv if self.resume else job.argv)}"
                + (f" > {job.log}" if job.log else "")
            )
            if cell.before is not None:
                cell.before()
            jobs.append(job)
        t0 = time.time()
        outcomes = self.launcher.run(jobs)
        self.ledger.refresh()
        failed = []
        for (cell, why), out in zip(todo, outcomes):
            if out.report is None:
                failed.append(
                    f"{cell.name}: {out.error}" + (f" [log: {out.log}]" if out.log and out.log not in out.error else "")
                )
                continue
            reports[cell.name] = out.report
            self.log.append({"cell": cell.name, "action": "ran", "reason": why, "wall_time_s": time.time() - t0})
        if failed:
            raise StageFailed(f"{len(failed)} of {len(todo)} cell(s) failed: " + "; ".join(failed))
        return [reports[c.name] for c in cells]


def stage_flags(profile: str, pair, artifacts: str, results: str) -> dict[str, str]:
    """The flags every cell's stage gets from the driver: its profile, its pair (a PairConfig, with the KV cache
    kind the driver was given) and output roots, so a cell runs what its driver was asked to."""
    return {
        "--profile": profile,
        "--large": pair.large,
        "--small": pair.small,
        "--direction": pair.direction,
        "--device": pair.device,
        "--dtype": pair.dtype,
        "--cache": pair.cache,
        "--artifacts": artifacts,
        "--results": results,
    }


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
def data_hash(folder: str | Path, profile: str | None = None) -> dict[str, Any]:
    """The prepared data's identity: its manifest's sha256 (which vouches for every split file), or,
    with no manifest, the sha256 of each JSONL file in the folder. None there: refused with how to prepare it for
    `profile` (the stage's --profile)."""
    from ..inputs.data import prepare_hint

    folder = Path(folder)
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return {"manifest_sha256": sha256_file(manifest)}
    files = {p.name: sha256_file(p) for p in sorted(folder.glob("*.jsonl"))}
    if not files:
        raise ValueError(
            f"{folder} holds no prepared data (no manifest.json, no *.jsonl); prepare it first: "
            f"{prepare_hint(folder, profile)}"
        )
    return {"files": files}
