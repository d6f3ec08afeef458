"""Atomic writes, hashes, provenance and the one report schema every stage writes.

Every file the suite produces goes through `atomic_write_*`: the bytes land in a temp
file in the same folder, are fsynced, and replace the target with `os.replace`. A kill
at any moment leaves either the old file or the new one, never half of either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- atomic writes
_UMASK = os.umask(0)
os.umask(_UMASK)

def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give them the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # The previous file (if any) is untouched; only the temp file is dropped.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
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


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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


def code_hash(*scripts: str | os.PathLike) -> str:
    """Hash of the kvlingo library plus the given stage scripts: what `--resume` compares.

    Relative script names are taken from the repository root, not the working directory.
    """
    files = sorted((ROOT / "kvlingo").rglob("*.py")) + [ROOT / s for s in scripts]
    return sha256_tree(files)


# --------------------------------------------------------------------------- provenance
def git_state(root: str | os.PathLike = ROOT) -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


def environment(device: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        **git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype": dtype,
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    elif device == "cpu":
        env["cpu_threads"] = torch.get_num_threads()
    return env


# --------------------------------------------------------------------------- the schema
def make_report(
    stage: str,
    *,
    config: Any,
    inputs: dict[str, Any],
    results: Any,
    n_samples: Any,
    seeds: Any = None,
    wall_time_s: float,
    device: str | None = None,
    dtype: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The common report. `inputs` maps a name to a sha256 (or a dict holding one)."""
    report = {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "created_unix": time.time(),
        "config": to_jsonable(config),
        "config_sha256": sha256_json(config),
        "inputs": to_jsonable(inputs),
        "env": environment(device, dtype),
        "seeds": to_jsonable(seeds),
        "n_samples": to_jsonable(n_samples),
        "wall_time_s": wall_time_s,
        "results": to_jsonable(results),
    }
    report.update(to_jsonable(extra))
    return report


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (then closed), ready for `atomic_write_bytes`."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def fmt_table(headers: list[str], rows: list[list[Any]], floatfmt: str = ".4g") -> str:
    """A small GitHub-markdown table (also readable on stdout)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in body)]) + "\n"
