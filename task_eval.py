"""ARC-Challenge and GSM8K accuracy after a KV-cache handoff (generate, then parse the answer).

Handoff modes (prompt formats and answer parsers: kvlingo/eval/tasks/):
- prompt: the source reads the prompt; the target answers from the translated cache of
  prompt[:-1], starting at prompt[-1:]. Paired baseline: the native target reading the
  prompt itself.
- trace: the source reasons first (thinking on, greedy until </think> or --trace-tokens,
  then the think block is closed); the target gets the translated cache of prompt plus
  trace and writes only the answer. Paired baseline: the native target reading the same
  trace as text in its own prefill. With --native: the source answers after its own
  trace, and the target reasons and answers on its own.

A translated run also scores two floors on the same items (skip them with --no-controls):
control, the translated cache of the next item's prefix (its prompt, and in trace mode its
trace) in place of this one's, and no_context, the target from the prefix's last token alone.

Outputs under RESULTS/RUN/: task-TASK[-trace][-native].json, .rows.jsonl (one checksummed
row per answer or trace, appended as it finishes) and .md. Accuracy with SE per path, and
the exact McNemar test between the two paths on the same items. --resume skips rows
whose input hash matches and refuses a changed setting, input or code. A report made under
the same settings, inputs, models and code, its rows log unchanged, is up to date: nothing
runs (--force runs it again).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from tqdm.auto import tqdm

from kvlingo.errors import Refusal
from kvlingo.eval.itemrows import item_key
from kvlingo.eval.stats import mean_se, paired_accuracy
from kvlingo.eval.tasks.data import DATASETS, load_data, split_rows, split_suffix
from kvlingo.eval.tasks.generate import answer_text, control_partner, generate, reasoning_trace, trace_prefix
from kvlingo.eval.tasks.parsers import score
from kvlingo.eval.tasks.prompts import ITEM_BUILDERS, user_prompt_ids
from kvlingo.inputs.argtypes import whole
from kvlingo.inputs.models import PairConfig
from kvlingo.inputs.profiles import get_profile
from kvlingo.io import atomic_write_text, sha256_json
from kvlingo.records import resume
from kvlingo.records.paths import check_outputs, run_paths
from kvlingo.records.report import Metric, Report, fmt_pm, fmt_table
from kvlingo.stages.session import Session, add_eval_args, control_paths, prepare_and_exit
from kvlingo.stages.stage import StageParser, lock_run, refusals_exit

SCRIPT = Path(__file__).resolve()
EPILOG = """examples:
  python task_eval.py --task arc --native --device cuda --run pilot-l2s
  python task_eval.py --task gsm8k --run pilot-l2s --translator closed_form --resume
  python task_eval.py --task gsm8k --handoff trace --trace-tokens 512 --run pilot-l2s
  python task_eval.py --task arc --source artifacts/toy/corpus/arc.jsonl --large artifacts/toy/large \
      --small artifacts/toy/small --device cpu --dtype float32 --profile demo
"""


@dataclass(frozen=True)
class TaskConfig:
    profile: str  # run profile: default item count and token cap
    run: str  # results go to RESULTS/RUN/ (and the translator comes from ARTIFACTS/RUN/)
    task: str  # arc or gsm8k
    handoff: str  # prompt or trace
    mode: str  # "translated" (translated + native target + floors) or "native" (native source + native target)
    translator: str | None  # which translator of the run (translated mode only)
    limit: int  # items scored: the first N of the item split, in its order
    max_new_tokens: int  # greedy cap on each answer
    trace_tokens: int | None  # greedy cap on the reasoning trace (trace mode)
    enable_thinking: bool  # the chat template's thinking switch for the prompt (always on in trace mode)
    controls: tuple[str, ...]  # floors scored beside a translated run (control, no_context), or none
    refresh: str  # the part of each translated prefix the target recomputes (kvlingo/core/refresh.py)
    pair: PairConfig  # the resolved pair
    split: str = "all"  # item split scored: all, validation (the first half) or test (the second half)


@dataclass
class TaskResults:
    task: str
    handoff: str
    mode: str
    paths: dict  # per answering path: accuracy (mean ± SE, n), unparsable answers, cap hits, tokens, seconds
    comparison: dict  # paired differences (points) with exact McNemar tests
    trace: dict | None  # reasoning traces: count, mean length, cut by the cap
    rows: dict  # rows generated, resumed, reused from the sibling log; torn line dropped

    METRICS = (Metric("paths.translated.accuracy", True, "fraction of items answered correctly after the handoff"),)


def summarize(rows: list[dict]) -> dict:
    return {
        "accuracy": mean_se([float(r["correct"]) for r in rows]),
        "no_answer": sum(r["pred"] is None for r in rows),
        "hit_cap": sum(r["hit_cap"] for r in rows),
        "mean_new_tokens": sum(r["new_tokens"] for r in rows) / max(1, len(rows)),
        "mean_seconds": sum(r["seconds"] for r in rows) / max(1, len(rows)),
    }


def trace_summary(rows: list[dict]) -> dict:
    return {
        "n": len(rows),
        "hit_cap": sum(r["trace_hit_cap"] for r in rows),
        "mean_tokens": sum(len(r["trace_ids"]) for r in rows) / max(1, len(rows)),
    }


@refusals_exit("task_eval", resumable=True)
def main(argv: list[str] | None = None) -> None:
    ap = StageParser(
        description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--task", required=True, choices=sorted(ITEM_BUILDERS), help="arc (ARC-Challenge) or gsm8k")
    ap.add_argument(
        "--handoff",
        choices=("prompt", "trace"),
        default="prompt",
        help="prompt: hand over after the prompt; trace: after the source's reasoning trace",
    )
    ap.add_argument(
        "--trace-tokens",
        type=whole(1),
        default=None,
        help="cap on the reasoning trace in trace mode (default: the profile's max_new_tokens)",
    )
    add_eval_args(
        ap,
        "items scored, the first N",
        "the task's data set (ARC: allenai/ai2_arc ARC-Challenge/test; "
        "GSM8K: openai/gsm8k main/test; revisions in kvlingo/eval/tasks/data.py)",
        "TASK",
    )
    args = ap.parse_args(argv)
    data = DATASETS[args.task]

    if args.prepare:
        return prepare_and_exit(data, args)

    # ---------------------------------------------------------------- inputs
    t_start = time.time()
    profile = get_profile(args.profile)
    paths = run_paths(args)
    limit = args.limit if args.limit is not None else profile.task_items
    cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
    trace = args.handoff == "trace"
    trace_cap = (args.trace_tokens if args.trace_tokens is not None else profile.max_new_tokens) if trace else None
    if limit < 1 or cap < 1 or (trace and trace_cap < 1):
        raise Refusal("--limit, --max-new-tokens and --trace-tokens must be at least 1")
    thinking = True if trace else args.thinking
    try:
        rows, data_info = load_data(data, args.data_root, args.source)
    except ValueError as e:
        raise Refusal(str(e)) from None
    rows = split_rows(rows, args.split)
    if limit > len(rows):
        print(f"note: --limit {limit} but the data holds {len(rows)} items; scoring all of them")
    items = [ITEM_BUILDERS[args.task](r) for r in rows[:limit]]
    base = f"task-{args.task}" + ("-trace" if trace else "")
    name, sibling = (f"{base}-native", base) if args.native else (base, f"{base}-native")
    name, sibling = name + split_suffix(args.split), sibling + split_suffix(args.split)
    check_outputs([paths.report(name), paths.beside(name, ".rows.jsonl"), paths.beside(name, ".md")])
    session = Session(args, paths)  # the pair and the translator folder, checked; no weights yet
    controls = control_paths(args, len(items))
    config = TaskConfig(
        profile.name,
        paths.run,
        args.task,
        args.handoff,
        "native" if args.native else "translated",
        None if args.native else args.translator,
        len(items),
        cap,
        trace_cap,
        thinking,
        controls,
        str(args.refresh),
        session.pair_cfg,
        args.split,
    )
    inputs = {"data": data_info, **session.translator_inputs}
    ident = session.identity(config, inputs, resume.code_hash(SCRIPT))
    lock_run(paths.res, name)  # before the up-to-date check and the models: also refuses a folder it cannot write
    if session.say_if_up_to_date(paths.report(name), ident, args.force):
        return
    session.load()
    pair, tok, eos = session.pair, session.pair.tokenizer, session.eos

    # ---------------------------------------------------------------- rows
    models = pair.identities()
    maps_sha = session.translator_info["maps_sha256"] if session.translator_info else None
    env = {
        "stage": "task",
        "task": args.task,
        "handoff": args.handoff,
        "dtype": config.pair.dtype,
        "device": pair.device.split(":")[0],
    }
    answer_settings = {"max_new_tokens": cap, "enable_thinking": thinking, "trace_tokens": trace_cap}
    if args.native:
        scored = ("native_source", "native_target")
    else:
        scored = ("translated", "native_target_with_trace" if trace else "native_target", *controls)
    log = session.open_rows(paths.beside(name, ".rows.jsonl"), ident, args.resume, paths.beside(sibling, ".rows.jsonl"))

    def answer(path: str, prefix: list[int], item, extra: dict | None = None, other: list[int] | None = None) -> dict:
        gen = generate(
            "native_target" if path == "native_target_with_trace" else path,
            pair,
            session.translator,
            prefix,
            cap,
            eos,
            other,
            args.refresh,
        )
        reply = answer_text(tok, gen.ids)
        pred, correct = score(args.task, item, reply)
        return {
            "path": path,
            "item_id": item.id,
            "gold": item.gold,
            "pred": pred,
            "correct": correct,
            "reply": reply,
            "prompt_tokens": len(prefix),
            "new_ids": gen.ids,
            "new_tokens": len(gen.ids),
            "hit_cap": gen.hit_cap,
            "seconds": gen.seconds,
            **(extra or {}),
        }

    def own_trace(model, path: str, prompt_ids: list[int]) -> dict:
        tr = reasoning_trace(model, tok, prompt_ids, trace_cap, eos, pair.cache)
        return {
            "path": path,
            "trace_ids": tr.trace_ids,
            "trace_hit_cap": tr.hit_cap,
            "trace_seconds": tr.seconds,
            "trace_text": tok.decode(tr.trace_ids, skip_special_tokens=False),
        }

    def source_trace(prompt_ids: list[int], item_id: str) -> dict:
        return {**own_trace(pair.source, "source_trace", prompt_ids), "item_id": item_id}

    def produce(path: str, item, prompt_ids: list[int], prefix: list[int], other: list[int] | None) -> dict:
        if trace and path == "native_target":
            # the target reasons on its own first, then answers after its own trace
            t = own_trace(pair.target, path, prompt_ids)
            own = trace_prefix(tok, prompt_ids, t["trace_ids"], t["trace_hit_cap"])
            return answer(path, own, item, {k: v for k, v in t.items() if k != "path"})
        return answer(path, prefix, item, other=other)

    # Prefixes first (in trace mode the source's reasoning), so the control can use the next item's.
    prepared: list[tuple] = []
    traces: list[dict] = []
    for item in tqdm(items, desc=f"{args.task} source traces", unit="item", disable=not trace):
        prompt_ids = user_prompt_ids(tok, item.prompt, thinking)
        common = {**env, "item": asdict(item), "prompt_ids_sha256": sha256_json(prompt_ids)}
        prefix, trace_key = prompt_ids, None
        if trace:
            trace_key = item_key(**common, path="source_trace", trace_tokens=trace_cap, model=models["source"])
            trow = session.finished(trace_key, partial(source_trace, prompt_ids, item.id))
            traces.append(trow)
            prefix = trace_prefix(tok, prompt_ids, trow["trace_ids"], trow["trace_hit_cap"])
        prepared.append((item, prompt_ids, prefix, common, trace_key))

    by_path: dict[str, list[dict]] = {p: [] for p in scored}
    translated_ident = {
        "source": models["source"],
        "target": models["target"],
        "maps_sha256": maps_sha,
        **({"refresh": str(args.refresh)} if args.refresh.kind != "none" else {}),
    }
    for i, (item, prompt_ids, prefix, common, trace_key) in enumerate(
        tqdm(prepared, desc=f"{args.task} {args.handoff} {config.mode}", unit="item")
    ):
        other = prepared[control_partner(i, len(prepared))][2] if controls else None
        for path in scored:
            if path in ("translated", "control"):
                ident = dict(translated_ident)
            else:
                ident = {"model": models["source" if path == "native_source" else "target"]}
            if path == "control":
                ident["other_prefix_sha256"] = sha256_json(other)
            key = item_key(**common, **answer_settings, path=path, trace_key=trace_key, **ident)
            by_path[path].append(session.finished(key, partial(produce, path, item, prompt_ids, prefix, other)))

    # ---------------------------------------------------------------- report
    a, b = scored[:2]
    comparison = {
        f"{a}_vs_{b}": paired_accuracy([r["correct"] for r in by_path[a]], [r["correct"] for r in by_path[b]])
    }
    for floor in controls:
        comparison[f"translated_vs_{floor}"] = paired_accuracy(
            [r["correct"] for r in by_path["translated"]], [r["correct"] for r in by_path[floor]]
        )
    trace_info = None
    if trace:
        trace_info = {"source": trace_summary(traces)}
        if args.native:
            trace_info["target"] = trace_summary(by_path["native_target"])
    results = TaskResults(
        args.task,
        args.handoff,
        config.mode,
        {p: summarize(rs) for p, rs in by_path.items()},
        comparison,
        trace_info,
        {**session.counts, "dropped_torn_line": log.dropped_torn_line},
    )
    Report(
        f"task-{args.task}",
        config=config,
        results=results,
        metrics=TaskResults.METRICS,
        wall_time_s=time.time() - t_start,
        device=pair.device,
        dtype=config.pair.dtype,
        n_samples={"items": len(items)},
        inputs={
            **inputs,
            "items_sha256": sha256_json([asdict(i) for i in items]),
            "translator": session.translator_info,
            "code_sha256": resume.code_hash(SCRIPT),
            "rows": session.rows_input(),
        },
        resume_key=resume.resume_key(log.settings),
        files={log.path.name: session.rows_input()["sha256"]},
    ).write(paths.report(name))
    pct = lambda m: fmt_pm(m, 100.0, ".1f", missing="-")  # noqa: E731
    table = fmt_table(
        ["path", "items", "accuracy", "no answer", "hit cap", "new tokens"],
        [
            [p, s["accuracy"]["n"], pct(s["accuracy"]), s["no_answer"], s["hit_cap"], round(s["mean_new_tokens"], 1)]
            for p, s in results.paths.items()
        ],
    )
    c = comparison[f"{a}_vs_{b}"]
    line = (
        f"{a} − {b}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g}; "
        f"{a} only {c['mcnemar']['a_only']}, {b} only {c['mcnemar']['b_only']})"
    )
    for floor in controls:
        c = comparison[f"translated_vs_{floor}"]
        line += f"\ntranslated − {floor}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g})"
    if trace:
        t = trace_info["source"]
        line += f"\nsource traces: {t['n']}, mean {t['mean_tokens']:.1f} tokens, {t['hit_cap']} cut by the cap"
    title = f"# {args.task} ({args.handoff}, {config.mode}, run {paths.run})"
    atomic_write_text(paths.beside(name, ".md"), f"{title}\n\n{table}\n{line}\n")
    print(table + line)
    counts = session.counts
    print(
        f"rows: {counts['generated']} generated, {counts['resumed']} resumed, {counts['reused_from_sibling']} reused "
        f"from {sibling}.rows.jsonl; report {paths.report(name)}"
    )


if __name__ == "__main__":
    main()
