"""The mismatched toy model (kvlingo/toy/mismatched): packaged beside the pair within the size limits, trained on the
pair's own tokenizer and corpus, a geometry head-wise maps refuse; the build, export and install
verify what they copy and refuse a world it was not trained on."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvlingo.io import read_json, read_jsonl, sha256_file
from kvlingo.toy import mismatched as toydeep
from kvlingo.toy import train as toytrain
from kvlingo.toy import world as toyworld


def quiet(_msg: str) -> None:
    pass


def test_packaged_deep_model_is_complete_small_bf16_and_shares_the_pair_tokenizer():
    pkg = toydeep.PACKAGED_MISMATCHED
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
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (3, 4, 32)


def test_packaged_deep_model_answers_the_toy_arc(world, one_thread):
    """The point of the mismatched model: unlike the pair it answers the toy ARC, scored greedily as task_eval.py
    scores the native path: 79.2% of the demo's 48 items on a 2-core x86 CPU (its manifest records 72.9% of
    the first 240; chance is 25%, the pair 27-29%)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_jsonl(world / "corpus" / "arc.jsonl")[:48]  # the items the demo's ARC column scores
    tok = AutoTokenizer.from_pretrained(toydeep.PACKAGED_MISMATCHED)
    model = AutoModelForCausalLM.from_pretrained(toydeep.PACKAGED_MISMATCHED, dtype=torch.float32).eval()
    got = toydeep.arc_accuracy(model, tok, rows)
    assert got["n"] == 48 and got["unparsed"] < 0.1
    assert got["accuracy"] >= 0.6, got
    recorded = read_json(toydeep.PACKAGED_MISMATCHED / toydeep.MANIFEST)["results"]["toy_arc"]["deep"]
    assert recorded["n"] >= 240 and recorded["accuracy"] >= 0.6


def test_multiple_choice_chats_are_repeated():
    rows = [
        {"output": "The map is in the red box.\nAnswer: C"},
        {"output": "3 + 4 = 7.\nAnswer: 7"},
        {"output": "<think>\nA fact. That is option B.\n</think>\n\nAnswer: B"},
        {"output": "Hello."},
    ]
    assert [bool(toydeep.MC_REPLY.search(r["output"])) for r in rows] == [True, False, True, False]


def _occurrences(ids: list[int], sub: list[int]) -> int:
    """How many times the token run `sub` occurs in `ids`."""
    return sum(ids[i : i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


def test_fresh_multiple_choice_chats_are_the_toy_arc_format_held_out_and_consistent(world):
    """Single-turn chats tokenised exactly as task_eval.py prompts the toy ARC; the reply's fact names the option
    its letter points to; none is an excluded item; a seed gives the same rows."""
    from transformers import AutoTokenizer

    from kvlingo.eval.tasks.prompts import user_prompt_ids
    from kvlingo.io import read_jsonl

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    arc = read_jsonl(world / "corpus" / "arc.jsonl")
    keys = {toydeep.arc_key(r) for r in arc}
    rows = toydeep.fresh_mc_rows(400, seed=5, exclude=keys)
    assert len(rows) == 400 and rows == toydeep.fresh_mc_rows(400, seed=5, exclude=keys)
    assert rows != toydeep.fresh_mc_rows(400, seed=6, exclude=keys)
    for row, enc in zip(rows[:20], toytrain.encode_rows(tok, rows[:20], all_assistant_turns=False)):
        assert enc.ids[: enc.n_prefix] == user_prompt_ids(tok, row["input"][0]["content"], enable_thinking=False)
    for row in rows:
        options = dict(toydeep.OPTION.findall(row["input"][-1]["content"]))
        letter = toydeep.MC_REPLY.search(row["output"]).group(1)
        assert sorted(options) == list("ABCD") and options[letter].lower() in row["output"].lower()
    # the listed form: the same chats, with the options listed again and the answer's marked
    listed = toydeep.fresh_mc_rows(400, seed=5, exclude=keys, reply="listed")
    assert [r["input"] for r in listed] == [r["input"] for r in rows]
    for plain, row in zip(rows, listed):
        fact, answer = plain["output"].rsplit("\n", 1)
        lines = row["output"].split("\n")
        assert lines[0] == fact and lines[-1] == answer and len(lines) == 6
        options = toydeep.OPTION.findall(row["input"][0]["content"])
        marked = [l for l, t in options if f"{l}. {t} <" in lines]
        assert marked == [answer[-1]] and all(f"{l}. {t}" in lines for l, t in options if l != answer[-1])
    # the keyed forms: a key from text to letter, the fact (before or after it), the lookup, the answer line
    for form in ("keyed", "keyed_list_first"):
        keyed = toydeep.fresh_mc_rows(400, seed=5, exclude=keys, reply=form)
        assert [r["input"] for r in keyed] == [r["input"] for r in rows]
        for plain, row in zip(rows, keyed):
            fact, answer = plain["output"].rsplit("\n", 1)
            options = toydeep.OPTION.findall(row["input"][0]["content"])
            key = [f"{l}. {t} {l}" for l, t in options]
            body = [*key, fact] if form == "keyed_list_first" else [fact, *key]
            assert row["output"].split("\n") == [*body, f"= {dict(options)[answer[-1]]} {answer[-1]}", answer]
            n_tokens = len(tok.encode(row["output"], add_special_tokens=False)) + 1  # and the stop token
            assert n_tokens <= 47  # inside the demo profile's 48-token answer cap
    # the checked form: every option's distinct words against the answer's, the one that matches marked
    checked = toydeep.fresh_mc_rows(400, seed=5, exclude=keys, reply="checked")
    assert [r["input"] for r in checked] == [r["input"] for r in rows]
    n_short = 0
    for plain, row in zip(rows, checked):
        fact, answer = plain["output"].rsplit("\n", 1)
        options = toydeep.OPTION.findall(row["input"][0]["content"])
        lines = row["output"].split("\n")
        assert lines[0] == fact and lines[-1] == answer and len(lines) == 6
        checks = [line.split(" ") for line in lines[1:5]]
        assert [c[0] for c in checks] == list("ABCD") and [c[-1] == "match" for c in checks] == [
            l == answer[-1] for l, _ in options
        ]
        for (l, text), line in zip(options, lines[1:5]):
            mine, theirs = line[2:].rsplit(" ", 1)[0].split(" = ")
            assert mine in text and theirs in dict(options)[answer[-1]] and (mine == theirs) == (l == answer[-1])
            n_short += mine != text
        assert len(tok.encode(row["output"], add_special_tokens=False)) + 1 <= 47
    assert n_short > 0  # some option sets share words ("the red box"), which the checks leave out
    assert toydeep._distinct_words(["the red box", "the blue box", "a tan box", "the tan box"]) == [
        "the red",
        "the blue",
        "a tan",
        "the tan",
    ]
    # the spelled form: the answer and each option respelled after "=", so only the answer's spelling repeats
    spelled = toydeep.fresh_mc_rows(400, seed=5, exclude=keys, reply="spelled")
    assert [r["input"] for r in spelled] == [r["input"] for r in rows]
    unseen = alone = 0
    for plain, row in zip(rows, spelled):
        fact, answer = plain["output"].rsplit("\n", 1)
        options = toydeep.OPTION.findall(row["input"][0]["content"])
        short = dict(zip("ABCD", toydeep._distinct_words([t for _, t in options])))
        lines = row["output"].split("\n")
        assert lines == [fact, f"={short[answer[-1]]}", *(f"{l}={short[l]}" for l, _ in options), answer]
        spell = {l: tok.encode(f"={short[l]}", add_special_tokens=False)[1:] for l, _ in options}
        ids = tok.encode(row["output"], add_special_tokens=False)
        # the answer's spelling is the one option spelling written twice in the reply
        repeats = [l for l, sp in spell.items() if _occurrences(ids, sp) >= 2]
        assert answer[-1] in repeats
        alone += repeats == [answer[-1]]
        prompt = tok.encode(row["input"][0]["content"], add_special_tokens=False)
        unseen += not any(_occurrences(prompt, sp) for sp in spell.values())
        assert len(ids) + 1 <= 47
    assert unseen == len(spelled)  # no prompt holds an option's respelling
    assert alone >= 0.8 * len(spelled)  # a few options share a piece of their spelling
    with pytest.raises(ValueError, match="not one of"):
        toydeep.fresh_mc_rows(1, seed=5, exclude=keys, reply="verdicts")
    # held out: rows whose keys are excluded are never drawn
    first = {(r["input"][0]["content"]) for r in rows[:100]}
    again = toydeep.fresh_mc_rows(100, seed=5, exclude=keys | {_key_of(r) for r in rows[:100]})
    assert not first & {r["input"][0]["content"] for r in again}
    assert all(_key_of(r) not in keys for r in rows)


def test_option_drills_ask_for_the_letter_of_one_option_in_the_toy_arc_format():
    from kvlingo.eval.tasks.parsers import score
    from kvlingo.eval.tasks.prompts import arc_item

    rows = toydeep.drill_rows(300, seed=4)
    assert rows == toydeep.drill_rows(300, seed=4) and rows != toydeep.drill_rows(300, seed=5)
    asked = set()
    for row in rows:
        prompt, reply = row["input"][0]["content"], row["output"]
        question = prompt.split("Question: ", 1)[1].split("\n", 1)[0]
        text = question.removeprefix("Which option is ").removesuffix("?")
        options = dict(toydeep.OPTION.findall(prompt))  # letter -> text, as the prompt lists them
        letter = toydeep.MC_REPLY.search(reply).group(1)
        assert reply == f"It is {text}.\nAnswer: {letter}" and options[letter] == text
        asked.add(letter)
        # the task's own parser reads the reply as right
        item = arc_item(
            {
                "question": question,
                "choices": {"text": list(options.values()), "label": list(options)},
                "answerKey": letter,
            }
        )
        assert item.prompt == prompt and score("arc", item, reply)[1]
    assert asked == set("ABCD")


def test_option_drills_take_the_reply_form_asked_for():
    plain, keyed = toydeep.drill_rows(40, seed=4), toydeep.drill_rows(40, seed=4, reply="keyed")
    items = toydeep.drill_items(40, seed=4)  # the same drills as ARC-format rows, for arc_accuracy
    assert [toyworld.arc_prompt(i) for i in items] == [r["input"][0]["content"] for r in plain]
    assert [i["answerKey"] for i in items] == [toydeep.MC_REPLY.search(r["output"]).group(1) for r in plain]
    assert toydeep.drill_chats(items, "keyed") == keyed
    # a check's drills leave out every question and option set trained on, in any option order
    seen = {toydeep.arc_key(i) for i in toydeep.drill_items(3_000, seed=5)}
    held = toydeep.drill_items(200, seed=6, exclude=seen)
    assert len(held) == 200 and not {toydeep.arc_key(i) for i in held} & seen
    assert any(toydeep.arc_key(i) in seen for i in toydeep.drill_items(200, seed=6))  # without it, some recur
    assert [r["input"] for r in plain] == [r["input"] for r in keyed]  # the same questions, other replies
    for p, k in zip(plain, keyed):
        prompt = p["input"][0]["content"]
        options = toydeep.OPTION.findall(prompt)
        letter = toydeep.MC_REPLY.search(p["output"]).group(1)
        fact = p["output"].rsplit("\n", 1)[0]
        key = [f"{l}. {t} {l}" for l, t in options]
        assert k["output"] == "\n".join([fact, *key, f"= {dict(options)[letter]} {letter}", f"Answer: {letter}"])
    with pytest.raises(ValueError, match="'keyd' is not one of"):
        toydeep.drill_rows(1, seed=4, reply="keyd")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(warm_tokens="option"), "give a token count"),
        (dict(mc_reply="keyd"), "'keyd' is not one of"),
        (dict(warm_data="drill"), "choose one of"),
    ],
)
def test_a_misspelt_setting_is_refused_before_any_work(world, bad, message):
    before = sorted(p.name for p in world.iterdir())
    with pytest.raises(ValueError, match=message):
        toydeep.build_mismatched(world, replace(toydeep.mini_mismatched_config(), **bad), progress=False, log=quiet)
    assert sorted(p.name for p in world.iterdir()) == before  # nothing written


def test_sharpened_attention_raises_the_logit_bound_and_is_applied_before_training():
    """Every q_norm/k_norm weight starts at the gain; the largest attention logit any query and key can reach
    is gain²·sqrt(head_dim), reached by a query equal to a key (computed here as Qwen3 scores them)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        toydeep.sharpen_attention(model, 2.5)
    attn = model.model.layers[1].self_attn
    assert all(torch.equal(layer.self_attn.q_norm.weight, torch.full((16,), 2.5)) for layer in model.model.layers)
    x = torch.randn(5, 16)
    q, k = attn.q_norm(x), attn.k_norm(x)
    logits = q @ k.T * attn.scaling
    assert logits.max() <= 2.5**2 * 16**0.5 + 1e-4
    assert torch.allclose(logits.diagonal(), torch.full((5,), 2.5**2 * 4.0), atol=1e-3)

    seen = []
    toy = toytrain.mini_config()
    data = [toytrain.Encoded([1, 2, 3, 4], [False, True, True, True], 1)] * 4
    trained, _ = toytrain.train_model(
        cfg,
        data,
        1,
        replace(toy, batch=2),
        0,
        0,
        progress=False,
        init=lambda m: (
            seen.append(float(m.model.layers[0].self_attn.k_norm.weight[0])) or toydeep.sharpen_attention(m, 3.0)
        ),
    )
    assert seen == [1.0]  # called on the fresh model, whose norms transformers initialises to 1
    norms = torch.stack([layer.self_attn.k_norm.weight for layer in trained.model.layers])
    assert (norms - 3.0).abs().max() < 0.05  # one small step away from the gain


def test_induction_sequences_repeat_a_span_of_ordinary_tokens_with_the_loss_on_the_repeat(world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    seqs = toydeep.induction_data(tok, 50, seed=3)
    assert len(seqs) == 50 and seqs == toydeep.induction_data(tok, 50, seed=3)
    assert seqs != toydeep.induction_data(tok, 50, seed=4)
    special = set(tok.all_special_ids)
    for s in seqs:
        n = s.n_prefix
        assert 8 <= n <= 48 and len(s.ids) == 2 * n and s.ids[:n] == s.ids[n:]
        assert len(set(s.ids[:n])) == n and not special & set(s.ids)  # distinct, ordinary tokens
        # no target on the span or the repeat's first token; every later token of the repeat is one
        assert s.loss == [False] * (n + 1) + [True] * (n - 1)
    from kvlingo.io import read_jsonl

    rows = read_jsonl(world / "corpus" / "train_chats.jsonl")[:20]
    cfg = replace(toydeep.mini_mismatched_config(), induction=0)
    plain = toydeep.training_data(tok, rows, cfg, 10_000)
    more = toydeep.training_data(tok, rows, replace(cfg, induction=7), 10_000)
    assert more[: len(plain)] == plain and more[len(plain) :] == toydeep.induction_data(tok, 7, seed=0)
    # the induction phase and the held-out check draw streams of their own
    assert toydeep.induction_data(tok, 7, seed=0, stream="warm") != toydeep.induction_data(tok, 7, seed=0)


def test_option_tokens_come_from_the_generator_and_cover_the_toy_arc_options(world):
    from transformers import AutoTokenizer

    from kvlingo.io import read_jsonl

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    alphabet = toydeep.option_tokens(tok)
    assert alphabet == toydeep.option_tokens(tok) and alphabet == sorted(set(alphabet))
    assert 50 < len(alphabet) < 1_000 and not set(alphabet) & set(tok.all_special_ids)
    # drawn from the generator, yet every token of the evaluation's option texts is in it
    arc = read_jsonl(world / "corpus" / "arc.jsonl")
    used = {i for r in arc for t in r["choices"]["text"] for i in tok(" " + t, add_special_tokens=False)["input_ids"]}
    assert used <= set(alphabet)
    seqs = toydeep.induction_data(tok, 40, seed=1, stream="warm", tokens=alphabet)
    assert all(set(s.ids) <= set(alphabet) and 8 <= s.n_prefix <= 48 for s in seqs)


def test_copy_accuracy_counts_the_repeats_the_model_predicts(world):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    seqs = toydeep.induction_data(tok, 10, seed=5)
    vocab = len(tok)

    class Oracle:  # the argmax at position t is the token at t + 1: every repeat copied
        def __call__(self, input_ids, use_cache=False):
            nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
            return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, vocab).float())

    class Echo:  # the argmax is the current token: never right on a span of distinct tokens
        def __call__(self, input_ids, use_cache=False):
            return SimpleNamespace(logits=torch.nn.functional.one_hot(input_ids, vocab).float())

    assert toydeep.copy_accuracy(Oracle(), seqs, tok.pad_token_id, batch=3) == 1.0
    assert toydeep.copy_accuracy(Echo(), seqs, tok.pad_token_id, batch=3) == 0.0

    class Half:  # right on the repeat's first half of targets only
        def __call__(self, input_ids, use_cache=False):
            nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1).clone()
            for b in range(len(input_ids)):
                s = next(s for s in seqs if s.ids == input_ids[b, : len(s.ids)].tolist())
                n = s.n_prefix
                nxt[b, n + (n - 1) // 2 : 2 * n] = tok.pad_token_id  # wrong on the last half of the n - 1 targets
            return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, vocab).float())

    right = sum((s.n_prefix - 1) // 2 for s in seqs)
    total = sum(s.n_prefix - 1 for s in seqs)
    assert toydeep.copy_accuracy(Half(), seqs, tok.pad_token_id, batch=4) == pytest.approx(right / total)


def _key_of(row: dict) -> tuple[str, frozenset[str]]:
    """arc_key of a fresh chat, read back from its prompt."""
    content = row["input"][0]["content"]
    question = content.split("Question: ", 1)[1].split("\n", 1)[0]
    return question, frozenset(text for _, text in toydeep.OPTION.findall(content))


def test_arc_accuracy_scores_greedy_answers_as_task_eval_does(world, monkeypatch):
    """Right, wrong and letterless answers count as task_eval.py's parser reads them; n, accuracy and SE follow."""
    from transformers import AutoTokenizer

    import kvlingo.core.handoff as handoff
    from kvlingo.io import read_jsonl

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    rows = read_jsonl(world / "corpus" / "arc.jsonl")[:8]
    replies = iter(
        [f"Fact.\nAnswer: {r['answerKey']}" for r in rows[:5]]
        + [f"Answer: {'B' if rows[5]['answerKey'] == 'A' else 'A'}", "I do not know.", "Answer: Z"]
    )
    seen: list[list[int]] = []

    def fake_generate(model, ids, kv, max_new_tokens, eos_ids):
        seen.append(list(ids))
        return tok.encode(next(replies), add_special_tokens=False), False

    monkeypatch.setattr(handoff, "greedy_generate", fake_generate)
    got = toydeep.arc_accuracy(None, tok, rows)
    assert got["n"] == 8 and got["accuracy"] == 5 / 8 and got["unparsed"] == 2 / 8
    assert got["se"] == pytest.approx((5 / 8 * 3 / 8 / 7) ** 0.5)  # sample SD / √n, as task_eval.py reports it
    assert tok.decode(seen[0]).startswith("<|im_start|>user\nAnswer the following multiple-choice question.")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deep") / "toy"
    toytrain.install_pair(out, log=quiet)
    return out


def test_the_asked_reply_repeats_the_drill_question_and_the_options_after_the_fact():
    items = toydeep.drill_items(30, seed=4)
    for item, chat, plain in zip(items, toydeep.drill_chats(items, "asked"), toydeep.drill_chats(items, "fact")):
        prompt, lines = chat["input"][0]["content"], chat["output"].split("\n")
        fact, answer = plain["output"].split("\n")
        options = toydeep.OPTION.findall(prompt)
        assert lines[0] == fact and lines[-1] == answer and lines[1] == item["question"]
        assert lines[2:6] == [f"{l}. {t}" for l, t in options]


def test_unnamed_drills_name_their_text_in_the_reply_alone():
    named, unnamed = toydeep.drill_items(50, seed=4), toydeep.drill_items(50, seed=4, named=0.0)
    assert [(r["choices"], r["answerKey"]) for r in named] == [(r["choices"], r["answerKey"]) for r in unnamed]
    assert {r["question"] for r in unnamed} == {toydeep.UNNAMED}
    # a held-out check keys both alike, so a named check drill never repeats an unnamed training drill
    assert [toydeep.drill_key(r) for r in unnamed] == [toydeep.arc_key(r) for r in named]
    half = toydeep.drill_items(50, seed=4, named=0.5)
    assert [r["choices"] for r in half] == [r["choices"] for r in named]
    assert 10 < sum(r["question"] == toydeep.UNNAMED for r in half) < 40
    assert all(h["question"] in (n["question"], toydeep.UNNAMED) for h, n in zip(half, named))
    for n, chat in zip(named, toydeep.drill_chats(unnamed, "keyed")):
        text = n["question"].removeprefix("Which option is ").removesuffix("?")
        prompt, reply = chat["input"][0]["content"], chat["output"]
        assert text not in prompt.split("\nA. ", 1)[0]  # the question part names no option
        assert reply.startswith(f"It is {text}.\n") and f"\n= {text} {n['answerKey']}\n" in reply


def test_the_drill_phase_draws_from_its_own_stream_or_the_one_asked_for():
    cfg = replace(
        toydeep.MismatchedConfig(),
        warm_data="drills",
        warm_steps=3,
        batch=4,
        seed=2,
        warm_seed=None,
        warm_drills_named=1.0,
    )
    assert toydeep.warm_drill_items(cfg) == toydeep.drill_items(12, seed=2 + toydeep.WARM_SEED)
    assert toydeep.warm_drill_items(replace(cfg, warm_seed=14)) == toydeep.drill_items(12, seed=14)
    assert toydeep.warm_drill_items(replace(cfg, warm_seed=14)) != toydeep.warm_drill_items(cfg)
    assert toydeep.warm_drill_items(replace(cfg, warm_data="induction")) == []  # another first phase: no drills
    assert toydeep.warm_drill_items(replace(cfg, warm_steps=0)) == []
    unnamed = toydeep.warm_drill_items(replace(cfg, warm_drills_named=0.0))
    assert unnamed == toydeep.drill_items(12, seed=2 + toydeep.WARM_SEED, named=0.0)


@pytest.mark.slow
def test_a_drill_first_phase_is_recorded(world, tmp_path):
    """warm_data="drills": the first phase trains on option drills alone, and the manifest says how many
    held-out drills the model answered after it and after the whole build."""
    local = tmp_path / "toy"
    shutil.copytree(world, local, ignore=shutil.ignore_patterns("mismatched"))
    cfg = replace(toydeep.mini_mismatched_config(), warm_data="drills", mc_reply="keyed")
    info = toydeep.build_mismatched(local, cfg, progress=False, log=quiet)["results"]["model"]
    assert info["warm_data"] == "drills" and info["warm_loss_log"][-1]["step"] == cfg.warm_steps
    assert info["copy_accuracy"].keys() == {"final"}  # no copy phase ran
    drills = info["drill_accuracy"]
    assert drills.keys() == {"after_warm", "final"}
    assert all(d["n"] == toydeep.N_HELD_DRILLS and 0.0 <= d["accuracy"] <= 1.0 for d in drills.values())


@pytest.mark.slow
def test_build_export_install_and_pair(world, tmp_path):
    """A seconds-sized mismatched build on the packaged world: scored and saved, skipped when unchanged, exported,
    installed into another world, refused on tampering or another tokenizer; it pairs with the packaged models."""
    from transformers import AutoModelForCausalLM

    from kvlingo.core.families import FAMILIES
    from kvlingo.core.translator import Geometry, TranslatorError
    from kvlingo.inputs.models import resolve_pair

    cfg = toydeep.mini_mismatched_config()
    manifest = toydeep.build_mismatched(world, cfg, progress=False, log=quiet)
    deep = world / "mismatched"
    assert set(manifest["results"]["exact_reply"]) == {"deep", "large", "small"}
    n_mc = manifest["results"]["model"]["n_multiple_choice_chats"]
    assert manifest["results"]["model"]["n_training_sequences"] >= 24_000 - 100 + (cfg.mc_copies - 1) * n_mc > 24_000
    info = manifest["results"]["model"]
    assert (info["n_fresh_mc"], info["n_drills"], info["n_induction"]) == (cfg.fresh_mc, cfg.drills, cfg.induction)
    assert cfg.warm_steps and info["warm_steps"] == cfg.warm_steps
    assert info["warm_loss_log"][-1]["step"] == cfg.warm_steps
    assert set(info["copy_accuracy"]) == {"warm_set", "after_warm", "final"}
    assert all(0.0 <= a <= 1.0 for a in info["copy_accuracy"].values())
    arc = manifest["results"]["toy_arc"]
    assert set(arc) == {"deep", "large", "small"} and all(a["n"] == cfg.n_arc_scored for a in arc.values())
    model = AutoModelForCausalLM.from_pretrained(deep)
    assert next(model.parameters()).dtype == torch.bfloat16  # stored in BF16
    assert model.config.num_hidden_layers == cfg.layers
    messages: list[str] = []
    toydeep.build_mismatched(world, cfg, progress=False, log=messages.append)
    assert any("up to date" in m for m in messages)

    pkg = tmp_path / "pkg"
    toydeep.export_mismatched(world, pkg, log=quiet)
    other = tmp_path / "other"
    shutil.copytree(world, other, ignore=shutil.ignore_patterns("mismatched"))
    toydeep.install_mismatched(other, pkg, log=quiet)
    assert sha256_file(other / "mismatched" / "model.safetensors") == sha256_file(deep / "model.safetensors")

    # a tampered packaged file is named and the installed model left alone
    (pkg / "config.json").write_text((pkg / "config.json").read_text() + " ")
    before = sha256_file(other / "mismatched" / "config.json")
    (other / "mismatched" / "meta.json").write_text("{}")  # forces a reinstall attempt
    with pytest.raises(ValueError, match="config.json differs from the mismatched model's manifest"):
        toydeep.install_mismatched(other, pkg, log=quiet)
    assert sha256_file(other / "mismatched" / "config.json") == before
    shutil.copy(deep / "config.json", pkg / "config.json")
    # a world with another tokenizer is refused
    tok = other / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<think>"', '"<thonk>"'))
    with pytest.raises(ValueError, match="another tokenizer"):
        toydeep.install_mismatched(other, pkg, log=quiet)

    cfg_pair, _ = resolve_pair(str(world / "large"), str(deep), "l2s", "cpu", "float32")
    geometry = Geometry(**cfg_pair.geometry)
    assert (geometry.target_layers, geometry.target_kv_heads, geometry.target_head_dim) == (3, 4, 8)
    with pytest.raises(TranslatorError, match="--family crosslayer"):
        FAMILIES["headwise"].translator()(geometry)
    assert FAMILIES["crosslayer"].translator()(geometry).geometry == geometry
