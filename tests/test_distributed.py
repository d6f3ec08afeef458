"""Data-parallel distillation: `make train NPROC=2` (torchrun, two gloo ranks on the CPU) against one process
with the same global batch, a resume under another rank count, and the estimate printed (or refused) before a run.

References: the single-process run (train_translator.main in this process) and the single-process
FP64 normal equations; the estimate's graph memory against the bytes autograd itself saves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tinypair import chat_rows, load_tiny_pair, write_prepared

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.inputs.data import read_split
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import read_json
from kvlingo.records.saved import load_state
from kvlingo.train import footprint as E
from kvlingo.train.closed_form import normal_equations
from kvlingo.train.distributed import SINGLE, World, WorldRefused
from kvlingo.train.rows import fit_selection

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
N_FIT = 8
SETTINGS = [
    "--updates",
    "4",
    "--batch",
    "4",
    "--n-fit",
    str(N_FIT),
    "--checkpoint-every",
    "2",
    "--val-every",
    "2",
    "--lr",
    "3e-3",
    "--fit-weighting",
    "attention",
    "--family",
    "headwise",
    "--ridge",
    "0",
]  # plain least squares, as below

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tiny_pair_paths, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    folder = tmp_path_factory.mktemp("data")
    write_prepared(
        folder,
        tok,
        {"train": chat_rows(tok, 16, 0, "train", system_every=3), "validation": chat_rows(tok, 5, 1, "val")},
    )
    return folder


def cli(paths, data_dir, root, run, *extra) -> list[str]:
    return [
        "--profile",
        "tiny",
        "--data",
        str(data_dir),
        "--run",
        run,
        "--large",
        str(paths[0]),
        "--small",
        str(paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
        *SETTINGS,
        *extra,
    ]


def main(argv):
    import train_translator

    return train_translator.main(argv)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_env() -> dict:
    """The environment a user's shell gives make: offline, one thread, free of an outer make's flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(tiny_pair_paths, data, tmp_path_factory):
    """The same run twice: `make train NPROC=2` (torchrun, two gloo ranks), as the README and docs give it, and
    one process here; and the FP64 normal equations summed over two ranks (tests/torchrun_worker.py)."""
    root = tmp_path_factory.mktemp("runs")
    env = {**make_env(), "PYTHONPATH": str(ROOT)}
    worker = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "torchrun_worker.py"),
        str(root / "fit.pt"),
        str(tiny_pair_paths[0]),
        str(tiny_pair_paths[1]),
        str(data),
        str(N_FIT),
    ]
    proc = subprocess.run(worker, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train_args = [
        "--data",
        str(data),
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
    single = main(cli(tiny_pair_paths, data, root, "single"))
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
    line = next(line for line in dry.stdout.splitlines() if "/torchrun " in line)
    recipe = stage_command(["train_translator.py", "--run", "q/lr1e-3", "--results", "R", "--resume"], nproc=2)
    for argv in (shlex.split(line), recipe):
        launch = torchrun_args(argv[1:])  # exits 2 on a flag it takes for an ambiguous abbreviation of its own
        assert launch.nproc_per_node == "2" and launch.training_script == "train_translator.py"
        args = train_translator.parse_args(launch.training_script_args)
        assert args.run in ("r", "q/lr1e-3") and args.results == "R" and args.resume


@pytest.mark.slow
def test_two_ranks_equal_one_process(runs, tiny_pair_paths, data):
    art = runs.root / "artifacts"
    for kind in ("closed_form", "distilled"):
        d, s = load_state(art / "dist" / kind), load_state(art / "single" / kind)
        for name in ("weight", "bias"):
            assert rel(getattr(d, name), getattr(s, name)) < 1e-6, (kind, name)
    assert not torch.equal(
        load_state(art / "dist" / "distilled").weight, load_state(art / "dist" / "closed_form").weight
    )
    dist, single = runs.dist["results"], runs.single["results"]
    for a, b in zip(dist["val_kl_curve"] + dist["loss_curve"], single["val_kl_curve"] + single["loss_curve"]):
        assert a["update"] == b["update"] and abs(
            a.get("val_kl", a.get("loss")) - b.get("val_kl", b.get("loss"))
        ) <= 1e-6 * abs(b.get("val_kl", b.get("loss")))
    assert dist["fit"]["n_conversations"] == single["fit"]["n_conversations"] == N_FIT
    assert dist["fit"]["n_tokens"] == single["fit"]["n_tokens"]
    assert runs.dist["env"]["world_size"] == 2 and runs.single["env"]["world_size"] == 1
    # rank 0 alone prints: one estimate, one report line
    assert runs.out.count("estimate: peak") == 1 and runs.out.count("report: ") == 1, runs.out

    # The FP64 closed form: the two ranks' summed normal equations against one process's.
    got = torch.load(runs.root / "fit.pt")
    pair = load_tiny_pair(tiny_pair_paths)
    rows = read_split(data, "train", "natural", pair.target.config.vocab_size)
    rows = [rows[i] for i in fit_selection(len(rows), N_FIT, 42)]
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    ne = normal_equations(pair.source, pair.target, tr, rows, "attention")
    weight, bias = ne.solve()
    assert got["world_size"] == 2 and got["n_tokens"] == ne.n_tokens
    assert rel(got["weight"], weight) < 1e-12 and rel(got["bias"], bias) < 1e-12


@pytest.mark.slow
def test_resume_under_another_rank_count(runs, tiny_pair_paths, data, tmp_path, capsys):
    """Supported: a checkpoint written by two ranks resumes in one process and ends where one process ends."""
    shutil.copytree(runs.root / "artifacts" / "dist", tmp_path / "artifacts" / "dist")
    ckpts = tmp_path / "artifacts" / "dist" / "checkpoints"
    for name in ("ckpt_000004.pt", "DONE_000004"):
        (ckpts / name).unlink()
    rep = main(cli(tiny_pair_paths, data, tmp_path, "dist", "--resume"))
    assert rep["results"]["resumed_from_update"] == 2
    assert "written by 2 rank(s), this run has 1" in capsys.readouterr().out
    d, s = (
        load_state(tmp_path / "artifacts" / "dist" / "distilled"),
        load_state(runs.root / "artifacts" / "single" / "distilled"),
    )
    assert rel(d.weight, s.weight) < 1e-6 and rel(d.bias, s.bias) < 1e-6


# --------------------------------------------------------------------------- the estimate
def test_refuses_a_run_that_does_not_fit_before_any_work(tiny_pair_paths, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, data, tmp_path, "small", "--memory-limit-gib", "0.001"))
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "estimated peak" in err and "exceeds the 0.0 GiB" in err and "--no-memory-check" in err
    assert "estimate: peak" in out and "assumes throughput" in out
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "results").exists()


def test_more_ranks_than_conversations_is_refused(tiny_pair_paths):
    from kvlingo.inputs.models import resolve_pair

    pair_cfg, _ = resolve_pair(str(tiny_pair_paths[0]), str(tiny_pair_paths[1]), "l2s", "cpu", "float32")
    cfg = SimpleNamespace(updates=4, batch=2, val_every=2)
    args = SimpleNamespace(closed_form_only=False, memory_limit_gib=None, assume_tflops=None, no_memory_check=False)
    tr = Headwise(Geometry(**pair_cfg.geometry))
    with pytest.raises(WorldRefused, match="3 ranks but 2 conversations per update"):
        E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), World(0, 3), args)
    lines: list[str] = []
    est = E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), World(0, 2), args, say=lines.append)
    assert est.conversations_per_rank == 1 and lines[0].startswith("estimate: peak")
    one = E.before_training(pair_cfg, tr, cfg, get_profile("tiny"), SINGLE, args, say=lines.append)
    assert one.conversations_per_rank == 2 and est.seconds_per_update < one.seconds_per_update


def test_paper_budget_estimate_on_h100(capsys):
    """The planned figures the README quotes (estimate.py): real Qwen3 shapes (kvlingo.bench.shapes), no download."""
    import estimate

    one = estimate.main(["--profile", "paper-budget", "--gpu", "H100", "--nproc", "1"])
    eight = estimate.main(["--profile", "paper-budget", "--gpu", "H100", "--nproc", "8"])
    assert one.fits and one.peak_bytes == eight.peak_bytes  # memory per rank does not depend on N
    assert one.conversations_per_rank == 8 and eight.conversations_per_rank == 1
    assert 7.5 < one.seconds_per_update / eight.seconds_per_update < 8.0  # 8× fewer conversations, plus the all-reduce
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        estimate.main(["--profile", "paper-budget", "--gpu", "A10", "--nproc", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("estimate: estimated peak") and err.count("\n") == 1, err
    assert "a profile with shorter caps that fits: pilot" in err


def test_graph_memory_matches_what_autograd_saves(tiny_pair_paths, data):
    """The estimate's graph terms against the bytes of the distinct tensors autograd saves for one
    conversation's backward (translation, target graph and the KL's saved log-softmaxes)."""
    from kvlingo.train.distill import distill_loss

    pair = load_tiny_pair(tiny_pair_paths)
    rows = read_split(data, "train", "natural", pair.target.config.vocab_size)
    row = max(rows, key=lambda r: len(r["prefix_ids"]))
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for m in (pair.source, pair.target, tr) for p in m.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        distill_loss(pair.source, pair.target, tr, row, torch.float32)
    saved = sum(n for ptr, n in seen.items() if ptr not in params)
    src, tgt = E.Shape.of(pair.source.config), E.Shape.of(pair.target.config)
    est = E.estimate(
        src,
        tgt,
        tr.n_params(),
        tr.flops_per_token(),
        prefix_cap=len(row["prefix_ids"]),
        reply_cap=len(row["reply_ids"]),
        batch=1,
        dtype_bytes=4,
        prenorm=True,
        nproc=1,
        device=E.Device("cpu", "cpu", 1e12, 1.0, "test"),
    )
    n, C = len(row["reply_ids"]), len(row["prefix_ids"]) - 1
    predicted = est.memory["translation"] + est.memory["target graph"] + 2 * 4 * n * tgt.vocab
    assert 0.8 < saved / predicted < 1.25, (saved, predicted, C, n)
