"""Item-level rows of an evaluation: an append-only, checksummed log that a killed run resumes from.

One JSON object per line. The first line is a header holding the run's settings; every
other line is one finished item (one answer of one path), keyed by the sha256 of
everything that produced it (the *input hash*: prompt, model identities, translator maps,
generation settings). Each line carries `_sha256`, the hash of its own canonical content.

Why append-only with per-line checksums rather than rewriting the file per row: a row is
one `write` plus `fsync`, so the cost stays linear in the number of items. A write the
disk refuses (full, read-only) is cut back to the previous end and refused in one line
(`io.WriteRefused`), so it leaves no partial line. A kill during that write can leave at
most a torn *last* line; opening the log for a resume drops that line (saying so) by
rewriting the intact lines atomically (`io.atomic_write_text`) before anything is
appended, so a torn line can never end up in the middle. A damaged line that is not the
last one cannot come from a kill and is refused.

Resume rules:
- a fresh run (resume=False) replaces any old log with a new header;
- a resume keeps the log only when its header's identity (settings, inputs, pair and the
  code hash of the stage: kvlingo.records.resume) equals the current one, and otherwise
  refuses, naming every leaf that changed, so rows of old code never mix with new ones;
- an item is skipped when a row with its input hash exists (here, or in a sibling log
  passed as a donor, whose matching rows are copied over with `reused_from`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import Refusal
from ..io import atomic_write_text, sha256_json, to_jsonable, write_all, write_refusal
from ..records.resume import check as check_identity

CHECKSUM = "_sha256"


class RowsError(Refusal, ValueError):
    """A rows file that cannot be trusted (damaged before its last line, or no header)."""


def item_key(**parts: Any) -> str:
    """The input hash of one item: sha256 over canonical JSON of everything that produced it."""
    return sha256_json(parts)


def _line(obj: dict[str, Any]) -> str:
    body = to_jsonable({k: v for k, v in obj.items() if k != CHECKSUM})
    body[CHECKSUM] = sha256_json(body)
    return json.dumps(body, sort_keys=True) + "\n"


def _parse(line: str) -> dict[str, Any] | None:
    """The row on an intact line, or None for a torn or altered one."""
    if not line.endswith("\n"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or CHECKSUM not in obj:
        return None
    claimed = obj.pop(CHECKSUM)
    return obj if claimed == sha256_json(obj) else None


def read_rows(path: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(header, item rows, intact byte length) of a rows file, dropping a torn last line.

    Raises RowsError for a file with no valid header or with a damaged line before the last.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    rows: list[dict[str, Any]] = []
    good_bytes = 0
    for i, line in enumerate(lines):
        row = _parse(line)
        if row is None:
            if i == len(lines) - 1:
                break  # a torn tail from a killed write: dropped
            raise RowsError(
                f"{path}: line {i + 1} is damaged (bad JSON or checksum) and is not the last line; "
                "the file was edited or corrupted. Move it away and re-run without --resume."
            )
        rows.append(row)
        good_bytes += len(line.encode("utf-8"))
    if not rows or rows[0].get("kind") != "header":
        raise RowsError(
            f"{path} has no header line; it is not a rows file of this suite. Move it away and re-run without --resume."
        )
    return rows[0], rows[1:], good_bytes


class ItemRows:
    """The rows log of one report. `settings` is the stage's resume identity: what a resume must find unchanged."""

    def __init__(
        self,
        path: str | os.PathLike,
        settings: dict[str, Any],
        resume: bool,
        donors: Iterable[str | os.PathLike] = (),
        ignore: Iterable[str] = (),
    ):
        self.path = Path(path)
        self.settings = to_jsonable(settings)
        self.session = uuid.uuid4().hex[:12]  # marks the rows this process produced
        self.dropped_torn_line = False
        rows: list[dict[str, Any]] = []
        if resume and self.path.exists():
            header, rows, good_bytes = read_rows(self.path)
            check_identity(
                header.get("settings"),
                self.settings,
                str(self.path),
                "re-run with the original settings, code and inputs, or without --resume to start over "
                "(or choose another --run)",
                ignore=ignore,
            )
            if good_bytes != self.path.stat().st_size:
                # Drop the torn tail before appending, so it can never sit between two rows.
                self.dropped_torn_line = True
                print(
                    f"note: {self.path}: its last line was cut short (the run was killed while writing it); "
                    "dropped, and that item is answered again",
                    file=sys.stderr,
                )
                atomic_write_text(self.path, "".join(_line(r) for r in [header, *rows]))
        else:
            header = {
                "kind": "header",
                "settings": self.settings,
                "settings_sha256": sha256_json(self.settings),
                "created_unix": time.time(),
            }
            atomic_write_text(self.path, _line(header))
        self.header = header
        self.rows: dict[str, dict[str, Any]] = {r["key"]: r for r in rows if r.get("kind") == "item"}
        self._donor_rows: dict[str, tuple[dict[str, Any], str]] = {}
        for d in donors:
            d = Path(d)
            if d.resolve() == self.path.resolve() or not d.exists():
                continue
            try:
                dheader, drows, _ = read_rows(d)
            except RowsError:
                continue  # a damaged sibling is simply not reused
            if not isinstance(dheader.get("settings"), dict) or dheader["settings"].get("code") != self.settings.get(
                "code"
            ):
                continue  # rows made by other code are never reused
            for r in drows:
                if r.get("kind") == "item":
                    self._donor_rows.setdefault(r["key"], (r, d.name))

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict[str, Any] | None:
        """The finished row for `key`: from this log, else copied over from a donor log, else None."""
        if key in self.rows:
            return self.rows[key]
        if key in self._donor_rows:
            row, name = self._donor_rows[key]
            copied = {k: v for k, v in row.items() if k != CHECKSUM}
            copied["reused_from"] = name
            return self._write(copied)
        return None

    def append(self, key: str, row: dict[str, Any]) -> dict[str, Any]:
        """Record a finished item under its input hash; durable when this returns."""
        if key in self.rows:
            raise ValueError(f"item {key[:12]} is already in {self.path}")
        full = {"kind": "item", "key": key, "session": self.session, "created_unix": time.time(), **row}
        return self._write(full)

    def _write(self, row: dict[str, Any]) -> dict[str, Any]:
        line = _line(row)
        data = line.encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise write_refusal(self.path, e, len(data)) or e from None
        try:
            end = os.fstat(fd).st_size
            try:
                write_all(fd, data)
                os.fsync(fd)
            except OSError as e:  # a full disk may take part of the line: cut it off, so no torn line is left
                os.ftruncate(fd, end)
                raise write_refusal(self.path, e, len(data)) or e from None
        finally:
            os.close(fd)
        stored = json.loads(line)
        stored.pop(CHECKSUM)
        self.rows[stored["key"]] = stored
        return stored
