"""Checkpoints (kvlingo/train/checkpoints.py): damaged ones are detected."""

from __future__ import annotations

import pytest
import torch

from kvlingo.train import checkpoints as C

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_damaged_checkpoints_are_detected(tmp_path):
    folder = tmp_path / "ck"
    for u in (1, 2, 3):
        C.save_checkpoint(folder, u, {"x": torch.full((100,), float(u))})
    C.save_checkpoint(folder, 4, {"x": torch.zeros(3)})
    C.checkpoint_paths(folder, 4)[1].unlink()  # killed between the file and its marker: incomplete, not a candidate
    path3 = C.checkpoint_paths(folder, 3)[0]
    path3.write_bytes(path3.read_bytes()[:-50])  # truncated
    warnings: list[str] = []
    state = C.newest_checkpoint(folder, warn=warnings.append)
    assert state["update"] == 2 and torch.equal(state["x"], torch.full((100,), 2.0))
    assert "ckpt_000003.pt" in warnings[0] and "does not match its DONE marker" in warnings[0]
    for u in (1, 2):  # flip one byte: same length, different hash
        p = C.checkpoint_paths(folder, u)[0]
        blob = bytearray(p.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        p.write_bytes(bytes(blob))
    with pytest.raises(C.CheckpointError, match="no intact checkpoint"):
        C.newest_checkpoint(folder, warn=warnings.append)
    assert C.newest_checkpoint(tmp_path / "none") is None
    # temp files a kill leaves behind go on resume; checkpoints go only for a fresh run
    (folder / ".ckpt_000005.pt.abc123.tmp").write_bytes(b"half")
    (folder / "notes.txt").write_text("keep")
    assert C.clear_checkpoints(folder, temp_only=True) == 1 and (folder / "ckpt_000001.pt").exists()
    assert C.clear_checkpoints(folder) == 7 and sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
