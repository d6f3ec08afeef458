"""The IFEval stage end to end on the tiny pair: native, translated, resume, the accuracy gate, offline data and
punkt, and a full disk while rows are appended."""

from __future__ import annotations

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
import torch

import ifeval
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.eval.itemrows import read_rows
from kvlingo.eval.tasks import grader
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.io import read_json
from kvlingo.records.saved import save_translator

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def _doc(ids, kwargs, prompt="Write something."):
    return {"key": 1, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


SENT = "length_constraints:number_sentences"


# --------------------------------------------------------------------------- the stage script
@pytest.fixture(scope="module")
def ifeval_world(tiny_pair_paths, tmp_path_factory, punkt_home):
    root = tmp_path_factory.mktemp("ifeval_world")
    large, small = tiny_pair_paths
    m = load_model(ModelSpec.parse(str(large)), "cpu", torch.float32)
    maps = Headwise.identity(Geometry.of(m, m))  # same head_dim both sides
    save_translator(root / "artifacts" / "t" / "distilled", maps, {"direction": "l2s"})
    docs = [
        _doc(["punctuation:no_comma"], [{}], "Describe the cat on the mat. Do not use commas."),
        _doc(
            [SENT, "change_case:english_lowercase"],
            [{"relation": "less than", "num_sentences": 2}, {}],
            "Answer in lowercase, in one sentence: what did ada write?",
        ),
    ]
    docs[1]["key"] = 2
    (root / "ifeval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    base = [
        "--large",
        str(large),
        "--small",
        str(small),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--profile",
        "tiny",
        "--run",
        "t",
        "--results",
        str(root / "results"),
        "--source",
        str(root / "ifeval.jsonl"),
        "--max-new-tokens",
        "4",
        "--artifacts",
        str(root / "artifacts"),
    ]
    return {
        "root": root,
        "base": base,
        "maps": str(root / "artifacts" / "t" / "distilled"),
        "out": root / "results" / "t",
    }


def test_native_then_translated_then_gate(ifeval_world, capsys):
    w = ifeval_world
    ifeval.main(w["base"] + ["--native"])
    native = read_json(w["out"] / "ifeval-native.json")
    assert set(native["results"]["paths"]) == {"native_source", "native_target"}
    assert native["n_samples"] == {"prompts": 2, "instructions": 3}
    assert native["inputs"]["punkt"]["sha256"] == grader.ensure_punkt()["sha256"]
    nrows = read_rows(w["out"] / "ifeval-native.rows.jsonl")[1]
    assert len(nrows) == 4 and all(r["new_tokens"] <= 4 for r in nrows)
    s = native["results"]["paths"]["native_target"]
    assert s["hit_cap"] == sum(r["new_tokens"] == 4 and r["path"] == "native_target" for r in nrows)

    translated = w["base"]
    ifeval.main(translated)
    rep = read_json(w["out"] / "ifeval.json")
    assert set(rep["results"]["paths"]) == {"translated", "native_target", "control", "no_context"}
    # the native target's answers come from the native run's rows (same input hash), not regenerated
    assert rep["results"]["rows"] == {
        "generated": 6,
        "resumed": 0,
        "reused_from_sibling": 2,
        "dropped_torn_line": False,
    }
    trows = read_rows(w["out"] / "ifeval.rows.jsonl")[1]
    by = {(r["path"], r["doc_key"]): r for r in trows}
    k0, k1 = sorted({r["doc_key"] for r in trows})
    # Both prompts end with the same generation-prompt token, so prompt 0's control (prompt 1's
    # translated cache, then that token) answers exactly as prompt 1's translated path does.
    assert by[("control", k0)]["new_ids"] == by[("translated", k1)]["new_ids"]
    assert by[("control", k1)]["new_ids"] == by[("translated", k0)]["new_ids"]
    assert "translated_vs_no_context" in rep["results"]["comparison"]
    assert rep["results"]["paths"]["native_target"] == s
    manifest = json.loads((Path(w["maps"]) / "manifest.json").read_text())
    assert rep["inputs"]["translator"]["maps_sha256"] == manifest["maps_sha256"]

    # the gate, on resumed rows (nothing regenerated): exit nonzero iff the loss exceeds POINTS
    loss = -rep["results"]["comparison"]["translated_vs_native_target"]["prompt_level_strict_acc"]["delta_points"]
    with pytest.raises(SystemExit) as e:
        ifeval.main(translated + ["--resume", f"--max-accuracy-loss={loss - 0.5}"])
    assert e.value.code == 1 and "ifeval: gate failed" in capsys.readouterr().err
    gated = read_json(w["out"] / "ifeval.json")
    assert gated["results"]["gate"]["passed"] is False and gated["results"]["rows"]["generated"] == 0
    ifeval.main(translated + ["--resume", f"--max-accuracy-loss={loss + 0.5}"])
    assert read_json(w["out"] / "ifeval.json")["results"]["gate"]["passed"] is True

    with pytest.raises(SystemExit) as e:
        ifeval.main(translated + ["--resume", "--max-new-tokens", "5"])
    assert e.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ifeval.main(w["base"] + ["--native", "--max-accuracy-loss", "1"])
    assert e.value.code == 2 and "drop --native" in capsys.readouterr().err


def test_prepare_offline_fails_fast_or_copies_a_local_source(ifeval_world, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as e:
        ifeval.main(["--prepare", "--data-root", str(tmp_path)])
    assert e.value.code == 2 and "--source PATH" in capsys.readouterr().err
    ifeval.main(["--prepare", "--data-root", str(tmp_path), "--source", str(ifeval_world["root"] / "ifeval.jsonl")])
    manifest = read_json(tmp_path / "ifeval" / "manifest.json")
    assert manifest["rows"] == 2 and manifest["origin"]["local_source"].endswith("ifeval.jsonl")


def test_install_punkt_cli_writes_the_same_data(punkt_home, tmp_path, capsys):
    import nltk

    home = tmp_path / "nltk_home"
    try:
        ifeval.main(["--install-punkt", str(home)])
    finally:
        nltk.data.path.remove(str(home.resolve()))
    prov = grader.punkt_provenance(home / "tokenizers" / "punkt_tab" / "english")
    assert prov["sha256"] == punkt_home["sha256"] and f"NLTK_DATA={home.resolve()}" in capsys.readouterr().out


def test_ifeval_resume_after_a_code_edit_is_refused(ifeval_world, monkeypatch, capsys):
    import kvlingo.records.resume as resume

    w = ifeval_world
    ifeval.main(w["base"] + ["--native", "--run", "code"])
    rows = w["root"] / "results" / "code" / "ifeval-native.rows.jsonl"
    before = rows.read_bytes()
    monkeypatch.setattr(resume, "code_hash", lambda *a: "0" * 64)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ifeval.main(w["base"] + ["--native", "--run", "code", "--resume"])
    assert e.value.code == 2 and "code changed" in capsys.readouterr().err and rows.read_bytes() == before


def test_an_ifeval_report_is_up_to_date_unless_its_gate_failed(ifeval_world, monkeypatch, capsys):
    w = ifeval_world
    argv = w["base"] + ["--run", "t", "--resume"]
    ifeval.main(argv)
    report = read_json(w["out"] / "ifeval.json")
    loss = -report["results"]["comparison"]["translated_vs_native_target"]["prompt_level_strict_acc"]["delta_points"]
    monkeypatch.setattr(
        "kvlingo.inputs.models.load_pair", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("loaded"))
    )
    capsys.readouterr()
    ifeval.main(argv)
    assert "ifeval.json is up to date" in capsys.readouterr().out
    assert read_json(w["out"] / "ifeval.json") == report
    monkeypatch.undo()
    gate = [f"--max-accuracy-loss={loss - 0.5}"]
    with pytest.raises(SystemExit) as e:
        ifeval.main(argv + gate)
    assert e.value.code == 1
    monkeypatch.setattr(
        "kvlingo.inputs.models.load_pair", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("loaded"))
    )
    with pytest.raises(RuntimeError, match="loaded"):  # a failed gate is never up to date: it runs (and fails) again
        ifeval.main(argv + gate)


ROOT = Path(__file__).resolve().parents[2]


def test_a_full_disk_while_rows_are_appended_leaves_no_torn_line(benchmarked_run, tmp_path):
    """A file size limit (RLIMIT_FSIZE) lets the kernel write part of a row, then refuses the rest (EFBIG), as a
    full disk does. Once, the rows file was left ending in half a row, which a resume dropped silently. Now
    the partial row is cut off, the stage ends in one line (exit 2), and --resume answers the rest."""
    env = {**os.environ, "NLTK_DATA": str(benchmarked_run["punkt"]), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [
        sys.executable,
        "ifeval.py",
        *benchmarked_run["ifeval"],
        "--native",
        "--run",
        "r",
        "--results",
        str(tmp_path),
    ]
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
