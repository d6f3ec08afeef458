"""Task evaluation: answer parsers, prompt formats, the checksummed rows log, resume after a kill,
and the reasoning-trace path against transformers' own generate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tinypair import load_tiny_pair

import task_eval
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry, TranslatorError
from kvlingo.eval.itemrows import ItemRows, RowsError, read_rows
from kvlingo.eval.tasks.parsers import parse_choice, parse_gold_number, parse_number, score
from kvlingo.eval.tasks.prompts import arc_item, gsm8k_item, plain_ids, user_prompt_ids
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.io import read_json
from kvlingo.records.resume import ResumeRefused
from kvlingo.records.saved import load_translator, save_translator

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- parsers
@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is (C)", "C"),
        ("The answer is (C).\nI am sure.", "C"),
        ("answer: c", "C"),  # a lowercase letter
        ("b", "B"),
        ("**D**", "D"),
        ("A. Paris, because it is the capital.", "A"),
        ("Between (A) and (B), I pick (B).", "B"),  # several letters: the last bracketed one
        ("Maybe answer is A... no, the answer is D", "D"),  # several explicit answers: the last one
        ("I think the answer is a plant.", None),  # the article, not choice A
        ("A plant needs light to grow.", None),  # a sentence starting with the article
        ("Answer: E", None),  # not one of the labels
        ("I do not know.", None),  # no answer
        ("", None),
        ("<think>\nmaybe (A)\n</think>\n\nAnswer: B", "B"),  # a think block left in the text is ignored
    ],
)
def test_parse_choice(text, want):
    assert parse_choice(text, ("A", "B", "C", "D")) == want


@pytest.mark.parametrize(
    "text, want",
    [
        ("She pays $1,234.50 in total.\nAnswer: $1,234.50", "1234.5"),  # $ and thousands commas
        ("First 3 apples, then 5 more, so 8 in all", "8"),  # several numbers: the last
        ("Answer: 42, which is 6 times 7", "42"),  # the explicit marker beats the last number
        ("The answer is 42.", "42"),  # trailing period
        ("#### 1,000", "1000"),
        ("\\boxed{18} is what we get after 3 steps", "18"),
        ("The temperature fell to -5 degrees.", "-5"),
        ("x = 3.50", "3.5"),
        ("It is 1,000,000.", "1000000"),
        ("There is no number here.", None),  # no answer
        ("", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_gold_numbers_and_scoring():
    row = {"question": "How many?", "answer": "2 + 3 = 5 apples, 1,200 total\n#### 1,205"}
    item = gsm8k_item(row)
    assert parse_gold_number(row["answer"]) == item.gold == "1205"
    assert score("gsm8k", item, "So the answer is 1205.00") == ("1205", True)
    assert score("gsm8k", item, "I think 1,204") == ("1204", False)
    assert score("gsm8k", item, "no idea") == (None, False)


def test_arc_prompt_maps_numeric_labels_to_letters():
    row = {
        "id": "x1",
        "question": "Which is a mammal?",
        "answerKey": "3",
        "choices": {"text": ["trout", "frog", "whale", "crow"], "label": ["1", "2", "3", "4"]},
    }
    item = arc_item(row)
    assert item.labels == ("A", "B", "C", "D") and item.gold == "C" and item.id == "x1"
    assert "\nA. trout\nB. frog\nC. whale\nD. crow\n" in item.prompt and '"Answer: X"' in item.prompt
    assert score("arc", item, "The answer is (c)") == ("C", True)
    five = {**row, "choices": {"text": list("vwxyz"), "label": list("ABCDE")}, "answerKey": "E"}
    assert arc_item(five).labels[-1] == "E" and score("arc", arc_item(five), "Answer: E") == ("E", True)


# --------------------------------------------------------------------------- the rows log
def test_rows_torn_tail_is_dropped_and_appending_continues(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    log = ItemRows(path, {"cap": 4}, resume=False)
    for k in ("a", "b"):
        log.append(k, {"v": k})
    intact = path.read_bytes()
    with open(path, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"kind": "item", "key": "c", "v": "half')
    header, rows, _ = read_rows(path)
    assert [r["key"] for r in rows] == ["a", "b"]
    log2 = ItemRows(path, {"cap": 4}, resume=True)
    assert log2.dropped_torn_line and path.read_bytes() == intact and "b" in log2 and "c" not in log2
    log2.append("c", {"v": "c"})
    assert [r["key"] for r in read_rows(path)[1]] == ["a", "b", "c"]
    # without --resume the log starts over
    assert ItemRows(path, {"cap": 4}, resume=False).rows == {} and read_rows(path)[1] == []


def test_rows_damaged_line_before_the_end_is_refused(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    log = ItemRows(path, {"cap": 4}, resume=False)
    for k in ("a", "b"):
        log.append(k, {"v": 1})
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"v": 1', '"v": 2')  # an edit the checksum catches
    path.write_text("".join(lines))
    with pytest.raises(RowsError, match="line 2"):
        ItemRows(path, {"cap": 4}, resume=True)


def test_rows_resume_refuses_changed_settings_by_name(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    ItemRows(path, {"cap": 4, "models": {"target": "a"}, "dtype": "float32"}, resume=False)
    with pytest.raises(ResumeRefused) as e:
        ItemRows(path, {"cap": 8, "models": {"target": "b"}, "dtype": "float32"}, resume=True)
    assert "cap: 4 → 8" in str(e.value) and "models.target: a → b" in str(e.value) and "dtype" not in str(e.value)


def test_rows_of_other_code_are_never_reused(tmp_path):
    donor = ItemRows(tmp_path / "native.rows.jsonl", {"code": "old"}, resume=False)
    donor.append("k1", {"v": 7})
    assert ItemRows(tmp_path / "a.rows.jsonl", {"code": "new"}, resume=False, donors=[donor.path]).get("k1") is None
    assert ItemRows(tmp_path / "b.rows.jsonl", {"code": "old"}, resume=False, donors=[donor.path]).get("k1")["v"] == 7


def test_rows_from_a_sibling_log_are_reused_by_key(tmp_path):
    donor = ItemRows(tmp_path / "native.rows.jsonl", {"m": 1}, resume=False)
    donor.append("k1", {"v": 7})
    log = ItemRows(tmp_path / "translated.rows.jsonl", {"m": 2}, resume=False, donors=[donor.path])
    row = log.get("k1")
    assert row["v"] == 7 and row["reused_from"] == "native.rows.jsonl" and log.get("k2") is None
    assert [r["key"] for r in read_rows(log.path)[1]] == ["k1"]  # copied, so the log stands on its own


# --------------------------------------------------------------------------- end to end on the tiny pair
@pytest.fixture(scope="module")
def world(tiny_pair_paths, tmp_path_factory):
    root = tmp_path_factory.mktemp("task_world")
    large, small = tiny_pair_paths
    src = load_model(ModelSpec.parse(str(large)), "cpu", torch.float32)
    maps = Headwise.identity(Geometry.of(src, src))  # same head_dim both sides
    save_translator(root / "artifacts" / "t" / "distilled", maps, {"direction": "l2s"})
    gsm = [
        {
            "question": f"Ada has {i} cats and buys {i + 2} more. How many cats now?",
            "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}",
        }
        for i in range(40)
    ]
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    return {
        "root": root,
        "large": str(large),
        "small": str(small),
        "artifacts": str(root / "artifacts"),
        "maps": str(root / "artifacts" / "t" / "distilled"),
        "gsm8k": str(root / "gsm8k.jsonl"),
    }


def _args(world, results, *extra):
    return [
        "--large",
        world["large"],
        "--small",
        world["small"],
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--profile",
        "tiny",
        "--run",
        "t",
        "--results",
        str(results),
        "--artifacts",
        world["artifacts"],
        "--task",
        "gsm8k",
        "--source",
        world["gsm8k"],
        "--max-new-tokens",
        "6",
        *extra,
    ]


@pytest.mark.slow  # a real process, killed mid-run: pays one interpreter start-up
def test_resume_after_kill_regenerates_nothing_finished(world, tmp_path):
    results = tmp_path / "results"
    rows_path = results / "t" / "task-gsm8k.rows.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "killed_run.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "task_eval.py", *_args(world, results, "--limit", "40")],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if rows_path.exists() and len(read_rows(rows_path)[1]) >= 3:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
    tail = (tmp_path / "killed_run.log").read_text(errors="replace")[-2000:]
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{tail}"
    _, before, _ = read_rows(rows_path)
    assert len(before) >= 3 and not (results / "t" / "task-gsm8k.json").exists()
    first = {r["key"]: r for r in before}

    limit = len(before) // 2 + 2  # the finished items plus at least one more
    task_eval.main(_args(world, results, "--limit", str(limit), "--resume"))
    _, after, _ = read_rows(rows_path)
    keys = [r["key"] for r in after]
    # every (item, path) once, nothing duplicated: translated, native target, control, no-context
    assert len(keys) == len(set(keys)) == 4 * limit
    for r in after[: len(before)]:
        assert r == first[r["key"]]  # finished rows untouched: same timestamps, same session
    new_session = {r["session"] for r in after[len(before) :]}
    assert len(new_session) == 1 and new_session.isdisjoint({r["session"] for r in before})
    report = read_json(results / "t" / "task-gsm8k.json")
    rows = report["results"]["rows"]
    assert rows["generated"] == 4 * limit - len(before) and rows["resumed"] == len(before)

    # the resumed run equals an uninterrupted one
    task_eval.main(_args(world, tmp_path / "fresh", "--limit", str(limit)))
    fresh = {r["key"]: r for r in read_rows(tmp_path / "fresh" / "t" / "task-gsm8k.rows.jsonl")[1]}
    assert set(fresh) == set(keys)
    assert all(fresh[r["key"]]["new_ids"] == r["new_ids"] for r in after)

    def timeless(paths):
        return {p: {k: v for k, v in s.items() if k != "mean_seconds"} for p, s in paths.items()}

    fresh_report = read_json(tmp_path / "fresh" / "t" / "task-gsm8k.json")
    assert timeless(fresh_report["results"]["paths"]) == timeless(report["results"]["paths"])

    with pytest.raises(SystemExit) as e:
        task_eval.main(_args(world, results, "--limit", str(limit), "--resume", "--max-new-tokens", "7"))
    assert e.value.code == 2


def test_thinking_renders_the_prompt_with_its_think_block(world, tmp_path):
    """--thinking renders each prompt with enable_thinking=True (no empty think block), and says so in the config."""
    from transformers import AutoTokenizer

    task_eval.main(_args(world, tmp_path, "--limit", "1", "--native", "--thinking", "--max-new-tokens", "2"))
    report = read_json(tmp_path / "t" / "task-gsm8k-native.json")
    rows = read_rows(tmp_path / "t" / "task-gsm8k-native.rows.jsonl")[1]
    tok = AutoTokenizer.from_pretrained(world["small"])
    item = gsm8k_item(json.loads(Path(world["gsm8k"]).read_text().splitlines()[0]))
    thinking, plain = user_prompt_ids(tok, item.prompt, True), user_prompt_ids(tok, item.prompt, False)
    assert thinking != plain and report["config"]["enable_thinking"] is True
    assert {r["prompt_tokens"] for r in rows} == {len(thinking)}


def test_trace_handoff_against_transformers_generate(world, tmp_path):
    task_eval.main(_args(world, tmp_path, "--limit", "2", "--handoff", "trace", "--trace-tokens", "5"))
    report = read_json(tmp_path / "t" / "task-gsm8k-trace.json")
    assert set(report["results"]["paths"]) == {"translated", "native_target_with_trace", "control", "no_context"}
    rows = read_rows(tmp_path / "t" / "task-gsm8k-trace.rows.jsonl")[1]
    answers = ["translated", "native_target_with_trace", "control", "no_context"]
    assert [r["path"] for r in rows] == ["source_trace"] * 2 + answers * 2
    traces, first, second = rows[:2], rows[2:6], rows[6:]

    large = load_model(ModelSpec.parse(world["large"]), "cpu", torch.float32)
    small = load_model(ModelSpec.parse(world["small"]), "cpu", torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["small"])
    think_close = tok.convert_tokens_to_ids("</think>")
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"), think_close]
    item = gsm8k_item(json.loads(Path(world["gsm8k"]).read_text().splitlines()[0]))
    prompt = user_prompt_ids(tok, item.prompt, True) + plain_ids(tok, "<think>\n")
    with torch.no_grad():
        ref = large.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
    ref = ref[: next((i for i, t in enumerate(ref) if t in stops), len(ref))]
    assert traces[0]["trace_ids"] == ref
    # the native target continues the same prompt + trace, closed as documented
    closing = plain_ids(tok, ("\n" if len(ref) == 5 else "") + "</think>\n\n")
    prefix = prompt + ref + closing
    with torch.no_grad():
        ans = small.generate(
            input_ids=torch.tensor([prefix]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=stops[:2],
            pad_token_id=tok.pad_token_id,
        )[0, len(prefix) :].tolist()
    ans = ans[: next((i for i, t in enumerate(ans) if t in stops[:2]), len(ans))]
    assert first[1]["new_ids"] == ans and first[1]["prompt_tokens"] == len(prefix)
    assert first[0]["prompt_tokens"] == len(prefix)  # the translated target saw the same prefix
    # Every prefix ends with the same closing token, so item 0's control (item 1's translated cache,
    # then that token) must answer exactly as item 1's translated path does.
    assert first[2]["new_ids"] == second[0]["new_ids"] and second[2]["new_ids"] == first[0]["new_ids"]
    # no-context: the target from the prefix's last token alone
    with torch.no_grad():
        floor = small.generate(
            input_ids=torch.tensor([prefix[-1:]]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=stops[:2],
            pad_token_id=tok.pad_token_id,
        )[0, 1:].tolist()
    floor = floor[: next((i for i, t in enumerate(floor) if t in stops[:2]), len(floor))]
    assert first[3]["new_ids"] == floor


def test_maps_for_another_direction_or_pair_are_refused(world, tiny_pair_paths, tmp_path):
    pair = load_tiny_pair(tiny_pair_paths)
    maps = Headwise.identity(Geometry.of(pair.source, pair.source))
    save_translator(tmp_path / "s2l", maps, {"direction": "s2l"})
    with pytest.raises(TranslatorError, match="direction 's2l'"):
        load_translator(tmp_path / "s2l", pair)
    save_translator(tmp_path / "other", maps, {"direction": "l2s", "models": {"source": {"id": "elsewhere"}}})
    with pytest.raises(TranslatorError, match="another source model"):
        load_translator(tmp_path / "other", pair)
    with pytest.raises(TranslatorError, match="family is 'headwise'"):
        load_translator(world["maps"], pair, family="crosshead")
    _, info = load_translator(world["maps"], pair)
    assert info["maps_sha256"] == json.loads((Path(world["maps"]) / "manifest.json").read_text())["maps_sha256"]


def test_resume_after_a_code_edit_is_refused_and_mixes_nothing(world, tmp_path, monkeypatch, capsys):
    """Rows made by other code are never reported beside new ones: the rows header holds the code hash."""
    import kvlingo.records.resume as resume

    task_eval.main(_args(world, tmp_path, "--limit", "2", "--no-controls"))
    rows = tmp_path / "t" / "task-gsm8k.rows.jsonl"
    before = rows.read_bytes()
    real = resume.code_hash
    monkeypatch.setattr(resume, "code_hash", lambda *a: "0" * 64 if "task_eval" in str(a[0]) else real(*a))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        task_eval.main(_args(world, tmp_path, "--limit", "2", "--no-controls", "--resume"))
    assert e.value.code == 2 and "code changed" in capsys.readouterr().err
    assert rows.read_bytes() == before


def test_a_finished_evaluation_is_up_to_date_until_its_maps_or_rows_change(world, tmp_path, monkeypatch, capsys):
    """The same settings, inputs, models and code: nothing loads, nothing is rewritten; --force, other maps or a
    changed rows log run it again."""
    task_eval.main(_args(world, tmp_path, "--limit", "2"))
    report = tmp_path / "t" / "task-gsm8k.json"
    first = report.read_bytes()

    def loads(*_a, **_k):
        raise RuntimeError("the pair was loaded")

    monkeypatch.setattr("kvlingo.inputs.models.load_pair", loads)
    capsys.readouterr()
    for extra in ((), ("--resume",)):
        task_eval.main(_args(world, tmp_path, "--limit", "2", *extra))
        assert f"{report} is up to date (same settings, inputs, models and code)" in capsys.readouterr().out
    assert report.read_bytes() == first
    for extra in (("--force",), ("--limit", "3"), ("--no-controls",)):
        with pytest.raises(RuntimeError, match="was loaded"):
            task_eval.main(
                _args(world, tmp_path, "--limit", "2", *extra)
                if extra[0] != "--limit"
                else _args(world, tmp_path, *extra)
            )
    rows = tmp_path / "t" / "task-gsm8k.rows.jsonl"
    rows.write_bytes(rows.read_bytes() + b"\n")
    with pytest.raises(RuntimeError, match="was loaded"):
        task_eval.main(_args(world, tmp_path, "--limit", "2"))
    manifest = Path(world["maps"]) / "manifest.json"
    saved = manifest.read_bytes()
    rows.write_bytes(rows.read_bytes()[:-1])
    task_eval.main(_args(world, tmp_path, "--limit", "2"))  # up to date again
    try:
        from kvlingo.records.saved import sealed

        retrained = {**json.loads(saved), "note": "retrained"}  # another translator's manifest, sealed as written
        manifest.write_text(json.dumps(sealed(retrained)))
        with pytest.raises(RuntimeError, match="was loaded"):
            task_eval.main(_args(world, tmp_path, "--limit", "2"))  # another translator: evaluated again
    finally:
        manifest.write_bytes(saved)
