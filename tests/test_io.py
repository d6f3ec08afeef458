"""Atomic writes (kvlingo/io.py) survive interruption, a full or read-only disk and SIGKILL, and get ordinary
permissions."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlingo import io as report

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_interrupted_write_leaves_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    report.atomic_write_json(target, {"v": 1})

    def boom(fd):
        raise KeyboardInterrupt  # e.g. Ctrl-C between write and rename

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        report.atomic_write_json(target, {"v": 2})
    assert report.read_json(target) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # the temp file was removed


def test_sigkill_during_write_leaves_previous_file(tmp_path):
    target = tmp_path / "big.bin"
    report.atomic_write_bytes(target, b"old")
    root = Path(__file__).resolve().parents[1]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r})\n"
        "from kvlingo.io import atomic_write_bytes\n"
        "print('go', flush=True)\n"
        f"while True: atomic_write_bytes({str(target)!r}, b'x' * (256 << 20))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"go"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = target.read_bytes()
    assert data == b"old" or data == b"x" * (256 << 20)  # one whole version, never a torn one


def test_atomic_files_get_ordinary_permissions(tmp_path):
    """mkstemp creates 0600 files; a report must get the permissions any other new file would."""
    p = report.atomic_write_text(tmp_path / "r.json", "{}")
    assert (p.stat().st_mode & 0o777) == (0o666 & ~report._UMASK)


def test_the_writers_leave_nothing_half_written_on_a_full_or_read_only_disk(tmp_path, monkeypatch):
    """The two writers every file goes through: an atomic write refused by the file system keeps the old file and
    leaves no temp file; a row the disk takes only part of is cut off, so the rows file never ends torn."""
    from kvlingo.eval.itemrows import ItemRows, read_rows
    from kvlingo.io import WriteRefused, atomic_write_text

    target = tmp_path / "report.json"
    target.write_text("old")
    real_open, real_write = os.open, os.write

    def read_only(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        with pytest.raises(WriteRefused, match=f"cannot write report.json in {tmp_path} \\(Read-only file system\\)"):
            atomic_write_text(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]

    log = ItemRows(tmp_path / "x.rows.jsonl", {"settings": 1}, resume=False)
    log.append("a", {"answer": "first"})
    whole = log.path.read_bytes()

    def half(fd, data):  # the disk takes half of the row, then is full
        if os.readlink(f"/proc/self/fd/{fd}") == str(log.path):
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", half)
        with pytest.raises(
            WriteRefused, match=f"no space left in {tmp_path} \\(No space left on device\\): writing x.rows.jsonl needs"
        ):
            log.append("b", {"answer": "second"})
    assert log.path.read_bytes() == whole  # no torn line
    assert [r["key"] for r in read_rows(log.path)[1]] == ["a"]
