"""Building, training and installing the toy world (kvlingo/toy/train.py): the packaged pair is what was scored,
an install regenerates and verifies its corpus, tampering is refused, a mini build reloads and pairs, and the
loss mask and teacher-forced hits against generation."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvlingo.io import read_json, read_jsonl, sha256_file
from kvlingo.toy import train as toytrain
from kvlingo.toy import world as toyworld

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


MINI_WORLD = toytrain.mini_config(0).world


def test_mini_build_matches_fresh_world_and_skips_when_unchanged(mini, tmp_path):
    # The build's corpus equals an independent write_world of the same config.
    fresh = toyworld.write_world(tmp_path / "fresh", MINI_WORLD)
    for name in toyworld.WORLD_FILES:
        assert sha256_file(mini / "corpus" / f"{name}.jsonl") == sha256_file(fresh[name]), name
    before = read_json(mini / "manifest.json")
    again = toytrain.build_toy_world(mini, seed=0, mini=True, progress=False, log=quiet)
    assert again["created_unix"] == before["created_unix"]  # nothing rebuilt
    for rel, sha in before["files"].items():
        assert sha256_file(mini / rel) == sha, rel


def test_tampered_corpus_is_rebuilt_and_models_reused(mini, tmp_path):
    out = tmp_path / "toy"
    shutil.copytree(mini, out)
    weights = sha256_file(out / "large" / "model.safetensors")
    meta_mtime = (out / "large" / "meta.json").stat().st_mtime_ns
    arc = out / "corpus" / "arc.jsonl"
    arc.write_text(arc.read_text() + "\n{}\n")
    messages = []
    toytrain.build_toy_world(out, seed=0, mini=True, progress=False, log=messages.append)
    assert not any("up to date" in m for m in messages)
    assert any(m.startswith("large: reusing") for m in messages)
    assert (out / "large" / "meta.json").stat().st_mtime_ns == meta_mtime
    assert sha256_file(out / "large" / "model.safetensors") == weights
    assert all(r for r in read_jsonl(arc))


def test_loss_mask_covers_exactly_the_assistant_turns(mini, corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mini / "tokenizer")
    rows = corpus["train_chats"][:40]
    for row, enc in zip(rows, toytrain.encode_rows(tok, rows)):
        masked = tok.decode([i for i, m in zip(enc.ids, enc.loss) if m], skip_special_tokens=False)
        expect = "".join(m["content"] + "<|im_end|>" for m in row["input"] if m["role"] == "assistant")
        assert masked == expect + row["output"] + "<|im_end|>"
        # The prefix is what the chat template renders through the generation prompt.
        prefix = tok.apply_chat_template(
            row["input"], tokenize=True, add_generation_prompt=True, enable_thinking=row["reasoning"] == "on"
        )["input_ids"]
        assert enc.ids[: enc.n_prefix] == list(prefix)


def test_teacher_forced_hits_match_greedy_generation(mini, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mini / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(mini / "large").eval()
    for row in corpus["chats"][:4]:
        prefix = tok.apply_chat_template(
            row["input"], tokenize=True, add_generation_prompt=True, enable_thinking=False
        )["input_ids"]
        x = torch.tensor([prefix])
        gen = model.generate(x, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(prefix) :].tolist()
        enc = toytrain.Encoded(list(prefix) + gen, [False] * len(prefix) + [True] * len(gen), len(prefix))
        assert toytrain.reply_token_hits(model, [enc], tok.pad_token_id) == [[True] * len(gen)]
        other = [(t + 1) % len(tok) for t in gen]
        enc_bad = toytrain.Encoded(list(prefix) + other, enc.loss, len(prefix))
        assert toytrain.reply_token_hits(model, [enc_bad], tok.pad_token_id)[0][0] is False


def test_saved_pair_reloads_and_passes_the_pair_check(mini):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvlingo.inputs.models import check_pair

    large = AutoModelForCausalLM.from_pretrained(mini / "large")
    small = AutoModelForCausalLM.from_pretrained(mini / "small")
    tok_l, tok_s = AutoTokenizer.from_pretrained(mini / "large"), AutoTokenizer.from_pretrained(mini / "small")
    check_pair(large.config, small.config, tok_l, tok_s)
    lc, sc = large.config, small.config
    assert lc.hidden_size > sc.hidden_size
    assert lc.rope_parameters["rope_theta"] != sc.rope_parameters["rope_theta"]
    assert lc.vocab_size == sc.vocab_size == len(tok_l)
    assert set(lc.layer_types) == set(sc.layer_types) == {"full_attention"}
    assert lc.sliding_window is None and not lc.use_sliding_window
    assert tok_l.eos_token == "<|im_end|>" and tok_l.pad_token == "<|endoftext|>"

    manifest = read_json(mini / "manifest.json")
    assert manifest["stage"] == "toy_world" and toytrain.is_mini(manifest)
    for name in ("large", "small"):
        scores = manifest["results"]["exact_reply"][name]
        assert set(scores) == {f"chat_{k}" for k in toyworld.KINDS} | {"ifeval_file", "arc_file", "gsm8k_file"}
        assert all(0.0 <= v <= 1.0 for conds in scores.values() for v in conds.values())
        assert read_json(mini / name / "meta.json")["exact_reply"] == scores
    ids = tok_l("My name is Ada.", return_tensors="pt")["input_ids"]
    out = large(input_ids=ids).logits
    assert out.shape == (1, ids.shape[1], lc.vocab_size) and torch.isfinite(out).all()


def test_a_folder_that_is_not_a_toy_world_is_never_built_over(tmp_path):
    """Building or installing replaces corpus/, tokenizer/, the model folders and manifest.json under --out;
    a folder holding anything else (or another stage's manifest) is refused before it is touched."""
    home = tmp_path / "home"
    (home / "large").mkdir(parents=True)
    (home / "large" / "mine.txt").write_text("precious")
    (home / "notes.txt").write_text("precious")
    for build in (lambda: toytrain.install_pair(home), lambda: toytrain.build_toy_world(home, mini=True)):
        with pytest.raises(ValueError, match=r"holds what is not a toy world's \(notes.txt\)"):
            build()
    assert (home / "large" / "mine.txt").read_text() == "precious" and (home / "notes.txt").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"stage": "prepare"}))
    with pytest.raises(ValueError, match="manifest.json with stage 'prepare'"):
        toytrain.install_pair(other)
    toytrain.check_world_folder(tmp_path / "new")  # a new folder, an empty one, a toy world: fine
    (tmp_path / "empty").mkdir()
    toytrain.check_world_folder(tmp_path / "empty")
