"""A stage run from Python as a user runs it: its one-line refusal (exit 2, no traceback), the files it leaves,
and a disk that fills up under it."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root but the stages' empty run locks (`.STAGE.lock`, not outputs)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (p.name.endswith(".lock") and not p.stat().st_size)
    }


# A setting a resume may change (RESUME_SAFE): the finished training is then not up to date, so a resume of it gets
# as far as its checks (the run's lock, the checkpoints) instead of reporting the finished run.
NOT_UP_TO_DATE = ("--checkpoint-every", "1")


def refused(fn, argv, capsys) -> str:
    """The one line a refused stage prints (exit 2, no traceback); progress bars aside."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (e.value.code, err)
    lines = [line for line in err.split("\n") if line and "\r" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    refused.out = out
    return lines[0]


def no_models(monkeypatch):
    """Any model load fails the test: a refusal must come first."""
    import kvlingo.inputs.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))


def moved(benchmarked_run, tmp_path: Path) -> list[str]:
    """The finished run's training command with its --artifacts and --results roots under tmp_path."""
    roots = {str(benchmarked_run["root"] / name): str(tmp_path / name) for name in ("artifacts", "results")}
    return [roots.get(a, a) for a in benchmarked_run["train"]]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def full_disk(monkeypatch, folder: Path, code: int = errno.ENOSPC) -> None:
    """Writes of files under `folder` fail as on a full disk: at fsync, where a full disk (or quota) often
    shows first, after the data went to the page cache."""
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
