"""The stage skeleton (kvlingo/stages/skeleton.py): checks before changes, one line and one exit status per
refusal.

A finished tiny run is snapshotted by the sha256 of every file; each refused command must exit with status 2 and
one line on stderr, and the snapshot must be unchanged afterwards. A folder where an output goes, a damaged JSON
file, a second run of a stage holding the run's lock, and Ctrl-C end in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from stagecli import NOT_UP_TO_DATE, files_under, moved, no_models, refused, snapshot
from tinypair import chat_rows, write_prepared

import benchmark
import ifeval
import prepare
import train_translator

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def other_tokenizer_folder(tok, folder: Path) -> Path:
    """The same tokenizer plus one extra token: ids that decode to garbage under the pair's tokenizer."""
    other = type(tok).from_pretrained(tok.name_or_path)
    other.add_tokens(["<extra_token_for_the_test>"])
    other.save_pretrained(folder)
    return folder


def test_refused_commands_change_nothing(finished, tiny_pair_paths, tmp_path, capsys, monkeypatch):
    root, train = finished["root"], finished["train"]
    before = snapshot(root)
    assert any(k.startswith("artifacts/r/distilled/") for k in before) and "results/r/train.json" in before

    # 1. a refused resume: a missing --init-from, other settings, other code
    err = refused(train_translator.main, [*train, "--resume", "--init-from", str(tmp_path / "missing")], capsys)
    assert "holds no manifest.json" in err
    assert "settings.lr: 0.001 → 0.003" in refused(train_translator.main, [*train, "--resume", "--lr", "3e-3"], capsys)
    with monkeypatch.context() as m:  # an edit of the code the stage imports
        m.setattr("kvlingo.records.resume.code_hash", lambda *scripts: "e" * 64)
        assert "code changed" in refused(train_translator.main, [*train, "--resume"], capsys)

    # 4. data prepared with another tokenizer: named by both digests, in training and in the benchmark
    other_tok = other_tokenizer_folder(finished["tok"], tmp_path / "other_tok")
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(other_tok)
    rows = chat_rows(other, 8, 0, "o")
    bad_data = write_prepared(tmp_path / "bad" / "tiny", other, {"train": rows, "validation": rows, "test": rows})
    from kvlingo.inputs.models import tokenizer_digest

    for fn, argv in (
        (train_translator.main, [*train, "--data", str(bad_data)]),
        (benchmark.main, [*finished["run"], *finished["pair"], "--data", str(bad_data)]),
    ):
        err = refused(fn, argv, capsys)
        assert tokenizer_digest(other)[:16] in err and tokenizer_digest(finished["tok"])[:16] in err

    # 6. a pair no translator can join is refused from its config, before any weights load
    sliding = tmp_path / "sliding"
    shutil.copytree(tiny_pair_paths[1], sliding)
    cfg = json.loads((sliding / "config.json").read_text())
    cfg.update(
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        layer_types=["sliding_attention"] * cfg["num_hidden_layers"],
    )
    (sliding / "config.json").write_text(json.dumps(cfg))
    import kvlingo.inputs.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights were loaded before the refusal"))
    err = refused(
        train_translator.main, [*[a if a != str(tiny_pair_paths[1]) else str(sliding) for a in train]], capsys
    )
    assert "non-full attention" in err
    monkeypatch.undo()

    # 5. an empty source over a good prepared set
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = refused(
        prepare.main,
        [
            "--profile",
            "tiny",
            "--source",
            str(empty),
            "--tokenizer",
            str(tiny_pair_paths[1]),
            "--out",
            str(root / "data"),
        ],
        capsys,
    )
    assert "no usable conversations" in err and "is kept" in err

    assert snapshot(root) == before


def test_a_damaged_json_file_is_refused_by_name(finished, tmp_path, capsys):
    """A manifest or report cut short (a bad copy, a hand edit) ends the stage with one line that names the
    file, where it breaks and the fix, never a JSONDecodeError traceback; the damaged file is left as it is."""
    import export
    import summary
    from kvlingo.io import DamagedFile, read_jsonl

    root = tmp_path / "copy"
    shutil.copytree(finished["root"], root)
    run = [a.replace(str(finished["root"]), str(root)) for a in finished["run"]]
    data = root / "data" / "tiny"

    def cut(path: Path) -> str:
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
        return text

    # the translator's manifest, read by the benchmark
    manifest = root / "artifacts" / "r" / "distilled" / "manifest.json"
    good = cut(manifest)
    err = refused(benchmark.main, [*run, *finished["pair"], "--data", str(data)], capsys)
    assert f"{manifest} does not parse as JSON at line" in err and "train or export it again" in err
    manifest.write_text(good)

    # the prepared data's manifest
    data_manifest = data / "manifest.json"
    good = cut(data_manifest)
    err = refused(benchmark.main, [*run, *finished["pair"], "--data", str(data)], capsys)
    assert f"{data_manifest} does not parse as JSON" in err and "rerun the stage that wrote it" in err
    data_manifest.write_text(good)

    # a report, read by the summary and by the export
    report = root / "results" / "r" / "benchmark.json"
    report.write_text('{"stage": "benchmark", "results": {"quality"')
    for fn, argv in ((summary.main, run[2:]), (export.main, run[2:])):
        err = refused(fn, argv, capsys)
        assert f"{report} does not parse as JSON at line 1" in err and "rerun the stage that wrote it" in err
    assert report.read_text() == '{"stage": "benchmark", "results": {"quality"'

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(DamagedFile, match=r"rows.jsonl does not parse as JSON at line 3"):
        read_jsonl(rows)


def test_a_second_run_of_a_stage_on_the_same_run_is_refused_while_the_first_runs(finished, tmp_path, capsys):
    """Two trainings of one run would mix their checkpoints and translators: while one process holds the run's
    lock, another is refused at once, and the lock goes when its holder is killed (nothing left to clean up)."""
    import subprocess
    import sys

    from kvlingo.stages.skeleton import lock_run, refusals_exit

    res = finished["root"] / "results" / "r"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvlingo.stages.skeleton import lock_run; "
            f"lock_run({str(res)!r}, 'train'); lock_run({str(finished['root'] / 'data')!r}, 'prepare-tiny'); "
            "print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(finished["root"])
        err = refused(train_translator.main, [*finished["train"], *NOT_UP_TO_DATE, "--resume"], capsys)
        assert f"another train is still running in {res}" in err and str(res / ".train.lock") in err
        source = finished["root"] / "chats.jsonl"  # never read: the data folder's build is refused first
        err = refused(
            prepare.main,
            [
                "--profile",
                "tiny",
                "--source",
                str(source),
                "--tokenizer",
                str(finished["tok"].name_or_path),
                "--out",
                str(finished["root"] / "data"),
            ],
            capsys,
        )
        assert "another prepare-tiny is still running" in err and "another --out" in err
        assert snapshot(finished["root"]) == before
    finally:
        holder.kill()
        holder.wait()

    @refusals_exit("train")
    def stage():
        lock_run(res, "train")
        return "ran"

    assert stage() == "ran" and stage() == "ran"  # the killed holder's lock is gone, and each call frees its own


def test_faults_a_stage_once_met_with_a_traceback_are_refused_in_one_line(finished, tmp_path, capsys):
    """Each of these once ended in a traceback, after work, or not at all: a refresh setting deeper than the
    target (refused before any weights load), every checkpoint damaged, a batch larger than the training
    split, a second training writing the same run's artifacts from another --results, and a --cache other than
    the one a finished report was made with (which the up-to-date check used to accept)."""
    import subprocess
    import sys

    import kvlingo.inputs.models as models

    root, train, run, pair = finished["root"], finished["train"], finished["run"], finished["pair"]
    before = snapshot(root)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights were loaded before the refusal"))
        for setting in ("layers:99", "layer:7"):
            err = refused(benchmark.main, [*run, *pair, "--data", str(finished["data"]), "--refresh", setting], capsys)
            assert "but the target has" in err or "but the target's layers are" in err
            assert "give layers:K with K ≤" in err
        err = refused(train_translator.main, [*train, "--run", "b", "--batch", "13"], capsys)
        assert "--batch 13 is more than the 12 training conversations" in err

    ckpts = root / "artifacts" / "r" / "checkpoints"
    saved = {p: p.read_bytes() for p in ckpts.glob("ckpt_*.pt")}
    assert saved
    try:
        for p, data in saved.items():
            p.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        err = refused(train_translator.main, [*train, *NOT_UP_TO_DATE, "--resume"], capsys)
        assert "no intact checkpoint" in err and "drop --resume" in err
    finally:
        for p, data in saved.items():
            p.write_bytes(data)

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvlingo.stages.skeleton import lock_run; "
            f"lock_run({str(root / 'artifacts' / 'r')!r}, 'train', root_flag='--artifacts'); "
            "print('held', flush=True); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        other_results = [a if a != str(root / "results") else str(tmp_path / "results") for a in train]
        err = refused(train_translator.main, [*other_results, *NOT_UP_TO_DATE, "--resume"], capsys)
        assert f"another train is still running in {root / 'artifacts' / 'r'}" in err
    finally:
        holder.kill()
        holder.wait()
    assert snapshot(root) == before

    bench = [*run, *pair, "--data", str(finished["data"]), "--allow-cv"]
    benchmark.main(bench)
    report = json.loads((root / "results" / "r" / "benchmark.json").read_text())
    assert report["env"]["cache"] == report["config"]["pair"]["cache"] == "preallocated"
    capsys.readouterr()
    benchmark.main([*bench, "--cache", "dynamic"])  # other code on the handoff's path: measured again
    assert "is up to date" not in capsys.readouterr().out
    report = json.loads((root / "results" / "r" / "benchmark.json").read_text())
    assert report["env"]["cache"] == report["config"]["pair"]["cache"] == "dynamic"
    assert report["results"]["timing"]["contexts"][0]["paths"]["target_reprefill"]["n"] > 0
    benchmark.main(bench)  # the flag is this run's setting, not the process's: preallocated again, measured again
    assert "is up to date" not in capsys.readouterr().out
    assert json.loads((root / "results" / "r" / "benchmark.json").read_text())["env"]["cache"] == "preallocated"


def test_ctrl_c_ends_a_stage_in_one_line_and_frees_its_run_lock(tmp_path, capsys):
    from kvlingo.stages.skeleton import INTERRUPTED_STATUS, lock_run, refusals_exit

    def stage(resumable: bool):
        @refusals_exit("demo", resumable=resumable)
        def main():
            lock_run(tmp_path / "run", "demo")  # held, then freed by the decorator
            raise KeyboardInterrupt

        return main

    for resumable in (True, False):
        with pytest.raises(SystemExit) as e:
            stage(resumable)()
        err = capsys.readouterr().err
        assert e.value.code == INTERRUPTED_STATUS and err.count("\n") == 1, err
        assert err.startswith("demo: interrupted; every file it wrote is whole") and ("--resume" in err) == resumable


def test_sigterm_ends_a_stage_in_one_line_with_its_status(tmp_path):
    """`kill PID` of a running stage (a scheduler's preemption): one line saying it stopped and how to go on, and
    status 143, as Ctrl-C's 130; it once ended silently with -15."""
    import signal
    import subprocess
    import sys
    import time

    from kvlingo.stages.skeleton import TERMINATED_STATUS

    code = (
        "import sys, time; from kvlingo.stages.skeleton import refusals_exit\n"
        "@refusals_exit('train_translator', resumable=True)\n"
        "def main():\n    print('ready', flush=True); time.sleep(60)\n"
        "main()"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == TERMINATED_STATUS == 143, err
    assert err.count("\n") == 1 and err.startswith("train_translator: stopped by SIGTERM") and "--resume" in err, err


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
    benchmarked_run, tmp_path, monkeypatch, capsys, stage, output
):
    """Once, all the work ran, then IsADirectoryError with a traceback, exit 1 and partial files."""
    folder = tmp_path / output.replace("RUN", "r")
    results = ["--results", str(tmp_path / "results"), "--run", "r"]  # the finished run's translators, new results
    argv = {
        "train": moved(benchmarked_run, tmp_path),  # a new run in new roots
        "benchmark": [
            *benchmarked_run["run"],
            *benchmarked_run["pair"],
            "--data",
            str(benchmarked_run["data"]),
            *results,
        ],
        "ifeval": [*benchmarked_run["ifeval"], *results],
    }[stage]
    folder.mkdir(parents=True)
    no_models(monkeypatch)
    main = {"train": train_translator.main, "benchmark": benchmark.main, "ifeval": ifeval.main}[stage]
    err = refused(main, argv, capsys)
    assert f"{folder} is a folder, but the stage writes a file there: remove it (rmdir {folder})" in err, err
    assert "estimate: peak" not in refused.out
    assert not [f for f in files_under(tmp_path) if not f.endswith(".lock")]
