"""Serving measurements: a conversation whose turns alternate between engines, and time to first token.

Time to first token (TTFT) is the wall time of one engine call that returns one token for a
prompt: scheduling, the connector's load (translation and the write into the paged cache),
the forward of what is left of the prompt, and sampling. Each path is timed the same way,
round by round in alternation (so drift on a shared machine hits both), after untimed warm-ups;
every trial is kept.

The random-weight fixtures for timing at real shapes live here too (`random_model_folder`,
`random_export`): model folders saved with a tokenizer, and an exported translator without
evidence, which the gate therefore refuses unless a run waives it.

Nothing here imports vLLM at module level; the engine calls take `vllm.LLM` objects.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

OFF = {"kv_transfer_params": {"kvlingo": "off"}}  # SamplingParams.extra_args of a request the connector stays out of
NO_SAVE = {"kv_transfer_params": {"kvlingo": "no-save"}}  # one that loads but leaves the store as it was


# --------------------------------------------------------------------------- timing
def interleaved(paths: dict[str, Callable[[], Any]], trials: int, warmups: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each path: `warmups` untimed rounds, then `trials` timed rounds, the paths in turn."""
    for _ in range(warmups):
        for call in paths.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(trials):
        for name, call in paths.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
            STARTS.append((name, time.time() - times[name][-1], time.time()))
    return times


STARTS: list[tuple[str, float, float]] = []  # (path, wall start, wall end) of every timed call, in order


def spread(xs: list[float]) -> dict[str, float]:
    """n, median, min, max and coefficient of variation of a list of trials."""
    mean = statistics.fmean(xs)
    cv = statistics.stdev(xs) / mean if len(xs) > 1 and mean else 0.0
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs), "cv": cv}


def ratio(slow: list[float], fast: list[float]) -> dict[str, float]:
    """Speedup of `fast` over `slow`: the ratio of medians, and the range over every pair of trials."""
    return {
        "median": statistics.median(slow) / statistics.median(fast),
        "low": min(slow) / max(fast),
        "high": max(slow) / min(fast),
    }


# --------------------------------------------------------------------------- where a translation's time goes
def run_state() -> dict[str, Any]:
    """What a translation's speed could depend on in this process, now: torch's intra-op threads, the CPUs this
    process may run on, whether inference mode is on, and the machine's NUMA nodes."""
    import torch

    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "threads": torch.get_num_threads(),
        "affinity": allowed_cpus(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "numa_nodes": len(nodes) or 1,
    }


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Suspects:
    """One translation call timed wherever an engine could make it slower than a benchmark does: before vLLM is
    imported, after it, beside one engine, beside two, and inside the engine's own load (its `translate_s`),
    each row with the process state it ran in (`run_state`). A suspect that costs nothing leaves its row at the
    first row's time."""

    def __init__(self, trials: int, warmups: int = 1):
        self.trials, self.warmups = trials, warmups
        self.rows: list[dict[str, Any]] = []

    def time(self, where: str, call: Callable[[], Any]) -> dict[str, Any]:
        """`warmups` untimed calls, then `trials` timed ones (`interleaved`); the row is kept and returned."""
        return self.add(where, interleaved({where: call}, self.trials, self.warmups)[where])

    def add(self, where: str, times: list[float], **state) -> dict[str, Any]:
        """A row of seconds measured elsewhere (the engine's own), with the state it ran in where known."""
        row = {"where": where, "trials": list(times), **spread(times), **{**run_state(), **state}}
        self.rows.append(row)
        return row

    def table(self) -> str:
        """The rows as markdown, each median also as a multiple of the first row's."""
        if not self.rows:
            return ""
        base = self.rows[0]["median"]
        lines = [
            "| where the translation ran | n | median s | min | max | × first row | torch threads | CPUs allowed "
            "| inference mode |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            cells = [r["where"], r["n"], f"{r['median']:.3f}", f"{r['min']:.3f}", f"{r['max']:.3f}"]
            cells += [f"{r['median'] / base:.2f}", r["threads"], r["affinity"], "yes" if r["inference_mode"] else "no"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        return "\n".join(lines)


def first_touch(shapes: list[tuple[int, ...]], dtype, trials: int) -> dict[str, Any]:
    """The allocation suspect: seconds to allocate tensors of `shapes` and write every byte once (the page faults
    of fresh memory, which a translation that allocates its result pays), against writing the same bytes into
    tensors written before. Trials interleaved; returns each path's trials and spread, and the difference of
    medians."""
    import torch

    kept = [torch.zeros(s, dtype=dtype) for s in shapes]

    def fresh():
        for s in shapes:
            torch.empty(s, dtype=dtype).fill_(1)

    def reused():
        for t in kept:
            t.fill_(1)

    times = interleaved({"fresh": fresh, "reused": reused}, trials, 1)
    out: dict[str, Any] = {k: {"trials": v, **spread(v)} for k, v in times.items()}
    out["bytes"] = sum(t.numel() * t.element_size() for t in kept)
    out["cost_s"] = out["fresh"]["median"] - out["reused"]["median"]
    return out


def first_token(llm, ids: list[int], extra: dict | None = None):
    """One greedy token of `ids` (the engine's output for it)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    return llm.generate({"prompt_token_ids": list(ids)}, params, use_tqdm=False)[0].outputs[0]


def greedy(llm, ids: list[int], max_tokens: int, extra: dict | None = None, logprobs: int | None = None):
    """The engine's greedy reply to `ids` (stopping at the tokenizer's end of turn)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra, logprobs=logprobs)
    return llm.generate({"prompt_token_ids": list(ids)}, params, use_tqdm=False)[0].outputs[0]


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's ids of `messages` through the generation prompt (thinking off)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --------------------------------------------------------------------------- the alternating conversation
def conversation(
    engines: dict[str, Any],
    tokenizer,
    turns: list[tuple[str, str]],
    trials: int,
    warmups: int,
    max_tokens: int,
    decisions: list[dict],
) -> list[dict[str, Any]]:
    """Run `turns` ([(engine name, user message)]) as one conversation, each turn on its engine with the
    connector; at each switch of engine, time the first token through the connector against the engine's
    own re-prefill of the same prompt. `decisions` is the connector's record (`connector.DECISIONS`).
    Returns one row per turn."""
    messages: list[dict[str, str]] = []
    rows, previous = [], None
    for turn, (name, user) in enumerate(turns, 1):
        llm = engines[name]
        messages.append({"role": "user", "content": user})
        ids = render(tokenizer, messages)
        row: dict[str, Any] = {
            "turn": turn,
            "engine": name,
            "switch": previous is not None and previous != name,
            "prompt_tokens": len(ids),
        }
        if row["switch"]:
            mark = len(decisions)
            times = interleaved(
                {
                    "reprefill": lambda llm=llm, ids=ids: first_token(llm, ids, OFF),
                    "connector": lambda llm=llm, ids=ids: first_token(llm, ids, NO_SAVE),
                },
                trials,
                warmups,
            )
            row["ttft"] = {path: spread(ts) for path, ts in times.items()}
            row["ttft_trials"] = times
            row["speedup"] = ratio(times["reprefill"], times["connector"])
            loads = [d for d in decisions[mark:] if d.get("event") == "loaded"]
            row["translate_ms"] = statistics.median(d["translate_s"] for d in loads) * 1e3 if loads else None
        mark = len(decisions)
        out = greedy(llm, ids, max_tokens)
        plan = next((d for d in decisions[mark:] if "mode" in d), {})
        row.update(
            mode=plan.get("mode"),
            loaded=plan.get("matched", 0),
            own_tokens=plan.get("own_tokens", 0),
            reason=plan.get("reason"),
            reply_ids=list(out.token_ids),
            reply=tokenizer.decode(out.token_ids, skip_special_tokens=True).strip(),
        )
        if row["switch"]:
            native = greedy(llm, ids, max_tokens, OFF)
            row["reprefill_reply"] = tokenizer.decode(native.token_ids, skip_special_tokens=True).strip()
            row["same_reply"] = list(native.token_ids) == row["reply_ids"]
        messages.append({"role": "assistant", "content": row["reply"]})
        rows.append(row)
        previous = name
    return rows


def switch_table(rows: list[dict[str, Any]]) -> str:
    """The per-turn table of `conversation`, as markdown."""
    head = (
        "| turn | engine | prompt | own | translated | vLLM prefills | TTFT re-prefill ms | TTFT connector ms "
        "| speedup (range) | translate ms | reply | = re-prefill reply |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        own, loaded = r.get("own_tokens", 0), r.get("loaded", 0)
        cells = [r["turn"], r["engine"], r["prompt_tokens"], own, loaded - own, r["prompt_tokens"] - loaded]
        if r["switch"]:
            t, s = r["ttft"], r["speedup"]
            cells += [
                f"{1e3 * t['reprefill']['median']:.1f}",
                f"{1e3 * t['connector']['median']:.1f}",
                f"{s['median']:.2f}× ({s['low']:.2f}–{s['high']:.2f})",
                "–" if r["translate_ms"] is None else f"{r['translate_ms']:.2f}",
            ]
        else:
            cells += ["–", "–", "–", "–"]
        cells += [r["reply"].replace("\n", " ")[:60], {True: "yes", False: "no"}.get(r.get("same_reply"), "–")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- random-weight fixtures at real shapes
def random_model_folder(name: str, out: Path, tokenizer_dir: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A model folder of preset `name`'s exact shape (kvlingo.bench.shapes) with random weights, saved with the
    tokenizer of `tokenizer_dir` (its ids are a subset of the model's vocabulary). Kept when complete."""
    from transformers import AutoTokenizer

    from ..bench.random_pair import random_model
    from ..inputs.models import resolve_dtype

    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    model = random_model(name, "cpu", resolve_dtype(dtype), seed=seed)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    tmp.rename(out)
    return out


def random_export(
    large: Path,
    small: Path,
    out: Path,
    direction: str,
    family: str,
    key_space: str = "cache",
    dtype: str = "bfloat16",
    seed: int = 0,
    refresh: str = "none",
    flags: dict | None = None,
) -> Path:
    """An exported translator of `family` (its option values `flags` by dest, e.g. a variant's; the rest its
    defaults) with random maps N(0, 0.02) for the pair of folders, handing over under `refresh` and recording the
    target tensors its handoff reads with their sha256 (`inputs.reads.handoff_reads`), without evidence (the gate
    refuses it: a timing-only run must waive it). Kept while it reads back as these settings."""
    import json

    import torch

    from ..core.families import FAMILIES
    from ..core.settings import Geometry
    from ..core.translator import TranslatorError
    from ..inputs.models import resolve_pair
    from ..inputs.reads import handoff_reads
    from ..records.saved import (
        CONFIG_FILE,
        build,
        export_config,
        read_export,
        state_bytes,
        write_export,
    )

    out = Path(out)
    if (out / CONFIG_FILE).is_file():
        try:
            config, _, _ = read_export(out)
            kept = (config.get("family"), config.get("key_space"), config.get("direction"), config.get("refresh"))
            geometry = config["geometry"]
            settings = FAMILIES[family].settings_from(flags or {}, Geometry(**geometry), FAMILIES)
            spec = {"family": family, "key_space": key_space, "settings": settings, "geometry": geometry}
            wanted = json.loads(json.dumps(build(spec, device="meta").settings()))
            if (
                kept == (family, key_space, direction, refresh)
                and config.get("settings") == wanted
                and "reads" in config
            ):
                return out
        except (TranslatorError, KeyError, TypeError, ValueError):  # damaged, edited or of an older format: made again
            pass
    pair, _ = resolve_pair(str(large), str(small), direction, "cpu", dtype)
    settings = FAMILIES[family].settings_from(flags or {}, Geometry(**pair.geometry), FAMILIES)
    maps = build({"family": family, "key_space": key_space, "settings": settings, "geometry": pair.geometry})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in maps.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    manifest = {
        **maps.spec(),
        "direction": direction,
        "models": pair.identities(),
        "n_params": maps.n_params(),
        "stage": "random-weights",
    }
    config = export_config(manifest, asdict(pair), {"run": "random-weights", "translator": "random"}, refresh)
    config["reads"] = handoff_reads(family, refresh, config["models"]["target"], key_space)
    write_export(out, state_bytes(maps), config, None)
    return out
