"""The training stage end to end on the tiny pair: distillation and its outputs, resume guards and checkpoints,
frozen models, a full disk, the family and objective flags.

References: an uninterrupted run for resume, the run's own earlier reports for what is up to date."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from stagecli import files_under, full_disk, moved, no_models, refused
from tinypair import chat_rows, load_tiny_pair, write_prepared
from trainrun import write_train_split

import train_translator
from kvlingo.core.translator import TranslatorError
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.io import read_json
from kvlingo.records import resume
from kvlingo.records.saved import load_state, load_translator, read_manifest
from kvlingo.train import frozen as F

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "train_translator.py"


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
        "--lr",
        "3e-3",
        "--batch",
        "2",
        "--n-fit",
        "12",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
        *extra,
    ]


def main(argv):
    import train_translator

    return train_translator.main(argv)


@pytest.fixture(scope="module")
def trained(tiny_pair_paths, train_data, tmp_path_factory):
    """One complete run: 8 updates, checkpoints every 2, validation every 4, of head-wise maps without refresh,
    whose closed form leaves room for 8 updates to show (the default's closed form, with the exact layer 0 and
    the token features, is already near its distilled KL on the tiny pair)."""
    root = tmp_path_factory.mktemp("run")
    args = cli(
        tiny_pair_paths,
        train_data[0],
        root,
        "base",
        *HEADWISE,
        "--updates",
        "8",
        "--checkpoint-every",
        "2",
        "--val-every",
        "4",
    )
    return root, args, main(args)


HEADWISE = ("--family", "headwise", "--refresh", "none")  # maps with `weight` and `bias`, no token term
# a pair's cache geometry, for building a run's config without models
SMALL_GEOMETRY = {"source_layers": 4, "source_kv_heads": 2, "source_head_dim": 8}
SMALL_GEOMETRY |= {"target_layers": 4, "target_kv_heads": 2, "target_head_dim": 8}


def maps_equal(a: Path, b: Path) -> bool:
    """Two saved translators hold the same tensors, bit for bit (any family)."""
    sa, sb = load_state(a).state_dict(), load_state(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_distillation_lowers_validation_kl_and_writes_outputs(trained, pair32):
    root, _, report = trained
    res = report["results"]
    assert res["distilled_val_kl"] < 0.97 * res["closed_form_val_kl"], res["val_kl_curve"]
    assert [p["update"] for p in res["val_kl_curve"]] == [0, 4, 8] and len(res["loss_curve"]) == 8
    assert res["frozen_weights"]["verified"] and all(m["match"] for m in res["frozen_weights"]["models"].values())
    art, out = root / "artifacts" / "base", root / "results" / "base"
    cf, manifest = load_state(art / "closed_form"), read_manifest(art / "closed_form")
    dist, dmanifest = load_state(art / "distilled"), read_manifest(art / "distilled")
    assert not torch.equal(cf.weight, dist.weight)
    assert dmanifest["direction"] == "l2s" and dmanifest["key_space"] == "prenorm" and dmanifest["family"] == "headwise"
    assert dmanifest["closed_form_sha256"] == manifest["maps_sha256"]
    translator, _ = load_translator(art / "distilled", pair32, key_space="prenorm")  # how later stages load it
    assert torch.equal(translator.weight, dist.weight)
    saved = json.loads((out / "train.json").read_text())
    assert (
        saved["stage"] == "train"
        and saved["config"]["lr"] == 3e-3
        and set(saved["inputs"]["data"]) == {"train.natural.jsonl", "validation.natural.jsonl"}
    )
    assert (out / "train.md").read_text().startswith("# train: base")
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (art / "checkpoints").iterdir()) == sorted(
        [f"ckpt_{u:06d}.pt" for u in (2, 4, 6, 8)] + [f"DONE_{u:06d}" for u in (2, 4, 6, 8)]
    )


def test_the_validation_kl_comes_with_its_n_and_its_se_over_conversations(trained, train_data, pair32):
    """Once, train.md gave the validation KL with neither SE nor n, and train.json held no SE. Now each point of the
    curve holds its SE over the validation conversations, n_samples their reply tokens, and the page both. The
    reference: validation_kl on the saved closed-form maps, and mean_se of its figure on each conversation alone."""
    from kvlingo.core.settings import Refresh
    from kvlingo.eval.stats import mean_se
    from kvlingo.records.report import fmt_pm
    from kvlingo.train.distill import validation_kl

    root, _, report = trained
    res, n, val = report["results"], report["n_samples"], train_data[2]
    translator, _ = load_translator(root / "artifacts" / "base" / "closed_form", pair32, key_space="prenorm")

    def kl(rows):
        return validation_kl(
            pair32.source, pair32.target, translator, rows, torch.float32, refresh=Refresh(), kind=pair32.cache
        )[0]

    ref, first = mean_se([kl([r]) for r in val]), res["val_kl_curve"][0]
    assert first["val_kl"] == res["closed_form_val_kl"] and abs(first["val_kl"] - kl(val)) <= 1e-6 * ref["mean"]
    assert abs(first["se"] - ref["se"]) <= 1e-6 * ref["se"] and all(p["se"] > 0 for p in res["val_kl_curve"])
    tokens = sum(len(r["reply_ids"]) for r in val)
    assert n["validation_conversations"] == len(val) == 6 and n["validation_reply_tokens"] == tokens
    dist = (res["best"] or res["val_kl_curve"][-1])["update"]  # the saved translator's validation
    dist = next(p for p in res["val_kl_curve"] if p["update"] == dist)
    assert dist["val_kl"] == res["distilled_val_kl"] and dist["se"] == res["distilled_val_kl_se"]
    assert first["se"] == res["closed_form_val_kl_se"]  # each headline KL carries its SE beside it
    page = (root / "results" / "base" / "train.md").read_text()
    assert f"n = {len(val)} conversations ({tokens} reply tokens)" in page
    for p in (first, dist):
        assert fmt_pm({"mean": p["val_kl"], "se": p["se"]}) in page


def test_a_resumed_training_page_gives_the_total_wall_time(tiny_pair_paths, train_data, tmp_path):
    """Once, after an interrupted training resumed, train.md said "Wall time 23.1 s", the resumed stretch alone,
    while train.json's wall_time_s_total said 50.5 s. Now the page gives the total, and this invocation's."""
    from kvlingo.train import checkpoints as ckpt

    args = cli(tiny_pair_paths, train_data[0], tmp_path, "r", *HEADWISE, "--updates", "4", "--checkpoint-every", "2")
    main(args)
    ckpts = tmp_path / "artifacts" / "r" / "checkpoints"
    for name in ("ckpt_000004.pt", "DONE_000004"):  # killed after update 2's checkpoint, before the report
        (ckpts / name).unlink()
    (tmp_path / "results" / "r" / "train.json").unlink()
    state = ckpt.load_checkpoint(*ckpt.checkpoint_paths(ckpts, 2))
    state["history"]["wall_time_s"] += 1000.0  # the stretch before the kill ran long
    ckpt.save_checkpoint(ckpts, 2, {k: v for k, v in state.items() if k not in ("format", "update")})
    rep = main([*args, "--resume"])
    total, wall = rep["results"]["wall_time_s_total"], rep["wall_time_s"]
    assert rep["results"]["resumed_from_update"] == 2 and total > 1000 > wall
    page = (tmp_path / "results" / "r" / "train.md").read_text()
    assert f"Wall time {total:.1f} s distilling in all (every resumed stretch), {wall:.1f} s this invocation." in page


def test_init_from_reuses_the_closed_form(tiny_pair_paths, train_data, trained, tmp_path):
    root, _, base = trained
    src = root / "artifacts" / "base" / "closed_form"
    rep = main(
        cli(tiny_pair_paths, train_data[0], tmp_path, "reuse", *HEADWISE, "--init-from", str(src), "--closed-form-only")
    )
    assert maps_equal(src, tmp_path / "artifacts" / "reuse" / "closed_form")
    assert rep["results"]["distilled_val_kl"] is None
    assert rep["results"]["closed_form_val_kl"] == base["results"]["closed_form_val_kl"]
    with pytest.raises(SystemExit) as e:
        main(
            cli(
                tiny_pair_paths,
                train_data[0],
                tmp_path,
                "reuse2",
                *HEADWISE,
                "--init-from",
                str(src),
                "--key-space",
                "cache",
            )
        )
    assert e.value.code == 2


# --------------------------------------------------------------------------- resume guards and checkpoints
def test_resume_refuses_each_change_and_accepts_none(
    tiny_pair_paths, train_data, trained, tmp_path, capsys, monkeypatch
):
    root, args, _ = trained
    ckpts = root / "artifacts" / "base" / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}

    def refused(argv, pattern):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err  # one line, no traceback
        assert re.search(pattern, err), err

    refused(
        [*args, "--resume", "--lr", "1e-3"],
        r"refusing to resume base.*settings changed: settings\.lr: 0\.003 → 0\.001;.*drop --resume",
    )
    refused(
        [*args, "--resume", "--val-every", "3"], r"settings changed: settings\.val_every: 4 → 3;"
    )  # where the curve is measured
    with monkeypatch.context() as m:  # an edit of the code the stage imports
        m.setattr(resume, "code_hash", lambda *scripts: "e" * 64)
        refused([*args, "--resume"], r"refusing to resume.*code changed: code: \w+… → eeeeeeeeeeee…")
    # data: same folder layout elsewhere, one reply token changed
    rows = [json.loads(line) for line in (train_data[0] / "train.natural.jsonl").read_text().splitlines()]
    rows[3]["reply_ids"][0] = (rows[3]["reply_ids"][0] + 1) % 300
    changed = write_train_split(tmp_path / "data", rows, train_data[2])
    refused(
        [*args, "--resume", "--data", str(changed)], r"data changed: inputs\.data\.train\.natural\.jsonl: \w+… → \w+…"
    )
    # model: a copy of the small model with one weight nudged
    from transformers import AutoModelForCausalLM

    small = tmp_path / "small"
    shutil.copytree(tiny_pair_paths[1], small)
    m = AutoModelForCausalLM.from_pretrained(small)
    with torch.no_grad():
        m.model.norm.weight[0] += 0.5
    m.save_pretrained(small)
    refused([*args, "--resume", "--small", str(small)], r"models changed: pair\.target\.")
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before  # a refusal touches nothing

    # Unchanged inputs (and a resume-safe setting, recorded as it ran) resume from the last checkpoint and
    # change nothing.
    dist = root / "artifacts" / "base" / "distilled" / "maps.safetensors"
    old = dist.read_bytes()
    rep = main([*args, "--resume", "--checkpoint-every", "3"])
    assert rep["results"]["resumed_from_update"] == 8 and dist.read_bytes() == old
    assert rep["results"]["segments"] == [
        {"from_update": 0, "checkpoint_every": 2, "world_size": 1},
        {"from_update": 8, "checkpoint_every": 3, "world_size": 1},
    ]


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--lr", "nan"), "train_translator.py: argument --lr: nan is out of range; give a finite number > 0"),
        (("--lr", "-1e-3"), "train_translator.py: argument --lr: -1e-3 is out of range; give a finite number > 0"),
        (("--n-fit", "0"), "train_translator.py: argument --n-fit: 0 is below 1; give a whole number ≥ 1"),
        (("--ridge", "-1"), "train_translator: --ridge -1.0 is invalid: it must be a finite number ≥ 0"),
        (("--ridge", "much"), "train_translator: --ridge much is invalid: give a number ≥ 0, or auto"),
        (("--weight-decay", "nan"), "train_translator.py: argument --weight-decay: nan is out of range"),
        (
            ("--value-fit", "output", "--init-from", "elsewhere"),
            "train_translator: --value-fit output with --init-from: the closed form is the folder's",
        ),
        (
            ("--family", "crosshead", "--value-fit", "output"),
            "train_translator: --value-fit output: the attention-output value fit needs one fit block per target "
            "layer and KV head",
        ),
    ],
)
def test_settings_out_of_range_are_refused_in_one_line_before_any_weights_load(
    tiny_pair_paths, train_data, tmp_path, capsys, monkeypatch, flags, says
):
    monkeypatch.setattr("kvlingo.inputs.models.load_pair", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, train_data[0], tmp_path, "bad", *flags))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(says), err
    assert not (tmp_path / "artifacts" / "bad").exists()


def test_split_files_are_checked_against_the_data_manifest(tiny_pair_paths, train_data, tmp_path, capsys):
    folder = write_train_split(tmp_path / "data", train_data[1], train_data[2])
    with (folder / "validation.natural.jsonl").open("a") as f:
        f.write(json.dumps(train_data[2][0]) + "\n")
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, folder, tmp_path, "manifest", "--updates", "1"))
    assert e.value.code == 2 and "validation.natural.jsonl was changed after preparation" in capsys.readouterr().err


def test_resume_after_truncated_checkpoint_falls_back_and_matches(tiny_pair_paths, train_data, trained, tmp_path):
    root, args, _ = trained
    shutil.copytree(root / "artifacts", tmp_path / "artifacts")
    newest = tmp_path / "artifacts" / "base" / "checkpoints" / "ckpt_000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    moved = [a if a != str(root / "artifacts") else str(tmp_path / "artifacts") for a in args]
    moved = [a if a != str(root / "results") else str(tmp_path / "results") for a in moved]
    rep = main([*moved, "--resume"])
    assert rep["results"]["resumed_from_update"] == 6
    assert maps_equal(root / "artifacts" / "base" / "distilled", tmp_path / "artifacts" / "base" / "distilled")


def test_a_finished_training_is_up_to_date_until_an_input_or_output_changes(trained, tmp_path, capsys, monkeypatch):

    root, args, _ = trained
    shutil.copytree(root, tmp_path / "run")
    args = [str(tmp_path / "run") + a.removeprefix(str(root)) if a.startswith(str(root)) else a for a in args]
    report = tmp_path / "run" / "results" / "base" / "train.json"
    maps = tmp_path / "run" / "artifacts" / "base" / "distilled" / "maps.safetensors"
    main(args)  # trains once more if an earlier test left another training's report in this run
    first = json.loads(report.read_text())

    def loads_nothing(*_a, **_k):
        raise AssertionError("an up-to-date training loaded the models")

    with monkeypatch.context() as m:
        m.setattr("kvlingo.inputs.models.load_pair", loads_nothing)
        capsys.readouterr()
        assert main(args) == first  # same config, data, models and code: nothing runs, nothing is rewritten
        assert f"{report} is up to date (same config, inputs and code); --force re-trains" in capsys.readouterr().out
        assert main([*args, "--resume"]) == first and json.loads(report.read_text()) == first
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--force"])  # --force trains again
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--updates", "9"])  # a changed setting trains again
        with pytest.raises(AssertionError, match="loaded the models"):
            main([*args, "--closed-form-only"])  # another kind of run trains again
        saved = maps.read_bytes()
        maps.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
        with pytest.raises(AssertionError, match="loaded the models"):
            main(args)  # maps that are not the ones the report records: trained again
        maps.write_bytes(saved)
        assert main(args) == first
    rep = main([*args, "--force"])
    assert rep["created_unix"] > first["created_unix"] and maps.read_bytes() == saved  # retrained bit for bit


def test_frozen_weights_are_verified(tiny_pair_paths, train_data, tmp_path, monkeypatch, capsys):
    import kvlingo.train.distill as distill

    real = distill.distill_step

    def tampering_step(source, target, *a, **kw):
        out = real(source, target, *a, **kw)
        with torch.no_grad():
            target.model.norm.weight[0] += 1e-3
        return out

    monkeypatch.setattr(distill, "distill_step", tampering_step)
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_pair_paths, train_data[0], tmp_path, "tamper", "--updates", "1"))
    assert e.value.code == 1 and "frozen model weights changed during training: target" in capsys.readouterr().err
    assert not (tmp_path / "artifacts" / "tamper" / "distilled").exists()

    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(F.FrozenWeightsChanged, match="trainable parameters"):
        F.check_frozen({"target": model})


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tiny_pair_paths, train_data, tmp_path):
    """A real process killed with SIGKILL after its first checkpoint, then resumed, equals an uninterrupted run.

    Bit-identity holds for one CPU thread count: the reference, the killed run and the resume all use one.
    """
    settings = ["--updates", "24", "--checkpoint-every", "3", "--val-every", "6"]
    main(cli(tiny_pair_paths, train_data[0], tmp_path / "ref", "run", *settings))

    argv = [sys.executable, str(SCRIPT), *cli(tiny_pair_paths, train_data[0], tmp_path / "kill", "run", *settings)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    marker = tmp_path / "kill" / "artifacts" / "run" / "checkpoints" / "DONE_000003"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate()[1].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill (rc {proc.returncode}): {err[-2000:]}"
    killed = tmp_path / "kill" / "artifacts" / "run"
    assert not (killed / "distilled").exists()

    # The resume runs in this process (one thread, like the killed one): a second interpreter start costs ~20 s here.
    rep = main([*cli(tiny_pair_paths, train_data[0], tmp_path / "kill", "run", *settings), "--resume"])
    assert rep["results"]["resumed_from_update"] >= 3
    assert maps_equal(tmp_path / "ref" / "artifacts" / "run" / "distilled", killed / "distilled")
    ref = json.loads((tmp_path / "ref" / "results" / "run" / "train.json").read_text())["results"]
    got = json.loads((tmp_path / "kill" / "results" / "run" / "train.json").read_text())["results"]
    assert got["loss_curve"] == ref["loss_curve"] and got["val_kl_curve"] == ref["val_kl_curve"]


def test_a_run_held_by_another_training_or_a_read_only_results_folder_is_refused_before_the_estimate(
    benchmarked_run, tmp_path, monkeypatch, capsys
):
    """Once, both printed the 5-line memory estimate before their one-line refusal."""
    argv = [*benchmarked_run["train"], "--results", str(tmp_path / "results"), "--run", "held"]
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


@pytest.mark.parametrize("full", ["artifacts/r/checkpoints", "results/r"])
def test_a_full_disk_during_training_ends_in_one_line_and_the_resume_goes_on(
    benchmarked_run, tmp_path, monkeypatch, capsys, full
):
    """Once, a 13–20-line OSError traceback. Now one line naming the folder and the space needed, no temp file
    left, and --resume (with space again) finishes as an uninterrupted run does."""
    argv = moved(benchmarked_run, tmp_path)
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


# --------------------------------------------------------------------------- what a resume trusts
def test_changing_val_every_on_resume_is_refused_and_checkpoint_every_is_recorded_as_it_ran(
    benchmarked_run, tmp_path, capsys
):
    """Once, `--val-every 2→1` on --resume exited 0 and the report claimed val_every 1 over a curve measured
    every 2. The validation cadence shapes the curve, so it is part of the resume identity; the checkpoint
    cadence shapes no figure, so it is free, and the report says how each stretch of updates ran."""
    argv = moved(benchmarked_run, tmp_path)
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


def test_an_edited_closed_form_manifest_is_fitted_again(benchmarked_run, tmp_path, capsys):
    """Once, after `"lr": 0.001 → 9.001` in closed_form/manifest.json, a rerun said "closed-form fit up to date"
    and kept the edited file."""
    argv = moved(benchmarked_run, tmp_path)
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


def test_the_same_model_folder_named_by_another_path_resumes(benchmarked_run, tiny_pair_paths, tmp_path, monkeypatch):
    """Once, `--large ../pair/large` then `--large /abs/pair/large` was refused on resume as "settings changed"."""
    monkeypatch.chdir(tiny_pair_paths[0].parent)
    absolute = moved(benchmarked_run, tmp_path)
    relative = [os.path.relpath(a) if a in map(str, tiny_pair_paths) else a for a in absolute]
    assert relative != absolute
    first = train_translator.main(relative)
    # --checkpoint-every 1, a setting a resume may change: the finished run is then not up to date and resumes
    again = train_translator.main([*absolute, "--checkpoint-every", "1", "--resume"])
    assert again["results"]["resumed_from_update"] == 2
    assert first["config"]["pair"]["large"] == again["config"]["pair"]["large"] == str(tiny_pair_paths[0])


@pytest.mark.parametrize(
    "flags, family, settings",
    [
        (
            ["--family", "crosslayer", "--k", "3", "--rank", "4", "--pairing", "proportional"],
            "crosslayer",
            {"k": 3, "rank": 4, "pairing": "proportional"},
        ),
        (["--family", "crosshead", "--key-rank", "3"], "crosshead", {"rank": 0, "key_rank": 3}),
        (
            ["--family", "residual", "--base", "crosshead", "--rank", "2", "--hidden", "8"],
            "residual",
            {"base": {"family": "crosshead", "settings": {"rank": 2}}, "hidden": 8},
        ),
    ],
)
def test_family_flags_reach_the_translator_a_training_builds(flags, family, settings):
    import train_translator
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.records.saved import build
    from kvlingo.stages.train import family_from_args

    geometry = {
        "source_layers": 4,
        "source_kv_heads": 2,
        "source_head_dim": 8,
        "target_layers": 3,
        "target_kv_heads": 2,
        "target_head_dim": 8,
    }
    args = train_translator.parse_args(flags)
    pair = SimpleNamespace(direction="l2s", geometry=geometry)
    got_family, got = family_from_args(args, get_profile("tiny"), pair)
    assert (got_family, got) == (family, settings)
    spec = build({"family": family, "key_space": "prenorm", "settings": got, "geometry": geometry}).settings()
    maps = spec["base"]["settings"] if family == "residual" else spec
    maps.pop("layers")  # the plan, made from the settings
    assert maps.pop("key_rank") == got.get("key_rank", maps["rank"])  # recorded: the keys' rank, --rank's unless given
    got.pop("key_rank", None)
    assert spec == {**got, **({"init_seed": 0} if family == "residual" else {})}


def test_a_non_default_family_resumes_bit_identically_and_loads_only_as_itself(tiny_pair_paths, tmp_path, capsys):
    from transformers import AutoTokenizer

    import train_translator

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        tmp_path / "data", tok, {"train": chat_rows(tok, 16, 0, "t"), "validation": chat_rows(tok, 4, 1, "v")}
    )

    def argv(root, *extra):
        return [
            "--profile",
            "tiny",
            "--data",
            str(data),
            "--run",
            "r",
            "--large",
            str(tiny_pair_paths[0]),
            "--small",
            str(tiny_pair_paths[1]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--lr",
            "3e-3",
            "--family",
            "crosslayer",
            "--k",
            "2",
            "--n-fit",
            "16",
            "--updates",
            "6",
            "--checkpoint-every",
            "2",
            "--artifacts",
            str(root / "artifacts"),
            "--results",
            str(root / "results"),
            *extra,
        ]

    train_translator.main(argv(tmp_path / "a"))
    train_translator.main(argv(tmp_path / "b"))
    ck = tmp_path / "b" / "artifacts" / "r" / "checkpoints"
    for u in (4, 6):  # as if killed after the update-2 checkpoint
        (ck / f"DONE_{u:06d}").unlink()
    (tmp_path / "b" / "artifacts" / "r" / "distilled" / "manifest.json").unlink()
    rep = train_translator.main([*argv(tmp_path / "b"), "--resume"])
    assert rep["results"]["resumed_from_update"] == 2
    a, b = (load_state(tmp_path / x / "artifacts" / "r" / "distilled") for x in "ab")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    manifest = read_manifest(tmp_path / "a" / "artifacts" / "r" / "distilled")
    assert manifest["family"] == "crosslayer" and manifest["settings"]["k"] == 2
    assert len(manifest["settings"]["layers"][0]) == 2  # the ranked layer plan is recorded
    assert json.loads((tmp_path / "a" / "results" / "r" / "train.json").read_text())["results"]["fit"]["layer_ranking"]
    pair = load_tiny_pair(tiny_pair_paths)
    with pytest.raises(TranslatorError, match="family is 'crosslayer'"):
        load_translator(tmp_path / "a" / "artifacts" / "r" / "distilled", pair, family="headwise")
    shutil.rmtree(tmp_path / "b")


def test_training_refuses_a_folder_without_manifest(finished, tmp_path, capsys):
    """A half-built folder (split files, no manifest) is never trained on."""
    half = tmp_path / "half"
    shutil.copytree(finished["data"], half)
    (half / "manifest.json").unlink()
    err = refused(train_translator.main, [*finished["train"], "--data", str(half)], capsys)
    assert "manifest.json not found" in err


def test_training_under_the_new_objectives_and_early_stopping(tiny_pair_paths, tmp_path):
    from transformers import AutoTokenizer

    import train_translator

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        tmp_path / "data", tok, {"train": chat_rows(tok, 16, 0, "t"), "validation": chat_rows(tok, 4, 1, "v")}
    )
    args = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--family",
        "crosshead",
        "--batch",
        "2",
        "--n-fit",
        "8",
        "--ridge",
        "0",
        "--updates",
        "4",
        "--val-every",
        "1",
        "--lr",
        "3e-2",
        "--artifacts",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "r"),
    ]
    rep = train_translator.main(
        [
            *args,
            "--run",
            "x",
            "--refresh",
            "exact:0",
            "--context-weight",
            "0.5",
            "--onpolicy",
            "0.5",
            "--keep-best",
            "--n-train",
            "8",
        ]
    )
    res, cfg = rep["results"], rep["config"]
    assert cfg["refresh"] == "exact:0" and cfg["onpolicy"] == 0.5 and rep["n_samples"]["train_conversations"] == 8
    best = min(res["val_kl_curve"], key=lambda p: p["val_kl"])
    assert (
        res["best"] == {"update": best["update"], "val_kl": best["val_kl"]}
        and res["distilled_val_kl"] == best["val_kl"]
    )
    manifest = json.loads((tmp_path / "a" / "x" / "distilled" / "manifest.json").read_text())
    assert manifest["val_kl"] == best["val_kl"]
    with pytest.raises(SystemExit) as e:
        train_translator.main([*args, "--run", "y", "--n-train", "99"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        train_translator.main([*args, "--run", "y", "--onpolicy", "1.5"])
    assert e.value.code == 2


def test_zero_updates_is_refused_and_writes_nothing(tiny_pair_paths, train_data, tmp_path, capsys):
    """`--updates 0` once ran a zero-update "distillation" and reported it; the closed-form maps alone are
    --closed-form-only."""
    err = refused(main, cli(tiny_pair_paths, train_data[0], tmp_path, "zero", "--updates", "0"), capsys)
    assert "--updates 0 distils nothing" in err and "--closed-form-only" in err
    assert not files_under(tmp_path / "results") and not files_under(tmp_path / "artifacts")


def test_the_value_fit_on_the_attention_output_is_a_fit_setting(tiny_pair_paths, train_data, tmp_path):
    """`--value-fit output` on the default translator: recorded in the config and the fit, a closed form of its own
    (not the plain fit's, reused), the keys' maps the plain fit's."""
    plain = main(cli(tiny_pair_paths, train_data[0], tmp_path, "plain", "--closed-form-only"))
    out = main(cli(tiny_pair_paths, train_data[0], tmp_path, "out", "--closed-form-only", "--value-fit", "output"))
    assert plain["config"]["value_fit"] == "values" and "value_fit" not in plain["results"]["fit"]
    assert out["config"]["value_fit"] == "output" and out["results"]["fit"]["value_fit"] == "output"
    assert out["config"]["family"] == plain["config"]["family"] == "tokeninput"
    a = load_state(tmp_path / "artifacts" / "plain" / "closed_form").state_dict()
    b = load_state(tmp_path / "artifacts" / "out" / "closed_form").state_dict()
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    kv = [k for k in a if a[k].dim() and a[k].shape[0] == 2]  # tensors stacked [keys, values, ...]
    assert kv and all(torch.equal(a[k][0], b[k][0]) for k in kv), [k for k in kv if not torch.equal(a[k][0], b[k][0])]
    assert any(not torch.equal(a[k][1], b[k][1]) for k in kv)


def test_token_features_at_chosen_layers_are_chosen_in_the_fit_and_named_in_the_report(
    tiny_pair_paths, train_data, tmp_path
):
    """`--token-layers 1 --token-choice fit` as typed: the closed form chooses one target layer on its held-out
    conversations (--ridge auto, the default), never layer 0, which the handoff under exact:0 takes from the target;
    train.json records the choice and every layer's share, train.md names the layer, and the saved maps read the
    features there alone."""
    rep = main(
        cli(tiny_pair_paths, train_data[0], tmp_path, "chosen", "--closed-form-only", "--token-layers", "1")
        + ["--token-choice", "fit"]
    )
    choice = rep["results"]["fit"]["layer_choice"]
    share = choice["held_out_share_removed"]
    assert rep["config"]["refresh"] == "exact:0" and choice["native_layers"] == [0]  # the target's own layer 0
    assert choice["chosen"] == [max(range(1, len(share)), key=share.__getitem__)]
    md = (tmp_path / "results" / "chosen" / "train.md").read_text()
    assert f"Token features at target layers {choice['chosen'][0]} of {len(share)}, chosen by the closed form" in md
    maps = load_state(tmp_path / "artifacts" / "chosen" / "closed_form")
    assert maps.chosen_layers() == choice["chosen"] and maps.settings()["token_choice"] == "fit"


def test_a_decaying_learning_rate_reaches_each_update_and_a_resume_continues_it(tiny_pair_paths, tmp_path, capsys):
    """--lr-schedule cosine: each update's AdamW rate is `lr_at`'s (the checkpoints keep the rate of the update
    before them), the decay changes the maps, a run resumed after its update-2 checkpoint equals the uninterrupted
    one bit for bit, the report names the decay, and a resume under another schedule is refused, naming it."""
    from transformers import AutoTokenizer

    from kvlingo.train.checkpoints import checkpoint_paths, load_checkpoint
    from kvlingo.train.distill import lr_at

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        tmp_path / "data", tok, {"train": chat_rows(tok, 16, 0, "t"), "validation": chat_rows(tok, 4, 1, "v")}
    )

    def argv(root, schedule="cosine"):
        return [
            *("--profile", "tiny", "--data", str(data), "--run", "r", "--large", str(tiny_pair_paths[0])),
            *("--small", str(tiny_pair_paths[1]), "--device", "cpu", "--dtype", "float32", "--family", "headwise"),
            *("--lr", "3e-2", "--lr-schedule", schedule, "--n-fit", "16", "--updates", "6", "--checkpoint-every", "2"),
            *("--artifacts", str(root / "artifacts"), "--results", str(root / "results")),
        ]

    train_translator.main(argv(tmp_path / "a"))
    ck = tmp_path / "a" / "artifacts" / "r" / "checkpoints"
    for u in (2, 4, 6):
        state = load_checkpoint(*checkpoint_paths(ck, u))
        assert state["optimizer"]["param_groups"][0]["lr"] == lr_at(3e-2, "cosine", u - 1, 6)
    assert lr_at(3e-2, "cosine", 5, 6) < 3e-2 / 10  # the last update's rate, near 0
    assert "lr 0.03 (cosine decay to 0)" in (tmp_path / "a" / "results" / "r" / "train.md").read_text()
    train_translator.main(argv(tmp_path / "c", "constant"))
    a, c = (load_state(tmp_path / x / "artifacts" / "r" / "distilled") for x in "ac")
    assert not all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), c.state_dict().values()))

    train_translator.main(argv(tmp_path / "b"))
    ck = tmp_path / "b" / "artifacts" / "r" / "checkpoints"
    for u in (4, 6):  # as if killed after the update-2 checkpoint
        (ck / f"DONE_{u:06d}").unlink()
    (tmp_path / "b" / "artifacts" / "r" / "distilled" / "manifest.json").unlink()
    assert "lr_schedule" in refused(train_translator.main, [*argv(tmp_path / "b", "linear"), "--resume"], capsys)
    rep = train_translator.main([*argv(tmp_path / "b"), "--resume"])
    assert rep["results"]["resumed_from_update"] == 2
    b = load_state(tmp_path / "b" / "artifacts" / "r" / "distilled")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("flags, expected", [([], "cosine"), (["--lr-schedule", "constant"], "constant")])
def test_the_learning_rate_schedule_is_the_profiles_unless_given(flags, expected):
    """Without --lr-schedule a run decays its rate as its profile says (every profile: cosine), with or without
    --family; a flag given wins."""
    from kvlingo.inputs.profiles import PROFILES, get_profile
    from kvlingo.stages.train import train_config

    assert {p.lr_schedule for p in PROFILES.values()} == {"cosine"}
    pair = SimpleNamespace(direction="s2l", geometry=SMALL_GEOMETRY)
    for family in ([], ["--family", "headwise"]):
        args = train_translator.parse_args([*family, *flags])
        assert train_config(args, get_profile("tiny"), pair).lr_schedule == expected


def test_the_objective_is_the_profiles_unless_given():
    """`train_translator.py --profile scale` trains the plain objective in both directions (the decay's choice on
    both pairs, docs/results.md); a profile's objective, where one is set, is what a run without the flag trains,
    and --onpolicy wins over it."""
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.stages.train import train_config

    onpolicy = get_profile("scale", objective=({"onpolicy": 0.5}, {}))
    for direction in ("l2s", "s2l"):
        pair = SimpleNamespace(direction=direction, geometry=SMALL_GEOMETRY)
        plain = train_config(train_translator.parse_args(["--profile", "scale"]), get_profile("scale"), pair)
        assert plain.onpolicy == 0.0
        default = train_config(train_translator.parse_args([]), onpolicy, pair)
        assert default.onpolicy == (0.5 if direction == "l2s" else 0.0)
        given = train_config(train_translator.parse_args(["--onpolicy", "0.25"]), onpolicy, pair)
        assert given.onpolicy == 0.25
