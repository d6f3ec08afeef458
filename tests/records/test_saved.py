"""The saved translator (kvlingo/records/saved.py): its folder round-trips and refuses tampering, maps of
another direction or pair, and an export folder holding other files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tinypair import load_tiny_pair

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry, TranslatorError
from kvlingo.records.saved import load_state, load_translator, read_manifest, save_translator


def test_maps_save_load_roundtrip_and_tamper(tmp_path):
    maps = Headwise(Geometry(2, 2, 4, 2, 2, 4), "cache")
    with torch.no_grad():
        maps.weight.normal_()
    save_translator(tmp_path / "m", maps, {"direction": "l2s"})
    manifest = read_manifest(tmp_path / "m")
    loaded = load_state(tmp_path / "m", manifest)
    assert torch.equal(loaded.weight, maps.weight) and manifest["key_space"] == "cache"
    assert manifest["family"] == "headwise" and manifest["geometry"]["target_head_dim"] == 4
    assert isinstance(loaded, Headwise) and loaded.flops_per_token() == maps.flops_per_token()
    blob = bytearray((tmp_path / "m" / "maps.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (tmp_path / "m" / "maps.safetensors").write_bytes(bytes(blob))
    with pytest.raises(TranslatorError, match="does not match its manifest hash"):
        read_manifest(tmp_path / "m")


def test_an_export_never_writes_into_a_folder_of_other_files(tmp_path):
    """`--out` naming a model folder would have replaced its config.json: a folder holding anything but an
    export's files (or a config.json of another format) is refused before a byte is written."""
    from kvlingo.records.saved import FORMAT, check_export_folder

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(
        TranslatorError, match="holds files that are not an exported translator's \\(config.json with format None\\)"
    ):
        check_export_folder(model)
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(TranslatorError, match="model.safetensors"):
        check_export_folder(model)
    assert (model / "config.json").read_text() == '{"model_type": "qwen3"}'

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text(json.dumps({"format": FORMAT}))
    (earlier / "maps.safetensors").write_bytes(b"maps")
    killed = tmp_path / "killed"  # an export killed before its config.json, with a temp file of its last write
    killed.mkdir()
    (killed / "maps.safetensors").write_bytes(b"maps")
    (killed / ".README.md.x1y2.tmp").write_text("half")
    for fine in (earlier, killed, tmp_path / "new"):
        check_export_folder(fine)
    (earlier / "config.json").write_text('{"format": ')
    with pytest.raises(TranslatorError, match="config.json"):
        check_export_folder(earlier)


def test_maps_for_another_direction_or_pair_are_refused(task_world, tiny_pair_paths, tmp_path):
    pair = load_tiny_pair(tiny_pair_paths)
    maps = Headwise.identity(Geometry.of(pair.source, pair.source))
    save_translator(tmp_path / "s2l", maps, {"direction": "s2l"})
    with pytest.raises(TranslatorError, match="direction 's2l'"):
        load_translator(tmp_path / "s2l", pair)
    save_translator(tmp_path / "other", maps, {"direction": "l2s", "models": {"source": {"id": "elsewhere"}}})
    with pytest.raises(TranslatorError, match="another source model"):
        load_translator(tmp_path / "other", pair)
    with pytest.raises(TranslatorError, match="family is 'headwise'"):
        load_translator(task_world["maps"], pair, family="crosshead")
    _, info = load_translator(task_world["maps"], pair)
    assert info["maps_sha256"] == json.loads((Path(task_world["maps"]) / "manifest.json").read_text())["maps_sha256"]


def test_a_re_export_that_fails_leaves_the_good_export_whole(tmp_path, monkeypatch):
    """A full disk (or a kill) while a re-export writes: the export it would replace stays as it was, file for file,
    and no staging folder is left; a re-export that completes replaces it whole."""
    from kvlingo.records import saved
    from kvlingo.records.saved import CONFIG_FILE, write_export

    monkeypatch.setattr(saved, "model_card", lambda config, evidence, verdict: f"# {config['family']}\n")
    out = tmp_path / "export"
    write_export(out, b"old maps", {"format": saved.FORMAT, "family": "headwise"}, None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert CONFIG_FILE in before

    real = saved.atomic_write_text

    def full_disk(path, text):  # the model card, written after the maps, before config.json
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saved, "atomic_write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_export(out, b"new maps", {"format": saved.FORMAT, "family": "tokeninput"}, None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    monkeypatch.setattr(saved, "atomic_write_text", real)
    write_export(out, b"new maps", {"format": saved.FORMAT, "family": "tokeninput"}, None)
    assert (out / "maps.safetensors").read_bytes() == b"new maps"
    assert json.loads((out / CONFIG_FILE).read_text())["family"] == "tokeninput"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_the_ifeval_command_an_export_suggests_reads_the_run_s_ifeval_data(tmp_path, monkeypatch):
    """The `make ifeval` an export suggests reads what the run's IFEval report read: EVAL_ROOT where its prepared
    copy is, IFEVAL_SOURCE only where make would have to prepare one, neither where the Makefile's default is it;
    and the translator and refresh only where ifeval.py's defaults would be others."""
    from kvlingo.core.settings import Refresh
    from kvlingo.records import saved
    from kvlingo.records.paths import RunPaths

    monkeypatch.chdir(tmp_path)  # the repository root the command is typed at
    monkeypatch.setattr(saved, "trained_refresh", lambda *folders: Refresh.parse("none"))
    pair = {"large": "L", "small": "S", "direction": "l2s", "device": "cpu", "dtype": "float32"}

    def command(profile, data, kind="distilled", refresh="none"):
        manifest = {"config": {"profile": profile, "pair": pair}}
        return saved.ifeval_command(
            RunPaths("r"), manifest, kind, {"inputs": {"data": data}}, {"config": {"refresh": refresh}}
        )

    run = "make ifeval PROFILE=tiny RUN=r LARGE=L SMALL=S DEVICE=cpu DTYPE=float32"
    prepared = {"prepared": str(tmp_path / "evals" / "ifeval" / "ifeval.jsonl"), "origin": {"local_source": "/s.jsonl"}}
    assert command("tiny", prepared) == f"{run} EVAL_ROOT=evals IFEVAL_SOURCE=/s.jsonl"  # no copy left there
    (tmp_path / "evals" / "ifeval").mkdir(parents=True)
    (tmp_path / "evals" / "ifeval" / "manifest.json").write_text("{}")
    assert command("tiny", prepared) == f"{run} EVAL_ROOT=evals"
    assert command("tiny", prepared, "closed_form", "tail:2") == (
        f"{run} TRANSLATOR=closed_form REFRESH=tail:2 EVAL_ROOT=evals"
    )
    toy = {"prepared": str(tmp_path / "data" / "toy-eval" / "ifeval" / "ifeval.jsonl"), "origin": {}}
    assert command("demo", toy) == "make ifeval PROFILE=demo RUN=r LARGE=L SMALL=S"  # the Makefile's own data
    read = {"source": str(tmp_path / "artifacts" / "toy" / "corpus" / "ifeval.jsonl")}  # ifeval.py --source
    assert command("demo", read) == "make ifeval PROFILE=demo RUN=r LARGE=L SMALL=S"  # PROFILE=demo's IFEVAL_SOURCE
    assert command("tiny", read) == f"{run} IFEVAL_SOURCE=artifacts/toy/corpus/ifeval.jsonl"  # no default there


def test_a_training_run_folder_given_as_an_export_names_its_export_or_the_command_that_writes_it(tmp_path, monkeypatch):
    """ARTIFACTS/RUN (or its distilled/ or closed_form/ maps) is not an export: the refusal names RUN/export where
    it exists, and otherwise `make export` with the run it would export (run from the repository root)."""
    import shlex

    from kvlingo.records.saved import CONFIG_FILE, MANIFEST_FILE, read_export

    monkeypatch.chdir(tmp_path)
    run = Path("artifacts") / "demo-l2s"
    for kind in ("closed_form", "distilled"):
        (run / kind).mkdir(parents=True)
        (run / kind / MANIFEST_FILE).write_text("{}")
    (run / "export").mkdir()
    (run / "export" / CONFIG_FILE).write_text("{}")
    for given in (run, run / "distilled"):
        with pytest.raises(TranslatorError, match=f"not a complete exported translator; load {run / 'export'}, the"):
            read_export(given)
    (run / "export" / CONFIG_FILE).unlink()
    then = f"\\(from the repository root\\), then load {run / 'export'}$"
    for given in (run, run / "distilled", run / "export"):
        with pytest.raises(
            TranslatorError, match=f"training run's folder: export it with `make export RUN=demo-l2s` {then}"
        ):
            read_export(given)
    with pytest.raises(TranslatorError, match=f"`make export RUN=demo-l2s TRANSLATOR=closed_form` {then}"):
        read_export(run / "closed_form")
    elsewhere = tmp_path / "runs" / "mine"
    (elsewhere / "distilled").mkdir(parents=True)
    (elsewhere / "distilled" / MANIFEST_FILE).write_text("{}")
    flags = shlex.quote(f"--artifacts {elsewhere.parent}")
    with pytest.raises(TranslatorError) as err:
        read_export(elsewhere)
    assert f"`make export RUN=mine EXPORT_ARGS={flags}`" in str(err.value)
    with pytest.raises(
        TranslatorError, match="give the folder `make export RUN=...` wrote \\(ARTIFACTS/RUN/export\\)$"
    ):
        read_export(tmp_path / "runs")


def test_the_model_card_names_the_training_schedule_and_budget():
    """The card's Training section reads the manifest's training config: a config written before `lr_schedule`
    existed ran at a constant rate, and closed-form maps say they were not distilled."""
    from kvlingo.io import to_jsonable
    from kvlingo.records.saved import training_lines
    from kvlingo.train.config import TrainConfig

    cfg = to_jsonable(TrainConfig(profile="scale", family="tokeninput", updates=3200, batch=4, lr=3e-3, onpolicy=0.5))
    cosine = {**cfg, "lr_schedule": "cosine"}
    lines = training_lines({"config": cosine, "stage": "distilled", "updates": 3200, "val_kl": 0.01234})
    assert "- profile: scale, seed 42" in lines
    assert (
        "- distillation: 3200 updates × 4 conversations, AdamW at 0.003, `lr_schedule: cosine` "
        "(kvlingo.train.distill.lr_at)" in lines
    )
    assert "- objective: KL through the frozen target; on-policy share 0.5" in lines
    assert "- validation KL/token of the saved maps: 0.01234" in lines
    old = {k: v for k, v in cfg.items() if k != "lr_schedule"}
    assert any("`lr_schedule: constant`" in line for line in training_lines({"config": old}))
    assert "- closed-form fit only (no distillation)" in training_lines({"config": cfg, "stage": "closed_form"})
    assert training_lines({}) == []  # maps saved without a training config: no section
