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


def test_an_export_records_the_target_tensors_its_handoff_reads_with_their_sha256(tiny_pair_paths):
    """What a handoff reads of the target, by family, refresh and key space: nothing (cache keys, no refresh); every
    layer's key norm (prenorm keys are finished with it); the embedding, the first norm and layer 0's K/V
    projections (token features), with layer 0's key norm (exact:0); every weight (a refresh that runs the target's
    layers). The sha256 are the stored tensors' (`models.tensor_digest`)."""
    from kvlingo.core.refresh import Refresh
    from kvlingo.inputs.models import ModelSpec, checkpoint_files, read_tensors, tensor_digest
    from kvlingo.records.saved import handoff_reads, target_weight_names

    target = ModelSpec.parse(str(tiny_pair_paths[1])).identity()
    names = list(read_tensors(checkpoint_files(target), lambda n: n))
    layers = sorted({n.split(".layers.")[1].split(".")[0] for n in names if ".layers." in n})
    features = {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "kv"),
    }

    def picked(family, refresh, space):
        return {n.removeprefix("model.") for n in target_weight_names(names, family, Refresh.parse(refresh), space)}

    assert picked("crosshead", "none", "cache") == set()
    assert picked("crosshead", "tail:4", "prenorm") == {f"layers.{i}.self_attn.k_norm.weight" for i in layers}
    assert picked("tokeninput", "none", "cache") == features
    assert picked("headwise", "exact:0", "cache") == picked("tokeninput", "exact:0", "cache")
    assert picked("tokeninput", "exact:0", "cache") == features | {"layers.0.self_attn.k_norm.weight"}
    reads = handoff_reads("tokeninput", "exact:0", target, "cache")
    stored = read_tensors(checkpoint_files(target), lambda n: [m for m in n if m in reads["target_weights"]])
    assert reads["token_ids"] and reads["target_weights"] == {n: tensor_digest(t) for n, t in stored.items()}
    assert handoff_reads("crosshead", "layers:2", target, "cache")["target_weights"] == "all"
    assert handoff_reads("crosshead", "none", target, "cache") == {
        "source": "keys and values of every source layer",
        "token_ids": False,
        "target_weights": {},
    }
