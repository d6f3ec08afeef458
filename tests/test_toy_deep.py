"""The deep toy model (kvlingo/toy/deep): packaged beside the pair within the size limits, trained on the
pair's own tokenizer and corpus, a geometry head-wise maps refuse; the build, export and install
verify what they copy and refuse a world it was not trained on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvlingo.io import read_json, sha256_file
from kvlingo.toy import deep as toydeep
from kvlingo.toy import train as toytrain


def quiet(_msg: str) -> None:
    pass


def test_packaged_deep_model_is_complete_small_bf16_and_shares_the_pair_tokenizer():
    pkg = toydeep.PACKAGED_DEEP
    manifest = read_json(pkg / toydeep.MANIFEST)
    assert manifest["stage"] == "toy_deep" and not manifest["results"]["mini"]
    shipped = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()}
    assert shipped == set(manifest["files"]) | {toydeep.MANIFEST}
    for rel, sha in manifest["files"].items():
        assert sha256_file(pkg / rel) == sha, rel
    weights = sorted([*toytrain.PACKAGED.glob("*/*.safetensors"), *pkg.glob("*.safetensors")])
    assert sum(w.stat().st_size for w in weights) <= 24 * 2**20  # every packaged model together
    assert all(w.stat().st_size < 5 * 2**20 for w in weights)
    from safetensors import safe_open

    for w in pkg.glob("*.safetensors"):
        with safe_open(w, framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, w
    pair = read_json(toytrain.PACKAGED / "manifest.json")
    assert manifest["inputs"]["tokenizer_sha256"] == pair["files"]["tokenizer/tokenizer.json"]
    assert manifest["inputs"]["corpus_sha256"] == {k: v for k, v in pair["files"].items() if k.startswith("corpus/")}
    assert sha256_file(pkg / "tokenizer.json") == pair["files"]["tokenizer/tokenizer.json"]
    config = read_json(pkg / "config.json")
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (6, 4, 16)


def test_multiple_choice_chats_are_repeated():
    rows = [{"output": "The map is in the red box.\nAnswer: C"}, {"output": "3 + 4 = 7.\nAnswer: 7"},
            {"output": "<think>\nA fact. That is option B.\n</think>\n\nAnswer: B"}, {"output": "Hello."}]
    assert [bool(toydeep.MC_REPLY.search(r["output"])) for r in rows] == [True, False, True, False]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deep") / "toy"
    toytrain.install_pair(out, log=quiet)
    return out


@pytest.mark.slow
def test_build_export_install_and_pair(world, tmp_path):
    """A seconds-sized deep build on the packaged world: scored and saved, skipped when unchanged, exported,
    installed into another world, refused on tampering or another tokenizer; it pairs with the packaged models."""
    from transformers import AutoModelForCausalLM

    from kvlingo.core.translator import FAMILIES, Geometry, TranslatorError
    from kvlingo.run.models import resolve_pair

    cfg = toydeep.mini_deep_config()
    manifest = toydeep.build_deep(world, cfg, progress=False, log=quiet)
    deep = world / "deep"
    assert set(manifest["results"]["exact_reply"]) == {"deep", "large", "small"}
    n_mc = manifest["results"]["model"]["n_multiple_choice_chats"]
    assert manifest["results"]["model"]["n_training_sequences"] >= 24_000 - 100 + (cfg.mc_copies - 1) * n_mc > 24_000
    model = AutoModelForCausalLM.from_pretrained(deep)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.num_hidden_layers == cfg.layers  # stored BF16
    messages: list[str] = []
    toydeep.build_deep(world, cfg, progress=False, log=messages.append)
    assert any("up to date" in m for m in messages)

    pkg = tmp_path / "pkg"
    toydeep.export_deep(world, pkg, log=quiet)
    other = tmp_path / "other"
    shutil.copytree(world, other, ignore=shutil.ignore_patterns("deep"))
    toydeep.install_deep(other, pkg, log=quiet)
    assert sha256_file(other / "deep" / "model.safetensors") == sha256_file(deep / "model.safetensors")

    # a tampered packaged file is named and the installed model left alone
    (pkg / "config.json").write_text((pkg / "config.json").read_text() + " ")
    before = sha256_file(other / "deep" / "config.json")
    (other / "deep" / "meta.json").write_text("{}")  # forces a reinstall attempt
    with pytest.raises(ValueError, match="config.json differs from the deep model's manifest"):
        toydeep.install_deep(other, pkg, log=quiet)
    assert sha256_file(other / "deep" / "config.json") == before
    shutil.copy(deep / "config.json", pkg / "config.json")
    # a world with another tokenizer is refused
    tok = other / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<think>"', '"<thonk>"'))
    with pytest.raises(ValueError, match="another tokenizer"):
        toydeep.install_deep(other, pkg, log=quiet)

    cfg_pair, _ = resolve_pair(str(world / "large"), str(deep), "l2s", "cpu", "float32")
    geometry = Geometry(**cfg_pair.geometry)
    assert (geometry.target_layers, geometry.target_kv_heads, geometry.target_head_dim) == (3, 4, 8)
    with pytest.raises(TranslatorError, match="--family crosslayer"):
        FAMILIES["headwise"](geometry)
    assert FAMILIES["crosslayer"](geometry).geometry == geometry
