"""Measurement that can decide: evaluation items split into validation and test halves, the benchmark's
validation and train splits, and as many held-out toy conversations as asked, disjoint from everything else."""

from __future__ import annotations

import json

import pytest
from test_tasks import _args, world  # noqa: F401  (the tiny task world fixture)

from kvlingo.eval.tasks.data import split_rows, split_suffix
from kvlingo.io import read_json
from kvlingo.toy import train as toytrain
from kvlingo.toy import world as toyworld

pytestmark = pytest.mark.usefixtures("one_thread")


def test_item_splits_are_disjoint_halves_in_order():
    rows = list(range(11))
    val, test = split_rows(rows, "validation"), split_rows(rows, "test")
    assert val == list(range(5)) and test == list(range(5, 11)) and split_rows(rows, "all") == rows
    assert (split_suffix("all"), split_suffix("validation"), split_suffix("test")) == ("", "-validation", "-test")
    with pytest.raises(ValueError, match="item split"):
        split_rows(rows, "train")


def test_task_eval_scores_each_half_under_its_own_report(world, tmp_path):  # noqa: F811
    import task_eval

    for split in ("validation", "test"):
        task_eval.main(_args(world, tmp_path, "--limit", "3", "--split", split, "--no-controls"))
    val = read_json(tmp_path / "t" / "task-gsm8k-validation.json")
    test = read_json(tmp_path / "t" / "task-gsm8k-test.json")
    assert val["config"]["split"] == "validation" and test["config"]["split"] == "test"
    gsm = [json.loads(line) for line in open(world["gsm8k"])]
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


def test_more_chats_extend_the_held_out_conversations_disjointly():
    cfg = toytrain.mini_config(0).world
    generated = toyworld.generate_world(cfg)
    rows, meta = toyworld.more_chats(cfg, len(generated.chats) + 60)
    assert rows[: len(generated.chats)] == generated.chats and len(rows) == len(meta) == len(generated.chats) + 60
    key = lambda r: json.dumps(r["input"], sort_keys=True)  # noqa: E731
    assert len({key(r) for r in rows}) == len(rows)  # no conversation twice
    assert not {key(r) for r in rows} & {key(r) for r in generated.train}  # none the toy models trained on
    finals = {r["input"][-1]["content"] for r in rows[len(generated.chats) :]}
    eval_prompts = (
        {r["prompt"] for r in generated.ifeval}
        | {toyworld.arc_prompt(r) for r in generated.arc}
        | {toyworld.gsm8k_prompt(r) for r in generated.gsm8k}
    )
    assert not finals & eval_prompts
    shorter, _ = toyworld.more_chats(cfg, len(generated.chats) + 20)
    assert shorter == rows[: len(generated.chats) + 20]  # a smaller N is a prefix of a larger one
    assert toyworld.more_chats(cfg, 5)[0] == generated.chats[:5]


def test_benchmark_scores_the_validation_and_train_splits(tiny_pair_paths, tmp_path):
    from tinypair import task_inputs

    import benchmark
    import train_translator

    data, _ = task_inputs(tmp_path, tiny_pair_paths[0])
    common = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--run",
        "r",
        "--artifacts",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "r"),
    ]
    train_translator.main([*common, "--family", "headwise", "--updates", "1", "--n-fit", "12"])
    for split in ("validation", "train"):
        benchmark.main(
            [*common, "--split", split, "--timing-conversations", "0", "--control-dtypes", "none", "--limit", "5"]
        )
    val = read_json(tmp_path / "r" / "r" / "benchmark-validation.json")
    train = read_json(tmp_path / "r" / "r" / "benchmark-train.json")
    assert val["config"]["split"] == "validation" and "validation_split" in val["inputs"]
    assert train["n_samples"]["conversations"] == 5 and "train_split" in train["inputs"]
    assert not (tmp_path / "r" / "r" / "benchmark.json").exists()  # the test split's report is untouched
    arms = val["results"]["quality"]["arms"]
    native = arms["native_target"]
    assert native["context_kl_token_mean"] == 0 if native["context_tokens"] else native["context_tokens"] == 0
    assert 0 < arms["distilled"]["attention_cosine"]["mean"] <= 1 and arms["distilled"]["attention_cosine"]["n"] == 5
