"""Outputs and trusted files under an ordinary but careless user, on the tiny pair.

- Every path a stage writes is checked before any model loads: a folder where a report goes, a
  folder that cannot be written, a run another process holds (no memory estimate first).
- A full or read-only disk ends in one line and exit 2 wherever it strikes (a checkpoint, a
  report, a rows file, prepared data): no temp file, no staging folder, no torn line left, and
  the same command with --resume goes on.
- What a resume, a ledger or a loader trusts is hashed where it is recorded and checked where it
  is trusted: the closed-form manifest, a finished cell's maps and rows.
- A resume's identity: a setting that shapes the report (val_every) is refused when changed;
  one that is free (checkpoint_every) is recorded as each stretch ran; the same model folder
  named by another path is the same model.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tinypair import chat_rows, write_prepared

import ablate
import benchmark
import export
import ifeval
import prepare
import train_translator
from kvlingo.eval.tasks import grader
from kvlingo.io import read_json, sha256_file
from kvlingo.stages.ledger import Ledger

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


@pytest.fixture(scope="module")
def world(tiny_pair_paths, tmp_path_factory):
    """Prepared splits, a 2-prompt IFEval file, punkt_tab, and a finished run `r` (train, benchmark)."""
    import nltk
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("integrity")
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        root / "data" / "tiny",
        tok,
        {
            "train": chat_rows(tok, 12, 0, "t"),
            "validation": chat_rows(tok, 4, 1, "v"),
            "test": chat_rows(tok, 4, 2, "x"),
        },
    )
    docs = [
        {"key": k, "prompt": p, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
        for k, p in ((1, "Describe the cat. Do not use commas."), (2, "Describe the mat. Do not use commas."))
    ]
    (root / "ifeval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    punkt = root / "nltk_data"
    grader.install_punkt(punkt)
    pair = [
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    run = [
        "--profile",
        "tiny",
        "--run",
        "r",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
    ]
    train = [*run, *pair, "--data", str(data), "--updates", "2", "--n-fit", "12", "--lr", "1e-3"]
    train_translator.main(train)
    benchmark.main([*run, *pair, "--data", str(data), "--timing-conversations", "0", "--control-dtypes", "none"])
    yield {
        "root": root,
        "data": data,
        "pair": pair,
        "run": run,
        "train": train,
        "punkt": punkt,
        "ifeval": [
            "--profile",
            "tiny",
            *pair,
            "--source",
            str(root / "ifeval.jsonl"),
            "--max-new-tokens",
            "3",
            "--artifacts",
            str(root / "artifacts"),
        ],
    }
    nltk.data.path.remove(str(punkt.resolve()))


def refused(fn, argv, capsys) -> str:
    """The one line a refused stage prints (exit 2, no traceback); progress bars aside."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (e.value.code, err)
    lines = [line for line in err.split("\n") if line and "\r" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    refused.out = out
    return lines[0]


def no_models(monkeypatch):
    """Any model load fails the test: a refusal must come first."""
    import kvlingo.inputs.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))


def moved(world, tmp_path: Path) -> list[str]:
    """The finished run's training command with its --artifacts and --results roots under tmp_path."""
    roots = {str(world["root"] / name): str(tmp_path / name) for name in ("artifacts", "results")}
    return [roots.get(a, a) for a in world["train"]]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- outputs checked first
@pytest.mark.parametrize(
    "stage, output",
    [
        ("train", "results/RUN/train.json"),
        ("train", "results/RUN/train.png"),
        ("train", "artifacts/RUN/distilled/maps.safetensors"),
        ("benchmark", "results/RUN/benchmark.json"),
        ("ifeval", "results/RUN/ifeval.json"),
        ("ifeval", "results/RUN/ifeval.rows.jsonl"),
    ],
)
def test_a_folder_where_an_output_goes_is_refused_before_any_model_loads(
    world, tmp_path, monkeypatch, capsys, stage, output
):
    """Once, all the work ran, then IsADirectoryError with a traceback, exit 1 and partial files."""
    folder = tmp_path / output.replace("RUN", "r")
    results = ["--results", str(tmp_path / "results"), "--run", "r"]  # the finished run's translators, new results
    argv = {
        "train": moved(world, tmp_path),  # a new run in new roots
        "benchmark": [*world["run"], *world["pair"], "--data", str(world["data"]), *results],
        "ifeval": [*world["ifeval"], *results],
    }[stage]
    folder.mkdir(parents=True)
    no_models(monkeypatch)
    main = {"train": train_translator.main, "benchmark": benchmark.main, "ifeval": ifeval.main}[stage]
    err = refused(main, argv, capsys)
    assert f"{folder} is a folder, but the stage writes a file there: remove it (rmdir {folder})" in err, err
    assert "estimate: peak" not in refused.out
    assert not [f for f in files_under(tmp_path) if not f.endswith(".lock")]


def test_a_run_held_by_another_training_or_a_read_only_results_folder_is_refused_before_the_estimate(
    world, tmp_path, monkeypatch, capsys
):
    """Once, both printed the 5-line memory estimate before their one-line refusal."""
    argv = [*world["train"], "--results", str(tmp_path / "results"), "--run", "held"]
    held = tmp_path / "results" / "held"
    held.mkdir(parents=True)
    with open(held / ".train.lock", "a") as lock:  # another training of this run holds its lock
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        no_models(monkeypatch)
        err = refused(train_translator.main, argv, capsys)
    assert f"another train is still running in {held}" in err and "estimate" not in refused.out

    real_open = os.open
    read_only = tmp_path / "read-only"

    def open_(path, flags, *a, **k):  # a read-only file system under read_only (root ignores chmod)
        if str(path).startswith(str(read_only)) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    read_only.mkdir()
    monkeypatch.setattr(os, "open", open_)
    err = refused(train_translator.main, [*argv, "--results", str(read_only)], capsys)
    assert err.startswith(f"train_translator: cannot write to {read_only} (Read-only file system); give --results")
    assert "estimate" not in refused.out and not list(read_only.iterdir())


# --------------------------------------------------------------------------- a full or read-only disk
def full_disk(monkeypatch, folder: Path, code: int = errno.ENOSPC) -> None:
    """Writes of files under `folder` fail as on a full disk: at fsync, where a full disk (or quota) often
    shows first, after the data went to the page cache."""
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("full", ["artifacts/r/checkpoints", "results/r"])
def test_a_full_disk_during_training_ends_in_one_line_and_the_resume_goes_on(
    world, tmp_path, monkeypatch, capsys, full
):
    """Once, a 13–20-line OSError traceback. Now one line naming the folder and the space needed, no temp file
    left, and --resume (with space again) finishes as an uninterrupted run does."""
    argv = moved(world, tmp_path)
    argv += ["--updates", "4", "--checkpoint-every", "2", "--val-every", "2"]
    with monkeypatch.context() as m:
        full_disk(m, tmp_path / full)
        err = refused(train_translator.main, argv, capsys)
    assert f"no space left in {tmp_path / full} (No space left on device): writing " in err, err
    assert "needs" in err and "is free; free at least" in err and "--resume" in err
    assert not [f for f in files_under(tmp_path) if f.endswith(".tmp")]
    rep = train_translator.main([*argv, "--resume"])
    assert rep["results"]["distilled_val_kl"] is not None
    clean = train_translator.main([*argv, "--run", "clean"])
    assert rep["results"]["val_kl_curve"] == clean["results"]["val_kl_curve"]


def test_a_full_disk_while_rows_are_appended_leaves_no_torn_line(world, tmp_path):
    """A file size limit (RLIMIT_FSIZE) lets the kernel write part of a row, then refuses the rest (EFBIG), as a
    full disk does. Once, the rows file was left ending in half a row, which a resume dropped silently. Now
    the partial row is cut off, the stage ends in one line (exit 2), and --resume answers the rest."""
    env = {**os.environ, "NLTK_DATA": str(world["punkt"]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "ifeval.py", *world["ifeval"], "--native", "--run", "r", "--results", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = tmp_path / "r" / "ifeval-native.rows.jsonl"
    lines = rows.read_bytes().splitlines(keepends=True)
    assert len(lines) == 5  # the header and 2 prompts × 2 paths
    limit = len(lines[0]) + len(lines[1]) + len(lines[2]) // 2  # room for the header, a row and half of the next
    shutil.rmtree(tmp_path / "r")

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cut = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    said = re.findall(r"ifeval: [^\r\n]*", cut.stderr)  # progress bars may share its line
    assert cut.returncode == 2 and len(said) == 1 and "Traceback" not in cut.stderr, cut.stderr[-2000:]
    assert said[0].startswith(
        f"ifeval: no room for ifeval-native.rows.jsonl in {tmp_path / 'r'} (File too large): it needs "
    ), said
    text = rows.read_bytes()
    assert text.endswith(b"\n") and len(text.splitlines()) == 2  # the header and one whole row
    again = subprocess.run([*argv, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "cut short" not in again.stderr, again.stderr[-2000:]
    assert read_json(tmp_path / "r" / "ifeval-native.json")["results"]["rows"]["resumed"] == 1


def test_a_full_disk_while_preparing_data_leaves_no_staging_folder(world, tmp_path, monkeypatch, capsys):
    """Once, a traceback and the `.PROFILE.building-PID` staging folder left behind."""
    source = tmp_path / "chats.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "input": [{"role": "user", "content": f"hello {i} " * 5}],
                    "output": f"answer {i} " * 3,
                    "reasoning": "off",
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    out = tmp_path / "data"
    full_disk(monkeypatch, out)
    err = refused(
        prepare.main,
        ["--profile", "tiny", "--source", str(source), "--tokenizer", str(world["pair"][1]), "--out", str(out)],
        capsys,
    )
    assert err.startswith(f"prepare: no space left in {out}/.tiny.building-"), err
    assert [p.name for p in out.iterdir()] == [".prepare-tiny.lock"]


def test_the_writers_leave_nothing_half_written_on_a_full_or_read_only_disk(tmp_path, monkeypatch):
    """The two writers every file goes through: an atomic write refused by the file system keeps the old file and
    leaves no temp file; a row the disk takes only part of is cut off, so the rows file never ends torn."""
    from kvlingo.eval.itemrows import ItemRows, read_rows
    from kvlingo.io import WriteRefused, atomic_write_text

    target = tmp_path / "report.json"
    target.write_text("old")
    real_open, real_write = os.open, os.write

    def read_only(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        with pytest.raises(WriteRefused, match=f"cannot write report.json in {tmp_path} \\(Read-only file system\\)"):
            atomic_write_text(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]

    log = ItemRows(tmp_path / "x.rows.jsonl", {"settings": 1}, resume=False)
    log.append("a", {"answer": "first"})
    whole = log.path.read_bytes()

    def half(fd, data):  # the disk takes half of the row, then is full
        if os.readlink(f"/proc/self/fd/{fd}") == str(log.path):
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", half)
        with pytest.raises(
            WriteRefused, match=f"no space left in {tmp_path} \\(No space left on device\\): writing x.rows.jsonl needs"
        ):
            log.append("b", {"answer": "second"})
    assert log.path.read_bytes() == whole  # no torn line
    assert [r["key"] for r in read_rows(log.path)[1]] == ["a"]


# --------------------------------------------------------------------------- what a resume trusts
def test_changing_val_every_on_resume_is_refused_and_checkpoint_every_is_recorded_as_it_ran(world, tmp_path, capsys):
    """Once, `--val-every 2→1` on --resume exited 0 and the report claimed val_every 1 over a curve measured
    every 2. The validation cadence shapes the curve, so it is part of the resume identity; the checkpoint
    cadence shapes no figure, so it is free, and the report says how each stretch of updates ran."""
    argv = moved(world, tmp_path)
    argv += ["--updates", "4", "--checkpoint-every", "2", "--val-every", "2"]
    train_translator.main(argv)
    ckpts = tmp_path / "artifacts" / "r" / "checkpoints"
    for name in ("ckpt_000004.pt", "DONE_000004"):  # killed after update 2's checkpoint
        (ckpts / name).unlink()
    err = refused(train_translator.main, [*argv, "--resume", "--val-every", "1"], capsys)
    assert "refusing to resume r from its checkpoint: settings changed: settings.val_every: 2 → 1;" in err
    rep = train_translator.main([*argv, "--resume", "--checkpoint-every", "1"])
    assert rep["results"]["resumed_from_update"] == 2
    assert [p["update"] for p in rep["results"]["val_kl_curve"]] == [0, 2, 4] and rep["config"]["val_every"] == 2
    assert rep["results"]["segments"] == [
        {"from_update": 0, "checkpoint_every": 2, "world_size": 1},
        {"from_update": 2, "checkpoint_every": 1, "world_size": 1},
    ]
    assert sorted(p.name for p in ckpts.glob("ckpt_*")) == ["ckpt_000002.pt", "ckpt_000003.pt", "ckpt_000004.pt"]


def test_an_edited_closed_form_manifest_is_fitted_again(world, tmp_path, capsys):
    """Once, after `"lr": 0.001 → 9.001` in closed_form/manifest.json, a rerun said "closed-form fit up to date"
    and kept the edited file."""
    argv = moved(world, tmp_path)
    argv += ["--closed-form-only"]
    train_translator.main(argv)
    folder = tmp_path / "artifacts" / "r" / "closed_form"
    manifest, maps = read_json(folder / "manifest.json"), (folder / "maps.safetensors").read_bytes()
    edited = {**manifest, "config": {**manifest["config"], "lr": 9.001}}
    (folder / "manifest.json").write_text(json.dumps(edited, indent=2))
    capsys.readouterr()
    train_translator.main(argv)
    out = capsys.readouterr().out
    assert "closed-form fit up to date" not in out
    assert (
        f"closed-form fit not reused: {folder / 'manifest.json'}: it was edited after it was written (its "
        "content_sha256 does not match its fields); train or export it again (this run fits it again)"
    ) in out
    assert read_json(folder / "manifest.json")["config"]["lr"] == 0.001
    assert (folder / "maps.safetensors").read_bytes() == maps  # the same fit, made again
    capsys.readouterr()
    train_translator.main(argv)
    assert "train.json is up to date" in capsys.readouterr().out  # the refitted run, intact again


def test_the_same_model_folder_named_by_another_path_resumes(world, tiny_pair_paths, tmp_path, monkeypatch):
    """Once, `--large ../pair/large` then `--large /abs/pair/large` was refused on resume as "settings changed"."""
    monkeypatch.chdir(tiny_pair_paths[0].parent)
    absolute = moved(world, tmp_path)
    relative = [os.path.relpath(a) if a in map(str, tiny_pair_paths) else a for a in absolute]
    assert relative != absolute
    first = train_translator.main(relative)
    # --checkpoint-every 1, a setting a resume may change: the finished run is then not up to date and resumes
    again = train_translator.main([*absolute, "--checkpoint-every", "1", "--resume"])
    assert again["results"]["resumed_from_update"] == 2
    assert first["config"]["pair"]["large"] == again["config"]["pair"]["large"] == str(tiny_pair_paths[0])


def test_a_benchmark_report_that_is_a_folder_is_named_as_one_by_export(world, tmp_path, capsys):
    """Once, export said that a benchmark.json which is a folder "does not exist"."""
    results = tmp_path / "results"
    (results / "r" / "benchmark.json").mkdir(parents=True)
    err = refused(
        export.main,
        [
            "--run",
            "r",
            "--artifacts",
            str(world["root"] / "artifacts"),
            "--results",
            str(results),
            "--out",
            str(tmp_path / "export"),
        ],
        capsys,
    )
    assert f"{results / 'r' / 'benchmark.json'} is a folder, not a report: remove it" in err, err
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------- what a ledger trusts
def test_a_ledger_checks_every_output_of_a_finished_cell(tmp_path):
    """The recipe's, the ablation's and the frontier's cells share the ledger: a finished cell counts as done only
    while its report, its declared outputs and the files its report lists all hold what was recorded."""
    from kvlingo.stages.cells import Cell

    report, rows, maps = tmp_path / "benchmark.json", tmp_path / "benchmark.rows.jsonl", tmp_path / "maps.safetensors"
    rows.write_text('{"row": 1}\n')
    maps.write_bytes(b"maps")
    report.write_text(json.dumps({"files": {rows.name: sha256_file(rows)}}))
    cell = Cell("benchmark/a", "benchmark", "benchmark.py", {}, str(report), {}, outputs=(str(maps),))
    ledger = Ledger(tmp_path / "recipe-state.json", {}, resume=False)
    ledger.start(cell.name, {"key": cell.key, "outputs": list(cell.outputs)})
    ledger.finish(cell.name, report, 0.0)
    assert ledger.check(cell) == ("done", "finished with the same key")
    for path, damage in ((maps, b"mapz"), (rows, b'{"row": 2}\n')):
        good = path.read_bytes()
        path.write_bytes(damage)
        assert ledger.check(cell) == ("run", f"its output {path} changed since the cell finished")
        path.unlink()
        assert ledger.check(cell) == ("run", f"its output {path} is missing")
        path.write_bytes(good)
    assert ledger.check(cell)[0] == "done"


@pytest.mark.slow
def test_ablate_resume_redoes_cells_whose_maps_or_rows_changed(world, tiny_pair_paths, tmp_path, capsys):
    """Once, one flipped byte in a finished cell's maps.safetensors, or an edited benchmark.rows.jsonl, and
    `ablate.py --resume` skipped every cell."""
    argv = [
        "--profile",
        "tiny",
        "--data",
        str(world["data"]),
        *world["pair"],
        "--skip-tasks",
        "ifeval",
        "gsm8k",
        "--settings",
        "crosshead",
        "--long-factor",
        "0",
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--results",
        str(tmp_path / "results"),
    ]
    first = ablate.main(argv)
    cell = tmp_path / "results" / "tiny-l2s-ablate" / "crosshead"
    maps = tmp_path / "artifacts" / "tiny-l2s-ablate" / "crosshead" / "distilled" / "maps.safetensors"
    rows = cell / "benchmark-validation.rows.jsonl"
    good_maps, good_rows = maps.read_bytes(), rows.read_bytes()
    maps.write_bytes(good_maps[:-1] + bytes([good_maps[-1] ^ 1]))
    lines = good_rows.decode().splitlines(keepends=True)
    rows.write_text(lines[0].replace('"id"', '"id_edited"', 1) + "".join(lines[1:]))
    capsys.readouterr()
    again = ablate.main([*argv, "--resume"])
    out = capsys.readouterr().out
    assert f"train/crosshead/train: queued (its output {maps} changed since the cell finished)" in out, out
    assert (
        f"benchmark/crosshead/benchmark-validation: queued (its output {rows} changed since the cell finished)" in out
    ), out
    assert maps.read_bytes() == good_maps and rows.read_bytes() == good_rows  # made again, as they were
    assert again["results"]["rows"][0]["val_kl"] == first["results"]["rows"][0]["val_kl"]
    capsys.readouterr()
    ablate.main([*argv, "--resume"])
    assert "up to date (finished with the same key" in capsys.readouterr().out
