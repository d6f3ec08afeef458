"""Distillation checkpoints: written atomically, marked complete last, verified on load.

`ckpt_<update>.pt` (a torch.save buffer, written atomically), then `DONE_<update>` holding
its sha256 in `sha256sum` format. Only a checkpoint with a DONE marker and a matching hash
counts; a damaged one is skipped with a warning and the previous complete one is used.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import Refusal
from ..io import atomic_write_bytes, atomic_write_text, sha256_bytes

CHECKPOINT_FORMAT = 2


class CheckpointError(Refusal, ValueError):
    """No intact checkpoint to resume from."""


CKPT_RE = re.compile(r"^DONE_(\d+)$")


def checkpoint_paths(folder: str | Path, update: int) -> tuple[Path, Path]:
    folder = Path(folder)
    return folder / f"ckpt_{update:06d}.pt", folder / f"DONE_{update:06d}"


def save_checkpoint(folder: str | Path, update: int, state: dict[str, Any]) -> Path:
    """Write the checkpoint atomically, then its DONE marker (sha256) last."""
    path, marker = checkpoint_paths(folder, update)
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "update": update, **state}, buf)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    atomic_write_text(marker, f"{sha256_bytes(data)}  {path.name}\n")
    return path


def load_checkpoint(path: str | Path, marker: str | Path) -> dict[str, Any]:
    """Load one checkpoint after checking it against its marker; CheckpointError if damaged."""
    path, marker = Path(path), Path(marker)
    try:
        want = marker.read_text().split()[0]
        data = path.read_bytes()
    except (OSError, IndexError) as e:
        raise CheckpointError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from e
    got = sha256_bytes(data)
    if got != want:
        raise CheckpointError(
            f"{path.name}: sha256 {got[:12]}… does not match its DONE marker {want[:12]}… (truncated or corrupted)"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — any unpickling failure means a damaged file
        raise CheckpointError(f"{path.name}: does not load ({type(e).__name__}: {e})") from e
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path.name}: checkpoint format {state.get('format')} is not {CHECKPOINT_FORMAT}")
    return state


def complete_checkpoints(folder: str | Path) -> list[tuple[int, Path, Path]]:
    """(update, checkpoint, marker) for every DONE marker, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = CKPT_RE.match(p.name)
        if m:
            update = int(m.group(1))
            found.append((update, checkpoint_paths(folder, update)[0], p))
    return sorted(found, reverse=True)


def newest_checkpoint(folder: str | Path, warn: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The newest intact checkpoint. A damaged one is skipped with a warning; None if there are none at all.

    Raises CheckpointError when checkpoints exist but none is intact.
    """
    candidates = complete_checkpoints(folder)
    problems = []
    for update, path, marker in candidates:
        try:
            state = load_checkpoint(path, marker)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"warning: skipping damaged checkpoint {e}")
            continue
        if problems:
            warn(f"warning: resuming from the previous complete checkpoint, {path.name} (update {update})")
        return state
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {folder}: " + "; ".join(problems) + ". Start a fresh run (drop --resume)."
        )
    return None


TEMP_RE = re.compile(r"^\.(ckpt_\d+\.pt|DONE_\d+)\..*\.tmp$")  # atomic_write_bytes' temp files, left by a kill
FILE_RE = re.compile(r"^(ckpt_\d+\.pt|DONE_\d+)$")


def clear_checkpoints(folder: str | Path, temp_only: bool = False) -> int:
    """Remove this module's checkpoint files (a fresh run must not resume into an old one's), or only temp files."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    n = 0
    for p in folder.iterdir():
        if TEMP_RE.match(p.name) or (not temp_only and FILE_RE.match(p.name)):
            p.unlink()
            n += 1
    return n
