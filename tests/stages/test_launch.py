"""Recipe cells as jobs (kvlingo/stages/launch.py): the local launcher and SLURM through submitit.

The stages are fakestage.py processes under the real scripts' names (no model: a cell costs a fraction of a
second plus its counted updates), so that the launchers' real mechanics (processes, GPU groups, kills, submitit's
pickles, signals and requeues) are what the tests exercise. The reference for a killed or preempted recipe is an
uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

import recipe
from kvlingo.io import atomic_write_json, read_json
from kvlingo.records.report import sealed
from kvlingo.stages import cells as K
from kvlingo.stages.launch import CellJob, SlurmLauncher, SlurmSettings

HELPERS = Path(__file__).resolve().parents[2] / "tests" / "helpers"
STEP_S = 0.25  # seconds per counted update of a fake training cell (tiny profile: 4 updates per cell)


# --------------------------------------------------------------------------- the recipe on fake stages
@pytest.fixture
def world(tmp_path, tiny_pair_paths, monkeypatch):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for stage, name in (("train", "train_translator.py"), ("benchmark", "benchmark.py"), ("ifeval", "ifeval.py")):
        (scripts / name).symlink_to(HELPERS / "fakestage.py")
        monkeypatch.setitem(recipe.SCRIPTS, stage, scripts / name)
    monkeypatch.setenv("FAKE_STAGE_STEP_S", str(STEP_S))
    data = tmp_path / "data"
    atomic_write_json(data / "manifest.json", sealed({"stage": "prepare", "files": {}}))
    src = tmp_path / "ifeval.jsonl"
    src.write_text('{"key": 1, "prompt": "p", "instruction_id_list": [], "kwargs": []}\n')
    large, small = map(str, tiny_pair_paths)

    def argv(run: str, *extra: str) -> list[str]:
        return [
            "--profile",
            "tiny",
            "--data",
            str(data),
            "--run",
            run,
            "--large",
            large,
            "--small",
            small,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--ifeval-source",
            str(src),
            "--artifacts",
            str(tmp_path / "artifacts"),
            "--results",
            str(tmp_path / "results"),
            *extra,
        ]

    return argv, tmp_path


def comparable(rep: dict) -> str:
    """A recipe report's results without what depends on how it ran (cells: actions, runs, times), as
    JSON text (a single seed's SE is NaN, which equals itself only as text)."""
    res = dict(rep["results"])
    res.pop("cells")
    return json.dumps(res, sort_keys=True)


def run_in_thread(argv: list[str]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        try:
            out["report"] = recipe.main(argv)
        except BaseException as e:  # noqa: BLE001 — handed to the test
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, out


def kill_when_counting(pid_file: Path, ckpt: Path, sig: int, which: int, deadline_s: float = 120) -> int:
    """Wait for a fake training cell to have checkpointed at least once, then send `sig` to its
    process (which=0) or to its parent, the job that runs it (which=1). Returns the pid signalled."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if pid_file.is_file() and ckpt.is_file() and read_json(ckpt)["update"] >= 1:
            pid = int(pid_file.read_text().split()[which])
            os.kill(pid, sig)
            return pid
        time.sleep(0.02)
    raise AssertionError(f"{pid_file} never started counting")


@pytest.mark.slow
def test_local_launcher_runs_cells_concurrently_and_resumes_a_killed_one(world):
    argv, root = world
    ref = recipe.main(argv("ref", "--max-parallel", "2", "--gpus", "0", "1"))

    cell = root / "artifacts" / "kill" / "lr3.16e-04-s42"
    t, out = run_in_thread(argv("kill", "--max-parallel", "2", "--gpus", "0", "1"))
    kill_when_counting(cell / "stage.pid", cell / "checkpoints" / "update.json", signal.SIGKILL, which=0)
    t.join(300)
    assert "report" in out, out.get("error")
    assert comparable(out["report"]) == comparable(ref)

    ledger = read_json(root / "results" / "kill" / K.LEDGER_FILE)["cells"]
    assert ledger["train/lr3.16e-04-s42"]["runs"] == 2 and ledger["train/lr3.16e-04-s42"]["status"] == "done"
    assert sum(c["runs"] for c in ledger.values()) == len(ledger) + 1
    killed = read_json(ledger["train/lr3.16e-04-s42"]["report"])
    assert killed["results"]["resumed_from_update"] >= 1  # went on from its checkpoint, not from the start
    # the two grid cells ran at the same time, each on its own GPU, and each wrote a log
    a, b = (read_json(ledger[f"train/{c}-s42"]["report"])["process"] for c in ("lr1.00e-04", "lr3.16e-04"))
    assert a["started_unix"] < b["ended_unix"] and b["started_unix"] < a["ended_unix"]
    assert {a["cuda_visible_devices"], b["cuda_visible_devices"]} == {"0", "1"}
    assert (root / "results" / "kill" / "logs" / "train" / "lr3.16e-04-s42.log").is_file()


@pytest.mark.slow
def test_slurm_launcher_through_submitit_requeues_a_preempted_cell(world):
    """submitit's local executor runs the same jobs the SLURM launcher submits; a SIGUSR2 (what SLURM
    sends before a preemption) makes the job checkpoint and requeue, and the stage resumes."""
    argv, root = world
    short = ["--skip", "benchmark", "ifeval", "--seeds", "42"]  # the closed form and the grid: 3 levels, 4 jobs
    ref = recipe.main(argv("ref", *short))
    slurm = [
        "--launcher",
        "slurm",
        "--submitit-cluster",
        "local",
        "--max-parallel",
        "2",
        "--time-limit",
        "30",
        "--slurm-folder",
        str(root / "slurm"),
    ]
    cell = root / "artifacts" / "pre" / "lr1.00e-04-s42"
    t, out = run_in_thread(argv("pre", *short, *slurm))
    kill_when_counting(cell / "stage.pid", cell / "checkpoints" / "update.json", signal.SIGUSR2, which=1)
    t.join(300)
    assert "report" in out, out.get("error")
    assert comparable(out["report"]) == comparable(ref)
    ledger = read_json(root / "results" / "pre" / K.LEDGER_FILE)["cells"]
    assert ledger["train/lr1.00e-04-s42"]["runs"] == 2
    assert read_json(ledger["train/lr1.00e-04-s42"]["report"])["results"]["resumed_from_update"] >= 1
    assert sum(c["runs"] for c in ledger.values()) == len(ledger) + 1


def test_failed_cells_are_named_with_their_logs(world, monkeypatch, capsys):
    argv, root = world
    # One training cell of the grid cannot read its data; the other cell of its level still finishes.
    monkeypatch.setenv("FAKE_STAGE_FAIL", "/lr1.00e-04-s42")
    with pytest.raises(SystemExit) as e:
        recipe.main(argv("fail", "--max-parallel", "2", "--skip", "ifeval"))
    log = root / "results" / "fail" / "logs" / "train" / "lr1.00e-04-s42.log"
    message = capsys.readouterr().err
    assert e.value.code == 1 and "1 of 2 cell(s) failed" in message, message
    assert "train/lr1.00e-04-s42: train_translator.py exited with status 1" in message and str(log) in message
    assert "cannot read the data" in log.read_text()
    cells = read_json(root / "results" / "fail" / K.LEDGER_FILE)["cells"]
    assert cells["train/lr1.00e-04-s42"]["status"] == "failed" and cells["train/lr3.16e-04-s42"]["status"] == "done"
    assert not (root / "results" / "fail" / "recipe.json").exists()  # no summary until every cell has finished


# --------------------------------------------------------------------------- what SLURM would be sent
def test_slurm_job_array_parameters(tmp_path, monkeypatch):
    """sbatch and srun stand-ins on PATH: the launcher's real submission, read back from the script it hands sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("sbatch", f'cp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n'),
        ("srun", "exit 0\n"),
    ):
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    settings = SlurmSettings(
        partition="gpu-long",
        account="proj42",
        gpus_per_cell=4,
        time_limit_min=720,
        max_parallel=3,
        cpus_per_cell=16,
        mem_gb=None,
        max_requeues=2,
    )
    launcher = SlurmLauncher(tmp_path / "slurm", settings, cluster="slurm")
    jobs = [
        CellJob(
            f"train/lr{i}",
            {"stage": "train", "key": str(i)},
            ("train_translator.py", "--lr", str(i)),
            ("train_translator.py", "--lr", str(i), "--resume"),
            str(tmp_path / f"r{i}.json"),
            str(tmp_path / K.LEDGER_FILE),
            nproc=launcher.nproc,
        )
        for i in range(5)
    ]
    handles = launcher.submit(jobs)
    assert [h.job_id for h in handles] == [f"4242_{i}" for i in range(5)]
    script = (tmp_path / "submitted.sh").read_text()
    for line in (
        "#SBATCH --partition=gpu-long",
        "#SBATCH --account=proj42",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=720",
        "#SBATCH --array=0-4%3",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --signal=USR2@90",
    ):
        assert line in script.splitlines(), (line, script)
    submitted = handles[2].submission().function  # the pickled job a task of the array will run
    assert submitted.name == "train/lr2" and submitted.nproc == 4 and submitted.preemptible and not submitted.resume
    assert submitted.checkpoint().function.resume  # a requeue runs the stage with its resume flag
    assert str(Path(sys.executable).parent) in script  # the jobs run this environment's interpreter


def test_slurm_needs_the_cells_device_named(world, capsys):
    argv, root = world
    with pytest.raises(SystemExit) as e:
        recipe.main(argv("auto", "--launcher", "slurm", "--device", "auto"))
    assert e.value.code == 2 and "needs an explicit --device (cuda)" in capsys.readouterr().err
    assert not (root / "results").exists()


def test_slurm_without_srun_is_refused_before_anything_is_written(world, monkeypatch, capsys):
    """No SLURM on this machine: one line naming the fix and status 2, not submitit's traceback after the ledger."""
    argv, root = world
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "srun").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    with pytest.raises(SystemExit) as e:
        recipe.main(argv("nosrun", "--launcher", "slurm", "--skip", "ifeval"))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert "`srun` is not on PATH" in err and "--launcher local" in err and "--submitit-cluster local" in err
    assert not (root / "results").exists() and not (root / "artifacts").exists()


def test_local_launcher_refuses_a_gpu_named_twice():
    from kvlingo.errors import RunRefused
    from kvlingo.stages.launch import LocalLauncher

    assert [g for group in LocalLauncher(2, ["0", "1", "2", "3"], 2).groups for g in group] == ["0", "1", "2", "3"]
    with pytest.raises(RunRefused, match="--gpus names 1 more than once"):
        LocalLauncher(2, ["0", "1", "1", "2"], 1)


def test_slurm_flags_reach_the_job_settings(tmp_path):
    import recipe
    from kvlingo.stages.launch import launcher_from_args

    args = recipe.parse_args(
        [
            "--launcher",
            "slurm",
            "--device",
            "cuda",
            "--cpus-per-cell",
            "6",
            "--mem-gb",
            "48",
            "--max-requeues",
            "3",
            "--submitit-cluster",
            "debug",
        ]
    )
    launcher = launcher_from_args(args, tmp_path, say=lambda _m: None)
    s = launcher.settings
    assert (s.cpus_per_cell, s.mem_gb, s.max_requeues) == (6, 48.0, 3)
    assert s.parameters()["cpus_per_task"] == 6 and s.parameters()["mem_gb"] == 48.0
