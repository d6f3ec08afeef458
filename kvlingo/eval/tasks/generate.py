"""The answering paths of IFEval and the tasks (all greedy; `kvlingo.core.handoff` does the work).

- native_source / native_target: the model prefills the whole prompt itself and generates;
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

`generate(path, ...)` is the one dispatch both evaluation stages call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...core.handoff import greedy_generate, translate
from .prompts import plain_ids

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PATHS = ("native_source", "native_target", "translated", "control", "no_context")
CONTROL_PATHS = ("control", "no_context")  # the floors scored beside every translated run


def answer_text(tok, ids: Sequence[int]) -> str:
    """The visible answer in generated ids: what follows the last '</think>' when a think block is
    present ('' when it was never closed), else everything; special tokens dropped."""
    close = tok.convert_tokens_to_ids(THINK_CLOSE)
    opened = tok.convert_tokens_to_ids(THINK_OPEN)
    ids = list(ids)
    if close in ids:
        last = len(ids) - 1 - ids[::-1].index(close)
        return tok.decode(ids[last + 1 :], skip_special_tokens=True).lstrip()
    if opened in ids:
        return ""
    return tok.decode(ids, skip_special_tokens=True)


@dataclass
class Generated:
    ids: list[int]  # generated token ids, stop token excluded
    hit_cap: bool  # True when the token cap ended generation
    seconds: float  # wall time of prefill + generation (and translation, on the translated path)


def control_partner(i: int, n: int) -> int:
    """The item whose prefix stands in for item i's in the control arm: the next one, cyclically."""
    if n < 2:
        raise ValueError("the control arm needs at least two items")
    return (i + 1) % n


def generate(
    path: str,
    pair,
    translator,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos: set[int],
    other_ids: Sequence[int] | None = None,
    refresh=None,
) -> Generated:
    """Greedy answer of one path (see the module docstring) to a prompt of token ids.

    `other_ids` is the control's stand-in prefix (another item's); `translator` (and `refresh`,
    kvlingo.core.refresh) are used by the translated and control paths only. Caches are the pair's kind.
    """
    if path not in PATHS:
        raise ValueError(f"unknown answering path {path!r}; one of {PATHS}")
    prompt_ids = list(prompt_ids)
    t0 = time.perf_counter()
    kv, model, start = None, pair.target, prompt_ids
    if path == "native_source":
        model = pair.source
    elif path in ("translated", "control"):
        cached = prompt_ids if path == "translated" else list(other_ids or [])
        if len(cached) < 2:
            raise ValueError(f"the {path} path needs a prefix of at least 2 tokens to hand over")
        kv = translate(
            pair.source, translator, cached[:-1], pair.dtype, refresh=refresh, target=pair.target, kind=pair.cache
        )
        start = prompt_ids[-1:]
    elif path == "no_context":
        start = prompt_ids[-1:]
    ids, hit = greedy_generate(model, start, kv, max_new_tokens=max_new_tokens, eos_ids=eos, kind=pair.cache)
    return Generated(ids, hit, time.perf_counter() - t0)


@dataclass
class Trace:
    prefix_ids: list[int]  # prompt + "<think>\n" + trace + closing: what the answering model continues
    trace_ids: list[int]  # the generated reasoning tokens only
    hit_cap: bool  # True when the trace cap cut the reasoning
    seconds: float


def reasoning_trace(
    model, tok, prompt_ids: Sequence[int], trace_tokens: int, eos: set[int], kind: str = "preallocated"
) -> Trace:
    """Greedy reasoning inside a think block (on a cache of `kind`), closed by us; see the module docstring."""
    close = tok.convert_tokens_to_ids(THINK_CLOSE)
    start = list(prompt_ids) + plain_ids(tok, THINK_OPEN + "\n")
    t0 = time.perf_counter()
    ids, hit = greedy_generate(model, start, None, max_new_tokens=trace_tokens, eos_ids=set(eos) | {close}, kind=kind)
    return Trace(trace_prefix(tok, prompt_ids, ids, hit), ids, hit, time.perf_counter() - t0)


def trace_prefix(tok, prompt_ids: Sequence[int], trace_ids: Sequence[int], hit_cap: bool) -> list[int]:
    """A trace's prefix from a stored trace (what a resumed run continues from)."""
    closing = plain_ids(tok, ("\n" if hit_cap else "") + THINK_CLOSE + "\n\n")
    return list(prompt_ids) + plain_ids(tok, THINK_OPEN + "\n") + list(trace_ids) + closing
