"""Every figure the README quotes has a report behind it.

A measured passage of README.md sits between `<!-- figures: FILE ... -->` and `<!-- end figures -->`, naming the
reports it quotes: copies, under docs/reports/, of the sealed JSON reports a run wrote under results/ (each still
carries its content hash, so an edited copy is found). Every number in the passage must be one of the reports'
numbers at the precision printed: as recorded, as a percentage (×100), or as a thousands-separated count. A
figure typed by hand, or left behind when the reports were replaced, fails here, and so does a number with no
report at all. Dates (YYYY-MM-DD) and commit hashes are provenance, not figures, and are skipped.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvlingo.records.report import seal_problem

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OPEN = re.compile(r"<!-- figures: ([^>]*?) -->")
CLOSE = "<!-- end figures -->"
NUMBER = re.compile(r"(?<![\w.\-/])[-−]?\d[\d,]*(?:\.\d+)?(?![\w])")
PROVENANCE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b[0-9a-f]{7,40}\b|`[^`]*`")


def passages(text: str) -> list[tuple[list[str], str]]:
    out = []
    for m in OPEN.finditer(text):
        end = text.find(CLOSE, m.end())
        assert end > 0, f"README.md: the figures passage opened at offset {m.start()} is never closed ({CLOSE})"
        out.append((m.group(1).split(), text[m.end() : end]))
    return out


HASHES = re.compile(r"sha256|git_sha|resume_key|created_unix")  # fields that are provenance, not figures


def leaves(value) -> list[float]:
    """Every figure in a report: its numbers, and the numbers in its text cells (tables keep some figures as text,
    "72.3 ± 2.8 (n=256)"); hashes, commits and timestamps are not figures."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, dict):
        return [x for k, v in value.items() if not HASHES.search(str(k)) for x in leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in leaves(v)]
    if isinstance(value, str) and not re.fullmatch(r"[0-9a-f]{12,}", value) and len(value) < 200:
        return [float(s) for s in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w])", value)]
    return []


def printed(token: str) -> tuple[float, int]:
    text = token.replace("−", "-").replace(",", "")
    return float(text), len(text.split(".")[1]) if "." in text else 0


def backed(token: str, values: list[float]) -> bool:
    x, places = printed(token)
    tol = 0.5 * 10**-places + 1e-12
    return any(abs(v - x) <= tol or abs(100 * v - x) <= tol or abs(-v - x) <= tol for v in values)


def test_readme_has_measured_passages():
    found = passages(README.read_text())
    assert found, "README.md quotes no report (no <!-- figures: ... --> passage)"
    for files, _ in found:
        assert files, "a figures passage names no report"


@pytest.mark.parametrize("index", range(len(passages(README.read_text()))))
def test_every_number_in_a_measured_passage_is_in_its_reports(index):
    files, body = passages(README.read_text())[index]
    values = []
    for name in files:
        path = ROOT / name
        assert path.is_file() and path.parent == ROOT / "docs" / "reports", f"{name}: not a report under docs/reports"
        report = json.loads(path.read_text())
        problem = seal_problem(report)
        assert problem is None, f"{name}: {problem}"
        values += leaves(report)
    text = PROVENANCE.sub(" ", re.sub(r"<!--.*?-->", " ", body, flags=re.S))
    missing = [t for t in NUMBER.findall(text) if not backed(t, values)]
    assert not missing, f"README.md figures with no report behind them in {files}: {missing}"


def test_the_check_catches_a_number_no_report_holds():
    values = leaves({"a": {"kept": 0.934, "n": 256}, "b": "72.3 ± 2.8"})
    assert backed("93.4", values) and backed("0.93", values) and backed("256", values) and backed("72.3", values)
    assert not backed("93.5", values) and not backed("257", values) and not backed("2.9", values)
    assert NUMBER.findall(PROVENANCE.sub(" ", "on 2026-12-05 (commit 4335f15), n = 1,024: 3.5%")) == ["1,024", "3.5"]
