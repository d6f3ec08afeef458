"""The ARC/GSM8K stage end to end on the tiny pair: resume after a kill, the thinking and trace handoffs against
transformers' own generate, each half of the items under its own report, up to date until the maps or rows
change, and refusals before any work."""

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
from stagecli import refused

import task_eval
from kvlingo.eval.itemrows import read_rows
from kvlingo.eval.tasks.prompts import gsm8k_item, plain_ids, user_prompt_ids
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.io import read_json

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


ROOT = Path(__file__).resolve().parents[2]


def _args(task_world, results, *extra):
    return [
        "--large",
        task_world["large"],
        "--small",
        task_world["small"],
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
        task_world["artifacts"],
        "--task",
        "gsm8k",
        "--source",
        task_world["gsm8k"],
        "--max-new-tokens",
        "6",
        *extra,
    ]


@pytest.mark.slow  # a real process, killed mid-run: pays one interpreter start-up
def test_resume_after_kill_regenerates_nothing_finished(task_world, tmp_path):
    results = tmp_path / "results"
    rows_path = results / "t" / "task-gsm8k.rows.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "killed_run.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "task_eval.py", *_args(task_world, results, "--limit", "40")],
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
    task_eval.main(_args(task_world, results, "--limit", str(limit), "--resume"))
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
    task_eval.main(_args(task_world, tmp_path / "fresh", "--limit", str(limit)))
    fresh = {r["key"]: r for r in read_rows(tmp_path / "fresh" / "t" / "task-gsm8k.rows.jsonl")[1]}
    assert set(fresh) == set(keys)
    assert all(fresh[r["key"]]["new_ids"] == r["new_ids"] for r in after)

    def timeless(paths):
        return {p: {k: v for k, v in s.items() if k != "mean_seconds"} for p, s in paths.items()}

    fresh_report = read_json(tmp_path / "fresh" / "t" / "task-gsm8k.json")
    assert timeless(fresh_report["results"]["paths"]) == timeless(report["results"]["paths"])

    with pytest.raises(SystemExit) as e:
        task_eval.main(_args(task_world, results, "--limit", str(limit), "--resume", "--max-new-tokens", "7"))
    assert e.value.code == 2


def test_thinking_renders_the_prompt_with_its_think_block(task_world, tmp_path):
    """--thinking renders each prompt with enable_thinking=True (no empty think block), and says so in the config."""
    from transformers import AutoTokenizer

    task_eval.main(_args(task_world, tmp_path, "--limit", "1", "--native", "--thinking", "--max-new-tokens", "2"))
    report = read_json(tmp_path / "t" / "task-gsm8k-native.json")
    rows = read_rows(tmp_path / "t" / "task-gsm8k-native.rows.jsonl")[1]
    tok = AutoTokenizer.from_pretrained(task_world["small"])
    item = gsm8k_item(json.loads(Path(task_world["gsm8k"]).read_text().splitlines()[0]))
    thinking, plain = user_prompt_ids(tok, item.prompt, True), user_prompt_ids(tok, item.prompt, False)
    assert thinking != plain and report["config"]["enable_thinking"] is True
    assert {r["prompt_tokens"] for r in rows} == {len(thinking)}


def test_trace_handoff_against_transformers_generate(task_world, tmp_path):
    task_eval.main(_args(task_world, tmp_path, "--limit", "2", "--handoff", "trace", "--trace-tokens", "5"))
    report = read_json(tmp_path / "t" / "task-gsm8k-trace.json")
    assert set(report["results"]["paths"]) == {"translated", "native_target_with_trace", "control", "no_context"}
    rows = read_rows(tmp_path / "t" / "task-gsm8k-trace.rows.jsonl")[1]
    answers = ["translated", "native_target_with_trace", "control", "no_context"]
    assert [r["path"] for r in rows] == ["source_trace"] * 2 + answers * 2
    traces, first, second = rows[:2], rows[2:6], rows[6:]

    large = load_model(ModelSpec.parse(task_world["large"]), "cpu", torch.float32)
    small = load_model(ModelSpec.parse(task_world["small"]), "cpu", torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task_world["small"])
    think_close = tok.convert_tokens_to_ids("</think>")
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"), think_close]
    item = gsm8k_item(json.loads(Path(task_world["gsm8k"]).read_text().splitlines()[0]))
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


def test_resume_after_a_code_edit_is_refused_and_mixes_nothing(task_world, tmp_path, monkeypatch, capsys):
    """Rows made by other code are never reported beside new ones: the rows header holds the code hash."""
    import kvlingo.records.resume as resume

    task_eval.main(_args(task_world, tmp_path, "--limit", "2", "--no-controls"))
    rows = tmp_path / "t" / "task-gsm8k.rows.jsonl"
    before = rows.read_bytes()
    real = resume.code_hash
    monkeypatch.setattr(resume, "code_hash", lambda *a: "0" * 64 if "task_eval" in str(a[0]) else real(*a))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        task_eval.main(_args(task_world, tmp_path, "--limit", "2", "--no-controls", "--resume"))
    assert e.value.code == 2 and "code changed" in capsys.readouterr().err
    assert rows.read_bytes() == before


def test_a_finished_evaluation_is_up_to_date_until_its_maps_or_rows_change(task_world, tmp_path, monkeypatch, capsys):
    """The same settings, inputs, models and code: nothing loads, nothing is rewritten; --force, other maps or a
    changed rows log run it again."""
    task_eval.main(_args(task_world, tmp_path, "--limit", "2"))
    report = tmp_path / "t" / "task-gsm8k.json"
    first = report.read_bytes()

    def loads(*_a, **_k):
        raise RuntimeError("the pair was loaded")

    monkeypatch.setattr("kvlingo.inputs.models.load_pair", loads)
    capsys.readouterr()
    for extra in ((), ("--resume",)):
        task_eval.main(_args(task_world, tmp_path, "--limit", "2", *extra))
        assert f"{report} is up to date (same settings, inputs, models and code)" in capsys.readouterr().out
    assert report.read_bytes() == first
    for extra in (("--force",), ("--limit", "3"), ("--no-controls",)):
        with pytest.raises(RuntimeError, match="was loaded"):
            task_eval.main(
                _args(task_world, tmp_path, "--limit", "2", *extra)
                if extra[0] != "--limit"
                else _args(task_world, tmp_path, *extra)
            )
    rows = tmp_path / "t" / "task-gsm8k.rows.jsonl"
    rows.write_bytes(rows.read_bytes() + b"\n")
    with pytest.raises(RuntimeError, match="was loaded"):
        task_eval.main(_args(task_world, tmp_path, "--limit", "2"))
    manifest = Path(task_world["maps"]) / "manifest.json"
    saved = manifest.read_bytes()
    rows.write_bytes(rows.read_bytes()[:-1])
    task_eval.main(_args(task_world, tmp_path, "--limit", "2"))  # up to date again
    try:
        from kvlingo.records.saved import sealed

        retrained = {**json.loads(saved), "note": "retrained"}  # another translator's manifest, sealed as written
        manifest.write_text(json.dumps(sealed(retrained)))
        with pytest.raises(RuntimeError, match="was loaded"):
            task_eval.main(_args(task_world, tmp_path, "--limit", "2"))  # another translator: evaluated again
    finally:
        manifest.write_bytes(saved)


def test_task_eval_scores_each_half_under_its_own_report(task_world, tmp_path):  # noqa: F811
    import task_eval

    for split in ("validation", "test"):
        task_eval.main(_args(task_world, tmp_path, "--limit", "3", "--split", split, "--no-controls"))
    val = read_json(tmp_path / "t" / "task-gsm8k-validation.json")
    test = read_json(tmp_path / "t" / "task-gsm8k-test.json")
    assert val["config"]["split"] == "validation" and test["config"]["split"] == "test"
    gsm = [json.loads(line) for line in open(task_world["gsm8k"])]
    ids = lambda p: [
        r["item_id"]
        for r in map(json.loads, open(p).read().splitlines()[1:])  # noqa: E731
        if r.get("path") == "translated"
    ]
    got_val, got_test = (
        ids(tmp_path / "t" / "task-gsm8k-validation.rows.jsonl"),
        ids(tmp_path / "t" / "task-gsm8k-test.rows.jsonl"),
    )
    assert len(got_val) == len(got_test) == 3 and not set(got_val) & set(got_test)
    assert len(gsm) == 40  # validation: items 0..2 of the first 20; test: items 20..22


def test_task_data_is_not_prepared_into_a_folder_that_cannot_be_written(tmp_path, capsys):
    """`--prepare` into a --data-root below a file once ended in NotADirectoryError from the atomic write."""
    import task_eval

    source = tmp_path / "arc.jsonl"
    source.write_text("")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = refused(
        task_eval.main, ["--task", "arc", "--prepare", "--data-root", str(blocker), "--source", str(source)], capsys
    )
    assert f"{blocker} is a file, but the stage writes into a folder there" in err
    assert "give --data-root another folder" in err
    assert blocker.read_text() == "x"
