"""A chat source file with every kind of row the data stage meets: good, too long, to be cropped, and broken
lines (the `prepare_world` fixture)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from kvlingo.inputs.data import open_prepared, split_path
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import read_jsonl


def load_split(data_dir, split, variant):
    """Rows of one prepared file after checking the folder against its manifest (what every stage does)."""
    open_prepared(data_dir)
    return read_jsonl(split_path(data_dir, split, variant))


TOPICS = "apple river stone cloud lamp garden violin copper meadow harbor pepper candle".split()
SYSTEM = "You are concise."
N_GOOD, N_LONG, N_CROP = 100, 4, 4
PROFILE = get_profile("tiny")  # prefix_cap 96, reply_cap 16


def good_row(i: int) -> dict:
    a, b = TOPICS[i % 12], TOPICS[(i * 5 + 3) % 12]
    on = i % 2 == 0
    answer = f"The {a} sits by the {b} number {i}."
    messages = [{"role": "user", "content": f"Question {i}: where is the {a} and the {b}?"}]
    if i % 7 == 1:  # a short multi-turn chat
        messages = [
            {"role": "user", "content": f"Earlier {i}: hello about the {a}."},
            {"role": "assistant", "content": f"Hello, the {a} is fine."},
        ] + messages
    return {
        "input": messages,
        "output": f"<think>\nThe user asks about the {a} {i}.\n</think>\n\n{answer}" if on else answer,
        "reasoning": "on" if on else "off",
        "system_prompt": SYSTEM if i % 3 == 0 else "",
        "category": "chat",
    }


def long_row(i: int) -> dict:
    """Its final user turn alone is longer than the prefix cap: must be dropped."""
    row = good_row(i)
    row["input"] = [{"role": "user", "content": f"Question {i}: " + " ".join(TOPICS * 10)}]
    return row


def crop_row(i: int) -> dict:
    """Four long earlier turns, a short final one: must be cropped at a turn boundary."""
    row = good_row(i)
    history = []
    for k in range(4):
        words = " ".join(TOPICS[(k + j) % 12] for j in range(12))
        history += [
            {"role": "user", "content": f"Earlier {i}.{k}: {words}"},
            {"role": "assistant", "content": f"Reply {k}: {words}"},
        ]
    row["input"] = history + [row["input"][-1]]
    row["system_prompt"] = SYSTEM
    return row


def bad_lines() -> tuple[list[str], Counter]:
    g = good_row(0)
    rows = {
        "missing_role": {**g, "input": [{"content": "hi"}]},
        "empty_reply": {**good_row(2), "output": ""},
        "bad_input": {**g, "input": "hello"},
        "bad_reasoning_flag": {**g, "reasoning": "maybe"},
        "bad_content_type": {**g, "input": [{"role": "user", "content": 42}]},
        "bad_reply_type": {**g, "output": ["a"]},
        "missing_think_block": {**g, "output": "no think here"},
        "input_not_ending_with_user": {**g, "input": g["input"] + [{"role": "assistant", "content": "x"}]},
    }
    lines = [json.dumps(r) for r in rows.values()]
    lines += [json.dumps({**good_row(4), "output": "   "}), "this is not json", "[1, 2]"]
    expected = Counter(list(rows)) + Counter({"empty_reply": 1, "invalid_json": 1, "not_an_object": 1})
    return lines, expected


def all_rows() -> list[dict]:
    return (
        [good_row(i) for i in range(N_GOOD)]
        + [long_row(N_GOOD + i) for i in range(N_LONG)]
        + [crop_row(N_GOOD + N_LONG + i) for i in range(N_CROP)]
    )


def fixture_row(i: int) -> dict:
    return all_rows()[i]


def write_source(path: Path) -> Path:
    bad, _ = bad_lines()
    lines = [json.dumps(r) for r in all_rows()]
    lines.insert(10, lines[0])  # one exact duplicate
    lines[20:20] = bad
    path.write_text("\n".join(lines) + "\n")
    return path
