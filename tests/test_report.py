"""Atomic writes survive interruption; hashes and the report schema."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlingo import io as report
from kvlingo.records.report import Metric, Report, fmt_pm, fmt_table, huge_pages, read_report


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
    root = Path(__file__).resolve().parent.parent
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


def test_hashes_and_schema(tmp_path):
    p = report.atomic_write_text(tmp_path / "a.txt", "hello")
    assert report.sha256_file(p) == report.sha256_bytes(b"hello")
    assert report.sha256_json({"a": 1, "b": 2}) == report.sha256_json({"b": 2, "a": 1})
    r = Report(
        "unit",
        config={"x": 1},
        inputs={"a": report.sha256_file(p)},
        results={"m": 0.5},
        n_samples={"n": 3},
        seeds=[0],
        wall_time_s=0.1,
        device="cpu",
        dtype="float32",
        metrics=(Metric("m", False, "a test metric"),),
    ).write(tmp_path / "unit.json")
    for key in (
        "schema_version",
        "stage",
        "config",
        "inputs",
        "env",
        "seeds",
        "results",
        "n_samples",
        "wall_time_s",
        "metrics",
        "files",
        "resume_key",
    ):
        assert key in r
    assert {
        "git_sha",
        "git_dirty",
        "python",
        "torch",
        "transformers",
        "device",
        "dtype",
        "threads",
        "huge_pages",
    } <= set(r["env"])
    assert r["metrics"] == {"m": {"higher_is_better": False, "definition": "a test metric"}}
    assert read_report(tmp_path / "unit.json", "unit")["results"] == {"m": 0.5}
    with pytest.raises(ValueError, match="not 'train'"):
        read_report(tmp_path / "unit.json", "train")


def test_fmt_table_and_pm():
    t = fmt_table(["row", "kl"], [["native", 0.0], ["control", 1.23456]])
    assert "| control | 1.235 |" in t and t.count("\n") == 4
    assert fmt_pm({"mean": 0.5, "se": 0.01, "n": 9}, 100.0, ".1f") == "50.0 ± 1.0"
    assert fmt_pm({"mean": 0.5, "se": float("nan"), "n": 1}) == "0.5"
    assert fmt_pm(None) == "—" and fmt_pm({"mean": 0.0, "se": 0.0, "n": 0}, missing="-") == "-"


def test_atomic_files_get_ordinary_permissions(tmp_path):
    """mkstemp creates 0600 files; a report must get the permissions any other new file would."""
    p = report.atomic_write_text(tmp_path / "r.json", "{}")
    assert (p.stat().st_mode & 0o777) == (0o666 & ~report._UMASK)


def test_huge_pages_reads_the_allocator_request_and_the_kernel_mode(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    for text, mode in (
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
    ):
        setting.write_text(text)
        assert huge_pages(setting)["kernel"] == mode
    setting.write_text("garbled\n")
    assert huge_pages(setting)["kernel"] is None
    assert huge_pages(tmp_path / "absent")["kernel"] is None  # not Linux, or no THP support
    for value, on in (("1", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", value)
        assert huge_pages(setting)["torch_allocator"] is on
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert huge_pages(setting)["torch_allocator"] is False
