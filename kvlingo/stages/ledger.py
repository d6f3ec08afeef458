"""The recipe's cell ledger, `recipe-state.json`, shared by cells that run at the same time.

One entry per cell: its key, status (running, done, failed), flags, inputs, report, and once done
the sha256 of the report and of every output it vouches for (declared maps, the rows and figures
the report lists), how many times it was started, and where it last ran. A finished cell is
skipped only while all of those hashes still match. The recipe's settings sit beside them, so a
resume under other settings is refused. A run without --resume keeps the finished cells of a
ledger made under the same settings (`reuse`): a cell whose key and hashes still match is up to
date, any other runs afresh.

Concurrent cells (threads of the local launcher, SLURM jobs on other nodes) each record their
own entry. Every change is read → change one entry → atomic replace, under an exclusive
`fcntl.flock` on `recipe-state.json.lock`: between processes, and between threads (each change
opens the lock file anew, and flock locks belong to the open file). No writer can replace the
file with a copy that misses another's change. On a cluster the results folder must be on a
filesystem that honours flock across nodes (NFSv4, Lustre and GPFS do).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..io import DamagedFile, atomic_write_json, read_json, sha256_file, to_jsonable
from ..records.resume import ResumeRefused, diff

LEDGER_FILE = "recipe-state.json"
LEDGER_FORMAT = 1


@contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if absent) for the duration of the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def outputs_sha256(report: str | os.PathLike, outputs) -> dict[str, str]:
    """{path: sha256} of what a finished cell leaves beside its report: its declared outputs (maps) and the files
    the report lists beside itself (`files`: rows, figures). A resume checks them all (`Ledger.check`)."""
    paths = [Path(o) for o in outputs]
    try:
        listed = read_json(report).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    paths += [Path(report).with_name(str(n)) for n in (listed if isinstance(listed, dict) else {})]
    return {str(p): sha256_file(p) for p in paths if p.is_file()}


def entry_of(cell) -> dict[str, Any]:
    """The ledger fields a cell (kvlingo.stages.cells.Cell) is recorded with when it starts."""
    return {
        "stage": cell.stage,
        "key": cell.key,
        "flags": cell.flags,
        "extra": list(cell.extra),
        "inputs": cell.inputs,
        "report": str(cell.report),
        "outputs": list(cell.outputs),
    }


class Ledger:
    """recipe-state.json: the recipe's settings and one entry per cell, changed under a file lock."""

    def __init__(self, path: str | os.PathLike, config: dict[str, Any], resume: bool, reuse: bool = False):
        self.path = Path(path)
        self.resume = resume
        config = to_jsonable(config)
        with file_lock(self.lock_path):
            old = None
            if reuse and not resume:
                old = self._finished_cells(config)
            elif resume and self.path.is_file():
                try:
                    old = read_json(self.path)
                except DamagedFile as e:
                    raise ResumeRefused(f"{e.problem}: move it away and start a fresh recipe (drop --resume)") from None
                if not isinstance(old, dict) or old.get("format") != LEDGER_FORMAT:
                    found = old.get("format") if isinstance(old, dict) else type(old).__name__
                    raise ResumeRefused(
                        f"{self.path} has ledger format {found}, not {LEDGER_FORMAT}; "
                        "start a fresh recipe (drop --resume) or use another --run"
                    )
                cells = old.get("cells")
                bad = (
                    "cells"
                    if not isinstance(cells, dict)
                    else next(
                        (
                            f"cells.{n}"
                            for n, e in cells.items()
                            if not isinstance(e, dict) or not {"key", "status"} <= set(e)
                        ),
                        None,
                    )
                )
                if bad is not None:
                    raise ResumeRefused(
                        f"{self.path}: {bad} is not a ledger entry (edited by hand?); move the file "
                        "away and start a fresh recipe (drop --resume), or use another --run"
                    )
                changed = diff(old.get("config"), config)
                if changed:
                    raise ResumeRefused(
                        "refusing to resume: settings changed: "
                        + "; ".join(changed)
                        + f" (recorded in {self.path}); re-run with the original settings, "
                        "drop --resume to start over, or use another --run"
                    )
            self.state = old or {"format": LEDGER_FORMAT, "config": config, "created_unix": time.time(), "cells": {}}
            self.state.setdefault("invocations", []).append({"started_unix": time.time(), "resume": resume})
            atomic_write_json(self.path, self.state)

    def _finished_cells(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The ledger on disk with its finished cells only, when it is intact and was made under `config`;
        else None (a fresh ledger)."""
        try:
            old = read_json(self.path) if self.path.is_file() else None
        except DamagedFile:
            return None
        if (
            not isinstance(old, dict)
            or old.get("format") != LEDGER_FORMAT
            or diff(old.get("config"), config)
            or not isinstance(old.get("cells"), dict)
        ):
            return None
        cells = {
            n: e
            for n, e in old["cells"].items()
            if isinstance(e, dict) and e.get("status") == "done" and {"key", "report"} <= set(e)
        }
        return {**old, "cells": cells}

    @classmethod
    def attach(cls, path: str | os.PathLike) -> Ledger:
        """The ledger a running recipe keeps, for a cell's job to record itself in (no settings check)."""
        self = cls.__new__(cls)
        self.path, self.resume = Path(path), True
        self.refresh()
        return self

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.state["cells"]

    def refresh(self) -> None:
        """Read what every writer has recorded so far."""
        with file_lock(self.lock_path):
            self.state = read_json(self.path)

    def change(self, name: str, update: Callable[[dict[str, Any] | None], dict[str, Any]]) -> None:
        """Replace cell `name`'s entry with `update(current entry or None)`, as one locked read-change-replace."""
        with file_lock(self.lock_path):
            state = read_json(self.path)
            state["cells"][name] = update(state["cells"].get(name))
            atomic_write_json(self.path, state)
            self.state = state

    # ------------------------------------------------------------------ a cell's life
    def check(self, cell) -> tuple[str, str]:
        """("done" | "run", why). Raises ResumeRefused when the ledger holds the cell under another key."""
        entry = self.cells.get(cell.name)
        if entry is None:
            return "run", "new"
        if entry["key"] != cell.key and not self.resume:
            return "run", "its inputs or settings changed since it finished"
        if entry["key"] != cell.key:
            changed = diff(
                {"flags": entry.get("flags"), "extra": entry.get("extra"), "inputs": entry.get("inputs")},
                {"flags": cell.flags, "extra": list(cell.extra), "inputs": cell.inputs},
            )
            raise ResumeRefused(
                f"refusing to resume: cell {cell.name} was recorded with other inputs or settings: "
                + "; ".join(changed or ["its key differs"])
                + "; restore them, drop --resume to start a fresh recipe, or use another --run"
            )
        if entry["status"] != "done":
            return "run", f"interrupted while {entry['status']}"
        report = Path(cell.report)
        if not report.is_file():
            return "run", f"its report {report} is missing"
        if sha256_file(report) != entry.get("report_sha256"):
            return "run", f"its report {report} changed since the cell finished"
        recorded = entry.get("outputs_sha256")
        if not isinstance(recorded, dict) or not set(map(str, cell.outputs)) <= set(recorded):
            return "run", "the ledger records no hashes of its outputs"
        for path, sha in recorded.items():
            if not Path(path).is_file():
                return "run", f"its output {path} is missing"
            if sha256_file(path) != sha:
                return "run", f"its output {path} changed since the cell finished"
        return "done", "finished with the same key"

    def start(self, name: str, entry: dict[str, Any], where: dict[str, Any] | None = None) -> None:
        """Mark a cell running (one more run when its key is unchanged)."""

        def update(old):
            old = old or {}
            runs = old.get("runs", 0) + 1 if old.get("key") == entry["key"] else 1
            return {
                **entry,
                "status": "running",
                "started_unix": time.time(),
                "runs": runs,
                "where": {"host": socket.gethostname(), "pid": os.getpid(), **(where or {})},
            }

        self.change(name, update)

    def fail(self, name: str, error: str) -> None:
        self.change(name, lambda old: {**old, "status": "failed", "error": error, "failed_unix": time.time()})

    def finish(self, name: str, report: str | os.PathLike, wall_time_s: float) -> None:
        def update(old):
            new = {
                **old,
                "status": "done",
                "report_sha256": sha256_file(report),
                "finished_unix": time.time(),
                "outputs_sha256": outputs_sha256(report, old.get("outputs", [])),
                "wall_time_s": wall_time_s,
            }
            new.pop("error", None)
            return new

        self.change(name, update)
