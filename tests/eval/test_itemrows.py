"""The checksummed item rows log (kvlingo/eval/itemrows.py): a torn tail, a damaged line, changed settings or code,
and rows reused from a sibling log by key."""

from __future__ import annotations

import pytest

from kvlingo.eval.itemrows import ItemRows, RowsError, read_rows
from kvlingo.records.resume import ResumeRefused


def test_rows_torn_tail_is_dropped_and_appending_continues(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    log = ItemRows(path, {"cap": 4}, resume=False)
    for k in ("a", "b"):
        log.append(k, {"v": k})
    intact = path.read_bytes()
    with open(path, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"kind": "item", "key": "c", "v": "half')
    header, rows, _ = read_rows(path)
    assert [r["key"] for r in rows] == ["a", "b"]
    log2 = ItemRows(path, {"cap": 4}, resume=True)
    assert log2.dropped_torn_line and path.read_bytes() == intact and "b" in log2 and "c" not in log2
    log2.append("c", {"v": "c"})
    assert [r["key"] for r in read_rows(path)[1]] == ["a", "b", "c"]
    # without --resume the log starts over
    assert ItemRows(path, {"cap": 4}, resume=False).rows == {} and read_rows(path)[1] == []


def test_rows_damaged_line_before_the_end_is_refused(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    log = ItemRows(path, {"cap": 4}, resume=False)
    for k in ("a", "b"):
        log.append(k, {"v": 1})
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"v": 1', '"v": 2')  # an edit the checksum catches
    path.write_text("".join(lines))
    with pytest.raises(RowsError, match="line 2"):
        ItemRows(path, {"cap": 4}, resume=True)


def test_rows_resume_refuses_changed_settings_by_name(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    ItemRows(path, {"cap": 4, "models": {"target": "a"}, "dtype": "float32"}, resume=False)
    with pytest.raises(ResumeRefused) as e:
        ItemRows(path, {"cap": 8, "models": {"target": "b"}, "dtype": "float32"}, resume=True)
    assert "cap: 4 → 8" in str(e.value) and "models.target: a → b" in str(e.value) and "dtype" not in str(e.value)


def test_rows_of_other_code_are_never_reused(tmp_path):
    donor = ItemRows(tmp_path / "native.rows.jsonl", {"code": "old"}, resume=False)
    donor.append("k1", {"v": 7})
    assert ItemRows(tmp_path / "a.rows.jsonl", {"code": "new"}, resume=False, donors=[donor.path]).get("k1") is None
    assert ItemRows(tmp_path / "b.rows.jsonl", {"code": "old"}, resume=False, donors=[donor.path]).get("k1")["v"] == 7


def test_rows_from_a_sibling_log_are_reused_by_key(tmp_path):
    donor = ItemRows(tmp_path / "native.rows.jsonl", {"m": 1}, resume=False)
    donor.append("k1", {"v": 7})
    log = ItemRows(tmp_path / "translated.rows.jsonl", {"m": 2}, resume=False, donors=[donor.path])
    row = log.get("k1")
    assert row["v"] == 7 and row["reused_from"] == "native.rows.jsonl" and log.get("k2") is None
    assert [r["key"] for r in read_rows(log.path)[1]] == ["k1"]  # copied, so the log stands on its own
