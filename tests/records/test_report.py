"""The report schema (kvlingo/records/report.py): hashes, tables, and the huge pages a timing ran on."""

from __future__ import annotations

import pytest

from kvlingo import io as report
from kvlingo.records.report import Metric, Report, fmt_pm, fmt_table, huge_pages, read_report


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
