"""Evaluation tasks: pinned data, prompt formats, answer parsers, and the answering paths.

Data. Each data set is named by Hub repo, config, split and revision. `prepare_data`
writes `<root>/<name>/<name>.jsonl` and, last, `<root>/<name>/manifest.json` (origin,
resolved commit sha, row count, file sha256), either from the Hub or from a local JSONL
with the same fields (`--source`). The revisions are "main" because no commit sha could
be checked offline when this was written; each Hub prepare resolves "main" to a commit
sha and records it in the manifest. Pin that sha here before a paper run.

Prompt formats (one user turn, rendered with the target's chat template):
- ARC-Challenge: the question, one line per choice ("A. text"), then a request to end
  with "Answer: X". Numeric labels ("1".."4", used by a few items) become letters by
  position, and the gold key with them.
- GSM8K: the question, then a request to reason briefly and end with "Answer: N".
  The gold number is what follows "####" in the reference solution.

Parsers (a reply with no parsable answer counts as wrong, and is counted):
- `parse_choice`: the last explicit "answer is X" / "Answer: X" (any case, optional
  brackets, "option"/"choice" words), else the last bracketed letter "(X)", else a reply
  that is just a letter ("c", "C.", "**C**"), else a first line starting "X." / "X)";
  the letter must be one of the item's labels. A lowercase letter counts only where it
  cannot be the article "a" (followed by a word).
- `parse_number`: the last explicit marker ("Answer: N", "answer is N", "#### N",
  "\\boxed{N}"), else the last number in the reply. "$", thousands commas and a trailing
  period are dropped; numbers compare as exact decimals (3.50 == 3.5).

Answering paths (all greedy; `kvlingo.handoff` does the work):
- native: the model prefills the whole prompt itself and generates;
- translated: the source prefills `prompt[:-1]`, its cache is translated, and the target
  generates from `prompt[-1:]` (the suite's handoff convention);
- control: as translated, but the cache is another item's (the next one's, cyclically), so
  the target answers with the wrong content in its cache. Chat-templated prompts all end in
  the same token, so item i's control answer is item i+1's translated answer: the same
  answers, graded against the wrong items (the score of answers that ignore this item);
- no_context: the target generates from `prompt[-1:]` alone, with an empty cache: the floor
  a handoff that carried nothing would reach;
- reasoning trace: the model starts the think block ("<think>\\n"), generates until
  "</think>", a stop token or the trace cap, and the block is closed ("</think>\\n\\n",
  with a newline first when the cap cut the trace). Prompt plus trace is then the prefix
  that the answering model continues, natively or through a translated cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Sequence

from .report import atomic_write_json, atomic_write_jsonl, read_json, sha256_file


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class HubData:
    name: str  # short name; also the folder and file name under the data root
    repo_id: str  # dataset repository on the Hugging Face Hub
    config: str | None  # dataset config (subset), None for the default
    split: str  # split that is scored
    revision: str  # git revision; only a commit sha pins the data


IFEVAL = HubData("ifeval", "google/IFEval", None, "train", "main")
ARC = HubData("arc", "allenai/ai2_arc", "ARC-Challenge", "test", "main")
GSM8K = HubData("gsm8k", "openai/gsm8k", "main", "test", "main")
DATASETS = {d.name: d for d in (IFEVAL, ARC, GSM8K)}


def check_ifeval_row(row: dict[str, Any], where: str) -> None:
    if not isinstance(row.get("key"), int) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: an IFEval row needs an int 'key' and a str 'prompt'")
    ids, kw = row.get("instruction_id_list"), row.get("kwargs")
    if not isinstance(ids, list) or not isinstance(kw, list) or len(ids) != len(kw):
        raise ValueError(f"{where}: 'instruction_id_list' and 'kwargs' must be lists of equal length")


def check_arc_row(row: dict[str, Any], where: str) -> None:
    ch = row.get("choices")
    if not isinstance(row.get("question"), str) or not isinstance(ch, dict):
        raise ValueError(f"{where}: an ARC row needs 'question' (str) and 'choices' {{'text': [...], 'label': [...]}}")
    if len(ch.get("text", [])) != len(ch.get("label", [])) or len(ch.get("label", [])) < 2:
        raise ValueError(f"{where}: choices.text and choices.label must have the same length (at least 2)")
    if row.get("answerKey") not in ch["label"]:
        raise ValueError(f"{where}: answerKey {row.get('answerKey')!r} is not one of the labels {ch['label']}")


def check_gsm8k_row(row: dict[str, Any], where: str) -> None:
    if not isinstance(row.get("question"), str) or "####" not in str(row.get("answer", "")):
        raise ValueError(f"{where}: a GSM8K row needs 'question' and an 'answer' ending in '#### <number>'")
    if parse_gold_number(row["answer"]) is None:
        raise ValueError(f"{where}: no number after '####' in the answer")


CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "ifeval": check_ifeval_row, "arc": check_arc_row, "gsm8k": check_gsm8k_row,
}


def read_source(path: str | os.PathLike, name: str) -> list[dict[str, Any]]:
    """Rows of a local JSONL, each checked against the data set's format (errors name the line)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--source {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i} is not valid JSON ({e})") from None
            CHECKS[name](row, f"{path}:{i}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def _hub_offline() -> bool:
    on = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in on for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def fetch_hub_rows(data: HubData, timeout_s: float = 10.0) -> tuple[list[dict[str, Any]], str]:
    """(rows, commit sha) from the Hub; fails fast offline, naming the --source fix."""
    fix = f"Without Hub access, pass a local JSONL of {data.name} rows with --source PATH."
    if _hub_offline():
        raise ValueError(f"cannot fetch {data.repo_id}: Hugging Face Hub access is off (HF_HUB_OFFLINE=1). {fix}")
    from huggingface_hub import HfApi

    try:
        commit = HfApi().dataset_info(data.repo_id, revision=data.revision, timeout=timeout_s).sha
        from datasets import load_dataset

        ds = load_dataset(data.repo_id, data.config, split=data.split, revision=commit)
    except Exception as e:  # network, auth or a bad revision: all end the same way
        raise ValueError(f"cannot fetch {data.repo_id}@{data.revision} ({type(e).__name__}: {e}). {fix}") from e
    rows = [dict(r) for r in ds]
    for i, r in enumerate(rows):
        CHECKS[data.name](r, f"{data.repo_id} row {i}")
    return rows, commit


def prepare_data(data: HubData, root: str | os.PathLike, source: str | None = None) -> dict[str, Any]:
    """Write `<root>/<name>/<name>.jsonl`, then its manifest; return the manifest."""
    folder = Path(root) / data.name
    if source:
        rows = read_source(source, data.name)
        origin = {"local_source": str(Path(source).resolve()), "source_sha256": sha256_file(source)}
    else:
        rows, commit = fetch_hub_rows(data)
        origin = {"repo_id": data.repo_id, "config": data.config, "split": data.split,
                  "revision_requested": data.revision, "commit": commit}
    path = atomic_write_jsonl(folder / f"{data.name}.jsonl", rows)
    manifest = {"data": data.name, "origin": origin, "rows": len(rows), "file": path.name, "sha256": sha256_file(path)}
    atomic_write_json(folder / "manifest.json", manifest)
    return manifest


def load_data(data: HubData, root: str | os.PathLike,
              source: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, data provenance) from --source, else from the prepared copy under `root`."""
    if source:
        return read_source(source, data.name), {"source": str(Path(source).resolve()), "sha256": sha256_file(source)}
    folder = Path(root) / data.name
    mpath = folder / "manifest.json"
    if not mpath.exists():
        raise ValueError(f"{folder} holds no prepared {data.name} data; run the stage with --prepare "
                         "(needs Hub access), or pass a local JSONL with --source PATH")
    manifest = read_json(mpath)
    path = folder / manifest["file"]
    digest = sha256_file(path)
    if digest != manifest["sha256"]:
        raise ValueError(f"{path} does not match its manifest's sha256 (edited or damaged); re-run --prepare")
    info = {"prepared": str(path.resolve()), "sha256": digest, "origin": manifest["origin"]}
    return read_source(path, data.name), info


# --------------------------------------------------------------------------- prompt formats
@dataclass(frozen=True)
class TaskItem:
    id: str  # the data set's id (ARC) or a hash of the question (GSM8K)
    prompt: str  # the user message
    gold: str  # the gold letter (ARC) or canonical number (GSM8K)
    labels: tuple[str, ...] = ()  # ARC choice letters, in order


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def arc_item(row: dict[str, Any]) -> TaskItem:
    texts, labels = row["choices"]["text"], [str(x) for x in row["choices"]["label"]]
    letters = tuple(LETTERS[: len(labels)])  # "1".."4" (and any other labels) become A.. by position
    gold = letters[labels.index(str(row["answerKey"]))]
    lines = "\n".join(f"{l}. {t}" for l, t in zip(letters, texts))
    prompt = (
        "Answer the following multiple-choice question.\n\n"
        f"Question: {row['question']}\n{lines}\n\n"
        f'End your reply with a line of the form "Answer: X", where X is one of {", ".join(letters)}.'
    )
    return TaskItem(str(row.get("id") or _qhash(row["question"])), prompt, gold, letters)


def gsm8k_item(row: dict[str, Any]) -> TaskItem:
    prompt = (
        "Solve the following math problem. Reason step by step, briefly.\n\n"
        f"Question: {row['question']}\n\n"
        'End your reply with a line of the form "Answer: N", where N is the final number only.'
    )
    return TaskItem(_qhash(row["question"]), prompt, parse_gold_number(row["answer"]), ())


def _qhash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


ITEM_BUILDERS = {"arc": arc_item, "gsm8k": gsm8k_item}


# --------------------------------------------------------------------------- answer parsers
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


def strip_thinking(text: str) -> str:
    """The reply without any think block left in its text."""
    return _THINK.sub("", text)


def _choice_ok(text: str, m: re.Match, labels: Sequence[str]) -> str | None:
    letter = m.group(1)
    if letter.upper() not in labels:
        return None
    if letter.islower():
        # "a" followed by a word is the article ("the answer is a plant"), not a choice.
        rest = text[m.end(1):]
        if re.match(r"\s*[A-Za-z]", rest) and not re.match(r"\s*[\)\]]", rest):
            return None
    return letter.upper()


_EXPLICIT_CHOICE = re.compile(
    r"answer\s*(?:is|would be|will be)?\s*[:=\-]?\s*(?:option|choice)?\s*[:\-]?\s*[\(\[\*\"']*([A-Za-z])(?![A-Za-z])",
    re.I,
)
_BRACKETED = re.compile(r"[\(\[]([A-Za-z])[\)\]]")
_WHOLE = re.compile(r"^\W*([A-Za-z])\W*$")
_LEADING = re.compile(r"^\W*([A-Z])[\.\):]\s")


def parse_choice(text: str, labels: Sequence[str] = ("A", "B", "C", "D")) -> str | None:
    """The chosen letter (upper case) or None; rules in the module docstring."""
    text = strip_thinking(text)
    for pattern in (_EXPLICIT_CHOICE, _BRACKETED):
        for m in reversed(list(pattern.finditer(text))):
            got = _choice_ok(text, m, labels)
            if got:
                return got
    stripped = text.strip()
    m = _WHOLE.match(stripped)
    if m and m.group(1).upper() in labels:
        return m.group(1).upper()
    first = stripped.splitlines()[0] if stripped else ""
    m = _LEADING.match(first + " ")
    if m and m.group(1) in labels:
        return m.group(1)
    return None


_NUM = r"(-?)\s?\$?\s?(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?![\d])"
_NUMBER = re.compile(r"(?<![\w.])" + _NUM)
_EXPLICIT_NUMBER = [
    re.compile(r"####\s*" + _NUM),
    re.compile(r"\\boxed\{\s*" + _NUM),
    re.compile(r"answer\s*(?:is)?\s*[:=]?\s*[\*\s]*" + _NUM, re.I),
]


def canonical_number(sign: str, digits: str) -> str | None:
    try:
        value = Decimal(digits.replace(",", ""))
    except InvalidOperation:
        return None
    if sign:
        value = -value
    out = format(value.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def _number_from(m: re.Match) -> str | None:
    return canonical_number(m.group(1) or m.group(2), m.group(3))


def parse_number(text: str) -> str | None:
    """The final number as a canonical decimal string, or None; rules in the module docstring."""
    text = strip_thinking(text)
    for pattern in _EXPLICIT_NUMBER:
        found = list(pattern.finditer(text))
        if found:
            return _number_from(found[-1])
    found = list(_NUMBER.finditer(text))
    return _number_from(found[-1]) if found else None


def parse_gold_number(answer: str) -> str | None:
    """GSM8K's gold: the number after the last '####'."""
    tail = answer.rsplit("####", 1)[-1]
    m = _NUMBER.search(tail)
    return _number_from(m) if m else None


def score(task: str, item: TaskItem, reply: str) -> tuple[str | None, bool]:
    """(parsed answer or None, correct)."""
    pred = parse_choice(reply, item.labels) if task == "arc" else parse_number(reply)
    return pred, pred is not None and pred == item.gold


# --------------------------------------------------------------------------- answering paths
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def user_prompt_ids(tok, text: str, enable_thinking: bool) -> list[int]:
    """One user turn through the chat template, up to and including the generation prompt."""
    from .models import render_ids

    return render_ids(tok, [{"role": "user", "content": text}], enable_thinking)


def plain_ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def answer_text(tok, ids: Sequence[int]) -> str:
    """The visible answer in generated ids: what follows the last '</think>' when a think block is
    present ('' when it was never closed), else everything; special tokens dropped."""
    close = tok.convert_tokens_to_ids(THINK_CLOSE)
    opened = tok.convert_tokens_to_ids(THINK_OPEN)
    ids = list(ids)
    if close in ids:
        last = len(ids) - 1 - ids[::-1].index(close)
        return tok.decode(ids[last + 1:], skip_special_tokens=True).lstrip()
    if opened in ids:
        return ""
    return tok.decode(ids, skip_special_tokens=True)


@dataclass
class Generated:
    ids: list[int]  # generated token ids, stop token excluded
    hit_cap: bool  # True when the token cap ended generation
    seconds: float  # wall time of prefill + generation (and translation, on the translated path)


def generate_native(model, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> Generated:
    from .handoff import greedy_generate

    t0 = time.perf_counter()
    ids, hit = greedy_generate(model, list(prompt_ids), None, max_new_tokens=max_new_tokens, eos_ids=eos)
    return Generated(ids, hit, time.perf_counter() - t0)


def generate_translated(source, target, translator, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int],
                        out_dtype) -> Generated:
    """Source prefill of prompt[:-1], translation, then the target greedy from prompt[-1:]."""
    from .handoff import greedy_generate, translated_cache

    if len(prompt_ids) < 2:
        raise ValueError("a handoff needs a prompt of at least 2 tokens")
    t0 = time.perf_counter()
    kv = translated_cache(source, translator, list(prompt_ids[:-1]), out_dtype)
    ids, hit = greedy_generate(target, list(prompt_ids[-1:]), kv, max_new_tokens=max_new_tokens, eos_ids=eos)
    return Generated(ids, hit, time.perf_counter() - t0)


def generate_control(source, target, translator, other_ids: Sequence[int], prompt_ids: Sequence[int],
                     max_new_tokens: int, eos: set[int], out_dtype) -> Generated:
    """Wrong-document control: the translated cache of *another* item's prefix (all but its last
    token), then the target greedy from this prompt's last token. Graded against this item, it
    shows what a translated cache scores when it carries the wrong content."""
    from .handoff import greedy_generate, translated_cache

    if len(other_ids) < 2 or len(prompt_ids) < 1:
        raise ValueError("a control needs another prefix of at least 2 tokens and a prompt of at least 1")
    t0 = time.perf_counter()
    kv = translated_cache(source, translator, list(other_ids[:-1]), out_dtype)
    ids, hit = greedy_generate(target, list(prompt_ids[-1:]), kv, max_new_tokens=max_new_tokens, eos_ids=eos)
    return Generated(ids, hit, time.perf_counter() - t0)


def generate_no_context(target, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int]) -> Generated:
    """No-context floor: the target greedy from the prompt's last token alone (the token a handoff
    continues from), with an empty cache."""
    return generate_native(target, list(prompt_ids[-1:]), max_new_tokens, eos)


def control_partner(i: int, n: int) -> int:
    """The item whose prefix stands in for item i's in the control arm: the next one, cyclically."""
    if n < 2:
        raise ValueError("the control arm needs at least two items")
    return (i + 1) % n


CONTROL_PATHS = ("control", "no_context")  # the floors scored beside every translated run


@dataclass
class Trace:
    prefix_ids: list[int]  # prompt + "<think>\n" + trace + closing: what the answering model continues
    trace_ids: list[int]  # the generated reasoning tokens only
    hit_cap: bool  # True when the trace cap cut the reasoning
    seconds: float


def reasoning_trace(model, tok, prompt_ids: Sequence[int], trace_tokens: int, eos: set[int]) -> Trace:
    """Greedy reasoning inside a think block, closed by us; see the module docstring."""
    from .handoff import greedy_generate

    close = tok.convert_tokens_to_ids(THINK_CLOSE)
    start = list(prompt_ids) + plain_ids(tok, THINK_OPEN + "\n")
    t0 = time.perf_counter()
    ids, hit = greedy_generate(model, start, None, max_new_tokens=trace_tokens, eos_ids=set(eos) | {close})
    closing = plain_ids(tok, ("\n" if hit else "") + THINK_CLOSE + "\n\n")
    return Trace(start + ids + closing, ids, hit, time.perf_counter() - t0)


def trace_prefix(tok, prompt_ids: Sequence[int], trace_ids: Sequence[int], hit_cap: bool) -> list[int]:
    """Rebuild a Trace's prefix from a stored trace (what a resumed run continues from)."""
    closing = plain_ids(tok, ("\n" if hit_cap else "") + THINK_CLOSE + "\n\n")
    return list(prompt_ids) + plain_ids(tok, THINK_OPEN + "\n") + list(trace_ids) + closing


# --------------------------------------------------------------------------- translator
def load_translator(folder: str | os.PathLike, source, target, direction: str | None = None,
                    models: dict[str, Any] | None = None):
    """(Translator, provenance) from a maps artifact; refuses maps that do not fit the pair."""
    from .maps import load_translator as load

    try:
        translator, info = load(folder, source, target, direction, models)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    keep = ("path", "maps_sha256", "key_space", "manifest_sha256")
    return translator, {k: info[k] for k in keep}


def pair_and_translator(args, run: str, stage: str):
    """The checked pair, and for a translated run its translator (None with --native).

    Returns (pair, translator, maps provenance, maps folder); a bad pair or maps exit with
    a message prefixed by `stage`.
    """
    from .models import pair_from_args

    translator, maps_info, maps_dir = None, None, None
    try:
        maps_dir = None if args.native else maps_folder(run, args.maps, args.maps_dir)
        pair = pair_from_args(args)
        models = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
        if maps_dir is not None:
            translator, maps_info = load_translator(maps_dir, pair.source, pair.target, args.direction, models)
    except ValueError as e:  # PairError included
        raise SystemExit(f"{stage}: {e}") from None
    return pair, translator, maps_info, maps_dir


def maps_folder(run: str, maps: str, maps_dir: str | None, artifacts: str = "artifacts") -> Path:
    """--maps-dir when given, else artifacts/<run>/<maps> (maps: distilled or closed_form).

    Checked before any model is loaded, so a missing translator fails in a second."""
    folder = Path(maps_dir) if maps_dir else Path(artifacts) / run / maps
    if not (folder / "manifest.json").exists():
        raise ValueError(f"{folder} holds no translator maps (no manifest.json). Train them first "
                         f"(train_translator.py --run {run}), or point --maps-dir at a maps folder")
    return folder


def add_eval_args(ap, items_help: str, data_help: str, data_folder: str) -> None:
    """The flags IFEval and the task evaluation share (besides kvlingo.models.add_pair_args)."""
    ap.add_argument("--run", default=None, help="run name: maps from artifacts/RUN/, reports to RESULTS/RUN/ "
                    "(default PROFILE-DIRECTION)")
    from .profiles import PROFILES

    ap.add_argument("--profile", default="pilot", choices=sorted(PROFILES),
                    help="run profile: default sample size and token cap")
    ap.add_argument("--limit", type=int, default=None, help=f"{items_help} (default: the profile's)")
    ap.add_argument("--native", action="store_true", help="score the native paths only (native source, native target)")
    ap.add_argument("--maps", choices=("distilled", "closed_form"), default="distilled",
                    help="which translator of the run: artifacts/RUN/{distilled,closed_form}")
    ap.add_argument("--maps-dir", default=None, metavar="PATH", help="translator maps folder (overrides --maps)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="greedy generation cap per answer (default: the profile's max_new_tokens)")
    ap.add_argument("--thinking", action="store_true",
                    help="render the prompt with enable_thinking=True (default False: an empty think block)")
    ap.add_argument("--resume", action="store_true",
                    help="keep finished rows whose input hash matches; refuse if a setting changed")
    ap.add_argument("--results", default="results", help="results root: reports go to RESULTS/RUN/")
    ap.add_argument("--source", default=None, metavar="PATH",
                    help="local JSONL of the data set's rows (offline); with --prepare, copied into the data root")
    ap.add_argument("--data-root", default="data", help=f"prepared data root: DATA_ROOT/{data_folder}/")
    ap.add_argument("--prepare", action="store_true",
                    help=f"fetch {data_help} into DATA_ROOT/{data_folder}/ (or copy --source there) and exit")
    ap.add_argument("--no-controls", action="store_true",
                    help="translated runs: skip the control (another item's translated cache) and no-context "
                    "(target from the last prompt token alone) paths, which double the generation work")


def paired(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """a vs b on the same items: difference in points and the exact McNemar test."""
    from .stats import mcnemar_exact

    n = len(a)
    delta = 100.0 * (sum(a) - sum(b)) / n if n else float("nan")
    return {"delta_points": delta, "mcnemar": mcnemar_exact(list(a), list(b))}


def pct(ms: dict[str, float]) -> str:
    """'45.2 ± 3.1' from a mean_se dict of a 0..1 quantity."""
    if not ms.get("n"):
        return "-"
    se = ms["se"]
    return f"{100 * ms['mean']:.1f}" + ("" if se != se else f" ± {100 * se:.1f}")
