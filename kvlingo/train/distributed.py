"""Data-parallel training under torchrun: ranks, the process group, and the few collectives training needs.

`torchrun --nproc-per-node N train_translator.py -- FLAGS` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE in their environment. The `--` keeps torchrun's parser off the stage's flags: it matches
every option-like argument against abbreviations of its own options, and `--run` abbreviates its
`--run-path`; the stage drops that `--` (`script_args`). Without them (or with WORLD_SIZE 1) training is one process and
every method here is a no-op. NCCL joins CUDA ranks (rank r on cuda:LOCAL_RANK), gloo joins CPU ranks.

The split is exact, not an approximation: the global batch and the data order are a single
process's (`rows.data_order`), each rank runs every N-th conversation of them (`share`), and what
the ranks computed is summed:
- distillation: each conversation's loss is divided by the global batch size before its backward,
  so the ranks' summed gradients are the single-process gradient (up to FP32 summation order);
  clipping and AdamW then run on identical gradients, and every rank's translator stays the same;
- the closed form: the FP64 normal equations (A, B, token count) are summed before the solve;
- validation: each rank's sum of conversation KLs, summed in FP64.
Rank 0 alone prints, draws progress bars and writes files; the other ranks wait at barriers.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import Failure, RunRefused

T = TypeVar("T")


class WorldRefused(RunRefused):
    """A distributed launch this training cannot run as asked (refused before any work)."""


class RankLost(Failure):
    """Another rank of the job stopped (killed, out of memory, a failed node): a collective could not complete."""


def collective(fn):
    """A collective whose failure (gloo's "Connection reset by peer", NCCL's errors) says, in one line, that a
    rank of the job is gone and how to resume, instead of a backend traceback."""

    def run(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0])[:120]
            raise RankLost(
                f"rank {self.rank}: another rank of this {self.size}-rank job stopped ({first}); every checkpoint "
                "is whole: run the same command again with --resume (make train TRAIN_ARGS=--resume NPROC=...)"
            ) from None

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


@dataclass(frozen=True)
class World:
    rank: int = 0  # this process's rank
    size: int = 1  # number of ranks (torchrun's WORLD_SIZE)
    local_rank: int = 0  # rank on this node: the GPU it drives
    device: str = "cpu"  # where collectives run: cuda:LOCAL_RANK under NCCL, cpu under gloo

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every size-th from position rank (lengths differ by at most one)."""
        return list(items[self.rank :: self.size])

    @collective
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(device_ids=[self.local_rank] if self.device.startswith("cuda") else None)

    @collective
    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (in its own dtype) and return it."""
        if self.distributed:
            buf = t.to(self.device)
            dist.all_reduce(buf)
            if buf is not t:
                t.copy_(buf)
        return t

    def sum_float(self, x: float) -> float:
        """A Python number summed over the ranks in FP64."""
        if not self.distributed:
            return x
        return float(self.sum_(torch.tensor([x], dtype=torch.float64, device=self.device)).item())

    def sum_grads(self, module: torch.nn.Module) -> None:
        """Sum every trainable parameter's gradient over the ranks (one flat all-reduce).

        A rank that ran no conversation this update contributes zeros."""
        if not self.distributed:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = self.sum_(torch.cat([p.grad.reshape(-1) for p in params]))
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def sum_normal_equations(self, ne) -> None:
        """Sum a `fit.NormalEquations` (A, B in FP64, and its token count) over the ranks, in place."""
        if not self.distributed:
            return
        self.sum_(ne.A)
        self.sum_(ne.B)
        self.sum_(ne.Y)
        ne.n_tokens = int(self.sum_(torch.tensor([ne.n_tokens], dtype=torch.int64, device=self.device)).item())


SINGLE = World()  # one process: no collective, every row is this process's


def script_args(argv: Sequence[str] | None = None) -> list[str]:
    """A stage's own arguments (`sys.argv[1:]` when None), less a leading `--` that kept torchrun's parser off
    them (some Python versions pass it on to the script, others drop it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def torchrun_command(python: str, nproc: int, argv: Sequence[str]) -> list[str]:
    """The command that runs stage `argv` (script, flags) on `nproc` ranks of this machine through torchrun's
    launcher (kvlingo/train/torchrun.py: a rank that dies is one line, not torchrun's traceback): the flags
    after `--`, so torchrun's parser cannot take one for its own."""
    return [
        python,
        "-m",
        "kvlingo.train.torchrun",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        argv[0],
        "--",
        *argv[1:],
    ]


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str) -> World:
    """The World of this process, from torchrun's environment; joins the process group on first call.

    `device` is the run's resolved device (cuda, mps or cpu). Under torchrun a CUDA rank takes
    cuda:LOCAL_RANK (set as the current device, so "cuda" means it everywhere), and ranks other
    than 0 send their stdout to /dev/null (stderr stays, so their errors are seen).
    """
    size = env_world_size()
    if size <= 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    if cuda and ":" in device:
        raise WorldRefused(
            f"--device {device} names one GPU, but under torchrun each rank takes cuda:LOCAL_RANK; "
            "pass --device cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)"
        )
    if cuda:
        if local >= torch.cuda.device_count():
            raise WorldRefused(
                f"rank {rank} wants cuda:{local}, but this node shows {torch.cuda.device_count()} "
                "GPU(s); lower --nproc-per-node (NPROC) to the GPU count"
            )
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 — for the life of the process
    return World(rank, size, local, f"cuda:{local}" if cuda else "cpu")


def close(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
