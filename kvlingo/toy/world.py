"""The toy world's text: a procedural chat corpus and evaluation files, deterministic from a seed.

The offline demo needs a pair of models that really use their KV cache, so every conversation
here is built so that its final reply depends on the prefix. Four kinds of item:

- recall: the user states facts (a name, a locker number, a password, a shopping list ...),
  unrelated distractor turns follow, and the final question asks for one fact back;
- ifeval: a writing request under checkable rules (all capitals, all lowercase, required
  keywords, an ending phrase, no commas, a <<title>>, N bullet points), graded by lm-eval's
  official IFEval checker; in the context variant the rule is given several turns earlier;
- math: GSM8K-style word problems whose reply is a worked solution ending in "Answer: N";
- mc: ARC-style four-option questions whose answer follows from facts in the question (or
  from an earlier turn) or from the world's fixed word categories.

Each item exists as a *context* variant (the facts or rule sit in earlier turns, so dropping them
must break the reply) and an *inline* variant (everything in the final user turn, the shape of
the IFEval/ARC/GSM8K evaluation files). ARC and GSM8K questions are asked in exactly the user
turn that task_eval.py renders for a real ARC/GSM8K row (`kvlingo.eval.tasks.prompts.arc_item`/`gsm8k_item`),
and their replies end with the "Answer: X" line that prompt asks for, so the toy pair is scored
by the real evaluation code without a toy-specific format. Every assistant reply is a deterministic function of the
conversation, so "exact reply" is a well-defined score.

Randomness comes from `random.Random` seeded with strings such as "toyworld/0/train": string
seeds hash with SHA-512 inside CPython, so the corpus does not depend on PYTHONHASHSEED, and
training and evaluation items come from separate streams. Evaluation items are drawn first and
training items that collide with them are skipped, so the two are disjoint.

Files written by `write_world(out_dir, cfg)`:
    train_chats.jsonl   training conversations for the toy models (Nemotron chat format)
    chats.jsonl         held-out conversations (Nemotron chat format; prepare.py --source)
    chats.meta.jsonl    one line per chats.jsonl row: kind, subkind, context_dependent
    ifeval.jsonl        google/IFEval format: key, prompt, instruction_id_list, kwargs
    ifeval.ref.jsonl    the reference reply for each ifeval.jsonl key
    arc.jsonl           allenai/ai2_arc format: id, question, choices{text,label}, answerKey
    arc.ref.jsonl       the reference reply (supporting fact, then "Answer: X") per arc.jsonl id
    gsm8k.jsonl         openai/gsm8k format: question, answer ("... #### N")
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..eval.tasks.prompts import arc_item, gsm8k_item
from ..io import atomic_write_jsonl

KINDS = ("recall", "ifeval", "math", "mc")
LETTERS = ("A", "B", "C", "D")

# --------------------------------------------------------------------------- word lists
NAMES = (
    "Ada Bram Cora Dario Elin Fenna Gideon Hana Ivo Jora Kasper Lina Milo Nadia Oskar Priya Quinn Rosa "
    "Soren Tova Uma Viktor Wren Xavi Yara Zeno Alma Bruno Celia Dmitri Esme Felix Greta Hugo Ines Jonas "
    "Kira Leon Mara Nico Olga Pavel Rhea Sami Thea Ugo Vera Wim"
).split()
CITIES = (
    "Lisbon Oslo Dublin Porto Leeds Bergen Tampere Ghent Lyon Turin Krakow Riga Malmo Basel Graz Split "
    "Cork Aarhus Bilbao Utrecht Nantes Brno Kaunas Bremen"
).split()
ANIMALS = "cat dog parrot rabbit hamster turtle goldfish pony".split()
PET_NAMES = "Biscuit Pepper Mango Noodle Pickles Ziggy Olive Sprout Waffles Clover Bean Toffee Pixel Juniper".split()
COLORS = "red blue green yellow purple orange white black silver brown".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
PASS_ADJ = "amber brave calm dusty eager fuzzy gentle hollow icy jolly lucky misty noble quiet rusty sunny".split()
PASS_NOUN = "falcon river lantern meadow pebble tiger comet harbor willow rocket maple otter canyon".split()
PASS_THINGS = ("wifi", "garage", "front door", "office safe", "bike lock", "laptop")
NUMBER_THINGS = ("locker number", "room number", "bus number", "seat number", "table number")
GROCERIES = "eggs rice lemons tea bread milk apples cheese onions butter pasta honey carrots beans".split()
ORDINALS = ("first", "second", "third", "fourth")
OBJECTS = "key ring coin map watch lamp clock book spoon shell".split()
ITEMS = "apples marbles stickers books shells coins pencils cookies stamps cards".split()
KEYWORDS = "river music window garden coffee winter bridge candle forest letter mountain paper kitchen island".split()
END_PHRASES = (
    "Is there anything else I can help with?",
    "Any other questions?",
    "Let me know if you need more.",
    "That is all for now.",
    "Thank you for reading.",
    "Have a nice day.",
)
# (topic, adjective, clause): a note about a topic is built from these, so its text is fixed by the topic.
TOPICS = (
    ("the harbor", "busy", "boats come and go all day"),
    ("a rainy afternoon", "quiet", "the streets shine with water"),
    ("the old library", "peaceful", "the shelves hold many stories"),
    ("a mountain lake", "cold", "the water looks very clear"),
    ("the city market", "lively", "people sell fruit and bread"),
    ("a winter morning", "crisp", "the grass is white with frost"),
    ("the school garden", "green", "children grow beans and herbs"),
    ("a summer picnic", "relaxed", "friends share food on the grass"),
    ("the night sky", "dark", "the stars look small and bright"),
    ("a train journey", "long", "the fields pass by the window"),
    ("the village bakery", "warm", "fresh bread comes out every morning"),
    ("a forest walk", "calm", "the trees give cool shade"),
    ("the town square", "open", "people meet near the fountain"),
    ("a snowy hill", "white", "children slide down on sleds"),
    ("the beach at dawn", "still", "the waves are soft and slow"),
    ("a small museum", "interesting", "old tools sit behind glass"),
    ("the family kitchen", "cozy", "someone is always cooking soup"),
    ("a bicycle ride", "fun", "the wind feels fresh on the face"),
    ("the river path", "pleasant", "ducks swim along the bank"),
    ("a spring festival", "colorful", "music plays in the streets"),
    ("the science fair", "exciting", "students show their projects"),
    ("a quiet cafe", "friendly", "the coffee smells very good"),
    ("the football match", "loud", "fans cheer for their team"),
    ("a long holiday", "restful", "there is time to read and sleep"),
    ("the old bridge", "strong", "it has stood for many years"),
    ("a birthday party", "happy", "everyone sings and eats cake"),
    ("the public park", "wide", "dogs run across the lawn"),
    ("a farm visit", "muddy", "the cows eat hay in the barn"),
    ("the evening news", "serious", "reporters talk about the day"),
    ("a camping trip", "simple", "we cook dinner over a fire"),
)
REQUESTS = ("Write a short note about {t}.", "Describe {t} in a few sentences.", "Tell me about {t}.")
# Word categories: the "world knowledge" that category questions test.
CATEGORIES = {
    "fruit": "apple banana cherry grape mango pear plum peach".split(),
    "animal": "horse tiger sheep eagle whale camel mouse zebra".split(),
    "tool": "hammer wrench saw drill shovel chisel ladder rake".split(),
    "color": "red blue green yellow purple orange pink gray".split(),
    "vehicle": "car truck bus train bicycle boat plane tractor".split(),
    "instrument": "piano violin drum flute guitar trumpet harp cello".split(),
}
TRIVIA = (
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do cows drink?", "Cows drink water."),
    ("Which season comes after winter?", "Spring comes after winter."),
    ("What gas do plants take in?", "Plants take in carbon dioxide."),
    ("How many months are in a year?", "There are twelve months in a year."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Where does the sun rise?", "The sun rises in the east."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("How many hours are in a day?", "There are twenty four hours in a day."),
    ("What is the largest planet?", "Jupiter is the largest planet."),
    ("What do fish use to breathe?", "Fish use gills to breathe."),
    ("Hello, how are you today?", "I am doing well, thank you. How can I help?"),
    ("Can you help me with something?", "Of course. What do you need?"),
    ("Thanks for your help so far.", "You are welcome."),
)
ACK_FACTS = "Thanks, I will remember that."
ACK_RULE = "Understood. I will follow that rule."
ACK_STORY = "Thanks for the story."
ACK_MATH = "Okay, go on."
MAX_NOTE_CHARS = 150  # longest IFEval reply (about 40 tokens of the toy tokenizer)


# --------------------------------------------------------------------------- items
@dataclass
class Item:
    """One conversation: `messages` ends with a user turn; `reply` is the final assistant answer."""

    kind: str  # recall | ifeval | math | mc
    subkind: str  # the template family inside the kind
    messages: list[dict[str, str]]  # [{"role", "content"}], ends with the final user turn
    reply: str  # the final answer (reasoning excluded)
    reasoning: str  # short reasoning shown inside <think> when the row has reasoning on
    context_dependent: bool  # True: the facts or rule sit in earlier turns, not in the final one
    task: dict[str, Any] = field(default_factory=dict)  # the eval-file row this item corresponds to (inline items)
    reply_after_reasoning: str | None = None  # the answer after </think> when it differs from `reply`


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _distractor(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.4:
        return rng.choice(TRIVIA)
    if r < 0.7:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    phrase = f"{rng.choice(PASS_ADJ)} {rng.choice(PASS_NOUN)} near the {rng.choice(KEYWORDS)}"
    return f"Please repeat this phrase: {phrase}.", f"{_cap(phrase)}."


def _with_context(
    rng: random.Random, setup: list[tuple[str, str]], final_user: str, max_distractors: int, shuffle_setup: bool = True
) -> list[dict[str, str]]:
    """Setup exchanges and 0..max_distractors distractor exchanges, then the final user turn.

    With shuffle_setup the distractors may also come before the facts; otherwise the setup
    (a rule, a story, the start of a word problem) opens the conversation.
    """
    exchanges = list(setup) + [_distractor(rng) for _ in range(rng.randint(0, max_distractors))]
    if shuffle_setup:
        rng.shuffle(exchanges)
    msgs: list[dict[str, str]] = []
    for user, assistant in exchanges:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return msgs + [{"role": "user", "content": final_user}]


def _inline(rng: random.Random, final_user: str, max_distractors: int) -> list[dict[str, str]]:
    """Unrelated distractor exchanges (maybe none) before a self-contained final user turn."""
    return _with_context(rng, [], final_user, max_distractors if rng.random() < 0.5 else 0)


# --------------------------------------------------------------------------- recall
def _facts(rng: random.Random) -> dict[str, tuple[str, list[str], str, str]]:
    """Every fact type: (statement, questions, answer, reasoning)."""
    name, friend = rng.sample(NAMES, 2)
    city = rng.choice(CITIES)
    animal, pet = rng.choice(ANIMALS), rng.choice(PET_NAMES)
    num_thing, num = rng.choice(NUMBER_THINGS), rng.randint(10, 9999)
    pass_thing = rng.choice(PASS_THINGS)
    password = f"{rng.choice(PASS_ADJ)}-{rng.choice(PASS_NOUN)}-{rng.randint(10, 99)}"
    color = rng.choice(COLORS)
    day, hour = rng.choice(DAYS), rng.randint(1, 12)
    groceries = rng.sample(GROCERIES, 4)
    glist = f"{groceries[0]}, {groceries[1]}, {groceries[2]} and {groceries[3]}"
    k = rng.randrange(4)
    shopping_q = ["What is on my shopping list?", f"What is the {ORDINALS[k]} item on my shopping list?"]
    list_pick = rng.randrange(2)
    shopping_a = [f"Your shopping list is {glist}.", f"The {ORDINALS[k]} item is {groceries[k]}."][list_pick]
    return {
        "name": (
            f"My name is {name}.",
            ["What is my name?", "Do you remember my name?"],
            f"Your name is {name}.",
            f"The user told me their name is {name}.",
        ),
        "friend": (
            f"My best friend is called {friend}.",
            ["What is my best friend called?"],
            f"Your best friend is called {friend}.",
            f"The user said their best friend is {friend}.",
        ),
        "city": (
            f"I live in {city}.",
            ["Where do I live?", "Which city do I live in?"],
            f"You live in {city}.",
            f"The user said they live in {city}.",
        ),
        "pet": (
            f"I have a {animal} called {pet}.",
            [f"What is my {animal} called?"],
            f"Your {animal} is called {pet}.",
            f"The user has a {animal} named {pet}.",
        ),
        "number": (
            f"My {num_thing} is {num}.",
            [f"What is my {num_thing}?"],
            f"Your {num_thing} is {num}.",
            f"The user said their {num_thing} is {num}.",
        ),
        "password": (
            f"The password for the {pass_thing} is {password}.",
            [f"What is the password for the {pass_thing}?"],
            f"The password for the {pass_thing} is {password}.",
            f"The user gave the {pass_thing} password {password}.",
        ),
        "color": (
            f"My favorite color is {color}.",
            ["What is my favorite color?"],
            f"Your favorite color is {color}.",
            f"The user likes the color {color}.",
        ),
        "meeting": (
            f"The meeting is on {day} at {hour} o'clock.",
            ["When is the meeting?"],
            f"The meeting is on {day} at {hour} o'clock.",
            f"The user said the meeting is {day} at {hour}.",
        ),
        "shopping": (f"My shopping list is {glist}.", [shopping_q[list_pick]], shopping_a, f"The user listed {glist}."),
    }


def make_recall(rng: random.Random, context: bool, max_distractors: int) -> Item:
    facts = _facts(rng)
    chosen = rng.sample(sorted(facts), rng.choices([1, 2, 3], weights=[5, 3, 2])[0])
    target = chosen[0]
    statement, questions, answer, reasoning = facts[target]
    question = rng.choice(questions)
    rng.shuffle(chosen)
    if context:
        if rng.random() < 0.5:  # all facts in one turn
            setup = [(" ".join(facts[c][0] for c in chosen), ACK_FACTS)]
        else:  # one turn per fact
            setup = [(facts[c][0], ACK_FACTS) for c in chosen]
        msgs = _with_context(rng, setup, question, max_distractors)
    else:
        msgs = _inline(rng, " ".join(facts[c][0] for c in chosen) + " " + question, max_distractors)
    return Item("recall", target, msgs, answer, reasoning, context)


# --------------------------------------------------------------------------- ifeval
IFEVAL_IDS = {
    "capital": "change_case:english_capital",
    "lowercase": "change_case:english_lowercase",
    "keywords": "keywords:existence",
    "end": "startend:end_checker",
    "no_comma": "punctuation:no_comma",
    "title": "detectable_format:title",
    "bullets": "detectable_format:number_bullet_lists",
}
RULE_TEXT = {
    "capital": (
        "Your entire reply must be in English and in capital letters only.",
        "Write the whole answer in all capital letters.",
    ),
    "lowercase": (
        "Use only lowercase letters in your entire reply, no capitals at all.",
        "Your whole answer must be in English and in lowercase letters.",
    ),
    "keywords": ("Include the keywords {kw} in your reply.", "Make sure the answer mentions {kw}."),
    "end": (
        'End your reply with the exact phrase "{end}" and nothing after it.',
        'Finish with the phrase "{end}" with no other words after it.',
    ),
    "no_comma": ("Do not use any commas in your reply.", "Avoid commas completely."),
    "title": (
        "Give your answer a title wrapped in double angular brackets, such as <<my title>>.",
        "Put a title in double angular brackets like <<title>> at the top.",
    ),
    "bullets": (
        "Your answer must have exactly {n} bullet points, using markdown bullets like * this.",
        "Use exactly {n} markdown bullet points such as * point.",
    ),
}


def _note(topic: tuple[str, str, str], rules: dict[str, Any]) -> str:
    """The reference note about `topic` obeying `rules` (a rule name -> its argument).

    Notes open with "I think": IFEval's case rules also require langdetect to call the reply
    English, and short all-capitals sentences without such function words are often read as
    German or Somali.
    """
    t, adj, clause = topic
    if "bullets" in rules:
        lines = [
            f"I think {t} is {adj}.",
            f"I know that {clause}.",
            f"Many people enjoy {t}.",
            f"I like to read about {t}.",
        ]
        body = "\n".join(f"* {line}" for line in lines[: rules["bullets"]])
    else:
        comma = "" if "no_comma" in rules else ","
        body = f"I think {t} is {adj}{comma} and {clause}."
    parts = [body]
    if "title" in rules:
        parts.insert(0, "<<" + " ".join(w.capitalize() for w in t.split()) + ">>")
    if "keywords" in rules:
        kws = rules["keywords"]
        parts.append(f"It reminds me of {kws[0]}." if len(kws) == 1 else f"It reminds me of {kws[0]} and {kws[1]}.")
    if "end" in rules:
        parts.append(rules["end"])
    text = "\n".join(parts)
    if "capital" in rules:
        text = text.upper()
    if "lowercase" in rules:
        text = text.lower()
    return text


def _draw_rules(rng: random.Random) -> dict[str, Any]:
    n = rng.choices([1, 2, 3], weights=[5, 4, 1])[0]
    names = list(RULE_TEXT)
    rules: dict[str, Any] = {}
    while len(rules) < n:
        r = rng.choice(names)
        if r in rules or ({r} | set(rules)) >= {"capital", "lowercase"}:
            continue
        if r == "keywords":
            rules[r] = rng.sample(KEYWORDS, rng.randint(1, 2))
        elif r == "end":
            rules[r] = rng.choice(END_PHRASES)
        elif r == "bullets":
            rules[r] = rng.randint(2, 4)
        else:
            rules[r] = None
    return rules


def _rule_sentence(rng: random.Random, name: str, arg: Any) -> str:
    text = rng.choice(RULE_TEXT[name])
    if name == "keywords":
        text = text.format(kw=" and ".join(arg))
    return text.format(end=arg, n=arg) if name in ("end", "bullets") else text


def _ifeval_kwargs(name: str, arg: Any) -> dict[str, Any]:
    """The IFEval kwargs dict under lm-eval's argument names; argument-free rules get {}."""
    if name == "keywords":
        return {"keywords": list(arg)}
    if name == "end":
        return {"end_phrase": arg}
    if name == "bullets":
        return {"num_bullets": arg}
    return {}


def make_ifeval(rng: random.Random, context: bool, max_distractors: int, plain: bool = False) -> Item:
    topic = rng.choice(TOPICS)
    request = rng.choice(REQUESTS).format(t=topic[0])
    rules = {} if plain else _draw_rules(rng)
    while len(_note(topic, rules)) > MAX_NOTE_CHARS:  # keep replies inside a demo-sized generation budget
        rules = _draw_rules(rng)
    order = list(rules)
    rng.shuffle(order)
    rule_text = " ".join(_rule_sentence(rng, r, rules[r]) for r in order)
    reply = _note(topic, rules)
    summary = ", ".join(r.replace("_", " ") for r in order) or "none"
    reasoning = f"A note about {topic[0]}. Rules: {summary}."
    task: dict[str, Any] = {}
    if plain:
        msgs = _inline(rng, request, max_distractors)
    elif context:
        setup = [(f"Here is a rule for the next thing I ask you to write. {rule_text}", ACK_RULE)]
        msgs = _with_context(rng, setup, request, max_distractors, shuffle_setup=False)
    else:
        prompt = f"{request} {rule_text}"
        msgs = _inline(rng, prompt, max_distractors)
        task = {
            "prompt": prompt,
            "instruction_id_list": [IFEVAL_IDS[r] for r in order],
            "kwargs": [_ifeval_kwargs(r, rules[r]) for r in order],
        }
    return Item("ifeval", "plain" if plain else "+".join(sorted(order)), msgs, reply, reasoning, context, task)


# --------------------------------------------------------------------------- math
def _math_problem(rng: random.Random) -> tuple[str, str, str, str, int]:
    """(subkind, setup sentence, rest of the problem, worked solution, answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.choice(["add", "sub", "mul", "mul_add", "mul_sub", "add3"])
    # Small operands: a tiny model has to memorise its addition and times tables.
    if form == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return (
            form,
            f"{name} has {a} {item}.",
            f"{name} buys {b} more {item}. How many {item} does {name} have now?",
            f"{name} has {a} {item} and buys {b} more, so {a} + {b} = {a + b}.",
            a + b,
        )
    if form == "sub":
        a = rng.randint(6, 30)
        b = rng.randint(1, a - 1)
        return (
            form,
            f"{name} has {a} {item}.",
            f"{name} gives away {b} {item}. How many {item} does {name} have left?",
            f"{name} has {a} {item} and gives away {b}, so {a} - {b} = {a - b}.",
            a - b,
        )
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if form == "mul":
        return (
            form,
            f"{name} has {a} boxes with {b} {item} in each box.",
            f"How many {item} does {name} have?",
            f"{a} boxes with {b} {item} each is {a} * {b} = {a * b}.",
            a * b,
        )
    if form == "mul_add":
        c = rng.randint(1, 10)
        return (
            form,
            f"{name} has {a} boxes with {b} {item} in each box.",
            f"{name} finds {c} more {item}. How many {item} does {name} have now?",
            f"{a} * {b} = {a * b} {item}. Then {a * b} + {c} = {a * b + c}.",
            a * b + c,
        )
    if form == "mul_sub":
        c = rng.randint(1, min(10, a * b - 1))
        return (
            form,
            f"{name} has {a} boxes with {b} {item} in each box.",
            f"{name} gives away {c} {item}. How many {item} does {name} have left?",
            f"{a} * {b} = {a * b} {item}. Then {a * b} - {c} = {a * b - c}.",
            a * b - c,
        )
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 12)
    return (
        form,
        f"{name} reads {a} pages on Monday and {b} pages on Tuesday.",
        f"On Wednesday {name} reads {c} pages. How many pages does {name} read in total?",
        f"{name} reads {a} + {b} + {c} = {a + b + c} pages.",
        a + b + c,
    )


def make_math(rng: random.Random, context: bool, max_distractors: int) -> Item:
    form, setup, rest, worked, answer = _math_problem(rng)
    reply = f"{worked}\nAnswer: {answer}"
    task: dict[str, Any] = {}
    if context:
        msgs = _with_context(
            rng, [(f"Here is a word problem. {setup}", ACK_MATH)], rest, max_distractors, shuffle_setup=False
        )
    else:
        task = {"question": f"{setup} {rest}", "answer": f"{worked}\n#### {answer}"}  # GSM8K's own format
        msgs = _inline(rng, gsm8k_prompt(task), max_distractors)
    # With reasoning on, the worked solution sits in <think>; the answer after it stays short.
    return Item("math", form, msgs, reply, worked, context, task, f"Answer: {answer}")


# --------------------------------------------------------------------------- multiple choice
def _mc_problem(rng: random.Random) -> tuple[str, str, str, list[str], str, str]:
    """(subkind, facts ('' if none), question, four options, correct option, reasoning)."""
    form = rng.choice(["boxes", "older", "lives", "count", "category"])
    if form == "boxes":
        o1, o2 = rng.sample(OBJECTS, 2)
        c1, c2, c3, c4 = rng.sample(COLORS, 4)
        name = rng.choice(NAMES)
        obj, col = rng.choice([(o1, c1), (o2, c2)])
        return (
            form,
            f"{name} put the {o1} in the {c1} box and the {o2} in the {c2} box.",
            f"Which box holds the {obj}?",
            [f"the {c} box" for c in (c1, c2, c3, c4)],
            f"the {col} box",
            f"The {obj} is in the {col} box.",
        )
    if form == "older":
        a, b, c, d = rng.sample(NAMES, 4)
        which = rng.choice(["older", "younger"])
        right = a if which == "older" else b
        return (
            form,
            f"{a} is older than {b}.",
            f"Who is {which}?",
            [a, b, c, d],
            right,
            f"{a} is older than {b}, so {right} is {which}.",
        )
    if form == "lives":
        a, b = rng.sample(NAMES, 2)
        ca, cb, cc, cd = rng.sample(CITIES, 4)
        person, city = rng.choice([(a, ca), (b, cb)])
        return (
            form,
            f"{a} lives in {ca}. {b} lives in {cb}.",
            f"Where does {person} live?",
            [ca, cb, cc, cd],
            city,
            f"{person} lives in {city}.",
        )
    if form == "count":
        name = rng.choice(NAMES)
        x, y = rng.randint(1, 9), rng.randint(1, 9)
        total = x + y
        wrong = rng.sample([v for v in range(max(1, total - 4), total + 5) if v != total], 3)
        return (
            form,
            f"{name} has {x} red balls and {y} blue balls.",
            f"How many balls does {name} have in total?",
            [str(total)] + [str(v) for v in wrong],
            str(total),
            f"{x} + {y} = {total} balls.",
        )
    cat = rng.choice(sorted(CATEGORIES))
    right = rng.choice(CATEGORIES[cat])
    others = rng.sample([c for c in sorted(CATEGORIES) if c != cat], 3)
    wrong = [rng.choice(CATEGORIES[o]) for o in others]
    article = "an" if cat[0] in "aeiou" else "a"
    return (
        form,
        "",
        f"Which of these is {article} {cat}?",
        [right] + wrong,
        right,
        f"{_cap(right)} is {article} {cat}.",
    )


def arc_prompt(row: dict[str, Any]) -> str:
    """The user turn for an ARC-format row: task_eval.py's own prompt."""
    return arc_item(row).prompt


def arc_reply(row: dict[str, Any], why: str = "") -> str:
    """The reference reply to `arc_prompt(row)`: the supporting fact, then "Answer: X".

    Stating the fact first turns "which letter?" into a lookup of the option text just written.
    """
    return f"{why}\nAnswer: {row['answerKey']}".strip()


def gsm8k_prompt(row: dict[str, Any]) -> str:
    """The user turn for a GSM8K-format row: task_eval.py's own prompt."""
    return gsm8k_item(row).prompt


def gsm8k_reply(row: dict[str, Any]) -> str:
    """The reference reply to `gsm8k_prompt(row)`: the worked solution, then "Answer: N"."""
    worked, answer = row["answer"].rsplit("####", 1)
    return f"{worked.strip()}\nAnswer: {answer.strip()}"


def gsm8k_final_answer(text: str) -> str | None:
    """The number after the last '####' in a solution, or None."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def make_mc(rng: random.Random, context: bool, max_distractors: int) -> Item:
    form, facts, question, options, right, why = _mc_problem(rng)
    context = context and bool(facts)
    rng.shuffle(options)
    letter = LETTERS[options.index(right)]
    task: dict[str, Any] = {}
    full_q = f"{facts} {question}".strip()
    row = {
        "question": question if context else full_q,
        "choices": {"text": options, "label": list(LETTERS)},
        "answerKey": letter,
    }
    if context:
        msgs = _with_context(
            rng, [(f"Here is a short story. {facts}", ACK_STORY)], arc_prompt(row), max_distractors, shuffle_setup=False
        )
    else:
        msgs = _inline(rng, arc_prompt(row), max_distractors)
        task = row
    return Item("mc", form, msgs, arc_reply(row, why), f"{why} That is option {letter}.", context, task, arc_reply(row))


# --------------------------------------------------------------------------- corpus rows
def nemotron_row(item: Item, reasoning_on: bool) -> dict[str, Any]:
    """A Llama-Nemotron chat row: input ends with the user turn; output is the final reply."""
    answer = item.reply_after_reasoning or item.reply
    output = f"<think>\n{item.reasoning}\n</think>\n\n{answer}" if reasoning_on else item.reply
    return {
        "input": [dict(m) for m in item.messages],
        "output": output,
        "reasoning": "on" if reasoning_on else "off",
        "system_prompt": "",
        "category": "chat",
    }


def drop_context(row: dict[str, Any]) -> dict[str, Any]:
    """The no-context control: the same row with every turn before the final user turn removed."""
    return {**row, "input": [dict(row["input"][-1])]}


def _input_key(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0  # one seed fixes the whole corpus; train and eval use separate streams of it
    n_train: int = 24_000  # training conversations for the toy models
    n_chats: int = 1_024  # held-out conversations in chats.jsonl
    n_ifeval: int = 541  # rows in ifeval.jsonl (the real IFEval size)
    n_arc: int = 1_172  # rows in arc.jsonl (the ARC-Challenge test size)
    n_gsm8k: int = 1_319  # rows in gsm8k.jsonl (the GSM8K test size)
    kind_weights: tuple[float, ...] = (0.45, 0.25, 0.15, 0.15)  # mixture over KINDS (recall, ifeval, math, mc)
    p_context: float = 0.65  # share of items whose facts or rule sit in earlier turns
    p_plain: float = 0.1  # share of ifeval items with no rule at all (what a dropped rule turns into)
    p_reasoning: float = 0.3  # share of rows with reasoning "on"
    max_distractors: int = 3  # unrelated exchanges between the facts and the final question


def make_item(rng: random.Random, kind: str, cfg: WorldConfig, context: bool | None = None) -> Item:
    if context is None:
        context = rng.random() < cfg.p_context
    if kind == "recall":
        return make_recall(rng, context, cfg.max_distractors)
    if kind == "ifeval":
        plain = rng.random() < cfg.p_plain
        return make_ifeval(rng, context and not plain, cfg.max_distractors, plain=plain)
    if kind == "math":
        return make_math(rng, context, cfg.max_distractors)
    if kind == "mc":
        return make_mc(rng, context, cfg.max_distractors)
    raise ValueError(f"unknown item kind {kind!r}; choose one of {KINDS}")


def _chat_stream(rng: random.Random, cfg: WorldConfig, n: int, skip: set[str]) -> list[tuple[dict, dict]]:
    """n (Nemotron row, meta) pairs, skipping conversations whose key is in `skip`."""
    out = []
    while len(out) < n:
        kind = rng.choices(KINDS, weights=cfg.kind_weights)[0]
        item = make_item(rng, kind, cfg)
        keys = {_input_key(item.messages), item.messages[-1]["content"]}
        if keys & skip:
            continue
        skip.add(_input_key(item.messages))
        row = nemotron_row(item, rng.random() < cfg.p_reasoning)
        out.append((row, {"kind": item.kind, "subkind": item.subkind, "context_dependent": item.context_dependent}))
    return out


def _task_stream(rng: random.Random, cfg: WorldConfig, kind: str, n: int, seen: set[str]) -> list[Item]:
    """n distinct inline items of one kind (their final prompts unique)."""
    out = []
    while len(out) < n:
        item = make_item(rng, kind, cfg, context=False)
        if not item.task or item.messages[-1]["content"] in seen:
            continue
        seen.add(item.messages[-1]["content"])
        out.append(item)
    return out


@dataclass
class World:
    train: list[dict]  # Nemotron rows for model training
    chats: list[dict]  # held-out Nemotron rows
    chats_meta: list[dict]  # kind/subkind/context_dependent per held-out row
    ifeval: list[dict]  # IFEval rows
    ifeval_ref: list[dict]  # {"key", "reply"} per IFEval row
    arc: list[dict]  # ARC rows
    arc_ref: list[dict]  # {"id", "reply"} per ARC row
    gsm8k: list[dict]  # GSM8K rows


def _eval_items(cfg: WorldConfig) -> tuple[list[Item], list[Item], list[Item], set[str]]:
    """The IFEval, ARC and GSM8K items, each from its own seed stream, and their final prompts."""
    eval_prompts: set[str] = set()
    ifeval_items = _task_stream(
        random.Random(f"toyworld/{cfg.seed}/eval/ifeval"), cfg, "ifeval", cfg.n_ifeval, eval_prompts
    )
    arc_items = _task_stream(random.Random(f"toyworld/{cfg.seed}/eval/arc"), cfg, "mc", cfg.n_arc, eval_prompts)
    gsm_items = _task_stream(random.Random(f"toyworld/{cfg.seed}/eval/gsm8k"), cfg, "math", cfg.n_gsm8k, eval_prompts)
    return ifeval_items, arc_items, gsm_items, eval_prompts


def generate_world(cfg: WorldConfig) -> World:
    """Everything in memory. Evaluation items come first, from their own seed streams."""
    if not 0 <= cfg.p_context <= 1 or not 0 <= cfg.p_reasoning <= 1:
        raise ValueError("p_context and p_reasoning must lie in [0, 1]")
    ifeval_items, arc_items, gsm_items, eval_prompts = _eval_items(cfg)
    seen = set(eval_prompts)
    chats = _chat_stream(random.Random(f"toyworld/{cfg.seed}/eval/chats"), cfg, cfg.n_chats, seen)
    train = _chat_stream(random.Random(f"toyworld/{cfg.seed}/train"), cfg, cfg.n_train, seen)

    ifeval = [{"key": 1000 + i, **it.task} for i, it in enumerate(ifeval_items)]
    ifeval_ref = [{"key": row["key"], "reply": it.reply} for row, it in zip(ifeval, ifeval_items)]
    arc = [{"id": f"Toy_{i:05d}", **it.task} for i, it in enumerate(arc_items)]
    arc_ref = [{"id": row["id"], "reply": it.reply} for row, it in zip(arc, arc_items)]
    gsm8k = [dict(it.task) for it in gsm_items]
    return World(
        train=[r for r, _ in train],
        chats=[r for r, _ in chats],
        chats_meta=[m for _, m in chats],
        ifeval=ifeval,
        ifeval_ref=ifeval_ref,
        arc=arc,
        arc_ref=arc_ref,
        gsm8k=gsm8k,
    )


def more_chats(cfg: WorldConfig, n: int) -> tuple[list[dict], list[dict]]:
    """n held-out conversations for translator training and evaluation at scale: chats.jsonl's, then more from
    their own stream ("toyworld/SEED/eval/chats-more"), each disjoint from every evaluation prompt, every
    held-out conversation and every conversation the toy models were trained on. Returns (rows, meta) with
    the first n of that order, so a smaller n is a prefix of a larger one; the packaged corpus is unchanged."""
    world = generate_world(cfg)
    rows, meta = list(world.chats[:n]), list(world.chats_meta[:n])
    if n <= len(rows):
        return rows, meta
    seen = _eval_items(cfg)[3] | {_input_key(r["input"]) for r in world.chats + world.train}
    for row, m in _chat_stream(random.Random(f"toyworld/{cfg.seed}/eval/chats-more"), cfg, n - len(rows), seen):
        rows.append(row)
        meta.append(m)
    return rows, meta


def write_more_chats(out_dir: str | Path, cfg: WorldConfig, n: int) -> Path:
    """`more_chats` as corpus files chats.N.jsonl and chats.N.meta.jsonl (atomically); returns the first."""
    rows, meta = more_chats(cfg, n)
    out_dir = Path(out_dir)
    atomic_write_jsonl(out_dir / f"chats.{n}.meta.jsonl", meta)
    return atomic_write_jsonl(out_dir / f"chats.{n}.jsonl", rows)


WORLD_FILES = ("train_chats", "chats", "chats.meta", "ifeval", "ifeval.ref", "arc", "arc.ref", "gsm8k")


def write_world(out_dir: str | Path, cfg: WorldConfig) -> dict[str, Path]:
    """Write every corpus and evaluation file (atomically); return {name: path}."""
    world = generate_world(cfg)
    out_dir = Path(out_dir)
    rows = {
        "train_chats": world.train,
        "chats": world.chats,
        "chats.meta": world.chats_meta,
        "ifeval": world.ifeval,
        "ifeval.ref": world.ifeval_ref,
        "arc": world.arc,
        "arc.ref": world.arc_ref,
        "gsm8k": world.gsm8k,
    }
    return {name: atomic_write_jsonl(out_dir / f"{name}.jsonl", rows[name]) for name in WORLD_FILES}
