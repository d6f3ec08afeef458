"""`python -m kvlingo.train.torchrun`: torchrun's launcher, but a rank that dies says so in one line, with how to
resume, in place of torchrun's error summary and traceback."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from kvlingo.train import torchrun


def failure(rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")


@pytest.mark.parametrize(
    "codes, status, said",
    [
        ({0: -9, 1: -15}, 1, [0]),  # rank 0 SIGKILLed; rank 1 stopped by the launcher (SIGTERM: not said)
        ({0: 1, 1: -15}, 1, []),  # rank 0 failed itself (its own one line says why): its status
        ({0: 2}, 2, []),
        ({0: -9, 1: -6}, 1, [0, 1]),
    ],
)
def test_a_failed_rank_is_one_line_and_the_job_status(monkeypatch, capsys, codes, status, said):
    def run(_args):
        raise ChildFailedError("train_translator.py", {r: failure(r, c) for r, c in codes.items()})

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert torchrun.main(["--standalone", "--nproc-per-node", str(len(codes)), "train_translator.py"]) == status
    err = capsys.readouterr().err
    lines = err.strip().splitlines() if err.strip() else []
    assert len(lines) == len(said), err
    for rank, line in zip(said, lines):
        assert line.startswith(f"torchrun: rank {rank} was killed (SIG") and "--resume" in line
    assert "Traceback" not in err and "ChildFailedError" not in err


def test_a_clean_run_returns_zero(monkeypatch):
    monkeypatch.setattr("torch.distributed.run.run", lambda _args: None)
    assert torchrun.main(["--standalone", "--nproc-per-node", "1", "train_translator.py"]) == 0


def test_a_collective_that_loses_its_peer_says_so_in_one_line(monkeypatch):
    """gloo's "Connection reset by peer" in a surviving rank's all-reduce: RankLost, one line, how to resume."""
    import torch

    from kvlingo.train import distributed

    def reset(_t):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer\nmore")

    monkeypatch.setattr(distributed.dist, "all_reduce", reset)
    world = distributed.World(rank=1, size=2)
    with pytest.raises(distributed.RankLost) as e:
        world.sum_(torch.zeros(3))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 1: another rank of this 2-rank job stopped (Connection reset")
    assert "--resume" in msg and e.value.status == 1
