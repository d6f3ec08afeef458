"""Files: atomic writes, JSON and JSONL, and content hashes.

Every file the suite produces goes through `atomic_write_*`: the bytes land in a temp
file in the same folder, are fsynced, and replace the target with `os.replace`. A kill
at any moment leaves either the old file or the new one, never half of either. A kill
can leave the temp file itself behind (`.NAME.*.tmp`); `remove_stale_temps` clears
those on the next run. A full disk or a read-only folder is a `WriteRefused`: one line
naming the folder and the space needed, the temp file removed.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import Refusal

ROOT = Path(__file__).resolve().parent.parent  # the repository root


# --------------------------------------------------------------------------- atomic writes
_UMASK = os.umask(0)
os.umask(_UMASK)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the disk or a quota is full
CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)  # a read-only file system, or no permission


class WriteRefused(Refusal):
    """A write the file system refused: no space left, a read-only or forbidden folder, or a folder where the
    file should be. The temp file is gone and the previous file (if any) untouched."""


def mib(n: int | float) -> str:
    """A byte count in words: bytes, KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} bytes"


def _free(folder: Path) -> int | None:
    try:
        while not folder.exists():
            folder = folder.parent
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_refusal(path: str | os.PathLike, err: OSError, size: int) -> WriteRefused | None:
    """The one-line refusal for an OSError that writing `size` bytes to `path` met, or None for another error."""
    path = Path(path)
    again = "then run the same command again (with --resume where the stage has it, to keep what was saved)"
    if err.errno in NO_ROOM:
        free = _free(path.parent)
        return WriteRefused(
            f"no space left in {path.parent} ({err.strerror}): writing {path.name} needs "
            f"{mib(size)}{f' and {mib(free)} is free' if free is not None else ''}; free at least "
            f"{mib(size)} there, {again}"
        )
    if err.errno == errno.EFBIG:  # a file size limit (ulimit -f), or the file system's largest file
        return WriteRefused(
            f"no room for {path.name} in {path.parent} ({err.strerror}): it needs {mib(size)} more "
            f"than the file size limit allows; raise the limit (ulimit -f) or write elsewhere, {again}"
        )
    if err.errno in CANNOT_WRITE:
        return WriteRefused(
            f"cannot write {path.name} in {path.parent} ({err.strerror}): make the folder writable "
            f"or write elsewhere, {again}"
        )
    if err.errno == errno.EISDIR or path.is_dir():
        return WriteRefused(f"{path} is a folder, not a file: remove it (rmdir {path}), {again}")
    return None


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` (os.write may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`data` in `path`, whole or not at all; a full or read-only disk ends in WriteRefused (one line naming the
    folder and the space needed), leaving no temp file and the previous file as it was."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give them the usual permissions
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        # The previous file (if any) is untouched; only the temp file is dropped.
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        refusal = write_refusal(path, e, len(data)) if isinstance(e, OSError) else None
        if refusal is not None:
            raise refusal from None
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
    """JSON's types from a report's values: a setting with `to_json` (a Refresh: its text) as it writes itself,
    dataclasses field by field, tuples as lists, paths as text, NumPy and torch scalars as numbers."""
    if hasattr(obj, "to_json") and not isinstance(obj, type):
        return obj.to_json()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return obj.item()  # numpy / torch scalars
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2, sort_keys=False, allow_nan=True) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, dumps(obj))


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> Path:
    text = "".join(json.dumps(to_jsonable(r), sort_keys=True) + "\n" for r in rows)
    return atomic_write_text(path, text)


class DamagedFile(Refusal, ValueError):
    """A JSON or JSONL file the suite should be able to read that does not parse (cut short, or edited by
    hand). `problem` names the file and where it breaks; the message adds the usual fix, which a caller
    that knows better can replace."""

    def __init__(self, path, err: ValueError, line: int | None = None):
        if line is not None:
            where = f"line {line}"
        elif isinstance(err, json.JSONDecodeError):
            where = f"line {err.lineno}, column {err.colno}"
        else:
            where = "its text"
        why = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
        self.path, self.problem = Path(path), f"{path} does not parse as JSON at {where} ({why})"
        super().__init__(
            f"{self.problem}: it was cut short or edited; restore it, or remove it and rerun the stage that wrote it"
        )


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in `path`; DamagedFile (a ValueError naming the file) when it does not parse."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise DamagedFile(path, e) from None


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """The rows of a JSONL file (blank lines skipped); DamagedFile naming the file and line when one does not parse."""
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):  # noqa: B007  (n names the damaged line below)
                if line.strip():
                    rows.append(json.loads(line))
        except ValueError as e:
            raise DamagedFile(path, e, n) from None
    return rows


# --------------------------------------------------------------------------- hashes
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-able object in canonical form (sorted keys, no whitespace)."""
    text = json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"))
    return sha256_bytes(text.encode("utf-8"))


def sha256_tree(paths: Iterable[str | os.PathLike], root: str | os.PathLike = ROOT) -> str:
    """One hash over several files, keyed by their path relative to `root`."""
    h = hashlib.sha256()
    for p in sorted(Path(p).resolve() for p in paths):
        h.update(str(p.relative_to(Path(root).resolve())).encode())
        h.update(b"\0")
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def _is_temp(path: Path) -> bool:
    """A temp file of `atomic_write_bytes` (`.NAME.*.tmp`)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def other_files(folder: str | os.PathLike, ours: Iterable[str], folders: Iterable[str] = ()) -> list[str]:
    """Sorted names in `folder` besides `ours` (files) and `folders` (folders) and atomic-write temp files: what a
    stage that replaces the folder's contents would destroy. An entry named like one of ours but of the other kind
    (a folder called manifest.json) is not ours."""
    ours, folders = set(ours), set(folders)
    out = []
    for p in Path(folder).iterdir():
        if _is_temp(p) or (p.name in ours and p.is_file() and not p.is_symlink()):
            continue
        if p.name in folders and p.is_dir() and not p.is_symlink():
            continue
        out.append(p.name + ("/" if p.is_dir() else ""))
    return sorted(out)


def not_ours(
    folder: str | os.PathLike,
    ours: Iterable[str],
    marker: str,
    key: str,
    value: Any,
    damaged_is_ours: bool = True,
    folders: Iterable[str] = (),
) -> str | None:
    """What a stage that replaces the contents of the folder `folder` would destroy, as a short listing, or
    None when the folder is the stage's own (or empty): entries besides `ours` (files) and `folders` and
    atomic-write temp files, or else a `marker` file (the stage's manifest or config) whose `key` is not
    `value`. A marker that does not parse counts as the stage's own, cut short, unless `damaged_is_ours` is
    False."""
    other = other_files(folder, ours, folders)
    path = Path(folder) / marker
    if not other and path.is_file():
        try:
            got = read_json(path)
            got = got.get(key) if isinstance(got, dict) else None
        except DamagedFile:
            got = value if damaged_is_ours else "unreadable"
        other = [] if got == value else [f"{marker} with {key} {got!r}"]
    return ", ".join(other[:5]) + (", …" if len(other) > 5 else "") if other else None


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete the temp files a killed `atomic_write_bytes` left in `folder` (not recursive)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.is_file() and _is_temp(p)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
