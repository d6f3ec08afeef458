"""The mismatched toy model: a third toy Qwen3 of another depth, KV-head count and head_dim, trained on the
packaged pair's own corpus and tokenizer, so that it pairs with either packaged model.

    large  4 layers × 2 KV heads × head_dim 32   (kvlingo/toy/pair)
    small  4 layers × 2 KV heads × head_dim 32   (kvlingo/toy/pair)
    mismatched   3 layers × 4 KV heads × head_dim 32   (kvlingo/toy/mismatched, this module)

large↔mismatched and mismatched↔small are pairs whose caches line up neither layer by layer nor head by
head: head-wise maps refuse them, cross-layer maps join them (`make demo PAIR=mismatched`).

The packaged pair scores 27-29% on the toy ARC (chance 25%), so an ARC column of a translated
run on it says nothing. The mismatched model is trained to answer it. The step that every other recipe
failed is naming the letter of the option a text belongs to, because in a chat each option's
text already has copies in the prompt. The defaults therefore:
- reply in the `spelled` form (`mc_reply`, `REPLY_FORMS`): the fact, the answer's text again after
  "=", every option respelled after its letter ("B=Lisbon", tokenised unlike the prompt's
  " Lisbon"), then "Answer: B". Only the answer's respelling repeats, right after its letter;
- first train `warm_steps` steps on option drills alone (`warm_data="drills"`: chats that ask
  which letter an option has, none naming the text in the question, drawn from `warm_seed`'s
  stream) at `warm_lr` 1e-3, where the letter lookup forms (at 3e-3 it never did);
- then train on the corpus plus `fresh_mc` single-turn chats in the toy ARC's own format (the
  facts inline, thinking off) and `drills` more drills, with each corpus multiple-choice chat seen
  `mc_copies` times per epoch.
The other options stay for the recorded runs that did not reach 60%: `induction` (random-token
copy sequences, `warm_data="induction"`), `qk_gain` (sharper attention from the first step),
`drills_named`/`warm_drills_named` (the share of drills whose question names the text) and the
other reply forms (the README, "More pairs", has every run). With the defaults the mismatched model is
shallower than the pair (3 layers against 4) and has twice its KV heads: its caches line up with
neither packaged model's, which is what the mismatched pairs are for.

Its manifest and scores name it "deep" (its name when it was built; the 28-layer pair is kvlingo/toy/deep.py).
`copy_accuracy` measures the copy itself, and `build_mismatched` records it after each phase.
`build_mismatched` scores the greedy toy-ARC accuracy of the model and of the pair beside it, as
task_eval.py scores the native path (`results.toy_arc`), and the exact-reply scores beside the
pair's. The packaged pair's files are untouched.

Training runs in FP32 on one thread (bf16 autocast is a speedup only on CPUs with AVX-512
BF16; without it BF16 matmuls are far slower), for a fixed step count, so a seed gives
the same weights on one machine (the defaults: 8,000 + 4,000 steps, about an hour of one core).
The weights are rounded to BF16 before scoring and stored in BF16 shards of at most 4 MB, like
the pair's.

Layout: DIR/mismatched/ is a save_pretrained folder (weights, config, tokenizer, meta.json) plus
manifest.json, written last (the build key, the pair's tokenizer and corpus hashes it was
trained on, scores, and the sha256 of every file). `build_mismatched` trains it into an installed toy
world; `export_mismatched` copies it into kvlingo/toy/mismatched; `install_mismatched` copies the packaged one into
a toy world after checking its files and that the world's tokenizer and corpus are the ones it
was trained on.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..io import atomic_write_json, read_json, read_jsonl, sha256_file, sha256_json, sha256_tree
from ..records.report import Report
from . import train as toytrain
from . import world as toyworld
from .train import ModelShape

PACKAGED_MISMATCHED = Path(__file__).with_name("mismatched")  # the committed mismatched model (with its manifest.json)
MANIFEST = "manifest.json"
MC_REPLY = re.compile(r"Answer: ([A-D])$")  # how a multiple-choice chat's reply ends (its reasoning-on form too)
OPTION = re.compile(r"^([A-D])\. (.*)$", re.M)  # one option line of the final user turn
OPTION_NAMED = re.compile(r"option [A-D]\.")  # the letter in a reasoning-on reply ("That is option B.")
LETTERS = "ABCD"
TRAIN_HINT = (
    "retrain and re-export the mismatched model with `make toy-train-mismatched` "
    "(python toy_world.py --out artifacts/toy --train-mismatched --export-mismatched kvlingo/toy/mismatched)"
)


@dataclass(frozen=True)
class MismatchedConfig:
    layers: int = 3  # decoder layers (the pair has 4)
    kv_heads: int = 4  # KV heads (the pair has 2)
    head_dim: int = 32  # per-head width (the pair has 32)
    shape: ModelShape = ModelShape(hidden=128, intermediate=384, heads=4, rope_theta=20_000.0)  # widths and RoPE base
    mc_copies: int = 1  # times each multiple-choice training chat appears per epoch (the copies options-shuffled)
    fresh_mc: int = 60_000  # extra single-turn multiple-choice chats in the toy ARC's own format (see `fresh_mc_rows`)
    mc_reply: str = "spelled"  # their replies' form, one of MC_REPLIES ("fact": the world's own; see `keyed_reply`)
    drills: int = 20_000  # extra single-turn chats asking which letter an option has (`drill_rows`, in
    # `mc_reply`'s form)
    qk_gain: float = 1.0  # initial weight of every q_norm/k_norm (`sharpen_attention`; 1 as transformers initialises)
    induction: int = 0  # extra random-token sequences whose second half repeats the first (`induction_data`)
    warm_steps: int = 8_000  # steps of a first phase (on `warm_data` alone); the main training starts from it
    warm_lr: float = 1e-3  # that phase's learning rate (for induction: constant after the warm-up, no weight decay)
    warm_data: str = "drills"  # that phase's data: "induction" (copy sequences, below) or "drills" (option drills
    # alone in `mc_reply`'s form, trained on the main phase's schedule at warm_lr: warm-up, cosine decay, weight decay)
    drills_named: float = 0.0  # share of drills whose question names the text asked about (in the others the
    # reply alone does: `drill_items`)
    warm_drills_named: float = 0.0  # the same share for the drill phase's drills
    warm_seed: int | None = 14  # the drill phase's data stream (`drill_items`' seed; None: seed + WARM_SEED)
    warm_tokens: int | str | None = 16  # that phase's spans: over this many random ordinary tokens, over
    # "options" (the tokens of the world's option texts, `option_tokens`), or None (all ordinary tokens)
    steps: int = 4_000  # optimiser steps (fixed, so the weights do not depend on the machine's speed)
    batch: int = 32  # conversations per step
    lr: float = 1e-3  # AdamW peak learning rate (warm-up, cosine decay and the rest as the pair's)
    autocast_bf16: bool = False  # FP32 training (see the module docstring)
    seed: int = 2  # weights and batch order (the pair used 0 and 1)
    threads: int = 1  # torch CPU threads for training and scoring
    n_arc_scored: int = 240  # toy-ARC rows (the first of arc.jsonl) whose greedy answers the manifest scores


def mini_mismatched_config() -> MismatchedConfig:
    """Seconds instead of minutes, for tests on the mini toy world."""
    return MismatchedConfig(
        layers=3,
        kv_heads=4,
        head_dim=8,
        shape=ModelShape(hidden=32, intermediate=64, heads=4, rope_theta=20_000.0),
        mc_copies=2,
        fresh_mc=16,
        mc_reply="fact",
        drills=8,
        drills_named=1.0,
        induction=8,
        qk_gain=2.0,
        warm_steps=4,
        warm_data="induction",
        warm_drills_named=1.0,
        warm_seed=None,
        warm_tokens="options",
        steps=12,
        batch=8,
        lr=3e-3,
        n_arc_scored=4,
    )


SOURCES = [Path(__file__), *toytrain.SOURCES]


def code_sha() -> str:
    """Hash of the code that determines the mismatched model (the pair's training code included)."""
    return sha256_tree(SOURCES)


def shuffle_options(row: dict, rng: random.Random) -> dict:
    """A multiple-choice chat with its four options in another order, the answer letter moved with them.

    The final user turn lists the options one per line ("A. text", kvlingo.eval.tasks.prompts.arc_item);
    the reply names the letter in "Answer: X" (and, with reasoning on, "That is option X.").
    """
    last = row["input"][-1]["content"]
    found = list(OPTION.finditer(last))
    gold = MC_REPLY.search(row["output"]).group(1)
    texts = [m.group(2) for m in found]
    right = texts[LETTERS.index(gold)]
    order = rng.sample(texts, len(texts))
    letter = LETTERS[order.index(right)]
    lines = "\n".join(f"{l}. {t}" for l, t in zip(LETTERS, order))
    content = last[: found[0].start()] + lines + last[found[-1].end() :]
    output = MC_REPLY.sub(f"Answer: {letter}", OPTION_NAMED.sub(f"option {letter}.", row["output"]))
    return {**row, "input": [*row["input"][:-1], {**row["input"][-1], "content": content}], "output": output}


def arc_key(row: dict) -> tuple[str, frozenset[str]]:
    """What makes two ARC-format rows the same item: the question and the set of option texts."""
    return row["question"], frozenset(row["choices"]["text"])


def _options(row: dict) -> list[tuple[str, str]]:
    """(letter, text) of an ARC-format row's options, in order (the world's rows are labelled A-D)."""
    return list(zip(row["choices"]["label"], row["choices"]["text"]))


def listed_reply(row: dict, fact: str) -> str:
    """The world's reply to an ARC-format row (`arc_reply`: its fact, then its answer line) with the options
    listed again between the two, the one the fact names marked:

        Vera lives in Lisbon.          Vera lives in Lisbon.
        Answer: B               →      A. Brno
                                       B. Lisbon <
                                       C. Aarhus
                                       D. Split
                                       Answer: B

    Listing is a copy from the prompt and the answer letter a copy from the marked line; the marking asks
    whether an option's text is the one the fact named.
    """
    letter = row["answerKey"]
    lines = [f"{l}. {t}" + (" <" if l == letter else "") for l, t in _options(row)]
    return toyworld.arc_reply(row, "\n".join([fact, *lines]))


def keyed_reply(row: dict, fact: str, list_first: bool = False) -> str:
    """The world's reply to an ARC-format row with a key from option text to letter written out, then looked up:

        Vera lives in Lisbon.          Vera lives in Lisbon.
        Answer: B               →      A. Brno A
                                       B. Lisbon B
                                       C. Aarhus C
                                       D. Split D
                                       = Lisbon B
                                       Answer: B

    Every step is a copy: an option's text after its letter (from the prompt), the letter again after the
    text (from the line's start), the answer's text (from the fact), and the letter that followed that text
    in the key (an induction copy: text, then letter, written once above). Naming the letter of a text
    straight from the prompt is a lookup backwards (the letter precedes the text there), the multiple-choice
    symbol binding that small models fail at. `list_first` writes the key before the fact. At most 47
    tokens of the toy tokenizer with the stop token, inside the demo's 48-token cap.
    """
    letter, options = row["answerKey"], _options(row)
    key = [f"{l}. {t} {l}" for l, t in options]
    lookup = f"= {_answer_text(row)} {letter}"
    return toyworld.arc_reply(row, "\n".join([*key, fact, lookup] if list_first else [fact, *key, lookup]))


def _distinct_words(texts: list[str]) -> list[str]:
    """Each text without the leading and trailing words all of them share ("the red box" → "red")."""
    words = [t.split() for t in texts]
    shortest = min(len(w) for w in words)
    lead = next((i for i in range(shortest) if len({w[i] for w in words}) > 1), shortest)
    trail = next((i for i in range(shortest - lead) if len({w[-1 - i] for w in words}) > 1), shortest - lead)
    return [" ".join(w[lead : len(w) - trail]) or t for w, t in zip(words, texts)]


def _short_options(row: dict) -> dict[str, str]:
    """Letter → that option's distinct words (`_distinct_words`) for an ARC-format row."""
    letters, texts = zip(*_options(row))
    return dict(zip(letters, _distinct_words(list(texts))))


def checked_reply(row: dict, fact: str) -> str:
    """The world's reply to an ARC-format row with every option checked against the answer, side by side:

        Vera lives in Lisbon.          Vera lives in Lisbon.
        Answer: B               →      A Brno = Lisbon no
                                       B Lisbon = Lisbon match
                                       C Aarhus = Lisbon no
                                       D Split = Lisbon no
                                       Answer: B

    Each check compares two words a few tokens apart (a local comparison, not a search of the prompt), and
    the answer letter is the one on the line marked "match" (a search for a fixed word, not for a text).
    A line's letter and text are copied from the prompt in order, the answer's from the line above. The
    words all four options share are left out ("the red box" is checked as "red"), so that every reply
    fits in 47 tokens of the toy tokenizer with the stop token, inside the demo's 48-token cap.
    """
    letter, short = row["answerKey"], _short_options(row)
    lines = [f"{l} {text} = {short[letter]} {'match' if l == letter else 'no'}" for l, text in short.items()]
    return toyworld.arc_reply(row, "\n".join([fact, *lines]))


def spelled_reply(row: dict, fact: str) -> str:
    """The world's reply to an ARC-format row with the answer and every option written again in a spelling the
    prompt does not use (no leading space, after "="), the letters before them:

        Vera lives in Lisbon.          Vera lives in Lisbon.
        Answer: B               →      =Lisbon
                                       A=Brno
                                       B=Lisbon
                                       C=Aarhus
                                       D=Split
                                       Answer: B

    The prompt writes an option as " Lisbon" (one token of the toy tokenizer); here it is "L", "isbon". So
    in the reply only the answer's spelling has an earlier copy, and its letter stands just before it: the
    situation of a named drill, whose options are read after a question naming one of them (the one
    lookup these models learned), moved into the reply. Only the options' distinct words are written
    ("the red box" as "red"), so that every reply fits in 47 tokens of the toy tokenizer with the stop
    token, inside the demo's 48-token cap.
    """
    short = _short_options(row)
    lines = [f"={short[row['answerKey']]}", *(f"{l}={text}" for l, text in short.items())]
    return toyworld.arc_reply(row, "\n".join([fact, *lines]))


def asked_reply(row: dict, fact: str) -> str:
    """The world's reply to an ARC-format row with the drill's question asked again after the fact, about the
    text the fact names, and the options listed again under it:

        Vera lives in Lisbon.          Vera lives in Lisbon.
        Answer: B               →      Which option is Lisbon?
                                       A. Brno
                                       B. Lisbon
                                       C. Aarhus
                                       D. Split
                                       Answer: B

    A named drill's prompt has this order (a question naming one text, then the options), and models that
    fail the toy ARC learn to answer such drills by checking each option against the question before it
    (a comparison forward in the text; the README, "More pairs"). Here the reply itself has that order,
    so the same comparison answers a chat whose own question names other option texts too.
    """
    lines = [f"{l}. {t}" for l, t in _options(row)]
    return toyworld.arc_reply(row, "\n".join([fact, named_question(_answer_text(row)), *lines]))


REPLY_FORMS = {
    "fact": toyworld.arc_reply,
    "listed": listed_reply,
    "keyed": keyed_reply,
    "asked": asked_reply,
    "keyed_list_first": lambda row, fact: keyed_reply(row, fact, list_first=True),
    "checked": checked_reply,
    "spelled": spelled_reply,
}
MC_REPLIES = tuple(REPLY_FORMS)


def _check_reply(reply: str) -> None:
    if reply not in MC_REPLIES:
        raise ValueError(f"multiple-choice reply form {reply!r} is not one of {MC_REPLIES}")


def _single_turn(row: dict, reply: str) -> dict:
    """A training chat of one user turn, the toy ARC's prompt for an ARC-format row, thinking off, and `reply`."""
    return {
        "input": [{"role": "user", "content": toyworld.arc_prompt(row)}],
        "output": reply,
        "reasoning": "off",
        "system_prompt": "",
        "category": "chat",
    }


def fresh_mc_rows(n: int, seed: int, exclude: set[tuple[str, frozenset[str]]], reply: str = "fact") -> list[dict]:
    """`n` single-turn chats in the toy ARC's own format, drawn from the world's generator on a stream of their own.

    Each is the user turn task_eval.py asks (`arc_prompt`: the facts inline, the four options, the answer
    line) with thinking off, and the world's reference reply (the supporting fact, then "Answer: X"). The
    corpus's multiple-choice chats mostly hold their facts in earlier turns, behind distractor exchanges,
    often with reasoning on; these are the evaluation's format itself. No row has the question and option
    set of an `exclude` key (the toy ARC's rows), so the score stays a held-out one. `reply` picks the
    reply's form (`REPLY_FORMS`: the world's own, `listed_reply`, `keyed_reply`, `asked_reply`,
    `checked_reply` or `spelled_reply`).
    """
    _check_reply(reply)
    rng = random.Random(f"toydeep/{seed}/fresh-mc")
    rows: list[dict] = []
    while len(rows) < n:
        item = toyworld.make_mc(rng, context=False, max_distractors=0)
        if arc_key(item.task) in exclude:
            continue
        fact = item.reply.rsplit("\n", 1)[0]  # arc_reply: the fact, then the answer line
        rows.append(_single_turn(item.task, REPLY_FORMS[reply](item.task, fact)))
    return rows


def option_tokens(tok, n_sets: int = 3_000, seed: int = 0) -> list[int]:
    """The token ids of the world's option texts as a prompt writes them ("A. Lisbon": " Lisbon"), read
    from `n_sets` option sets drawn by the world's own generator (`make_mc`), never from an evaluation file."""
    rng = random.Random(f"toydeep/{seed}/option-tokens")
    ids: set[int] = set()
    for _ in range(n_sets):
        for text in toyworld.make_mc(rng, context=False, max_distractors=0).task["choices"]["text"]:
            ids.update(tok(" " + text, add_special_tokens=False)["input_ids"])
    return sorted(ids - set(tok.all_special_ids))


def induction_data(
    tok,
    n: int,
    seed: int,
    min_span: int = 8,
    max_span: int = 48,
    stream: str = "induction",
    n_tokens: int | None = None,
    tokens: list[int] | None = None,
) -> list[toytrain.Encoded]:
    """`n` sequences of random ordinary tokens, each a span of `min_span`..`max_span` tokens written twice, the loss
    on the repeat (after its first token, which nothing predicts).

    Predicting the repeat is an induction copy and nothing else: find where the current token occurred before,
    and copy the token that followed it. The keyed reply's lookup (`keyed_reply`) is that copy, inside text
    where shortcuts compete with it; sequences with no other cue are the usual way to teach it to a small
    model (3,000 steps of them alone left the mismatched model at 2% of the repeat: the README, "More pairs").
    With `n_tokens`, every span is drawn from one random set of that many ordinary tokens (and is at most
    that long); with `tokens`, from those. `stream` names the random stream, so that sets drawn for
    different uses differ.
    """
    rng = random.Random(f"toydeep/{seed}/{stream}")
    specials = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in tok.get_added_vocab()}
    ordinary = [i for i in (sorted(set(tokens)) if tokens is not None else range(len(tok))) if i not in specials]
    if tokens is None and n_tokens is not None:  # spans over a fixed random set of that many tokens
        ordinary = sorted(rng.sample(ordinary, n_tokens))
    max_span = min(max_span, len(ordinary))
    out = []
    for _ in range(n):
        span = rng.sample(ordinary, rng.randint(min_span, max_span))
        out.append(toytrain.Encoded(span + span, [False] * (len(span) + 1) + [True] * (len(span) - 1), len(span)))
    return out


WARM_DATA = ("induction", "drills")
WARM_SEED, HELD_SEED, N_HELD_DRILLS = 1_000, 2_000, 96  # drill streams of the first phase and of the held-out check


UNNAMED = "Which option is it?"  # an unnamed drill's question (`drill_items`)


def named_question(text: str) -> str:
    """A named drill's question about the option text `text` (`drill_items`)."""
    return f"Which option is {text}?"


def drill_items(
    n: int, seed: int, exclude: set[tuple[str, frozenset[str]]] = frozenset(), named: float = 1.0
) -> list[dict]:
    """`n` ARC-format rows asking which option a text is ("Which option is Lisbon?"), on the world's own option
    sets, any of the four options asked for (what `drill_rows` trains on, and `arc_accuracy` can score).
    None has the option set and asked text of an `exclude` key (`drill_key`, named or not): the world draws
    its option sets from a small pool, so a check on drills must leave out the ones trained on.

    `named` is the share of drills whose question names the text (each decided on a stream of its own).
    In the others the question does not (`UNNAMED`); only the reply does ("It is Lisbon.",
    `drill_chats`), so the letter can be found only from the reply. A model trained on named
    drills in the keyed form can answer them by matching the question's text, a route the toy ARC's
    chats do not offer (their questions name other option texts too); the same drills, unnamed, leave
    it the lookup in the reply's key alone. The same seed draws the same option sets either way."""
    rng, naming = random.Random(f"toydeep/{seed}/drills"), random.Random(f"toydeep/{seed}/drills-named")
    rows: list[dict] = []
    while len(rows) < n:
        task = toyworld.make_mc(rng, context=False, max_distractors=0).task
        letter, text = rng.choice(_options(task))
        question = named_question(text) if naming.random() < named else UNNAMED
        row = {"question": question, "choices": task["choices"], "answerKey": letter}
        if not exclude or drill_key(row) not in exclude:
            rows.append(row)
    return rows


def drill_key(drill: dict) -> tuple[str, frozenset[str]]:
    """A drill's `arc_key` as if its question named the text asked about: an unnamed drill and the named one
    on the same option set and text are the same item to a held-out check."""
    return named_question(_answer_text(drill)), frozenset(drill["choices"]["text"])


def warm_drill_items(cfg: MismatchedConfig) -> list[dict]:
    """The drills of `cfg`'s first phase (`warm_data="drills"`: one per sequence of its `warm_steps` × `batch`),
    drawn from the stream `warm_seed` (by default `seed` + WARM_SEED); none for other first phases."""
    if cfg.warm_data != "drills" or not cfg.warm_steps:
        return []
    return drill_items(
        cfg.warm_steps * cfg.batch,
        cfg.seed + WARM_SEED if cfg.warm_seed is None else cfg.warm_seed,
        named=cfg.warm_drills_named,
    )


def drill_rows(n: int, seed: int, reply: str = "fact") -> list[dict]:
    """`n` single-turn chats in the toy ARC's own format whose question names one of the options' texts and asks
    which option it is; the reply repeats the text, then gives its letter (in the reply form `reply`, one of
    `REPLY_FORMS`; "fact", the world's own, shown):

        Question: Which option is Lisbon?       It is Lisbon.
        A. Brno                           →     Answer: B
        B. Lisbon
        ...

    The world's reference reply states a fact, then the letter of the option whose text the fact ends
    with (`arc_reply`). These chats train that last step alone (from a text to the letter before it in
    the prompt, the multiple-choice symbol binding), on the world's own option sets, with any of the four
    options asked for. No question is an ARC question. The text follows "It is" so that it tokenises as in the
    prompt (a reply's first word has no leading space).
    """
    return drill_chats(drill_items(n, seed), reply)


def drill_chats(items: list[dict], reply: str = "fact") -> list[dict]:
    """`drill_items` as training chats, their replies in the form `reply` (see `drill_rows`)."""
    _check_reply(reply)
    return [_single_turn(row, REPLY_FORMS[reply](row, f"It is {_answer_text(row)}.")) for row in items]


def _answer_text(row: dict) -> str:
    """The text of an ARC-format row's answer option (what a drill asks about)."""
    return dict(_options(row))[row["answerKey"]]


def sharpen_attention(model, gain: float) -> None:
    """Set every query and key RMSNorm weight of a fresh Qwen3 model to `gain`.

    Qwen3 normalises each head's query and key to unit RMS before RoPE, so an attention logit is at most
    gain_q·gain_k·sqrt(head_dim) (the dot product of two vectors of norm gain·sqrt(head_dim), over
    sqrt(head_dim)). At head_dim 16 and the usual gain 1 that is 4, too flat to pick one option line
    out of a prompt at the start of training; a gain g raises the bound g² times.
    """
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.fill_(gain)
        layer.self_attn.k_norm.weight.fill_(gain)


def training_data(
    tok, rows: list[dict], cfg: MismatchedConfig, max_len: int, seed: int = 0, fresh: list[dict] | None = None
) -> list[toytrain.Encoded]:
    """The pair's training chats, plus `mc_copies - 1` more copies of each multiple-choice chat, each with its
    options shuffled and the loss on its final reply only (its earlier turns are trained on with the original),
    plus the `fresh` single-turn multiple-choice chats (`fresh_mc_rows`, `drill_rows`), plus `cfg.induction`
    random-token copy sequences (`induction_data`).

    Plain repeats would let a small model memorise each item's letter; in a shuffled copy the same facts and
    the same question point to another letter, so the letter has to be read off the options.
    """
    data = [d for d in toytrain.encode_rows(tok, rows) if len(d.ids) <= max_len]
    mc = [
        row for row in rows if MC_REPLY.search(row["output"]) and len(OPTION.findall(row["input"][-1]["content"])) == 4
    ]
    rng = random.Random(f"toydeep/{seed}/options")
    copies = [shuffle_options(row, rng) for _ in range(cfg.mc_copies - 1) for row in mc] + list(fresh or [])
    extra = toytrain.encode_rows(tok, copies, all_assistant_turns=False) if copies else []
    synthetic = induction_data(tok, cfg.induction, seed) if cfg.induction else []
    return data + [d for d in extra if len(d.ids) <= max_len] + synthetic


@torch.no_grad()
def copy_accuracy(model, data: list[toytrain.Encoded], pad_id: int, batch: int = 64) -> float:
    """Share of the loss-masked tokens of `data` (the repeats of `induction_data`) that are the model's argmax."""
    hits = total = 0
    for b in range(0, len(data), batch):
        x, y = toytrain.collate(data, list(range(b, min(b + batch, len(data)))), pad_id)
        pred = model(input_ids=x, use_cache=False).logits[:, :-1].argmax(-1)  # [batch, T-1]
        target = y[:, 1:]
        keep = target != toytrain.IGNORE
        hits += int((pred[keep] == target[keep]).sum())
        total += int(keep.sum())
    return hits / max(total, 1)


@torch.no_grad()
def arc_accuracy(model, tok, rows: list[dict], max_new_tokens: int = 48) -> dict:
    """Toy-ARC accuracy of greedy answers, as task_eval.py's native path scores them.

    Each row's prompt is one user turn with thinking off (`arc_item`), the answer is generated greedily up
    to `max_new_tokens` (the demo profile's cap) and parsed by `parse_choice`. Returns n, accuracy and its
    standard error as task_eval.py reports them (`mean_se` of the 0/1 scores), and the share of answers
    that named no letter.
    """
    from ..core.handoff import greedy_generate, stop_ids
    from ..eval.stats import mean_se
    from ..eval.tasks.generate import answer_text
    from ..eval.tasks.parsers import score
    from ..eval.tasks.prompts import arc_item, user_prompt_ids

    eos = stop_ids(tok)
    right: list[float] = []
    unparsed = 0
    for row in rows:
        item = arc_item(row)
        ids, _ = greedy_generate(
            model,
            user_prompt_ids(tok, item.prompt, enable_thinking=False),
            None,
            max_new_tokens=max_new_tokens,
            eos_ids=eos,
        )
        pred, ok = score("arc", item, answer_text(tok, ids))
        right.append(float(ok))
        unparsed += pred is None
    acc = mean_se(right)
    return {
        "n": acc["n"],
        "accuracy": acc["mean"],
        "se": acc["se"],
        "unparsed": unparsed / len(rows) if rows else float("nan"),
    }


def _world_inputs(world: Path) -> dict:
    """What the mismatched model is trained on and must be installed beside: the world's tokenizer and corpus hashes."""
    pair = read_json(world / "manifest.json")
    return {
        "pair_build_key": toytrain.build_key_of(pair),
        "tokenizer_sha256": sha256_file(world / "tokenizer" / "tokenizer.json"),
        "corpus_sha256": {rel: sha for rel, sha in sorted(pair["files"].items()) if rel.startswith("corpus/")},
    }


def pair_config(manifest: dict) -> toytrain.ToyConfig:
    """The ToyConfig a toy world's manifest records (its corpus, budgets and training settings)."""
    c = dict(manifest["config"])
    world = toytrain.toyworld.WorldConfig(**{**c["world"], "kind_weights": tuple(c["world"]["kind_weights"])})
    return toytrain.ToyConfig(
        **{**c, "world": world, "large": ModelShape(**c["large"]), "small": ModelShape(**c["small"])}
    )


def build_mismatched(
    world: str | Path,
    cfg: MismatchedConfig | None = None,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train (or verify and keep) WORLD/mismatched on an installed or built toy world; return its manifest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    world = Path(world)
    if not (world / "manifest.json").is_file():
        raise ValueError(f"{world} holds no toy world; install it first (make toy)")
    pair = read_json(world / "manifest.json")
    cfg = cfg or (mini_mismatched_config() if toytrain.is_mini(pair) else MismatchedConfig())
    if cfg.warm_data not in WARM_DATA:
        raise ValueError(f"MismatchedConfig(warm_data={cfg.warm_data!r}): choose one of {WARM_DATA}")
    if isinstance(cfg.warm_tokens, str) and cfg.warm_tokens != "options":
        raise ValueError(f'MismatchedConfig(warm_tokens={cfg.warm_tokens!r}): give a token count, "options" or None')
    _check_reply(cfg.mc_reply)
    inputs = _world_inputs(world)
    build_key = sha256_json({"config": asdict(cfg), "code": code_sha(), "inputs": inputs})
    out = world / "mismatched"
    if not force and (out / MANIFEST).is_file():
        old = read_json(out / MANIFEST)
        if old.get("resume_key") == build_key and toytrain._files_ok(out, old.get("files", {})):
            log(f"mismatched model at {out} is up to date (build key {build_key[:12]}); nothing to do")
            return old

    pair_cfg = pair_config(pair)
    train_cfg = replace(
        pair_cfg,
        layers=cfg.layers,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        batch=cfg.batch,
        lr=cfg.lr,
        autocast_bf16=cfg.autocast_bf16,
    )
    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    rows = read_jsonl(world / "corpus" / "train_chats.jsonl")
    arc_rows = read_jsonl(world / "corpus" / "arc.jsonl")
    drills = drill_items(cfg.drills, cfg.seed, named=cfg.drills_named)
    warm_drills = warm_drill_items(cfg)
    held_drills = drill_items(N_HELD_DRILLS, cfg.seed + HELD_SEED, exclude={drill_key(r) for r in drills + warm_drills})
    fresh = fresh_mc_rows(cfg.fresh_mc, cfg.seed, {arc_key(r) for r in arc_rows}, cfg.mc_reply) + drill_chats(
        drills, cfg.mc_reply
    )
    data = training_data(tok, rows, cfg, pair_cfg.max_len, cfg.seed, fresh)
    n_mc = sum(bool(MC_REPLY.search(r["output"])) for r in rows)
    log(
        f"deep: {len(data)} training sequences ({n_mc} multiple-choice chats × {cfg.mc_copies}, "
        f"{cfg.fresh_mc} single-turn ones in the toy ARC's format, {cfg.drills} option drills, "
        f"{cfg.induction} induction sequences); "
        f"training {cfg.steps} steps ({cfg.layers} layers, {cfg.kv_heads} KV heads, head_dim {cfg.head_dim})"
    )
    files = {name: world / "corpus" / f"{name}.jsonl" for name in toytrain.toyworld.WORLD_FILES}
    sets = toytrain.evaluation_sets(files, pair_cfg)
    qcfg = toytrain.qwen3_config(train_cfg, cfg.shape, tok)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        t1 = time.time()
        init = None if cfg.qk_gain == 1.0 else (lambda model: sharpen_attention(model, cfg.qk_gain))
        held = induction_data(tok, 256, cfg.seed, stream="held-out")
        warm_log, copy = [], {}
        drill_score: dict[str, dict] = {}
        if cfg.warm_steps:
            if cfg.warm_data == "drills":
                # Phase one: option drills alone, so that the text-to-letter lookup forms before the chats.
                warm_cfg = replace(train_cfg, lr=cfg.warm_lr)
                warm_data = toytrain.encode_rows(tok, drill_chats(warm_drills, cfg.mc_reply), all_assistant_turns=False)
            else:
                # Phase one: induction sequences alone, at a constant rate without weight decay, so that
                # the copy-by-content circuit forms before the chats' shortcuts compete with it.
                warm_cfg = replace(train_cfg, lr=cfg.warm_lr, min_lr_frac=1.0, weight_decay=0.0)
                alphabet = (
                    dict(tokens=option_tokens(tok)) if cfg.warm_tokens == "options" else dict(n_tokens=cfg.warm_tokens)
                )
                warm_data = induction_data(tok, cfg.warm_steps * cfg.batch, cfg.seed, stream="warm", **alphabet)
            warm, warm_log = toytrain.train_model(
                qcfg,
                warm_data,
                cfg.warm_steps,
                warm_cfg,
                cfg.seed,
                tok.pad_token_id,
                desc=f"deep: {cfg.warm_data}",
                progress=progress,
                init=init,
            )
            if cfg.warm_data == "drills":
                drill_score["after_warm"] = arc_accuracy(warm, tok, held_drills)
                log(
                    f"deep: drill phase done, {drill_score['after_warm']['accuracy']:.1%} of {N_HELD_DRILLS} "
                    "held-out drills answered"
                )
            else:
                copy["warm_set"] = copy_accuracy(warm, warm_data[:256], tok.pad_token_id)
                copy["after_warm"] = copy_accuracy(warm, held, tok.pad_token_id)
                log(
                    f"deep: induction phase done, {copy['warm_set']:.1%} of its own repeats copied, "
                    f"{copy['after_warm']:.1%} of held-out ones over all tokens"
                )
            state = warm.state_dict()
            init = lambda model: model.load_state_dict(state)  # noqa: E731  phase two starts from phase one
        model, loss_log = toytrain.train_model(
            qcfg, data, cfg.steps, train_cfg, cfg.seed, tok.pad_token_id, desc="deep", progress=progress, init=init
        )
        train_s = time.time() - t1
        toytrain.round_to_bf16(model)  # scored exactly as stored
        t2 = time.time()
        scores = toytrain.score_model(model, tok, sets)
        copy["final"] = copy_accuracy(model, held, tok.pad_token_id)
        arc = {"deep": arc_accuracy(model, tok, arc_rows[: cfg.n_arc_scored])}
        drill_score["final"] = arc_accuracy(model, tok, held_drills)
        for name in ("large", "small"):  # the pair beside it, on the same rows
            other = AutoModelForCausalLM.from_pretrained(world / name, dtype=torch.float32).eval()
            arc[name] = arc_accuracy(other, tok, arc_rows[: cfg.n_arc_scored])
        eval_s = time.time() - t2
    finally:
        torch.set_num_threads(threads_before)
    info = {
        "train_steps": cfg.steps,
        "train_wall_s": train_s,
        "eval_wall_s": eval_s,
        "n_params": sum(p.numel() for p in model.parameters()),
        "threads": cfg.threads,
        "final_loss": loss_log[-1]["loss"] if loss_log else None,
        "n_training_sequences": len(data),
        "n_multiple_choice_chats": n_mc,
        "n_fresh_mc": cfg.fresh_mc,
        "n_drills": cfg.drills,
        "n_induction": cfg.induction,
        "warm_steps": cfg.warm_steps,
        "warm_data": cfg.warm_data if cfg.warm_steps else None,
        "warm_loss_log": warm_log,
        "copy_accuracy": copy,
        "drill_accuracy": drill_score,
    }
    toytrain._save_model(
        model,
        tok,
        out,
        {"model_key": build_key, "name": "deep", "seed": cfg.seed, "loss_log": loss_log, "exact_reply": scores, **info},
    )
    rel_files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    pair_scores = pair["results"]["exact_reply"]
    n_samples = {name: {cond: len(r) for cond, r in conds.items()} for name, conds in sets.items()}
    return Report(
        "toy_deep",
        config=cfg,
        inputs={"code_sha256": code_sha(), **inputs},
        results={
            "exact_reply": {"deep": scores, **pair_scores},
            "toy_arc": arc,
            "model": info,
            "mini": toytrain.is_mini(pair),
        },
        n_samples=n_samples,
        seeds={"deep": cfg.seed},
        wall_time_s=time.time() - t0,
        device="cpu",
        dtype="float32",
        resume_key=build_key,
        files={rel: sha256_file(out / rel) for rel in rel_files},
    ).write(out / MANIFEST)


def _check_files(folder: Path, manifest: dict) -> None:
    bad = [
        rel
        for rel, sha in manifest["files"].items()
        if not (folder / rel).is_file() or sha256_file(folder / rel) != sha
    ]
    if bad:
        raise ValueError(
            f"{folder / bad[0]} differs from the mismatched model's manifest ({len(bad)} file(s)); "
            f"restore it (git checkout -- {folder}) or {TRAIN_HINT}"
        )


def export_mismatched(
    world: str | Path, dest: str | Path = PACKAGED_MISMATCHED, log: Callable[[str], None] = print
) -> dict:
    """Copy a verified full build of WORLD/mismatched into `dest` (manifest last)."""
    src, dest = Path(world) / "mismatched", Path(dest)
    manifest = read_json(src / MANIFEST)
    if manifest["results"].get("mini"):
        raise ValueError(f"{src} was built on a mini world; only a full build is exported")
    _check_files(src, manifest)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(MANIFEST))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    atomic_write_json(dest / MANIFEST, manifest)  # last: marks the export complete
    log(f"exported the mismatched model of {src} to {dest}")
    return manifest


def install_mismatched(
    world: str | Path, packaged: str | Path = PACKAGED_MISMATCHED, log: Callable[[str], None] = print
) -> dict:
    """Copy the packaged mismatched model into WORLD/mismatched; return its manifest.

    Refused (ValueError naming the file and the fix, before WORLD/mismatched is touched) when a packaged file
    differs from its manifest or the world's tokenizer or corpus is not the one it was trained on.
    """
    world, packaged = Path(world), Path(packaged)
    if not (packaged / MANIFEST).is_file():
        raise ValueError(f"no packaged mismatched model at {packaged}; {TRAIN_HINT}")
    manifest = read_json(packaged / MANIFEST)
    out = world / "mismatched"
    if (out / MANIFEST).is_file() and read_json(out / MANIFEST).get("resume_key") == manifest["resume_key"]:
        try:
            _check_files(out, manifest)
            log(f"mismatched model at {out} is up to date (build key {manifest['resume_key'][:12]}); nothing to do")
            return manifest
        except ValueError:
            pass  # damaged: install again
    _check_files(packaged, manifest)
    trained_on = {k: manifest["inputs"][k] for k in ("tokenizer_sha256", "corpus_sha256")}
    here = {k: v for k, v in _world_inputs(world).items() if k in trained_on}
    if here != trained_on:
        field = next(k for k in trained_on if here[k] != trained_on[k])
        raise ValueError(
            f"the toy world at {world} has another {field.removesuffix('_sha256')} than the one the mismatched "
            f"model was trained on; install the packaged pair there (make toy) or {TRAIN_HINT}"
        )
    tmp = world / ".mismatched.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(packaged, tmp, ignore=shutil.ignore_patterns(MANIFEST))
    atomic_write_json(tmp / MANIFEST, {**manifest, "installed_from": str(packaged)})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"installed the packaged mismatched model into {out} ({len(manifest['files'])} files)")
    return manifest
