"""Run by tests/train/test_distributed.py under `torchrun --nproc-per-node 2` (gloo, CPU).

On every rank: the closed form's FP64 normal equations over this rank's share of the fit rows,
summed across the ranks and solved (rank 0 saves the FP64 solution). The training itself runs
as users start it, through `make train NPROC=2`.

    torchrun --nproc-per-node 2 tests/helpers/torchrun_worker.py OUT.pt LARGE SMALL DATA N_FIT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from tinypair import load_tiny_pair  # noqa: E402

from kvlingo.core.families.headwise.maps import Headwise  # noqa: E402
from kvlingo.core.translator import Geometry  # noqa: E402
from kvlingo.inputs.data import read_split  # noqa: E402
from kvlingo.train import distributed  # noqa: E402
from kvlingo.train.closed_form import normal_equations  # noqa: E402
from kvlingo.train.rows import fit_selection  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    out, large, small, data, n_fit = sys.argv[1:]
    world = distributed.init("cpu")
    pair = load_tiny_pair((large, small))
    rows = read_split(data, "train", "natural", pair.target.config.vocab_size)
    rows = [rows[i] for i in fit_selection(len(rows), int(n_fit), 42)]
    translator = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    ne = normal_equations(pair.source, pair.target, translator, world.share(rows), "attention")
    world.sum_normal_equations(ne)
    weight, bias = ne.solve()
    if world.main:
        torch.save({"weight": weight, "bias": bias, "n_tokens": ne.n_tokens, "world_size": world.size}, out)
    distributed.close(world)


if __name__ == "__main__":
    main()
