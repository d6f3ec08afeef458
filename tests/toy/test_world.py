"""The toy world's corpus (kvlingo/toy/world.py): deterministic, in the real evaluation formats, graded by the
official IFEval grader, disjoint between training and evaluation, with as many held-out conversations as asked."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from kvlingo.io import sha256_file
from kvlingo.toy import train as toytrain
from kvlingo.toy import world as toyworld

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


MINI_WORLD = toytrain.mini_config(0).world
NEMOTRON_KEYS = {"input", "output", "reasoning", "system_prompt", "category"}


# --------------------------------------------------------------------------- determinism
def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a = toyworld.write_world(tmp_path / "a", MINI_WORLD)
    b = toyworld.write_world(tmp_path / "b", MINI_WORLD)
    c = toyworld.write_world(tmp_path / "c", toytrain.mini_config(1).world)
    for name in toyworld.WORLD_FILES:
        assert sha256_file(a[name]) == sha256_file(b[name]), name
    assert sha256_file(a["train_chats"]) != sha256_file(c["train_chats"])
    assert sha256_file(a["ifeval"]) != sha256_file(c["ifeval"])


# --------------------------------------------------------------------------- formats
def test_chat_rows_are_nemotron_format(corpus):
    for rows in (corpus["train_chats"], corpus["chats"]):
        assert rows
        for row in rows:
            assert set(row) == NEMOTRON_KEYS
            assert row["category"] == "chat" and row["system_prompt"] == ""
            roles = [m["role"] for m in row["input"]]
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], roles
            assert all(set(m) == {"role", "content"} and m["content"] for m in row["input"])
            if row["reasoning"] == "on":
                assert re.fullmatch(r"<think>\n[^\n].*\n</think>\n\n\S.*", row["output"], flags=re.S), row["output"]
            else:
                assert row["reasoning"] == "off" and "<think>" not in row["output"]
    assert len(corpus["chats.meta"]) == len(corpus["chats"])
    assert {m["kind"] for m in corpus["chats.meta"]} <= set(toyworld.KINDS)


def test_ifeval_rows_use_lm_eval_ids_and_kwarg_names(corpus):
    registry = pytest.importorskip("lm_eval.tasks.ifeval.instructions_registry")
    for row in corpus["ifeval"]:
        assert set(row) == {"key", "prompt", "instruction_id_list", "kwargs"}
        assert isinstance(row["key"], int) and row["prompt"]
        assert len(row["kwargs"]) == len(row["instruction_id_list"]) >= 1
        for iid, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
            cls = registry.INSTRUCTION_DICT[iid]
            params = set(inspect.signature(cls(iid).build_description).parameters) - {"self"}
            assert set(kwargs) <= params, (iid, kwargs, params)
    assert len({r["key"] for r in corpus["ifeval"]}) == len(corpus["ifeval"])


def test_arc_and_gsm8k_rows(corpus):
    from kvlingo.eval.tasks.parsers import score
    from kvlingo.eval.tasks.prompts import arc_item, gsm8k_item

    refs = {r["id"]: r["reply"] for r in corpus["arc.ref"]}
    for row in corpus["arc"]:
        assert refs[row["id"]].endswith(f"\nAnswer: {row['answerKey']}")
        # the toy models are asked in task_eval.py's own prompt, and the real parser reads their reply
        assert toyworld.arc_prompt(row) == arc_item(row).prompt
        assert score("arc", arc_item(row), refs[row["id"]]) == (row["answerKey"], True)
        assert set(row) == {"id", "question", "choices", "answerKey"}
        assert row["choices"]["label"] == ["A", "B", "C", "D"]
        assert len(set(row["choices"]["text"])) == 4
        assert row["answerKey"] in row["choices"]["label"]
    for row in corpus["gsm8k"]:
        assert set(row) == {"question", "answer"}
        assert re.search(r"\n#### -?\d+$", row["answer"])
        assert toyworld.gsm8k_prompt(row) == gsm8k_item(row).prompt
        gold = row["answer"].rsplit("#### ", 1)[1]
        assert score("gsm8k", gsm8k_item(row), toyworld.gsm8k_reply(row)) == (gold, True)


def test_gsm8k_answers_are_right():
    # Recompute each answer from the numbers in the question (an independent solver per template).
    rng = __import__("random").Random(7)
    for _ in range(300):
        item = toyworld.make_math(rng, context=False, max_distractors=0)
        q = item.task["question"]
        nums = [int(n) for n in re.findall(r"\d+", q)]
        if "boxes" in q:
            expect = nums[0] * nums[1] + (nums[2] if "finds" in q else -nums[2] if "gives" in q else 0)
        elif "pages" in q:
            expect = sum(nums)
        else:
            expect = nums[0] + nums[1] if "buys" in q else nums[0] - nums[1]
        assert toyworld.gsm8k_final_answer(item.task["answer"]) == str(expect), q


def test_arc_answers_follow_from_the_question():
    rng = __import__("random").Random(3)
    for _ in range(300):
        item = toyworld.make_mc(rng, context=False, max_distractors=0)
        row = item.task
        right = row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
        q = row["question"]
        if "box holds the" in q:
            obj = q.split("box holds the ")[1].rstrip("?")
            assert re.search(rf"the {obj} in {right}\b", q), q
        elif "Who is" in q:
            older, younger = re.match(r"(\w+) is older than (\w+)\.", q).groups()
            assert right == (older if "older?" in q else younger)
        elif "Where does" in q:
            person = re.search(r"Where does (\w+) live", q).group(1)
            assert f"{person} lives in {right}." in q
        elif "How many balls" in q:
            assert int(right) == sum(int(n) for n in re.findall(r"\d+", q))
        else:
            cat = q.split()[-1].rstrip("?")
            assert right in toyworld.CATEGORIES[cat]
            assert all(t not in toyworld.CATEGORIES[cat] for t in row["choices"]["text"] if t != right)


# --------------------------------------------------------------------------- the official IFEval grader
@pytest.fixture(scope="module")
def ifeval_utils():
    return pytest.importorskip("lm_eval.tasks.ifeval.utils")


# These two need nltk's punkt_tab, which is not installed offline; the toy world never uses them.
NEEDS_PUNKT = {"length_constraints:number_sentences", "change_case:capital_word_frequency"}


def _grades(utils, row, reply) -> bool:
    return utils.process_results(row, [reply])["prompt_level_strict_acc"]


def test_ifeval_references_pass_official_grader(corpus, ifeval_utils):
    refs = {r["key"]: r["reply"] for r in corpus["ifeval.ref"]}
    rows = list(corpus["ifeval"])
    # More rows than the mini world holds: inline items from the training generator too.
    rng = __import__("random").Random(11)
    for i in range(300):
        item = toyworld.make_ifeval(rng, context=False, max_distractors=0)
        rows.append({"key": -i - 1, **item.task})
        refs[-i - 1] = item.reply
    for row in rows:
        assert not set(row["instruction_id_list"]) & NEEDS_PUNKT
        assert _grades(ifeval_utils, row, refs[row["key"]]), (row, refs[row["key"]])


def test_ifeval_grader_rejects_broken_replies(corpus, ifeval_utils):
    # The grader is not vacuous on these rows: undoing one rule fails the prompt.
    refs = {r["key"]: r["reply"] for r in corpus["ifeval.ref"]}
    broken = 0
    rng = __import__("random").Random(5)
    items = [toyworld.make_ifeval(rng, context=False, max_distractors=0) for _ in range(200)]
    for item in items:
        row, ref = {"key": 0, **item.task}, item.reply
        ids = row["instruction_id_list"]
        if "change_case:english_capital" in ids:
            bad = ref.lower()
        elif "detectable_format:title" in ids:
            bad = re.sub(r"<<.*?>>\n", "", ref)
        elif "startend:end_checker" in ids:
            bad = ref + "\nThe end."
        else:
            continue
        assert not _grades(ifeval_utils, row, bad), (row, bad)
        broken += 1
    assert broken > 50
    assert refs  # the file rows were graded in the test above


# --------------------------------------------------------------------------- disjointness and context
def test_training_items_are_disjoint_from_eval_items(corpus):
    train_inputs = {json.dumps(r["input"], sort_keys=True) for r in corpus["train_chats"]}
    assert not train_inputs & {json.dumps(r["input"], sort_keys=True) for r in corpus["chats"]}
    train_final = {r["input"][-1]["content"] for r in corpus["train_chats"]}
    eval_prompts = (
        {r["prompt"] for r in corpus["ifeval"]}
        | {toyworld.arc_prompt(r) for r in corpus["arc"]}
        | {toyworld.gsm8k_prompt(r) for r in corpus["gsm8k"]}
    )
    assert not train_final & eval_prompts


def test_recall_answers_live_in_the_dropped_context():
    rng = __import__("random").Random(2)
    for _ in range(300):
        item = toyworld.make_recall(rng, context=True, max_distractors=3)
        context = " ".join(m["content"] for m in item.messages[:-1])
        final = item.messages[-1]["content"]
        # Names, places, numbers and passwords in the answer must come from the earlier turns.
        values = [w.strip(".,") for w in item.reply.split()[1:] if w[0].isupper() or w[0].isdigit() or "-" in w]
        values += [w.strip(".") for w in item.reply.split() if w.strip(".") in toyworld.GROCERIES + toyworld.COLORS]
        assert values, item.reply
        for v in values:
            assert v in context and v not in final, (v, item.messages)


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
