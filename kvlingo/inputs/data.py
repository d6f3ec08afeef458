"""Chat data for the handoff: Nemotron-format rows -> tokenized natural and packed splits.

Source. Rows come from the chat subset of Nemotron post-training data, streamed from the
Hub at a recorded revision, or from a local JSONL in the same format (`--source PATH`).
A row is `{"input": [{"role", "content"}...], "output": str, "reasoning": "on"|"off",
"system_prompt": str}`. A row with missing roles, empty replies or wrong types is
skipped and counted by reason in the manifest; it never stops the run. Skipped too: a row
whose text holds a ChatML turn marker (`<|im_start|>`, `<|im_end|>`: the reply would be cut
at it), and a reply with think tags anywhere but one leading block. A UTF-8 byte-order mark
at the start of a local file is dropped.

Splits. Identical conversations are kept once (content hash). Each unique conversation
goes to train, validation or test by a hash of (seed, prompt id), where the prompt id hashes
the system prompt and messages but not the reply or the reasoning flag, so one prompt asked
with reasoning on and off lands in one split. Split weights are proportional to what each
split needs (its natural count plus its packed count), so the splits are disjoint by
construction. Inside a split, each variant samples with its own
RNG seeded by (seed, split, variant) over the pool sorted by id, so the output does not
depend on the order of the source rows.

Rendering. Everything goes through the tokenizer's chat template with enable_thinking
set from the row's flag. "on": the prefix ends with the plain generation prompt and the
reply opens with the `<think>` block; "off": the template's empty think block ends the
prefix and the reply is the answer alone. A non-empty system_prompt becomes a system
message. Earlier assistant turns carry their answer only, as Qwen3's template drops the
reasoning of past turns.

  natural  one conversation: prefix = everything before the final assistant turn,
           rendered through the generation prompt; reply = that turn.
  packed   several conversations of one split joined as one multi-turn history: random
           other conversations are put in front of a final one until the prefix passes
           the cap, then the prefix is cropped back under it (rule below). A first
           candidate that the crop would remove whole is skipped for another (at most
           MAX_PACK_MISSES times). A pack always holds at least two conversations: a final
           conversation that leaves no room for history is not packed (count:
           pack_without_history). The final conversation's system prompt and reasoning
           flag govern the example.

Caps (tokens).
  prefix   an over-long prefix is cropped from the left at a turn boundary: whole oldest
           turns (a user message plus the assistant messages answering it) are dropped;
           the system message is kept. If the system message plus the final user turn
           alone exceed the cap, the example is dropped and the sampler takes the next
           conversation. Manifest counts: prefix_cropped, dropped_prefix_too_long.
  reply    the reply ids are cut to the cap; reply_text is then the decoded kept ids.
           Manifest count: reply_cropped.

Token ids. prefix_ids = tok(prefix_text, add_special_tokens=False), exactly. The reply
text is the full conversation's rendering after the prefix text, up to and including the
first `<|im_end|>`; reply_ids are the ids of tok(prefix_text + reply_text) after the
prefix ids, when the prefix ids are a prefix of those (the usual case: the boundary is a
newline or a special token). When a BPE merge crosses the boundary, reply_ids =
tok(reply_text) on its own (count: boundary_merges). When the template renders a finished
turn differently from its own generation prompt (the offline toy template leaves out the
empty think block of a no-thinking turn), the reply text is the turn itself, the answer
plus `<|im_end|>` (count: reply_from_turn_text).

Output. `<out>/<profile>/{train,validation,test}.{natural,packed}.jsonl` and, written last,
`manifest.json` (stage "prepare"), which holds the sha256 of every file. A (re)build writes
into a staging folder beside it and swaps the complete set in, so a killed rebuild leaves the
previous set whole (the next run clears the staging folder). A source that yields no usable
conversation, or no example for a split, is an error, and an existing set is kept. The run is
keyed on the source hash, tokenizer digest and chat template, data config, seed and the hash
of this module; an unchanged key with intact files is a no-op, and a rebuild names what
changed. Every stage that reads prepared data calls `open_prepared`, which requires the
manifest, checks every file against it and the tokenizer against the pair's.

Counted, not fatal: a reasoning-on reply whose think block the chat template drops
(`think_dropped_by_template`: the template ignores `reasoning_content`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import Refusal
from ..io import (
    DamagedFile,
    atomic_write_jsonl,
    not_ours,
    read_json,
    read_jsonl,
    remove_stale_temps,
    sha256_bytes,
    sha256_file,
    sha256_json,
    sha256_tree,
    to_jsonable,
)
from ..records.report import Metric, Report, seal_problem
from ..records.resume import diff, resume_key
from . import models
from .models import tokenizer_digest
from .profiles import PROFILES, Profile

SPLITS = ("train", "validation", "test")
VARIANTS = ("natural", "packed")
MANIFEST = "manifest.json"
TURN_END = "<|im_end|>"  # ChatML end of turn: the last token of every reply
ROLES = ("system", "user", "assistant")
MAX_PACK_MISSES = 8  # first-history candidates a packed example may skip before its final conversation is given up


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # dataset repository on the Hugging Face Hub
    config: str  # dataset config (subset)
    split: str  # split streamed from that config
    revision: str  # git revision; only a commit sha pins the data


# Nemotron post-training chat rows: multi-turn chats with a per-row reasoning on/off flag.
# The revision is "main" because this dataset's commit sha could not be checked offline
# when this was written: pin it to a commit sha before a paper run. Each run resolves the
# revision to a commit sha, streams that commit, and records it in the manifest.
NEMOTRON = HubSource(repo_id="nvidia/Llama-Nemotron-Post-Training-Dataset", config="SFT", split="chat", revision="main")


@dataclass(frozen=True)
class DataConfig:
    profile: str  # profile name; also the folder under the output root
    n_train: int  # natural training examples
    n_validation: int  # natural validation examples
    n_test: int  # natural test examples
    n_packed: int  # packed (long-context) examples per split
    prefix_cap: int  # max prefix tokens; longer prefixes are cropped at a turn boundary
    reply_cap: int  # max reply tokens; longer replies are cut
    seed: int  # split assignment and per-split sampling

    @classmethod
    def from_profile(cls, profile: Profile, seed: int = 0) -> DataConfig:
        return cls(
            profile=profile.name,
            n_train=profile.n_train,
            n_validation=profile.n_validation,
            n_test=profile.n_test,
            n_packed=profile.n_packed,
            prefix_cap=profile.prefix_cap,
            reply_cap=profile.reply_cap,
            seed=seed,
        )

    def requested(self, split: str, variant: str) -> int:
        return self.n_packed if variant == "packed" else getattr(self, f"n_{split}")

    def split_weights(self) -> dict[str, int]:
        return {s: self.requested(s, "natural") + self.requested(s, "packed") for s in SPLITS}


@dataclass(frozen=True)
class Conversation:
    id: str  # sha256 of the canonical row content
    system: str  # system message ('' when none)
    messages: tuple[tuple[str, str], ...]  # (role, content) history, ending with the final user turn
    reasoning: bool  # the row's reasoning flag
    thought: str  # the final reply's think-block text ('' when reasoning is off)
    answer: str  # the final reply's visible answer

    @property
    def prompt_id(self) -> str:
        """The split key: the conversation without its reply and reasoning flag, so one prompt asked with
        reasoning on and off lands in one split."""
        return sha256_json({"system": self.system, "messages": self.messages})


class PrepareResult(NamedTuple):
    manifest: dict[str, Any]  # the manifest now on disk
    built: bool  # False when the existing data was already up to date
    reason: str  # why it was (re)built, or "up to date"


@dataclass
class PrepareResults:
    rows: dict  # source rows read, unique, duplicates, skipped by reason, and the split pools
    examples: dict  # per split.variant: kept/requested, reasoning on/off, crop counts, token-length statistics
    identity: dict  # what the set was made from (settings, source, tokenizer, code): a rebuild names what changed

    METRICS = (Metric("examples.train.natural.kept", True, "training conversations written (natural variant)"),)


class SplitIntegrityError(Refusal, ValueError):
    """A prepared file is missing or differs from the hash its manifest recorded."""


# --------------------------------------------------------------------------- rows
class _InvalidJson:
    """Stands for a source line that is not JSON (or not UTF-8), so it is counted, not fatal."""


_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.S)
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")  # ChatML's turn delimiters: never part of a message's text


def parse_row(row: Any) -> Conversation | str:
    """A validated conversation, or the reason (a short snake_case string) to skip the row."""
    if isinstance(row, _InvalidJson):
        return "invalid_json"
    if not isinstance(row, dict):
        return "not_an_object"
    raw = row.get("input")
    if not isinstance(raw, list) or not raw:
        return "bad_input"
    system = row.get("system_prompt") or ""
    if not isinstance(system, str):
        return "bad_system_prompt"
    messages: list[tuple[str, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            return "bad_message"
        role, content = m.get("role"), m.get("content")
        if role is None:
            return "missing_role"
        if role not in ROLES:
            return "bad_role"
        if not isinstance(content, str):
            return "bad_content_type"
        if role == "system":
            if i != 0:
                return "misplaced_system_message"
            if system.strip():
                return "two_system_prompts"
            system = content
            continue
        if not content.strip():
            return "empty_message"
        if any(m in content for m in CHAT_MARKERS):
            return "chat_marker_in_text"
        messages.append((role, content))
    if not messages or messages[-1][0] != "user":
        return "input_not_ending_with_user"
    flag = row.get("reasoning")
    if flag not in ("on", "off"):
        return "bad_reasoning_flag"
    output = row.get("output")
    if output is None:
        return "missing_reply"
    if not isinstance(output, str):
        return "bad_reply_type"
    if any(m in output or m in system for m in CHAT_MARKERS):
        return "chat_marker_in_text"  # the reply would end at the first <|im_end|>, silently cut
    match = _THINK.fullmatch(output)
    if match:
        thought, answer = match.group(1).strip(), match.group(2).strip()
        if "<think>" in answer or "</think>" in answer or "<think>" in thought:
            return "malformed_think_block"  # one think block, then the answer: no tags inside either
    elif "<think>" in output or "</think>" in output:
        return "malformed_think_block"
    else:
        thought, answer = None, output.strip()
    if not answer:
        return "empty_reply"
    if flag == "on" and thought is None:
        return "missing_think_block"
    if flag == "off" and thought:
        return "think_block_with_reasoning_off"
    system = system if system.strip() else ""
    content = {"system": system, "messages": messages, "reasoning": flag, "thought": thought or "", "answer": answer}
    return Conversation(
        id=sha256_json(content),
        system=system,
        messages=tuple(messages),
        reasoning=flag == "on",
        thought=thought or "",
        answer=answer,
    )


def local_rows(path: str | os.PathLike) -> Iterator[Any]:
    """Rows of a local JSONL; undecodable lines come out as markers, blank lines are skipped, and a UTF-8
    byte-order mark at the start of the file is not part of the first row."""
    with open(path, "rb") as f:
        for n, line in enumerate(f):
            if n == 0:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                yield json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                yield _InvalidJson()


def resolve_hub_revision(hub: HubSource = NEMOTRON, timeout_s: float = 10.0) -> str:
    """The commit sha `hub.revision` points at; fails fast offline, naming the --source fix."""
    fix = "Without Hub access, prepare from a local JSONL in the same format with --source PATH."
    if models.hub_offline():
        raise ValueError(f"cannot stream {hub.repo_id}: Hugging Face Hub access is off (HF_HUB_OFFLINE=1). {fix}")
    from huggingface_hub import HfApi

    try:
        info = HfApi().dataset_info(hub.repo_id, revision=hub.revision, timeout=timeout_s)
    except Exception as e:  # network, auth or a bad revision: all end the same way
        raise ValueError(
            f"cannot reach {hub.repo_id}@{hub.revision} on the Hub ({type(e).__name__}: {e}). {fix}"
        ) from e
    return info.sha


def hub_rows(hub: HubSource, commit: str) -> Iterator[Any]:
    """Stream the rows of one pinned commit; nothing is downloaded beyond what is read."""
    from datasets import load_dataset

    try:
        ds = load_dataset(hub.repo_id, hub.config, split=hub.split, streaming=True, revision=commit)
        yield from ds
    except Exception as e:
        raise ValueError(
            f"streaming {hub.repo_id} ({hub.config}/{hub.split}@{commit}) failed ({type(e).__name__}: {e}). "
            "Without Hub access, prepare from a local JSONL with --source PATH."
        ) from e


# --------------------------------------------------------------------------- splits
def assign_split(split_key: str, seed: int, weights: dict[str, int]) -> str:
    """Deterministic split of one conversation (by its prompt: `Conversation.prompt_id`): a seeded hash
    mapped onto the split weights."""
    u = int(hashlib.sha256(f"{seed}/{split_key}".encode()).hexdigest()[:15], 16) / 16**15
    total, acc = sum(weights.values()), 0.0
    for split in SPLITS:
        acc += weights[split] / total
        if u < acc:
            return split
    return max((s for s in SPLITS if weights[s]), key=SPLITS.index)


def collect_pools(
    rows: Iterable[Any],
    cfg: DataConfig,
    *,
    stop_when_full: bool = False,
    max_rows: int | None = None,
    progress: bool = False,
) -> tuple[dict[str, list[Conversation]], dict[str, Any]]:
    """Validate, deduplicate and assign rows to split pools (each sorted by id).

    `stop_when_full` ends the read once every split holds a margin over what it needs:
    that is how the Hub stream avoids reading more than the profile uses.
    """
    from tqdm.auto import tqdm

    weights = cfg.split_weights()
    if not sum(weights.values()):
        raise ValueError("the profile asks for no examples (all split sizes are 0)")
    targets = {s: w + w // 4 + 8 for s, w in weights.items() if w}
    pools: dict[str, list[Conversation]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    skipped: Counter[str] = Counter()
    n_read = duplicates = 0
    for row in tqdm(rows, desc="read rows", unit="row", disable=not progress):
        if max_rows is not None and n_read >= max_rows:
            break
        n_read += 1
        conv = parse_row(row)
        if isinstance(conv, str):
            skipped[conv] += 1
            continue
        if conv.id in seen:
            duplicates += 1
            continue
        seen.add(conv.id)
        pools[assign_split(conv.prompt_id, cfg.seed, weights)].append(conv)
        if stop_when_full and all(len(pools[s]) >= t for s, t in targets.items()):
            break
    for pool in pools.values():
        pool.sort(key=lambda c: c.id)
    counts = {
        "read": n_read,
        "unique": len(seen),
        "duplicates": duplicates,
        "skipped": dict(sorted(skipped.items())),
        "pool": {
            s: {
                "conversations": len(p),
                "reasoning_on": sum(c.reasoning for c in p),
                "reasoning_off": sum(not c.reasoning for c in p),
            }
            for s, p in pools.items()
        },
    }
    return pools, counts


# --------------------------------------------------------------------------- rendering
def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _turns(conversations: list[Conversation]) -> list[tuple[str, list[tuple[str, str]]]]:
    """History as (conversation id, messages) turns, oldest first; a turn opens at a user message.

    Earlier conversations contribute their final answer as an assistant message.
    """
    turns: list[tuple[str, list[tuple[str, str]]]] = []
    last = len(conversations) - 1
    for k, conv in enumerate(conversations):
        messages = list(conv.messages) + ([] if k == last else [("assistant", conv.answer)])
        start = len(turns)
        for role, content in messages:
            if role == "user" or len(turns) == start:
                turns.append((conv.id, []))
            turns[-1][1].append((role, content))
    return turns


def _render(tok, system: str, messages: list[tuple[str, str]], thinking: bool, final: dict | None = None) -> str:
    chat = [{"role": "system", "content": system}] if system else []
    chat += [{"role": r, "content": c} for r, c in messages]
    if final is not None:
        chat.append(final)
    return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=final is None, enable_thinking=thinking)


def _flat(turns) -> list[tuple[str, str]]:
    return [m for _, messages in turns for m in messages]


def make_example(tok, conversations: list[Conversation], cfg: DataConfig, counts: Counter) -> dict | None:
    """One example whose reply is the last conversation's; earlier ones become history.

    Returns None (and counts it) when even the final user turn does not fit the prefix cap.
    """
    final = conversations[-1]
    turns = _turns(conversations)
    for start in range(len(turns)):
        prefix_text = _render(tok, final.system, _flat(turns[start:]), final.reasoning)
        prefix_ids = _encode(tok, prefix_text)
        if len(prefix_ids) <= cfg.prefix_cap:
            break
    else:
        counts["dropped_prefix_too_long"] += 1
        return None
    kept = turns[start:]
    counts["prefix_cropped"] += start > 0

    last_turn = {"role": "assistant", "content": final.answer}
    if final.reasoning:
        last_turn["reasoning_content"] = final.thought
    full_text = _render(tok, final.system, _flat(kept), final.reasoning, final=last_turn)
    if full_text.startswith(prefix_text):
        rest = full_text[len(prefix_text) :]
        cut = rest.find(TURN_END)
        if cut < 0:
            raise ValueError(f"the chat template does not close assistant turns with {TURN_END}: not a ChatML template")
        reply_text = rest[: cut + len(TURN_END)]
    else:
        think = f"<think>\n{final.thought}\n</think>\n\n" if final.reasoning else ""
        reply_text = think + final.answer + TURN_END
        counts["reply_from_turn_text"] += 1
    if final.reasoning and final.thought and final.thought not in reply_text:
        counts["think_dropped_by_template"] += 1  # the template ignores reasoning_content: the reply lost its reasoning

    joint = _encode(tok, prefix_text + reply_text)
    if joint[: len(prefix_ids)] == prefix_ids:
        reply_ids = joint[len(prefix_ids) :]
    else:
        reply_ids = _encode(tok, reply_text)
        counts["boundary_merges"] += 1
    if len(reply_ids) > cfg.reply_cap:
        reply_ids = reply_ids[: cfg.reply_cap]
        reply_text = tok.decode(reply_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        counts["reply_cropped"] += 1

    source_ids = list(dict.fromkeys(cid for cid, _ in kept))
    return {
        "id": sha256_bytes(f"{prefix_text}\0{reply_text}".encode()),
        "prefix_ids": prefix_ids,
        "reply_ids": reply_ids,
        "prefix_text": prefix_text,
        "reply_text": reply_text,
        "reasoning": final.reasoning,
        "source_ids": source_ids,
    }


def _shuffled(pool: list[Conversation], rng: random.Random) -> list[Conversation]:
    order = list(pool)
    rng.shuffle(order)
    return order


def build_variant(
    tok, pool: list[Conversation], cfg: DataConfig, split: str, variant: str, progress: bool = False
) -> tuple[list[dict], Counter]:
    """Sample `cfg.requested(split, variant)` examples from one split's pool."""
    from tqdm.auto import tqdm

    n = cfg.requested(split, variant)
    rng = random.Random(f"kvlingo-data/{cfg.seed}/{split}/{variant}")
    counts: Counter = Counter()
    rows: list[dict] = []
    bar = tqdm(total=n, desc=f"{split}.{variant}", unit="ex", disable=not progress)
    for final in _shuffled(pool, rng):
        if len(rows) >= n:
            break
        group = [final]
        if variant == "packed":
            # Put conversations in front until the uncropped prefix passes the cap; the
            # turn-boundary crop in make_example then brings it back under the cap.
            misses = 0
            for other in _shuffled(pool, rng):
                if other.id == final.id:
                    continue
                group.insert(0, other)
                text = _render(tok, final.system, _flat(_turns(group)), final.reasoning)
                if len(_encode(tok, text)) <= cfg.prefix_cap:
                    continue
                # A first history conversation that the crop would remove whole leaves a
                # one-conversation "pack": skip it and try another (a bounded number of times).
                trial = make_example(tok, group, cfg, Counter())
                if len(group) > 2 or trial is None or len(trial["source_ids"]) > 1 or misses >= MAX_PACK_MISSES:
                    break
                group.pop(0)
                misses += 1
        scratch: Counter = Counter()
        example = make_example(tok, group, cfg, scratch)
        if example is not None and variant == "packed" and len(example["source_ids"]) < 2:
            counts["pack_without_history"] += 1  # the final conversation alone fills the cap
            continue
        counts.update(scratch)
        if example is not None:
            rows.append(example)
            bar.update(1)
    bar.close()
    return rows, counts


def _length_stats(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "min": min(values),
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "max": max(values),
    }


def _variant_summary(rows: list[dict], counts: Counter, requested: int) -> dict[str, Any]:
    n_conv = [len(r["source_ids"]) for r in rows]
    return {
        "requested": requested,
        "kept": len(rows),
        "short": max(0, requested - len(rows)),
        "reasoning_on": sum(r["reasoning"] for r in rows),
        "reasoning_off": sum(not r["reasoning"] for r in rows),
        **{
            k: counts.get(k, 0)
            for k in (
                "prefix_cropped",
                "dropped_prefix_too_long",
                "reply_cropped",
                "boundary_merges",
                "reply_from_turn_text",
                "pack_without_history",
                "think_dropped_by_template",
            )
        },
        "prefix_tokens": _length_stats([len(r["prefix_ids"]) for r in rows]),
        "reply_tokens": _length_stats([len(r["reply_ids"]) for r in rows]),
        "conversations_per_example": _length_stats(n_conv),
    }


# --------------------------------------------------------------------------- tokenizer
def check_tokenizer(manifest: dict[str, Any], digest: str, chat_template_sha256: str, name: str = "the pair") -> None:
    """Raise SplitIntegrityError unless the data was made with this tokenizer (vocab, merges, specials)
    and chat template; the message names both digests."""
    want = manifest["inputs"]["tokenizer"]
    if want["digest"] != digest:
        raise SplitIntegrityError(
            f"the data was tokenized with {want['name']!r} (tokenizer digest {want['digest'][:16]}…), but {name}'s "
            f"tokenizer has digest {digest[:16]}…: its ids would decode to other text. Prepare the data again with "
            "the pair's tokenizer (prepare.py --tokenizer ..., or make prepare)"
        )
    if want["chat_template_sha256"] != chat_template_sha256:
        raise SplitIntegrityError(
            f"the data was rendered with another chat template (sha256 {want['chat_template_sha256'][:16]}… vs "
            f"{name}'s {chat_template_sha256[:16]}…); prepare the data again with the pair's tokenizer"
        )


def open_prepared(data_dir: str | os.PathLike, pair=None, profile: str | None = None) -> dict[str, Any]:
    """The manifest of a complete prepared data folder, after checking every file's sha256 and, given a
    `PairConfig`, its tokenizer digest and chat template. SplitIntegrityError otherwise.

    A folder without a manifest is incomplete (a killed or running rebuild) and is refused; the refusal says how to
    prepare it for `profile` (the stage's --profile: `prepare_hint`).
    """
    manifest = verify_split(data_dir, profile)
    if pair is not None:
        check_tokenizer(manifest, pair.tokenizer_sha256, pair.chat_template_sha256)
    return manifest


def load_tokenizer(name_or_path: str):
    """The tokenizer of a local folder or a (cached, pinned) Hub id; it must carry a chat template."""
    tok = models.load_tokenizer(models.ModelSpec.parse(name_or_path))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer {name_or_path!r} has no chat template; use the target model's tokenizer")
    return tok


# --------------------------------------------------------------------------- files and manifest
def prepare_hint(data_dir: str | os.PathLike, profile: str | None = None) -> str:
    """The commands that prepare `data_dir` for `profile` (the stage's --profile; None: the folder's name, where
    that is a profile), as typed: prepare.py writes OUT/PROFILE/, so a folder of another name is prepared under
    it and passed with --data."""
    folder = Path(data_dir)
    if profile is None and folder.name in PROFILES:
        profile = folder.name
    local = "add --source PATH --tokenizer PATH for a local corpus and tokenizer"
    if profile is None or folder.name != profile:
        name = profile or "PROFILE"
        return (
            f"`.venv/bin/python prepare.py --profile {name} --out {folder}` ({local}) writes {folder / name}/; "
            f"then pass --data {folder / name}" + ("" if profile else " (PROFILE: the run's profile)")
        )
    script = f".venv/bin/python prepare.py --profile {profile}"
    if folder.parent.resolve() != Path("data").resolve():  # prepare.py's --out default, and the Makefile's
        return f"`{script} --out {folder.parent}` ({local}); or pass --data where it is prepared"
    return (
        f"`make prepare PROFILE={profile}` (SOURCE=PATH SMALL=PATH for a local corpus and pair), or `{script}` "
        f"({local}); or pass --data where it is prepared"
    )


def split_path(data_dir: str | os.PathLike, split: str, variant: str) -> Path:
    if split not in SPLITS or variant not in VARIANTS:
        raise ValueError(f"unknown split/variant {split}.{variant}; splits {SPLITS}, variants {VARIANTS}")
    return Path(data_dir) / f"{split}.{variant}.jsonl"


def verify_split(data_dir: str | os.PathLike, profile: str | None = None) -> dict[str, Any]:
    """Check every file the manifest lists against its sha256; return the manifest.

    Raises SplitIntegrityError naming the first missing or changed file (a missing manifest: with how to prepare
    the folder for `profile`, `prepare_hint`).
    """
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise SplitIntegrityError(f"{path} not found: prepare the data first: {prepare_hint(data_dir, profile)}")
    manifest = read_json(path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("stage") != "prepare" or not isinstance(files, dict):
        raise SplitIntegrityError(f"{path} is not a data-preparation manifest; rerun prepare.py --force")
    problem = seal_problem(manifest)
    if problem:
        raise SplitIntegrityError(f"{path}: {problem}; rerun prepare.py --force (its row counts are not trusted)")
    for name, digest in files.items():
        f = data_dir / name
        if not f.is_file():
            raise SplitIntegrityError(f"{f} is listed in {path} but missing; rerun prepare.py --force")
        actual = sha256_file(f)
        if actual != digest:
            raise SplitIntegrityError(
                f"{f} was changed after preparation: sha256 {actual[:12]}… != {digest[:12]}… in {path}. "
                "Rerun prepare.py --force to rebuild it."
            )
    return manifest


def read_split(
    data_dir: str | os.PathLike,
    split: str,
    variant: str = "natural",
    vocab_size: int | None = None,
    limit: int | None = None,
    profile: str | None = None,
) -> list[dict]:
    """Rows of one prepared file (the first `limit`), each checked for what a handoff reads: a prefix of
    at least 2 ids, a non-empty reply, ids inside the vocabulary. A missing file is refused with how to prepare
    the folder for `profile` (`prepare_hint`)."""
    path = split_path(data_dir, split, variant)
    if not path.is_file():
        raise SplitIntegrityError(f"{path} not found: prepare the data first: {prepare_hint(data_dir, profile)}")
    rows = read_jsonl(path)[:limit]
    if not rows:
        raise SplitIntegrityError(
            f"{path} holds no rows; prepare the data again (python prepare.py --profile ... --force)"
        )
    for n, r in enumerate(rows, 1):
        p, q = r.get("prefix_ids"), r.get("reply_ids")
        if not isinstance(p, list) or len(p) < 2 or not isinstance(q, list) or not q:
            raise SplitIntegrityError(
                f"{path} line {n}: needs prefix_ids (≥2 ids) and reply_ids (≥1 id); re-run prepare.py"
            )
        if vocab_size is not None and max(p + q) >= vocab_size:
            raise SplitIntegrityError(
                f"{path} line {n}: token id {max(p + q)} ≥ vocabulary {vocab_size}: the data was tokenized "
                "for another tokenizer; prepare it with the pair's tokenizer"
            )
    return rows


def data_code_hash() -> str:
    """Hash of the code that shapes the files: this module and the writers in kvlingo/io.py.

    Narrower than a stage's code hash on purpose: an edit elsewhere in kvlingo must not rebuild data.
    """
    here = Path(__file__).resolve()
    return sha256_tree([here, here.parent.parent / "io.py"])


def _up_to_date(data_dir: Path, identity: dict) -> tuple[bool, str]:
    """(up to date, why not): the folder's manifest must vouch for intact files made from this identity."""
    if not (data_dir / MANIFEST).is_file():
        return False, "first build" if not data_dir.exists() else "its manifest is missing"
    try:
        manifest = verify_split(data_dir)
    except (SplitIntegrityError, DamagedFile) as e:
        return False, f"files changed ({e})"
    if manifest.get("resume_key") == resume_key(identity):
        return True, "up to date"
    old = manifest.get("results", {}).get("identity")
    changed = diff(old, identity)
    return False, "inputs changed: " + (
        "; ".join(changed) if changed and old else "the manifest was made by older code"
    )


def _clear_leftovers(out_root: Path, name: str) -> list[Path]:
    """Remove what a killed build left: its staging and retired folders, and stray temp files.

    A build killed between `_swap_in`'s two renames leaves no `name` folder, the old set retired and
    the new one complete in staging. The complete set (the newest intact one: new before old) is
    renamed into place first, so nothing already prepared is thrown away; `_up_to_date` then judges
    it like any other."""
    gone = []
    data_dir = out_root / name
    if not data_dir.exists():
        sets = [
            p
            for kind in (".building-", ".retired-")
            for p in sorted(out_root.glob(f".{name}.*"), key=lambda q: q.stat().st_mtime, reverse=True)
            if kind in p.name
        ]
        for p in sets:
            try:
                verify_split(p)
            except (SplitIntegrityError, DamagedFile):
                continue
            os.replace(p, data_dir)
            break
    for p in out_root.glob(f".{name}.*"):
        if p.is_dir() and (".building-" in p.name or ".retired-" in p.name):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone + remove_stale_temps(out_root / name) + remove_stale_temps(out_root)


def _check_ours(data_dir: Path) -> None:
    """Refuse (ValueError) to replace a folder this module did not build: a rebuild swaps the whole folder
    out, so anything else in it (other files, another tool's manifest.json) would be deleted."""
    if not data_dir.is_dir():
        if data_dir.exists():
            raise ValueError(f"{data_dir} is a file, not a data folder; move it away or give another --out")
        return
    ours = {MANIFEST} | {split_path(data_dir, s, v).name for s in SPLITS for v in VARIANTS}
    shown = not_ours(data_dir, ours, MANIFEST, "stage", "prepare")  # our manifest cut short: rebuilt
    if shown:
        raise ValueError(
            f"{data_dir} holds files this suite did not prepare ({shown}); building there would delete "
            "them. Move them away or give another --out"
        )


def _swap_in(staging: Path, data_dir: Path) -> None:
    """Replace data_dir by the complete staging folder. The old set stays whole until the new one is
    in place: it is renamed aside (one rename), the new one renamed in (one rename), then deleted."""
    retired = data_dir.with_name(f".{data_dir.name}.retired-{os.getpid()}")
    if data_dir.exists():
        os.replace(data_dir, retired)
    os.replace(staging, data_dir)
    shutil.rmtree(retired, ignore_errors=True)


def prepare(
    tok,
    profile: Profile,
    *,
    source: str | os.PathLike | None = None,
    out_root: str | os.PathLike = "data",
    seed: int = 0,
    tokenizer_name: str | None = None,
    force: bool = False,
    hub: HubSource = NEMOTRON,
    max_rows: int | None = None,
    progress: bool = False,
) -> PrepareResult:
    """Build (or confirm) `<out_root>/<profile>/`: six split files, then the manifest.

    `source` is a local JSONL; None streams `hub`. `max_rows` bounds the rows read.
    """
    t0 = time.time()
    cfg = DataConfig.from_profile(profile, seed)
    data_dir = Path(out_root) / profile.name
    if source is not None:
        path = Path(source)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "not found"
            raise ValueError(f"source file {path} {what}; pass --source PATH to a Nemotron-format JSONL")
        src = {"kind": "local", "path": str(path), "sha256": sha256_file(path), "max_rows": max_rows}
        src_key = {k: v for k, v in src.items() if k != "path"}  # same bytes elsewhere: same data
    else:
        commit = resolve_hub_revision(hub)
        src = {
            "kind": "hub",
            **asdict(hub),
            "revision_requested": hub.revision,
            "revision": commit,
            "max_rows": max_rows,
        }
        src_key = src
    tok_info = {
        "name": tokenizer_name,
        "digest": tokenizer_digest(tok),
        "chat_template_sha256": sha256_json(tok.chat_template),
    }
    code = data_code_hash()
    identity = {
        "settings": cfg,
        "inputs": {"source": src_key},
        "code": code,
        "tokenizer": {k: tok_info[k] for k in ("digest", "chat_template_sha256")},
    }
    identity = to_jsonable(identity)
    _clear_leftovers(Path(out_root), profile.name)
    _check_ours(data_dir)
    fresh, reason = _up_to_date(data_dir, identity)
    if fresh and not force:
        return PrepareResult(read_json(data_dir / MANIFEST), False, reason)
    reason = "--force" if fresh else reason

    # The new set is built in a staging folder and swapped in whole: a killed rebuild leaves the
    # old set (and its manifest) exactly as it was, and the next run clears the staging folder.
    rows = local_rows(path) if source is not None else hub_rows(hub, commit)
    pools, row_counts = collect_pools(rows, cfg, stop_when_full=source is None, max_rows=max_rows, progress=progress)
    if not row_counts["unique"]:
        kept = f"; the existing set in {data_dir} is kept" if data_dir.exists() else ""
        raise ValueError(
            f"the source yields no usable conversations ({row_counts['read']} rows read, skipped by "
            f"reason: {row_counts['skipped'] or 'none'}){kept}. Check --source (Nemotron chat format)"
        )
    staging = data_dir.with_name(f".{data_dir.name}.building-{os.getpid()}")
    try:
        examples: dict[str, Any] = {}
        files: dict[str, str] = {}
        for split in SPLITS:
            for variant in VARIANTS:
                built, counts = build_variant(tok, pools[split], cfg, split, variant, progress=progress)
                target = split_path(staging, split, variant)
                atomic_write_jsonl(target, built)
                files[target.name] = sha256_file(target)
                examples[f"{split}.{variant}"] = _variant_summary(built, counts, cfg.requested(split, variant))
        empty = [name for name, e in examples.items() if e["requested"] and not e["kept"] and name.endswith(".natural")]
        if empty:
            kept = f"; the existing set in {data_dir} is kept" if data_dir.exists() else ""
            raise ValueError(
                f"the source yields no examples for {', '.join(empty)} ({row_counts['unique']} usable "
                f"conversations){kept}. Use a larger source or a smaller profile"
            )

        manifest = Report(
            "prepare",
            config=cfg,
            inputs={"source": src, "tokenizer": tok_info, "code_sha256": code},
            results=PrepareResults(rows=row_counts, examples=examples, identity=identity),
            n_samples={name: e["kept"] for name, e in examples.items()},
            seeds={"seed": seed},
            wall_time_s=time.time() - t0,
            resume_key=resume_key(identity),
            files=files,
            metrics=PrepareResults.METRICS,
        ).write(staging / MANIFEST)
    except BaseException:  # a refusal (a full disk), an error or an interrupt: no staging folder is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(staging, data_dir)  # once staging is complete, a kill here leaves it for the next run (_clear_leftovers)
    return PrepareResult(manifest, True, reason)
