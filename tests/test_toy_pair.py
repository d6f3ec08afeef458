"""The packaged full toy pair (kvlingo/toy_pair): what ships is what was scored, the install
regenerates and verifies the corpus it was trained on, tampering is refused, and on the real
pair a closed-form translator carries the context (slow: it loads and runs both models)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvlingo.io import read_json, sha256_file
from kvlingo.toy import train as toytrain

PACKAGED = toytrain.PACKAGED


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def installed(toy_pair) -> Path:
    return toy_pair


def test_packaged_pair_is_complete_small_and_bf16():
    manifest = read_json(PACKAGED / "manifest.json")
    assert manifest["stage"] == "toy_world" and not toytrain.is_mini(manifest)
    shipped = [p for p in PACKAGED.rglob("*") if p.is_file()]
    listed = {rel for rel in manifest["files"] if rel.split("/")[0] in toytrain.PACKAGED_PARTS}
    assert {p.relative_to(PACKAGED).as_posix() for p in shipped} == listed | {"manifest.json"}
    for rel in listed:
        assert sha256_file(PACKAGED / rel) == manifest["files"][rel], rel
    weights = sorted(PACKAGED.glob("*/*.safetensors"))
    assert {w.parent.name for w in weights} == {"large", "small"}
    assert sum(w.stat().st_size for w in weights) <= 16 * 2**20  # the limit for the committed pair
    assert all(w.stat().st_size < 5 * 2**20 for w in weights)  # 4 MB shards (+ header): no file over 5 MiB
    from safetensors import safe_open

    for w in weights:
        with safe_open(w, framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, w
    models = manifest["results"]["models"]
    assert models["large"]["n_params"] > 2 * models["small"]["n_params"]


def test_install_regenerates_the_trained_corpus_and_is_idempotent(installed):
    manifest = read_json(installed / "manifest.json")
    for rel, sha in manifest["files"].items():
        assert sha256_file(installed / rel) == sha, rel
    assert any(rel.startswith("corpus/") for rel in manifest["files"])
    messages: list[str] = []
    toytrain.install_pair(installed, log=messages.append)
    assert any("up to date" in m for m in messages)


def test_install_refuses_a_changed_corpus_or_tampered_weights(tmp_path, installed):
    pkg = tmp_path / "pkg"
    shutil.copytree(PACKAGED, pkg)
    manifest = read_json(pkg / "manifest.json")

    # A corpus generator that no longer reproduces the training corpus: stale weights, refused.
    stale = json.loads(json.dumps(manifest))
    stale["files"]["corpus/arc.jsonl"] = "0" * 64
    (pkg / "manifest.json").write_text(json.dumps(stale))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"corpus generator.*corpus/arc.jsonl.*make toy-train"):
        toytrain.install_pair(out, packaged=pkg, log=quiet)
    assert not out.exists() or not (out / "manifest.json").exists()

    # A flipped byte in a packaged weight file is named, and an existing install is left alone.
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    target = sorted((pkg / "large").glob("*.safetensors"))[-1]
    rel = target.relative_to(pkg).as_posix()
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    existing = tmp_path / "existing"
    shutil.copytree(installed, existing)
    (existing / "corpus" / "gsm8k.jsonl").write_text("damaged\n")  # forces a reinstall attempt
    before = sha256_file(existing / rel)
    with pytest.raises(ValueError, match=re.escape(rel) + " differs from the packaged manifest"):
        toytrain.install_pair(existing, packaged=pkg, log=quiet)
    assert sha256_file(existing / rel) == before


@pytest.mark.slow
def test_full_pair_reproduces_its_scores_and_a_fit_carries_the_context(installed, tmp_path):
    """The installed pair scores exactly what its manifest says, and a closed-form translator
    fitted on 64 chats beats the wrong-document control and the no-context floor on 24 more."""
    from tinypair import load_tiny_pair

    from kvlingo.core.families.headwise.maps import Headwise
    from kvlingo.core.translator import Geometry
    from kvlingo.eval.quality import control_contexts, score_conversation
    from kvlingo.inputs.data import prepare, read_split
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.train.closed_form import fit_closed_form

    manifest = read_json(installed / "manifest.json")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the build scored on one thread
    try:
        pair = load_tiny_pair((installed / "large", installed / "small"))
        world = toytrain.toyworld.WORLD_FILES
        files = {name: installed / "corpus" / f"{name}.jsonl" for name in world}
        cfg = toytrain.ToyConfig(world=toytrain.toyworld.WorldConfig())
        sets = toytrain.evaluation_sets(files, cfg)
        sets = {name: sets[name] for name in ("chat_recall", "arc_file", "gsm8k_file")}
        for name, model in (("large", pair.source), ("small", pair.target)):
            scores = toytrain.score_model(model, pair.tokenizer, sets)
            assert scores == {k: manifest["results"]["exact_reply"][name][k] for k in sets}, name
        big = manifest["results"]["exact_reply"]["large"]["chat_recall"]
        assert big["context"] > big["no_context"] + 0.3  # recall lives in the cache

        profile = get_profile("demo", n_train=64, n_validation=8, n_test=24, n_fit=64, n_packed=1)
        prepare(pair.tokenizer, profile, source=files["chats"], out_root=tmp_path / "data")
        train, test = (read_split(tmp_path / "data" / "demo", split) for split in ("train", "test"))
        translator = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
        stats = fit_closed_form(pair.source, pair.target, translator, train)
        assert stats["n_conversations"] == 64
        controls = control_contexts(test)
        rows = [
            score_conversation(
                pair.source,
                pair.target,
                {"closed_form": translator},
                "closed_form",
                conv,
                ctl["context_ids"],
                torch.float32,
            )
            for conv, ctl in zip(test, controls)
        ]
    finally:
        torch.set_num_threads(threads)
    kl = {arm: sum(r[arm]["kl_mean"] for r in rows) / len(rows) for arm in rows[0]}
    assert kl["native_target"] == 0.0
    assert kl["closed_form"] < 0.9 * kl["control"], kl  # measured 1.75 vs 2.27
    assert kl["closed_form"] < 0.8 * kl["no_context"], kl  # measured 1.75 vs 3.15
