"""ARC-Challenge and GSM8K accuracy after a KV-cache handoff (generate, then parse the answer).

Usage:
    python task_eval.py --task arc --prepare                      # once: the data into data/arc/ (needs the Hub)
    python task_eval.py --task arc --native --run pilot-l2s       # native source and native target
    python task_eval.py --task arc --run pilot-l2s                # translated, paired with the native target
    python task_eval.py --task gsm8k --handoff trace --run pilot-l2s

Handoff modes (prompt formats and answer parsers: kvlingo/tasks.py):
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
whose input hash matches and refuses a changed setting.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from kvlingo.handoff import stop_ids
from kvlingo.itemrows import ItemRows, RowsError, SettingsChanged, item_key
from kvlingo.models import add_pair_args, dtype_name
from kvlingo.profiles import get_profile
from kvlingo.report import (atomic_write_json, atomic_write_text, code_hash, fmt_table, make_report, sha256_file,
                            sha256_json)
from kvlingo.stats import mean_se
from kvlingo.tasks import (CONTROL_PATHS, DATASETS, ITEM_BUILDERS, add_eval_args, answer_text, control_partner,
                           generate_control, generate_native, generate_no_context, generate_translated, load_data,
                           pair_and_translator, paired, pct, prepare_data, reasoning_trace, score, trace_prefix,
                           user_prompt_ids)

EPILOG = """examples:
  python task_eval.py --task arc --native --device cuda --run pilot-l2s
  python task_eval.py --task gsm8k --run pilot-l2s --maps closed_form --resume
  python task_eval.py --task gsm8k --handoff trace --trace-tokens 512 --run pilot-l2s
  python task_eval.py --task arc --source arc_local.jsonl --large L --small S --dtype float32 --profile tiny --run t
"""


@dataclass(frozen=True)
class TaskConfig:
    run: str  # results/<run>/ (and artifacts/<run>/ for the maps)
    profile: str  # run profile: default item count and token cap
    task: str  # arc or gsm8k
    handoff: str  # prompt or trace
    mode: str  # "translated" (translated + native target) or "native" (native source + native target)
    limit: int  # items scored: the first N of the split, in its order
    max_new_tokens: int  # greedy cap on each answer
    trace_tokens: int | None  # greedy cap on the reasoning trace (trace mode)
    enable_thinking: bool  # the chat template's thinking switch for the prompt (always on in trace mode)
    large: str  # larger model (Hub id[@rev] or folder)
    small: str  # smaller model
    direction: str  # l2s: large reads, small continues; s2l the reverse
    device: str  # resolved device
    dtype: str  # model dtype
    maps_dir: str | None  # translator maps folder (translated mode only)
    controls: tuple[str, ...]  # floors scored beside a translated run (control, no_context), or none


def summarize(rows: list[dict]) -> dict:
    return {
        "accuracy": mean_se([float(r["correct"]) for r in rows]),
        "no_answer": sum(r["pred"] is None for r in rows),
        "hit_cap": sum(r["hit_cap"] for r in rows),
        "mean_new_tokens": sum(r["new_tokens"] for r in rows) / max(1, len(rows)),
        "mean_seconds": sum(r["seconds"] for r in rows) / max(1, len(rows)),
    }


def trace_summary(rows: list[dict]) -> dict:
    return {"n": len(rows), "hit_cap": sum(r["trace_hit_cap"] for r in rows),
            "mean_tokens": sum(len(r["trace_ids"]) for r in rows) / max(1, len(rows))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--task", required=True, choices=sorted(ITEM_BUILDERS), help="arc (ARC-Challenge) or gsm8k")
    ap.add_argument("--handoff", choices=("prompt", "trace"), default="prompt",
                    help="prompt: hand over after the prompt; trace: after the source's reasoning trace")
    ap.add_argument("--trace-tokens", type=int, default=None,
                    help="cap on the reasoning trace in trace mode (default: the profile's max_new_tokens)")
    add_eval_args(ap, "items scored, the first N", "the task's data set (ARC: allenai/ai2_arc ARC-Challenge/test; "
                  "GSM8K: openai/gsm8k main/test; revisions in kvlingo/tasks.py)", "TASK")
    args = ap.parse_args(argv)
    data = DATASETS[args.task]

    if args.prepare:
        try:
            manifest = prepare_data(data, args.data_root, args.source)
        except ValueError as e:
            raise SystemExit(f"task_eval: {e}") from None
        print(f"wrote {manifest['rows']} {data.name} rows to {Path(args.data_root) / data.name} ({manifest['origin']})")
        return

    # ---------------------------------------------------------------- inputs
    t_start = time.time()
    profile = get_profile(args.profile)
    run = args.run or f"{profile.name}-{args.direction}"
    limit = args.limit if args.limit is not None else profile.task_items
    cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
    trace = args.handoff == "trace"
    trace_cap = (args.trace_tokens if args.trace_tokens is not None else profile.max_new_tokens) if trace else None
    if limit < 1 or cap < 1 or (trace and trace_cap < 1):
        raise SystemExit("task_eval: --limit, --max-new-tokens and --trace-tokens must be at least 1")
    thinking = True if trace else args.thinking
    try:
        rows, data_info = load_data(data, args.data_root, args.source)
    except ValueError as e:
        raise SystemExit(f"task_eval: {e}") from None
    if limit > len(rows):
        print(f"note: --limit {limit} but the data holds {len(rows)} items; scoring all of them")
    items = [ITEM_BUILDERS[args.task](r) for r in rows[:limit]]

    pair, translator, maps_info, maps_dir = pair_and_translator(args, run, "task_eval")
    models = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
    tok, eos, dtype = pair.tokenizer, stop_ids(pair.tokenizer), dtype_name(pair.dtype)
    controls = () if args.native or args.no_controls or len(items) < 2 else CONTROL_PATHS
    if not args.native and not args.no_controls and len(items) < 2:
        print("note: one item only; the control path needs two, so the controls are skipped")
    config = TaskConfig(run, profile.name, args.task, args.handoff, "native" if args.native else "translated",
                        len(items), cap, trace_cap, thinking, args.large, args.small, args.direction, pair.device,
                        dtype, str(maps_dir) if maps_dir else None, controls)

    # ---------------------------------------------------------------- rows
    maps_sha = maps_info["maps_sha256"] if maps_info else None
    env = {"stage": "task", "task": args.task, "handoff": args.handoff, "dtype": dtype,
           "device": pair.device.split(":")[0]}
    answer_settings = {"max_new_tokens": cap, "enable_thinking": thinking, "trace_tokens": trace_cap}
    if args.native:
        paths = ("native_source", "native_target")
    else:
        paths = ("translated", "native_target_with_trace" if trace else "native_target", *controls)
    settings = {**env, **answer_settings, "models": models, "maps_sha256": maps_sha}
    out_dir = Path(args.results) / run
    base = f"task-{args.task}" + ("-trace" if trace else "")
    name, sibling = (f"{base}-native", base) if args.native else (base, f"{base}-native")
    try:
        log = ItemRows(out_dir / f"{name}.rows.jsonl", settings, args.resume,
                       donors=[out_dir / f"{sibling}.rows.jsonl"], info={"code_sha256": code_hash(__file__)})
    except (SettingsChanged, RowsError) as e:
        raise SystemExit(f"task_eval: {e}") from None
    counts = {"generated": 0, "resumed": 0, "reused_from_sibling": 0}

    def finished(key: str, make) -> dict:
        """The row for `key`: resumed, copied from the sibling log, or made now and appended."""
        how = "resumed" if key in log else "reused_from_sibling"
        row = log.get(key)
        if row is None:
            how, row = "generated", log.append(key, make())
        counts[how] += 1
        return row

    def answer(path: str, model_name: str, prefix: list[int], item, extra: dict | None = None,
               other: list[int] | None = None) -> dict:
        if path == "translated":
            gen = generate_translated(pair.source, pair.target, translator, prefix, cap, eos, pair.dtype)
        elif path == "control":
            gen = generate_control(pair.source, pair.target, translator, other, prefix, cap, eos, pair.dtype)
        elif path == "no_context":
            gen = generate_no_context(pair.target, prefix, cap, eos)
        else:
            gen = generate_native(getattr(pair, model_name), prefix, cap, eos)
        reply = answer_text(tok, gen.ids)
        pred, correct = score(args.task, item, reply)
        return {"path": path, "item_id": item.id, "gold": item.gold, "pred": pred, "correct": correct,
                "reply": reply, "prompt_tokens": len(prefix), "new_ids": gen.ids, "new_tokens": len(gen.ids),
                "hit_cap": gen.hit_cap, "seconds": gen.seconds, **(extra or {})}

    def own_trace(model_name: str, path: str, prompt_ids: list[int]) -> dict:
        tr = reasoning_trace(getattr(pair, model_name), tok, prompt_ids, trace_cap, eos)
        return {"path": path, "trace_ids": tr.trace_ids, "trace_hit_cap": tr.hit_cap, "trace_seconds": tr.seconds,
                "trace_text": tok.decode(tr.trace_ids, skip_special_tokens=False)}

    def produce(path: str, item, prompt_ids: list[int], prefix: list[int], other: list[int] | None) -> dict:
        if trace and path == "native_target":
            # the target reasons on its own first, then answers after its own trace
            t = own_trace("target", path, prompt_ids)
            own = trace_prefix(tok, prompt_ids, t["trace_ids"], t["trace_hit_cap"])
            return answer(path, "target", own, item, {k: v for k, v in t.items() if k != "path"})
        return answer(path, "source" if path == "native_source" else "target", prefix, item, other=other)

    # Prefixes first (in trace mode the source's reasoning), so the control can use the next item's.
    prepared: list[tuple] = []
    traces: list[dict] = []
    for item in tqdm(items, desc=f"{args.task} source traces", unit="item", disable=not trace):
        prompt_ids = user_prompt_ids(tok, item.prompt, thinking)
        common = {**env, "item": asdict(item), "prompt_ids_sha256": sha256_json(prompt_ids)}
        prefix, trace_key = prompt_ids, None
        if trace:
            trace_key = item_key(**common, path="source_trace", trace_tokens=trace_cap, model=models["source"])
            trow = finished(trace_key, lambda: {**own_trace("source", "source_trace", prompt_ids), "item_id": item.id})
            traces.append(trow)
            prefix = trace_prefix(tok, prompt_ids, trow["trace_ids"], trow["trace_hit_cap"])
        prepared.append((item, prompt_ids, prefix, common, trace_key))

    by_path: dict[str, list[dict]] = {p: [] for p in paths}
    translated_ident = {"source": models["source"], "target": models["target"], "maps_sha256": maps_sha}
    for i, (item, prompt_ids, prefix, common, trace_key) in enumerate(
            tqdm(prepared, desc=f"{args.task} {args.handoff} {config.mode}", unit="item")):
        other = prepared[control_partner(i, len(prepared))][2] if controls else None
        for path in paths:
            if path in ("translated", "control"):
                ident = dict(translated_ident)
            else:
                ident = {"model": models["source" if path == "native_source" else "target"]}
            if path == "control":
                ident["other_prefix_sha256"] = sha256_json(other)
            key = item_key(**common, **answer_settings, path=path, trace_key=trace_key, **ident)
            by_path[path].append(finished(key, lambda: produce(path, item, prompt_ids, prefix, other)))

    # ---------------------------------------------------------------- report
    results = {"task": args.task, "handoff": args.handoff, "mode": config.mode,
               "paths": {p: summarize(rs) for p, rs in by_path.items()}}
    a, b = paths[:2]
    results["comparison"] = {f"{a}_vs_{b}": paired([r["correct"] for r in by_path[a]],
                                                    [r["correct"] for r in by_path[b]])}
    for floor in controls:
        results["comparison"][f"translated_vs_{floor}"] = paired([r["correct"] for r in by_path["translated"]],
                                                                 [r["correct"] for r in by_path[floor]])
    if trace:
        results["trace"] = {"source": trace_summary(traces)}
        if args.native:
            results["trace"]["target"] = trace_summary(by_path["native_target"])
    report = make_report(
        f"task-{args.task}", config=config, results=results, wall_time_s=time.time() - t_start, device=pair.device,
        dtype=dtype, n_samples={"items": len(items)},
        inputs={"data": data_info, "items_sha256": sha256_json([asdict(i) for i in items]), "models": models,
                "maps": maps_info, "code_sha256": code_hash(__file__),
                "rows": {"path": str(log.path), "sha256": sha256_file(log.path)}},
        rows={**counts, "dropped_torn_line": log.dropped_torn_line},
    )
    table = fmt_table(["path", "items", "accuracy", "no answer", "hit cap", "new tokens"], [
        [p, s["accuracy"]["n"], pct(s["accuracy"]), s["no_answer"], s["hit_cap"], round(s["mean_new_tokens"], 1)]
        for p, s in results["paths"].items()
    ])
    c = results["comparison"][f"{a}_vs_{b}"]
    line = (f"{a} − {b}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g}; "
            f"{a} only {c['mcnemar']['a_only']}, {b} only {c['mcnemar']['b_only']})")
    for floor in controls:
        c = results["comparison"][f"translated_vs_{floor}"]
        line += f"\ntranslated − {floor}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g})"
    if trace:
        t = results["trace"]["source"]
        line += f"\nsource traces: {t['n']}, mean {t['mean_tokens']:.1f} tokens, {t['hit_cap']} cut by the cap"
    atomic_write_json(out_dir / f"{name}.json", report)
    title = f"# {args.task} ({args.handoff}, {config.mode}, run {run})"
    atomic_write_text(out_dir / f"{name}.md", f"{title}\n\n{table}\n{line}\n")
    print(table + line)
    print(f"rows: {counts['generated']} generated, {counts['resumed']} resumed, {counts['reused_from_sibling']} reused "
          f"from {sibling}.rows.jsonl; report {out_dir / f'{name}.json'}")


if __name__ == "__main__":
    main()
