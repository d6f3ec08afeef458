"""The recipe: selection on validation KL only, resume and refusal, the stages' pass-through flags.

Everything but the slow test runs the orchestration with a fake stage runner (no subprocess, no model): it writes
the reports a stage would, so that what the recipe reads and decides can be checked against values worked out
here. The slow test runs the real stages on the tiny pair, kills the recipe mid-cell and resumes it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakestage import fake_stage, flags_of, val_kl_of

import recipe
from kvlingo.errors import Refusal
from kvlingo.io import atomic_write_json, atomic_write_text, read_json, sha256_file
from kvlingo.records.report import sealed
from kvlingo.stages import cells as K

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- fake stages
class FakeStages:
    """Stands in for the stage scripts (fakestage.py): writes their outputs where they would and records each call."""

    def __init__(self, interrupt_at: int | None = None, forbid: bool = False):
        self.calls, self.interrupt_at, self.forbid, self.donor_seen = [], interrupt_at, forbid, {}

    def __call__(self, argv, report):
        if self.forbid:
            raise AssertionError(f"no stage should run, but {argv[0]} was started")
        self.calls.append(list(argv))
        if self.interrupt_at == len(self.calls):
            raise KeyboardInterrupt  # a kill while the stage runs: the ledger still says "running"
        rep = fake_stage(argv, report)
        if "donor_rows_seen" in rep:
            self.donor_seen[int(flags_of(argv)["--run"][0].rsplit("-s", 1)[1])] = rep["donor_rows_seen"]
        return rep


@pytest.fixture
def world(tmp_path, tiny_pair_paths):
    data = tmp_path / "data"
    atomic_write_json(data / "manifest.json", sealed({"stage": "prepare", "files": {}}))
    src = tmp_path / "ifeval.jsonl"
    src.write_text('{"key": 1, "prompt": "p", "instruction_id_list": [], "kwargs": []}\n')
    large, small = map(str, tiny_pair_paths)  # configs and tokenizers only: the fake stages load no weights
    argv = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--run",
        "r",
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
    ]
    return {"argv": argv, "root": tmp_path, "res": tmp_path / "results" / "r", "data": data, "large": large}


def ledger(world) -> dict:
    return read_json(world["res"] / K.LEDGER_FILE)


def names(calls) -> list[str]:
    out = []
    for argv in calls:
        f = flags_of(argv)
        out.append(f"{Path(argv[0]).stem}:{f['--run'][0].split('/', 1)[1]}")
    return out


EXPECTED = [  # tiny profile: grid [1e-4, 3.16e-4], the winner 3.16e-4 is an edge, so 1e-3 is added; seeds 42, 43
    "benchmark:native",
    "ifeval:native",
    "train_translator:closed",
    "train_translator:lr1.00e-04-s42",
    "train_translator:lr3.16e-04-s42",
    "train_translator:lr1.00e-03-s42",
    "train_translator:lr3.16e-04-s43",
    "benchmark:lr3.16e-04-s42",
    "ifeval:lr3.16e-04-s42",
    "benchmark:lr3.16e-04-s43",
    "ifeval:lr3.16e-04-s43",
]


# --------------------------------------------------------------------------- orchestration with fake stages
def test_recipe_selects_on_validation_kl_and_aggregates_seeds(world):
    fake = FakeStages()
    rep = recipe.main(world["argv"], runner=fake)
    assert names(fake.calls) == EXPECTED
    search = rep["results"]["lr_search"]
    # the validation KL's minimum, not the decoy test KL's (1e-4) nor the benchmark's
    assert search["chosen_lr"] == 3.16e-4 and search["extensions"] == 1 and not search["cap_hit"]
    assert [c["lr"] for c in search["cells"]] == [1e-4, 3.16e-4, 1e-3]
    assert [c["val_kl"] for c in search["cells"]] == [val_kl_of(lr, 42) for lr in (1e-4, 3.16e-4, 1e-3)]

    for argv in fake.calls:  # pair flags, profile and data reach every stage
        f = flags_of(argv)
        assert f["--large"] == [world["large"]] and f["--device"] == ["cpu"] and f["--dtype"] == ["float32"]
        assert f["--profile"] == ["tiny"] and f["--direction"] == ["l2s"]
        if Path(argv[0]).name != "ifeval.py":
            assert f["--data"] == [str(world["data"])]
        if Path(argv[0]).name == "train_translator.py" and "--closed-form-only" not in f:
            assert f["--init-from"] == [str(world["root"] / "artifacts" / "r" / "closed" / "closed_form")]
        assert "--resume" not in f and "--force" in f  # a fresh recipe starts every stage it runs afresh
    assert fake.donor_seen == {42: True, 43: True}  # the native IFEval rows were put beside each seed's run

    res = rep["results"]
    assert set(res["per_seed"]) == {"42", "43"}
    d = res["across_seeds"]["benchmark"]["distilled.kl_token_mean"]
    assert d["mean"] == pytest.approx(0.25) and d["se"] == pytest.approx(statistics.stdev([0.2, 0.3]) / math.sqrt(2))
    t = res["across_seeds"]["ifeval"]["translated.prompt_level_strict_acc"]
    assert t["mean"] == pytest.approx(0.25) and t["n"] == 2
    assert res["ifeval_item_level"]["42"]["translated.prompt_level_strict_acc"]["se"] == 0.05
    v = res["across_seeds"]["train"]["distilled_val_kl"]
    assert v["mean"] == pytest.approx(statistics.mean([val_kl_of(3.16e-4, s) for s in (42, 43)]))
    assert set(res["native"]["benchmark"]) == {"native_source", "native_target", "no_context"}
    assert rep["stage"] == "recipe" and rep["seeds"] == [42, 43]

    md = (world["res"] / "recipe.md").read_text()
    assert "Chosen rate: **0.000316**" in md and "seed 43" in md and "mean ± SE" in md
    assert (world["res"] / "recipe.png").read_bytes()[:4] == b"\x89PNG"
    cells = ledger(world)["cells"]
    assert len(cells) == len(EXPECTED) and all(c["status"] == "done" and c["runs"] == 1 for c in cells.values())


def test_resume_skips_finished_cells_and_continues_the_interrupted_one(world):
    with pytest.raises(SystemExit) as interrupted:  # Ctrl-C: one line and status 130 (stage.refusals_exit)
        recipe.main(world["argv"], runner=FakeStages(interrupt_at=5))  # killed inside train lr3.16e-04-s42
    assert interrupted.value.code == 130
    before = ledger(world)["cells"]
    assert [n for n, c in before.items() if c["status"] == "done"] == [
        "benchmark/native",
        "ifeval/native",
        "train/closed",
        "train/lr1.00e-04-s42",
    ]
    assert before["train/lr3.16e-04-s42"]["status"] == "running"
    mtimes = {n: os.stat(c["report"]).st_mtime_ns for n, c in before.items() if c["status"] == "done"}

    fake = FakeStages()
    recipe.main(world["argv"] + ["--resume"], runner=fake)
    assert names(fake.calls) == EXPECTED[4:]  # nothing finished was redone
    assert all("--resume" in a for a in fake.calls if Path(a[0]).name != "benchmark.py")  # stages continue too
    after = ledger(world)["cells"]
    for n in mtimes:
        assert after[n]["finished_unix"] == before[n]["finished_unix"]
        assert os.stat(after[n]["report"]).st_mtime_ns == mtimes[n]
    assert after["train/lr3.16e-04-s42"]["runs"] == 2 and after["train/lr1.00e-03-s42"]["runs"] == 1

    rep = recipe.main(world["argv"] + ["--resume"], runner=FakeStages(forbid=True))  # all finished: nothing runs
    assert {c["action"] for c in rep["results"]["cells"]} == {"skipped (finished)"}
    assert ledger(world)["cells"] == {**after}  # same entries, same timestamps


def test_a_second_recipe_keeps_its_up_to_date_cells_and_runs_the_rest_afresh(world, capsys):
    """Without --resume, a recipe under the same settings reruns only what is not up to date (a changed report
    here); --force reruns every cell; other settings start a fresh ledger."""
    recipe.main(world["argv"], runner=FakeStages())
    capsys.readouterr()
    rep = recipe.main(world["argv"], runner=FakeStages(forbid=True))
    assert {c["action"] for c in rep["results"]["cells"]} == {"skipped (finished)"}
    assert (
        capsys.readouterr().out.count(": up to date (finished with the same key") == len(EXPECTED) + 1
    )  # seed 42 reads its search cell
    report = Path(ledger(world)["cells"]["benchmark/lr3.16e-04-s43"]["report"])
    report.write_text(report.read_text().replace("0.3", "0.9"))
    fake = FakeStages()
    recipe.main(world["argv"], runner=fake)
    assert names(fake.calls) == ["benchmark:lr3.16e-04-s43"] and "--force" in fake.calls[0]
    fake = FakeStages()
    recipe.main(world["argv"] + ["--force"], runner=fake)
    assert names(fake.calls) == EXPECTED and all("--force" in a for a in fake.calls)
    fake = FakeStages()
    recipe.main(world["argv"] + ["--seeds", "42"], runner=fake)
    assert names(fake.calls) == [n for n in EXPECTED if not n.endswith("-s43")]


def test_resume_reruns_a_cell_whose_report_was_changed(world):
    recipe.main(world["argv"], runner=FakeStages())
    report = Path(ledger(world)["cells"]["benchmark/lr3.16e-04-s43"]["report"])
    report.write_text(report.read_text().replace("0.3", "0.9"))
    fake = FakeStages()
    recipe.main(world["argv"] + ["--resume"], runner=fake)
    assert names(fake.calls) == ["benchmark:lr3.16e-04-s43"]


def test_resume_refuses_changed_settings_and_inputs_naming_them(world, capsys):
    world["capsys"] = capsys
    recipe.main(world["argv"], runner=FakeStages())

    def refused(extra, pattern):
        capsys = world["capsys"]
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            recipe.main(world["argv"] + extra, runner=FakeStages(forbid=True))
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.search(pattern, err), err

    refused(["--resume", "--seeds", "42"], r"settings changed: seeds: \[42, 43\] → \[42\]")
    refused(["--resume", "--updates", "3"], r"updates: 4 → 3")
    atomic_write_json(world["data"] / "manifest.json", {"stage": "prepare", "files": {}, "edited": True})
    refused(["--resume"], r"cell benchmark/native .*inputs\.data\.manifest_sha256")
    fake = FakeStages()  # a fresh recipe (no --resume) starts over
    recipe.main(world["argv"], runner=fake)
    assert names(fake.calls) == EXPECTED


def test_passthrough_may_not_override_what_the_recipe_sets(world, capsys):
    for flag, what in (("--train-args=--lr 1e-3", "--lr"), ("--benchmark-args=--force", "--force")):
        with pytest.raises(SystemExit) as e:
            recipe.main(world["argv"] + [flag], runner=FakeStages(forbid=True))
        assert e.value.code == 2 and f"may not set {what}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, text, message",
    [
        ("--train-args", "--batch 2 --bogus 3", r"--train-args: train_translator.py: no flag --bogus"),
        ("--train-args", "--batch two", r"--train-args: argument --batch: .*'two'"),
        (
            "--train-args",
            "--upd 3",
            r"no flag --upd \(flags are spelled out in full, never abbreviated\); did you mean --updates\?",
        ),  # not --updates
        ("--benchmark-args", "--variant bent", r"--benchmark-args: argument --variant: invalid choice: 'bent'"),
        ("--ifeval-args", "--max-new-tokens", r"--ifeval-args: argument --max-new-tokens: expected one argument"),
        ("--ifeval-args", "--help", r"--help passed through to ifeval.py would print its help"),
        ("--train-args", "--batch '2", r"does not split into flags"),
    ],
)
def test_passthrough_is_parsed_by_the_stage_before_any_cell_runs(world, flag, text, message, capsys):
    with pytest.raises(SystemExit) as refused:
        recipe.main(world["argv"] + [f"{flag}={text}"], runner=FakeStages(forbid=True))  # forbid: no cell may run
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and err.startswith("recipe: ") and re.search(message, err), err
    assert "see .venv/bin/python" in err or "split" in message
    assert out == ""  # the stage's parser printed no help or usage on the way
    assert not (world["res"] / K.LEDGER_FILE).exists()  # refused before the ledger was written


def test_passthrough_the_stage_takes_reaches_every_cell(world):
    fake = FakeStages()
    recipe.main(world["argv"] + ["--train-args=--batch 2", "--benchmark-args=--allow-cv"], runner=fake)
    train = [a for a in fake.calls if Path(a[0]).name == "train_translator.py"]
    bench = [a for a in fake.calls if Path(a[0]).name == "benchmark.py"]
    assert train and all(a[a.index("--batch") + 1] == "2" for a in train)
    assert bench and all("--allow-cv" in a for a in bench)


def test_quick_and_explicit_shrinking(world):
    fake = FakeStages()
    recipe.main(world["argv"] + ["--quick", "--skip", "ifeval", "--lr-center", "1e-3", "--grid-size", "3"], runner=fake)
    # grid [3.16e-4, 1e-3, 3.16e-3 (diverges)]: the winner 3.16e-4 is the lower edge, so 1e-4 is added (--quick
    # allows one extension), which makes it interior; one seed; no IFEval
    assert names(fake.calls) == [
        "benchmark:native",
        "train_translator:closed",
        "train_translator:lr3.16e-04-s42",
        "train_translator:lr1.00e-03-s42",
        "train_translator:lr3.16e-03-s42",
        "train_translator:lr1.00e-04-s42",
        "benchmark:lr3.16e-04-s42",
    ]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(["--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


# --------------------------------------------------------------------------- end to end on the tiny pair
def split_rows(tok, n: int, seed: int, tag: str) -> list[dict]:
    from tinypair import chat_rows

    return chat_rows(tok, n, seed, tag, user_words=(8, 24), reply_words=(3, 8))


@pytest.mark.slow
def test_tiny_recipe_killed_mid_cell_then_resumed(tiny_pair_paths, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from kvlingo.eval.tasks import grader as ifeval_grader

    large, small = tiny_pair_paths
    tok = AutoTokenizer.from_pretrained(large)
    data = tmp_path / "data" / "tiny"
    files = {}
    for split, n, seed in (("train", 16, 0), ("validation", 4, 1), ("test", 3, 2)):
        path = data / f"{split}.natural.jsonl"
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in split_rows(tok, n, seed, split)))
        files[path.name] = sha256_file(path)
    from tinypair import write_prepared

    write_prepared(
        data,
        tok,
        {
            split: [json.loads(x) for x in (data / f"{split}.natural.jsonl").read_text().splitlines()]
            for split in ("train", "validation", "test")
        },
    )
    docs = [
        {
            "key": 1,
            "prompt": "Describe the cat on the mat. Do not use commas.",
            "instruction_id_list": ["punctuation:no_comma"],
            "kwargs": [{}],
        },
        {
            "key": 2,
            "prompt": "Answer in lowercase: what did ada write?",
            "instruction_id_list": ["change_case:english_lowercase"],
            "kwargs": [{}],
        },
    ]
    atomic_write_text(tmp_path / "ifeval.jsonl", "".join(json.dumps(d) + "\n" for d in docs))
    nltk_home = tmp_path / "nltk_data"
    ifeval_grader.install_punkt(nltk_home)
    for k, v in {"NLTK_DATA": str(nltk_home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)

    argv = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--run",
        "e2e",
        "--large",
        str(large),
        "--small",
        str(small),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--grid-size",
        "2",
        "--seeds",
        "42",
        "--max-extensions",
        "0",
        "--updates",
        "2",
        "--ifeval-source",
        str(tmp_path / "ifeval.jsonl"),
        "--ifeval-args=--max-new-tokens 4",
        "--benchmark-args=--allow-cv --timing-conversations 0 --control-dtypes float32",
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--results",
        str(tmp_path / "results"),
    ]
    state = tmp_path / "results" / "e2e" / K.LEDGER_FILE
    # A snapshot of the code: every cell key holds the code hash, and a resume across a code edit is
    # (rightly) refused, so the run must not see edits made to the working tree meanwhile.
    code = tmp_path / "code"
    code.mkdir()
    for p in ROOT.glob("*.py"):
        shutil.copy2(p, code / p.name)
    shutil.copytree(ROOT / "kvlingo", code / "kvlingo", ignore=shutil.ignore_patterns("__pycache__"))

    def launch(*extra: str, name: str) -> subprocess.Popen:
        # Its own process group, so that a kill takes the recipe and the stage it is running.
        return subprocess.Popen(
            [sys.executable, str(code / "recipe.py"), *argv, *extra],
            cwd=tmp_path,
            stdout=open(tmp_path / f"{name}.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-3000:]

    proc = launch(name="first")
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        try:
            cells = read_json(state)["cells"]
        except (OSError, ValueError):
            cells = {}
        if sum(c["status"] == "done" for c in cells.values()) >= 3 and any(
            c["status"] == "running" for c in cells.values()
        ):
            time.sleep(3)  # into the next cell's run
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, tail("first")
    before = read_json(state)["cells"]
    done = {
        n: (c["finished_unix"], os.stat(c["report"]).st_mtime_ns) for n, c in before.items() if c["status"] == "done"
    }
    interrupted = [n for n, c in before.items() if c["status"] == "running"]
    assert len(done) >= 3 and len(interrupted) == 1

    assert launch("--resume", name="second").wait() == 0, tail("second")
    after = read_json(state)["cells"]
    assert all(c["status"] == "done" for c in after.values()) and len(after) == 7
    for n, (finished, mtime) in done.items():  # finished cells were not redone
        assert after[n]["finished_unix"] == finished and os.stat(after[n]["report"]).st_mtime_ns == mtime
    assert after[interrupted[0]]["runs"] == 2 and sum(c["runs"] for c in after.values()) == 8
    rep = read_json(tmp_path / "results" / "e2e" / "recipe.json")
    res = rep["results"]
    assert res["lr_search"]["cap_hit"] is True and len(res["lr_search"]["cells"]) == 2
    chosen = min(res["lr_search"]["cells"], key=lambda c: c["val_kl"])
    assert res["lr_search"]["chosen_lr"] == chosen["lr"]
    train = read_json(Path(after[chosen["cell"]]["report"]))
    assert (
        train["results"]["distilled_val_kl"] == chosen["val_kl"] and train["n_samples"]["validation_conversations"] == 4
    )
    seed = res["per_seed"]["42"]
    assert seed["benchmark"]["distilled.kl_token_mean"] >= 0 and "translated.prompt_level_strict_acc" in seed["ifeval"]
    for name in ("recipe.md", "recipe.png"):
        assert (tmp_path / "results" / "e2e" / name).is_file()

    assert launch("--resume", name="third").wait() == 0, tail("third")  # nothing left to run
    again = read_json(tmp_path / "results" / "e2e" / "recipe.json")
    assert {c["action"] for c in again["results"]["cells"]} == {"skipped (finished)"}
    assert read_json(state)["cells"] == after


def test_a_recipe_without_distillation_updates_is_refused():
    """With --updates 0 every rate of the search gives the closed-form maps, so a "chosen" rate would mean nothing."""
    args = recipe.parse_args(["--profile", "tiny", "--lr-center", "1e-3", "--updates", "0"])
    with pytest.raises(Refusal, match="--updates must be ≥ 1 .*nothing to choose"):
        recipe.make_config(args, pair=None)
    assert (
        recipe.make_config(
            recipe.parse_args(["--profile", "tiny", "--lr-center", "1e-3", "--updates", "1"]), pair=None
        ).updates
        == 1
    )
