"""Data-parallel distillation (kvlingo/train/distributed.py): `make train NPROC=2` (torchrun, two gloo ranks on
the CPU) against one process with the same global batch, and a resume under another rank count.

References: the single-process run (train_translator.main in this process) and the single-process FP64 normal
equations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rankrun import N_FIT, SETTINGS, cli, main
from tinypair import load_tiny_pair

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.inputs.data import read_split
from kvlingo.io import read_json
from kvlingo.records.saved import load_state
from kvlingo.train.closed_form import normal_equations
from kvlingo.train.rows import fit_selection

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_env() -> dict:
    """The environment a user's shell gives make: offline, one thread, free of an outer make's flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(tiny_pair_paths, parallel_data, tmp_path_factory):
    """The same run twice: `make train NPROC=2` (torchrun, two gloo ranks), as the README and docs give it, and
    one process here; and the FP64 normal equations summed over two ranks (tests/helpers/torchrun_worker.py)."""
    root = tmp_path_factory.mktemp("runs")
    env = {**make_env(), "PYTHONPATH": str(ROOT)}
    worker = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "helpers" / "torchrun_worker.py"),
        str(root / "fit.pt"),
        str(tiny_pair_paths[0]),
        str(tiny_pair_paths[1]),
        str(parallel_data),
        str(N_FIT),
    ]
    proc = subprocess.run(worker, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train_args = [
        "--data",
        str(parallel_data),
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
        *SETTINGS,
    ]
    make = [
        "make",
        "train",
        "NPROC=2",
        "PROFILE=tiny",
        f"LARGE={tiny_pair_paths[0]}",
        f"SMALL={tiny_pair_paths[1]}",
        "DEVICE=cpu",
        "DTYPE=float32",
        "RUN=dist",
        f"TRAIN_ARGS={' '.join(train_args)}",
    ]
    proc = subprocess.run(make, cwd=ROOT, env=make_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torchrun --standalone --nproc-per-node 2 train_translator.py -- --profile tiny" in proc.stdout
    single = main(cli(tiny_pair_paths, parallel_data, root, "single"))
    return SimpleNamespace(
        root=root, out=proc.stdout, single=single, dist=read_json(root / "results" / "dist" / "train.json")
    )


def test_torchrun_hands_every_stage_flag_to_the_stage():
    """torchrun's own parser on the commands that start a data-parallel training (`make train NPROC=2`, the
    recipe's multi-GPU cells): each stage flag reaches the stage, none is taken for an abbreviation of one of
    torchrun's options (`--run` abbreviates `--run-path`)."""
    import shlex

    from torch.distributed.run import parse_args as torchrun_args

    import train_translator
    from kvlingo.stages.launch import stage_command

    dry = subprocess.run(
        ["make", "-n", "train", "NPROC=2", "PROFILE=tiny", "RUN=r", "TRAIN_ARGS=--resume --results R"],
        cwd=ROOT,
        env=make_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = next(line for line in dry.stdout.splitlines() if " -m kvlingo.train.torchrun " in line)
    recipe = stage_command(["train_translator.py", "--run", "q/lr1e-3", "--results", "R", "--resume"], nproc=2)
    for argv in (shlex.split(line), recipe):
        assert argv[1:3] == ["-m", "kvlingo.train.torchrun"]
        launch = torchrun_args(argv[3:])  # exits 2 on a flag it takes for an ambiguous abbreviation of its own
        assert launch.nproc_per_node == "2" and launch.training_script == "train_translator.py"
        args = train_translator.parse_args(launch.training_script_args)
        assert args.run in ("r", "q/lr1e-3") and args.results == "R" and args.resume


@pytest.mark.slow
def test_two_ranks_equal_one_process(runs, tiny_pair_paths, parallel_data):
    art = runs.root / "artifacts"
    for kind in ("closed_form", "distilled"):
        d, s = load_state(art / "dist" / kind), load_state(art / "single" / kind)
        for name in ("weight", "bias"):
            assert rel(getattr(d, name), getattr(s, name)) < 1e-6, (kind, name)
    assert not torch.equal(
        load_state(art / "dist" / "distilled").weight, load_state(art / "dist" / "closed_form").weight
    )
    dist, single = runs.dist["results"], runs.single["results"]
    # The curves are FP32 means over every reply token, summed per rank and all-reduced: another order of the same
    # few hundred terms than one process's, so they agree to a few float32 steps (1e-5 relative), not bit for bit.
    for a, b in zip(dist["val_kl_curve"] + dist["loss_curve"], single["val_kl_curve"] + single["loss_curve"]):
        assert a["update"] == b["update"] and abs(
            a.get("val_kl", a.get("loss")) - b.get("val_kl", b.get("loss"))
        ) <= 1e-5 * abs(b.get("val_kl", b.get("loss"))), (a, b)
    assert dist["fit"]["n_conversations"] == single["fit"]["n_conversations"] == N_FIT
    assert dist["fit"]["n_tokens"] == single["fit"]["n_tokens"]
    assert runs.dist["env"]["world_size"] == 2 and runs.single["env"]["world_size"] == 1
    # rank 0 alone prints: one estimate, one report line
    assert runs.out.count("estimate: peak") == 1 and runs.out.count("report: ") == 1, runs.out

    # The FP64 closed form: the two ranks' summed normal equations against one process's.
    got = torch.load(runs.root / "fit.pt")
    pair = load_tiny_pair(tiny_pair_paths)
    rows = read_split(parallel_data, "train", "natural", pair.target.config.vocab_size)
    rows = [rows[i] for i in fit_selection(len(rows), N_FIT, 42)]
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    ne = normal_equations(pair.source, pair.target, tr, rows, "attention")
    weight, bias = ne.solve()
    assert got["world_size"] == 2 and got["n_tokens"] == ne.n_tokens
    assert rel(got["weight"], weight) < 1e-12 and rel(got["bias"], bias) < 1e-12


@pytest.mark.slow
def test_resume_under_another_rank_count(runs, tiny_pair_paths, parallel_data, tmp_path, capsys):
    """Supported: a checkpoint written by two ranks resumes in one process and ends where one process ends."""
    shutil.copytree(runs.root / "artifacts" / "dist", tmp_path / "artifacts" / "dist")
    ckpts = tmp_path / "artifacts" / "dist" / "checkpoints"
    for name in ("ckpt_000004.pt", "DONE_000004"):
        (ckpts / name).unlink()
    rep = main(cli(tiny_pair_paths, parallel_data, tmp_path, "dist", "--resume"))
    assert rep["results"]["resumed_from_update"] == 2
    assert "written by 2 rank(s), this run has 1" in capsys.readouterr().out
    d, s = (
        load_state(tmp_path / "artifacts" / "dist" / "distilled"),
        load_state(runs.root / "artifacts" / "single" / "distilled"),
    )
    assert rel(d.weight, s.weight) < 1e-6 and rel(d.bias, s.bias) < 1e-6
