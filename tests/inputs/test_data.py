"""Data preparation (kvlingo/inputs/data.py) on a local fixture with a locally trained tokenizer: offline, seconds.

References are independent of kvlingo.inputs.data: prefixes are re-rendered by hand in ChatML, split membership is
read back from the question numbers in the text, and skip counts come from how the fixture was written."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from source_rows import N_CROP, N_GOOD, N_LONG, PROFILE, SYSTEM, all_rows, bad_lines, fixture_row, good_row, load_split

from kvlingo.inputs.data import (
    SPLITS,
    VARIANTS,
    SplitIntegrityError,
    open_prepared,
    prepare,
    split_path,
    tokenizer_digest,
    verify_split,
)
from kvlingo.io import read_json, read_jsonl, sha256_file
from kvlingo.records.report import sealed
from kvlingo.toy.tokenizer import save_tokenizer, train_chat_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def chatml(system: str, messages: list[dict], thinking: bool) -> str:
    """Hand-written reference rendering of a prefix (Qwen3 layout)."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    text += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def question(text: str) -> int:
    """Number of the last question in a rendered prefix: which fixture row it ends with."""
    return int(re.findall(r"Question (\d+):", text)[-1])


def test_splits_disjoint_and_sized(prepare_world):
    rows = prepare_world["rows"]
    questions = {s: {question(r["prefix_text"]) for v in VARIANTS for r in rows[s, v]} for s in SPLITS}
    sources = {s: {i for v in VARIANTS for r in rows[s, v] for i in r["source_ids"]} for s in SPLITS}
    for a, b in [("train", "validation"), ("train", "test"), ("validation", "test")]:
        assert not questions[a] & questions[b], (a, b)
        assert not sources[a] & sources[b], (a, b)
    for s in SPLITS:
        assert len(rows[s, "natural"]) == getattr(PROFILE, f"n_{s}")
        assert len(rows[s, "packed"]) == PROFILE.n_packed
        # natural examples are sampled without replacement inside a split
        assert len({question(r["prefix_text"]) for r in rows[s, "natural"]}) == len(rows[s, "natural"])


def test_same_seed_same_files_other_seed_differs(prepare_world, tmp_path):
    again = prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=tmp_path / "a", seed=0)
    other = prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=tmp_path / "b", seed=1)
    assert again.manifest["files"] == prepare_world["result"].manifest["files"]
    for name, digest in prepare_world["result"].manifest["files"].items():
        assert sha256_file(tmp_path / "a" / PROFILE.name / name) == digest
    assert other.manifest["files"]["train.natural.jsonl"] != again.manifest["files"]["train.natural.jsonl"]


def test_caps_and_token_ids(prepare_world):
    tok = prepare_world["tok"]
    for rows in prepare_world["rows"].values():
        for r in rows:
            assert 0 < len(r["prefix_ids"]) <= PROFILE.prefix_cap
            assert 0 < len(r["reply_ids"]) <= PROFILE.reply_cap
            assert r["prefix_ids"] == ids(tok, r["prefix_text"])
            assert tok.decode(r["reply_ids"], skip_special_tokens=False) == r["reply_text"]
            if r["reply_text"].endswith("<|im_end|>"):  # uncut reply: ids continue the prefix's
                full = ids(tok, r["prefix_text"] + r["reply_text"])
                assert full == r["prefix_ids"] + r["reply_ids"]


def test_crop_and_drop_rules_against_hand_rendering(prepare_world, tmp_path):
    # Everything goes to train and is tried: the counts must match the fixture exactly.
    profile = replace(PROFILE, n_train=10_000, n_validation=0, n_test=0, n_packed=0)
    res = prepare(prepare_world["tok"], profile, source=prepare_world["source"], out_root=tmp_path)
    stats = res.manifest["results"]["examples"]["train.natural"]
    assert stats["dropped_prefix_too_long"] == N_LONG
    assert stats["prefix_cropped"] == N_CROP
    assert stats["kept"] == N_GOOD + N_CROP
    tok, cap = prepare_world["tok"], PROFILE.prefix_cap
    cropped = 0
    for r in load_split(tmp_path / profile.name, "train", "natural"):
        row = fixture_row(question(r["prefix_text"]))
        on, msgs = row["reasoning"] == "on", row["input"]
        starts = [k for k, m in enumerate(msgs) if m["role"] == "user"]  # turn boundaries
        match = [k for k in starts if chatml(row["system_prompt"], msgs[k:], on) == r["prefix_text"]]
        assert len(match) == 1, r["prefix_text"]
        k = match[0]
        if k > 0:  # cropped: the system message stays and one more turn would not fit
            cropped += 1
            assert r["prefix_text"].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
            previous = starts[starts.index(k) - 1]
            assert len(ids(tok, chatml(row["system_prompt"], msgs[previous:], on))) > cap
    assert cropped == N_CROP


def test_natural_and_packed_shapes(prepare_world):
    rows, tok = prepare_world["rows"], prepare_world["tok"]
    for s in SPLITS:
        for r in rows[s, "natural"]:
            assert len(r["source_ids"]) == 1
            row = fixture_row(question(r["prefix_text"]))
            on = row["reasoning"] == "on"
            reply = (
                (
                    f"<think>\n{row['output'].split('<think>')[1].split('</think>')[0].strip()}\n</think>\n\n"
                    if on
                    else ""
                )
                + (row["output"].split("</think>\n\n")[-1])
                + "<|im_end|>"
            )
            want = ids(tok, r["prefix_text"] + reply)[len(r["prefix_ids"]) :][: PROFILE.reply_cap]
            assert r["reply_ids"] == want
        for r in rows[s, "packed"]:
            assert len(r["source_ids"]) >= 2
            assert len(set(re.findall(r"Question (\d+):", r["prefix_text"]))) >= 2
            # the history closes each earlier conversation with its answer; the last turn is the final user
            assert r["prefix_text"].count("<|im_start|>assistant\n") >= 2
            final = fixture_row(question(r["prefix_text"]))
            assert r["reasoning"] == (final["reasoning"] == "on")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    nat = mean([len(r["prefix_ids"]) for s in SPLITS for r in rows[s, "natural"]])
    pack = mean([len(r["prefix_ids"]) for s in SPLITS for r in rows[s, "packed"]])
    assert pack > 1.5 * nat
    assert min(len(r["prefix_ids"]) for s in SPLITS for r in rows[s, "packed"]) > PROFILE.prefix_cap // 2


def test_reasoning_rendered_through_template(prepare_world):
    manifest = prepare_world["result"].manifest["results"]["examples"]
    for (s, v), rows in prepare_world["rows"].items():
        for r in rows:
            if r["reasoning"]:
                assert r["prefix_text"].endswith("<|im_start|>assistant\n")
                assert r["reply_text"].startswith("<think>\nThe user asks about the ")
            else:
                assert r["prefix_text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
                assert "<think>" not in r["reply_text"]
        assert manifest[f"{s}.{v}"]["reasoning_on"] == sum(r["reasoning"] for r in rows)
        assert manifest[f"{s}.{v}"]["reasoning_off"] == sum(not r["reasoning"] for r in rows)
    natural = [r for s in SPLITS for r in prepare_world["rows"][s, "natural"]]
    assert any(r["reasoning"] for r in natural) and not all(r["reasoning"] for r in natural)


def test_bad_rows_counted_not_fatal(prepare_world):
    counts = prepare_world["result"].manifest["results"]["rows"]
    _, expected = bad_lines()
    assert counts["skipped"] == dict(expected)
    assert counts["duplicates"] == 1
    assert counts["read"] == len(all_rows()) + 1 + sum(expected.values())
    assert counts["unique"] == len(all_rows())


def test_verify_detects_tampering(prepare_world, tmp_path):
    data = tmp_path / "d"
    shutil.copytree(prepare_world["dir"], data)
    verify_split(data)
    target = data / "test.packed.jsonl"
    lines = target.read_text().splitlines()
    row = json.loads(lines[0])
    row["reply_ids"][0] += 1
    lines[0] = json.dumps(row, sort_keys=True)
    target.write_text("\n".join(lines) + "\n")
    with pytest.raises(SplitIntegrityError, match="test.packed.jsonl"):
        verify_split(data)
    with pytest.raises(SplitIntegrityError, match="test.packed.jsonl"):
        load_split(data, "train", "natural")
    (data / "validation.natural.jsonl").unlink()
    target.unlink()
    with pytest.raises(SplitIntegrityError, match=r"(validation\.natural|test\.packed)\.jsonl.*missing"):
        verify_split(data)


def test_rerun_is_noop_and_changes_rebuild(prepare_world, tmp_path):
    out, src = tmp_path / "out", tmp_path / "chats.jsonl"
    shutil.copy(prepare_world["source"], src)
    first = prepare(prepare_world["tok"], PROFILE, source=src, out_root=out)
    data = out / PROFILE.name
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in data.iterdir()}
    again = prepare(prepare_world["tok"], PROFILE, source=src, out_root=out)
    assert first.built and not again.built
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in data.iterdir()} == before

    (data / "train.natural.jsonl").write_text("{}\n")
    fixed = prepare(prepare_world["tok"], PROFILE, source=src, out_root=out)
    assert fixed.built and "train.natural.jsonl" in fixed.reason
    assert (data / "train.natural.jsonl").read_bytes() == before["train.natural.jsonl"][1]

    with open(src, "a") as f:
        f.write(json.dumps(good_row(999)) + "\n")
    assert prepare(prepare_world["tok"], PROFILE, source=src, out_root=out).built
    assert prepare(prepare_world["tok"], PROFILE, source=src, out_root=out, seed=3).built
    assert not prepare(prepare_world["tok"], PROFILE, source=src, out_root=out, seed=3).built
    assert prepare(prepare_world["tok"], PROFILE, source=src, out_root=out, seed=3, force=True).built


def test_manifest_contents(prepare_world):
    m = read_json(prepare_world["dir"] / "manifest.json")
    assert m["stage"] == "prepare" and m["seeds"] == {"seed": 0}
    assert m["inputs"]["source"]["sha256"] == sha256_file(prepare_world["source"])
    assert m["inputs"]["tokenizer"]["digest"] == tokenizer_digest(prepare_world["tok"])
    assert set(m["files"]) == {f"{s}.{v}.jsonl" for s in SPLITS for v in VARIANTS}
    lengths = m["results"]["examples"]["train.packed"]["prefix_tokens"]
    assert set(lengths) == {"min", "median", "mean", "max"} and lengths["max"] <= PROFILE.prefix_cap


def test_tokenizer_digest_survives_save_and_reload(prepare_world, tmp_path):
    from transformers import AutoTokenizer

    tok = prepare_world["tok"]
    reloaded = AutoTokenizer.from_pretrained(save_tokenizer(tok, tmp_path / "tok"))
    assert tokenizer_digest(reloaded) == tokenizer_digest(tok)
    other = train_chat_tokenizer(["a completely different corpus of words"] * 20, vocab_size=300)
    assert tokenizer_digest(other) != tokenizer_digest(tok)


def test_hub_without_network_fails_fast_naming_source(prepare_world, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="--source PATH"):
        prepare(prepare_world["tok"], PROFILE, source=None, out_root=tmp_path)
    with pytest.raises(ValueError, match="not found"):
        prepare(prepare_world["tok"], PROFILE, source=tmp_path / "missing.jsonl", out_root=tmp_path)


def test_hub_path_streams_until_pools_fill_and_records_commit(prepare_world, tmp_path, monkeypatch):
    import kvlingo.inputs.data as data

    consumed = []

    def fake_rows(hub, commit):  # stands in for the Hub stream: the fixture, one row at a time
        assert commit == "f" * 40
        for row in data.local_rows(prepare_world["source"]):
            consumed.append(row)
            yield row

    monkeypatch.setattr(data, "resolve_hub_revision", lambda hub: "f" * 40)
    monkeypatch.setattr(data, "hub_rows", fake_rows)
    small = replace(PROFILE, n_train=6, n_validation=2, n_test=2, n_packed=1)
    res = prepare(prepare_world["tok"], small, source=None, out_root=tmp_path)
    source = res.manifest["inputs"]["source"]
    assert source["kind"] == "hub" and source["revision"] == "f" * 40 and source["revision_requested"] == "main"
    n_lines = len(prepare_world["source"].read_text().splitlines())
    assert res.manifest["results"]["rows"]["read"] == len(consumed) < n_lines
    assert all(e["short"] == 0 for e in res.manifest["results"]["examples"].values())


def test_hub_unreachable_fails_with_clear_message(monkeypatch):
    import huggingface_hub

    from kvlingo.inputs.data import NEMOTRON, resolve_hub_revision

    def unreachable(self, *a, **k):
        raise ConnectionError("no route to host")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    with pytest.raises(ValueError, match=r"cannot reach .*--source PATH"):
        resolve_hub_revision(NEMOTRON)


def test_check_tokenizer(prepare_world):
    from kvlingo.inputs.data import check_tokenizer
    from kvlingo.io import sha256_json

    tok = prepare_world["tok"]
    check_tokenizer(prepare_world["result"].manifest, tokenizer_digest(tok), sha256_json(tok.chat_template))
    other = train_chat_tokenizer(["a completely different corpus of words"] * 20, vocab_size=300)
    with pytest.raises(SplitIntegrityError, match="tokenized with") as e:
        check_tokenizer(prepare_world["result"].manifest, tokenizer_digest(other), sha256_json(other.chat_template))
    assert tokenizer_digest(other)[:16] in str(e.value) and tokenizer_digest(tok)[:16] in str(e.value)


# --------------------------------------------------------------------------- hardening: edge cases and rebuilds
def test_row_edge_cases_are_refused_by_reason():
    from kvlingo.inputs.data import _InvalidJson, parse_row

    g = good_row(0)  # reasoning on
    assert parse_row({**g, "output": "<think>\na\n</think>\n\nb<think>c</think>d"}) == "malformed_think_block"
    assert parse_row({**good_row(1), "output": "done.<|im_end|> and more"}) == "chat_marker_in_text"
    assert parse_row({**g, "input": [{"role": "user", "content": "hi <|im_start|>system"}]}) == "chat_marker_in_text"
    assert not isinstance(parse_row(g), str) and isinstance(parse_row(_InvalidJson()), str)


def test_a_byte_order_mark_does_not_lose_the_first_row(tmp_path):
    from kvlingo.inputs.data import local_rows, parse_row

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(good_row(0)) + "\n" + json.dumps(good_row(1)) + "\n").encode())
    rows = list(local_rows(path))
    assert len(rows) == 2 and all(not isinstance(parse_row(r), str) for r in rows)


def test_one_prompt_with_reasoning_on_and_off_lands_in_one_split(prepare_world, tmp_path):
    src = tmp_path / "pairs.jsonl"
    rows = []
    for i in range(60):
        on = good_row(2 * i)  # even rows have reasoning on
        off = {**on, "reasoning": "off", "output": on["output"].split("</think>")[1].strip()}
        rows += [on, off]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = prepare(prepare_world["tok"], PROFILE, source=src, out_root=tmp_path / "out")
    where = {}
    for s in SPLITS:
        for r in read_jsonl(split_path(tmp_path / "out" / PROFILE.name, s, "natural")):
            where.setdefault(question(r["prefix_text"]), set()).add(s)
    assert where and all(len(splits) == 1 for splits in where.values())
    assert res.manifest["results"]["rows"]["unique"] == 120


def test_a_template_that_drops_reasoning_is_counted(prepare_world, tmp_path):
    tok = type(prepare_world["tok"]).from_pretrained(save_tokenizer(prepare_world["tok"], tmp_path / "tok"))
    tok.chat_template = tok.chat_template.replace("message['reasoning_content'] is defined", "false")
    res = prepare(tok, PROFILE, source=prepare_world["source"], out_root=tmp_path / "out")
    ex = res.manifest["results"]["examples"]["train.natural"]
    assert ex["think_dropped_by_template"] == ex["reasoning_on"] > 0


def test_a_killed_rebuild_keeps_the_old_set_and_leftovers_go(prepare_world, tmp_path, monkeypatch):
    import kvlingo.inputs.data as data

    out = tmp_path / "out"
    prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out, seed=0)
    folder = out / PROFILE.name
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real, calls = data.build_variant, []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # an interrupt after the train files were written
        return real(*a, **k)

    monkeypatch.setattr(data, "build_variant", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out, seed=1)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the seed-0 set, whole
    open_prepared(folder)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # an interrupted build removes its staging
    staging = out / f".{PROFILE.name}.building-999"  # what a SIGKILL (which no code sees) leaves
    staging.mkdir()
    (staging / "train.natural.jsonl").write_text("half")
    (folder / ".train.natural.jsonl.abc123.tmp").write_text("half")  # what a killed atomic write leaves
    res = prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out, seed=1)
    assert res.built and "settings.seed: 0 → 1" in res.reason  # the rebuild names what changed
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_build_killed_between_its_two_renames_keeps_the_new_set(prepare_world, tmp_path, monkeypatch):
    """`_swap_in` renames the old set aside, then the new one in; a kill between the two leaves no data folder.
    The next run puts the complete new set in place (not the old one, and no rebuild from the source)."""
    import kvlingo.inputs.data as data

    out = tmp_path / "out"
    prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out, seed=0)
    folder = out / PROFILE.name
    real_replace, calls = data.os.replace, []

    def killed(src, dst):
        calls.append(1)
        if len(calls) == 2 and str(dst) == str(folder):  # the new set's rename into place
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(data.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        data._swap_in(_copy_as_new_build(folder, out), folder)
    monkeypatch.undo()
    assert not folder.exists() and {p.name.split("-")[0] for p in out.iterdir()} == {
        f".{PROFILE.name}.retired",
        f".{PROFILE.name}.building",
    }
    new_manifest = next(out.glob(f".{PROFILE.name}.building-*")).joinpath("manifest.json").read_bytes()
    (out / f".{PROFILE.name}.building-999").mkdir()  # a half-built staging folder of another killed run

    monkeypatch.setattr(data, "collect_pools", lambda *a, **k: pytest.fail("rebuilt from the source"))
    res = prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out, seed=0)
    assert not res.built and (folder / "manifest.json").read_bytes() == new_manifest
    open_prepared(folder)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def _copy_as_new_build(folder: Path, out: Path) -> Path:
    """A complete staging folder as a build leaves it just before `_swap_in` (the same set, marked new)."""
    staging = out / f".{folder.name}.building-1"
    shutil.copytree(folder, staging)
    manifest = json.loads((staging / "manifest.json").read_text())
    manifest["wall_time_s"] = 12345.0  # tells the new set's manifest from the old one's
    (staging / "manifest.json").write_text(json.dumps(sealed(manifest)))  # sealed again, as a build writes it
    return staging


def test_a_folder_of_other_files_is_never_replaced_by_a_build(prepare_world, tmp_path):
    """A rebuild swaps the whole data folder out; one holding anything the suite did not prepare is refused."""
    out = tmp_path / "out"
    folder = out / PROFILE.name
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"holds files this suite did not prepare \(notes.txt\)"):
        prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out)
    assert (folder / "notes.txt").read_text() == "precious"
    (folder / "notes.txt").unlink()
    (folder / "manifest.json").write_text(json.dumps({"stage": "train"}))
    with pytest.raises(ValueError, match="manifest.json with stage 'train'"):
        prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out)
    (folder / "manifest.json").unlink()  # an empty folder is fine
    assert prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out).built


def test_a_folder_named_like_a_file_of_the_set_is_not_the_sets(prepare_world, tmp_path):
    """`manifest.json/` as a folder holding a user's file: refused, and nothing in it removed (it once built over
    it, "its manifest is missing", and the file was gone)."""
    out = tmp_path / "out"
    mine = out / PROFILE.name / "manifest.json"
    mine.mkdir(parents=True)
    (mine / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"holds files this suite did not prepare \(manifest.json/\)"):
        prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out)
    assert (mine / "keep.txt").read_text() == "precious"


def test_an_empty_source_keeps_the_existing_set(prepare_world, tmp_path):
    out = tmp_path / "out"
    prepare(prepare_world["tok"], PROFILE, source=prepare_world["source"], out_root=out)
    before = {p.name: p.read_bytes() for p in (out / PROFILE.name).iterdir()}
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    with pytest.raises(ValueError, match="no usable conversations.*is kept"):
        prepare(prepare_world["tok"], PROFILE, source=empty, out_root=out)
    assert {p.name: p.read_bytes() for p in (out / PROFILE.name).iterdir()} == before


def test_a_source_that_is_a_folder_is_named_as_one(tmp_path):
    from kvlingo.eval.tasks.data import read_source
    from kvlingo.inputs.data import prepare
    from kvlingo.inputs.profiles import get_profile

    with pytest.raises(ValueError, match=f"--source {tmp_path} is a folder, not a JSONL file"):
        read_source(tmp_path, "arc")
    with pytest.raises(ValueError, match=f"source file {tmp_path} is a folder, not a file"):
        prepare(None, get_profile("tiny"), source=tmp_path, out_root=tmp_path / "out")


def test_a_missing_data_folder_names_the_run_s_profile_and_a_command_that_makes_it(prepare_world, tmp_path):
    """Once, `--profile tiny --data /x/data` said `make prepare PROFILE=data`: a profile named after the folder,
    which is none. The hint names the stage's --profile, and its prepare.py command, run as printed (with the
    source and tokenizer it says to add), makes the folder it says to pass as --data."""
    import shlex

    from kvlingo.inputs.data import prepare_hint
    from kvlingo.inputs.profiles import PROFILES

    for folder, given in ((tmp_path / "data", "tiny"), (tmp_path / "elsewhere" / "tiny", None)):
        with pytest.raises(SplitIntegrityError) as e:
            open_prepared(folder, profile=given)
        msg = str(e.value)
        named = re.findall(r"(?:--profile |PROFILE=)([^\s`]+)", msg)
        assert named and set(named) == {"tiny"} <= set(PROFILES), msg
        argv = shlex.split(re.search(r"`\.venv/bin/python prepare\.py ([^`]*)`", msg)[1])
        assert "--source PATH --tokenizer PATH" in msg
        out = Path(argv[argv.index("--out") + 1])
        profile = replace(PROFILE, name=argv[argv.index("--profile") + 1])
        prepare(prepare_world["tok"], profile, source=prepare_world["source"], out_root=out, tokenizer_name="fixture")
        then = re.search(r"then pass --data (\S+)", msg)
        assert open_prepared(then[1] if then else folder)["files"] == prepare_world["result"].manifest["files"], msg
    assert "`make prepare PROFILE=tiny`" in prepare_hint(Path("data") / "tiny", "tiny")  # the Makefile's folder
    assert "PROFILE=demo" not in prepare_hint(Path("data") / "demo", "tiny")  # the run's profile, not the folder's
