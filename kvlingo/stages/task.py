"""ARC-Challenge and GSM8K accuracy after a KV-cache handoff (task_eval.py: generate, then parse the answer).

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
runs (--force runs it again). --prepare copies or fetches the task's rows into DATA_ROOT/TASK/
and exits.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ..core.settings import Refresh
from ..errors import Refusal
from ..eval.tasks.prompts import ITEM_BUILDERS
from ..inputs.argtypes import whole
from ..inputs.profiles import get_profile
from ..records import resume
from ..records.paths import check_outputs, run_paths
from ..records.report import Metric
from .session import Session, add_eval_args, control_paths, prepare_and_exit, report_names
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..eval.tasks.prompts import TaskItem
    from ..inputs.models import PairConfig


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
    refresh: Refresh  # the part of each translated prefix the target recomputes (kvlingo/core/refresh.py)
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


@dataclass(frozen=True)
class Prepared:
    """One item ready to answer: its prompt, the prefix the answer follows (the prompt, or in trace mode the
    prompt and the source's closed trace), what every row of it hashes, and its trace row's key."""

    item: TaskItem
    prompt_ids: list[int]
    prefix: list[int]
    common: dict[str, Any]
    trace_key: str | None


class Task(Stage):
    name = "task_eval"
    script = "task_eval.py"
    summary = "ARC-Challenge and GSM8K accuracy after a KV-cache handoff (generate, then parse the answer)."
    examples = (
        ".venv/bin/python task_eval.py --task arc --native --device cuda --run pilot-l2s",
        ".venv/bin/python task_eval.py --task gsm8k --run pilot-l2s --translator closed_form --resume",
        ".venv/bin/python task_eval.py --task gsm8k --handoff trace --trace-tokens 512 --run pilot-l2s",
        ".venv/bin/python task_eval.py --task arc --source artifacts/toy/corpus/arc.jsonl --large artifacts/toy/large "
        "--small artifacts/toy/small --device cpu --dtype float32 --profile demo",
    )
    resumable = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument("--task", required=True, choices=sorted(ITEM_BUILDERS), help="arc (ARC-Challenge) or gsm8k")
        p.add_argument(
            "--handoff",
            choices=("prompt", "trace"),
            default="prompt",
            help="prompt: hand over after the prompt; trace: after the source's reasoning trace",
        )
        p.add_argument(
            "--trace-tokens",
            type=whole(1),
            default=None,
            help="cap on the reasoning trace in trace mode (default: the profile's max_new_tokens)",
        )
        add_eval_args(
            p,
            "items scored, the first N",
            "the task's data set (ARC: allenai/ai2_arc ARC-Challenge/test; "
            "GSM8K: openai/gsm8k main/test; revisions in kvlingo/eval/tasks/data.py)",
            "TASK",
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """--prepare is done here, and `up_to_date` ends the stage with it; else the items, the pair and the
        translator folder are checked, and the run's identity made."""
        from ..eval.tasks.data import DATASETS

        args = self.args
        self.one_off = prepare_and_exit(DATASETS[args.task], args) if args.prepare else None
        if self.one_off is not None:
            return
        self.t0 = time.time()
        profile = get_profile(args.profile)
        self.paths = paths = run_paths(args)
        limit = args.limit if args.limit is not None else profile.task_items
        self.cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
        self.trace = args.handoff == "trace"
        self.trace_cap = (
            (args.trace_tokens if args.trace_tokens is not None else profile.max_new_tokens) if self.trace else None
        )
        if limit < 1 or self.cap < 1 or (self.trace and self.trace_cap < 1):
            raise Refusal("--limit, --max-new-tokens and --trace-tokens must be at least 1")
        self.thinking = True if self.trace else args.thinking
        self.items, data_info = read_items(args, limit)
        self.name, self.sibling = report_names(f"task-{args.task}" + ("-trace" if self.trace else ""), args)
        check_outputs([paths.report(self.name), paths.beside(self.name, ".rows.jsonl"), paths.beside(self.name, ".md")])
        self.session = Session(args, paths)  # the pair and the translator folder, checked; no weights yet
        self.controls = control_paths(args, len(self.items))
        self.config = self._config(profile.name)
        self.inputs = {"data": data_info, **self.session.translator_inputs}
        self.code_sha = resume.code_hash(self.script_path())
        self.ident = self.session.identity(self.config, self.inputs, self.code_sha)

    def _config(self, profile: str) -> TaskConfig:
        args = self.args
        return TaskConfig(
            profile,
            self.paths.run,
            args.task,
            args.handoff,
            "native" if args.native else "translated",
            None if args.native else args.translator,
            len(self.items),
            self.cap,
            self.trace_cap,
            self.thinking,
            self.controls,
            args.refresh,
            self.session.pair_cfg,
            args.split,
        )

    @property
    def scored(self) -> tuple[str, ...]:
        """The answering paths, the two the headline compares first."""
        if self.args.native:
            return ("native_source", "native_target")
        return ("translated", "native_target_with_trace" if self.trace else "native_target", *self.controls)

    def up_to_date(self) -> dict | None:
        if self.one_off is not None:
            return self.one_off
        lock_run(self.paths.res, self.name)  # before the up-to-date check and the models: refuses an unwritable folder
        return self.session.say_if_up_to_date(self.paths.report(self.name), self.ident, self.args.force)

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        """The pair's weights and the translator, then the rows log (a resume under another identity is refused
        there)."""
        paths = self.paths
        self.session.load()
        self.session.open_rows(
            paths.beside(self.name, ".rows.jsonl"),
            self.ident,
            self.args.resume,
            paths.beside(self.sibling, ".rows.jsonl"),
        )

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, list[dict]]:
        """Prefixes first (in trace mode the source's reasoning), so the control can use the next item's; then
        every (item, path) answer: resumed, reused from the sibling log, or generated now. Rows by path."""
        from tqdm.auto import tqdm

        from ..eval.itemrows import item_key
        from ..eval.tasks.generate import control_partner
        from ..io import sha256_json

        prepared = self._prefixes()
        answer_settings = {"max_new_tokens": self.cap, "enable_thinking": self.thinking, "trace_tokens": self.trace_cap}
        by_path: dict[str, list[dict]] = {p: [] for p in self.scored}
        bar = tqdm(prepared, desc=f"{self.args.task} {self.args.handoff} {self.config.mode}", unit="item")
        for i, p in enumerate(bar):
            other = prepared[control_partner(i, len(prepared))].prefix if self.controls else None
            for path in self.scored:
                ident = self._path_inputs(path)
                if path == "control":
                    ident["other_prefix_sha256"] = sha256_json(other)
                key = item_key(**p.common, **answer_settings, path=path, trace_key=p.trace_key, **ident)
                by_path[path].append(self.session.finished(key, partial(self._produce, path, p, other)))
        return by_path

    def _prefixes(self) -> list[Prepared]:
        """Each item's prompt and prefix; in trace mode the source's trace, resumed or generated now."""
        from tqdm.auto import tqdm

        from ..eval.itemrows import item_key
        from ..eval.tasks.generate import trace_prefix
        from ..eval.tasks.prompts import user_prompt_ids
        from ..io import sha256_json

        pair, tok = self.session.pair, self.session.pair.tokenizer
        env = {
            "stage": "task",
            "task": self.args.task,
            "handoff": self.args.handoff,
            "dtype": self.config.pair.dtype,
            "device": pair.device.split(":")[0],
        }
        source = pair.identities()["source"]
        self.traces: list[dict] = []
        prepared = []
        for item in tqdm(self.items, desc=f"{self.args.task} source traces", unit="item", disable=not self.trace):
            prompt_ids = user_prompt_ids(tok, item.prompt, self.thinking)
            common = {**env, "item": asdict(item), "prompt_ids_sha256": sha256_json(prompt_ids)}
            prefix, trace_key = prompt_ids, None
            if self.trace:
                trace_key = item_key(**common, path="source_trace", trace_tokens=self.trace_cap, model=source)
                trow = self.session.finished(trace_key, partial(self._source_trace, prompt_ids, item.id))
                self.traces.append(trow)
                prefix = trace_prefix(tok, prompt_ids, trow["trace_ids"], trow["trace_hit_cap"])
            prepared.append(Prepared(item, prompt_ids, prefix, common, trace_key))
        return prepared

    def _path_inputs(self, path: str) -> dict[str, Any]:
        """What a path's rows hash besides the item: the models, and for a translated path the maps and refresh."""
        models, refresh = self.session.pair.identities(), self.args.refresh
        if path in ("translated", "control"):
            return {
                "source": models["source"],
                "target": models["target"],
                "maps_sha256": self.session.maps_sha,
                **({"refresh": refresh} if refresh.active else {}),
            }
        return {"model": models["source" if path == "native_source" else "target"]}

    def _produce(self, path: str, p: Prepared, other: list[int] | None) -> dict:
        from ..eval.tasks.generate import trace_prefix

        if self.trace and path == "native_target":
            # the target reasons on its own first, then answers after its own trace
            t = self._own_trace(self.session.pair.target, path, p.prompt_ids)
            own = trace_prefix(self.session.pair.tokenizer, p.prompt_ids, t["trace_ids"], t["trace_hit_cap"])
            return self._answer(path, own, p.item, {k: v for k, v in t.items() if k != "path"})
        return self._answer(path, p.prefix, p.item, other=other)

    def _answer(
        self, path: str, prefix: list[int], item: TaskItem, extra: dict | None = None, other: list[int] | None = None
    ) -> dict:
        from ..eval.tasks.generate import answer_text, generate
        from ..eval.tasks.parsers import score

        session = self.session
        gen = generate(
            "native_target" if path == "native_target_with_trace" else path,
            session.pair,
            session.translator,
            prefix,
            self.cap,
            session.eos,
            other,
            self.args.refresh,
        )
        reply = answer_text(session.pair.tokenizer, gen.ids)
        pred, correct = score(self.args.task, item, reply)
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

    def _own_trace(self, model, path: str, prompt_ids: list[int]) -> dict:
        from ..eval.tasks.generate import reasoning_trace

        session, tok = self.session, self.session.pair.tokenizer
        tr = reasoning_trace(model, tok, prompt_ids, self.trace_cap, session.eos, session.pair.cache)
        return {
            "path": path,
            "trace_ids": tr.trace_ids,
            "trace_hit_cap": tr.hit_cap,
            "trace_seconds": tr.seconds,
            "trace_text": tok.decode(tr.trace_ids, skip_special_tokens=False),
        }

    def _source_trace(self, prompt_ids: list[int], item_id: str) -> dict:
        return {**self._own_trace(self.session.pair.source, "source_trace", prompt_ids), "item_id": item_id}

    # ------------------------------------------------------------------ publish
    def publish(self, by_path: dict[str, list[dict]]) -> dict:
        """The report, then its table (.md and stdout)."""
        results = self._results(by_path)
        report = self._report(results)
        self._say(results)
        return report

    def _results(self, by_path: dict[str, list[dict]]) -> TaskResults:
        from ..eval.stats import paired_accuracy

        a, b = self.scored[:2]
        correct = lambda path: [r["correct"] for r in by_path[path]]  # noqa: E731
        comparison = {f"{a}_vs_{b}": paired_accuracy(correct(a), correct(b))}
        for floor in self.controls:
            comparison[f"translated_vs_{floor}"] = paired_accuracy(correct("translated"), correct(floor))
        trace_info = None
        if self.trace:
            trace_info = {"source": trace_summary(self.traces)}
            if self.args.native:
                trace_info["target"] = trace_summary(by_path["native_target"])
        return TaskResults(
            self.args.task,
            self.args.handoff,
            self.config.mode,
            {p: summarize(rs) for p, rs in by_path.items()},
            comparison,
            trace_info,
            self.session.rows_summary(),
        )

    def _report(self, results: TaskResults) -> dict:
        from ..io import sha256_json
        from ..records.report import Report

        session, log = self.session, self.session.log
        rows = session.rows_input()
        return Report(
            f"task-{self.args.task}",
            config=self.config,
            results=results,
            metrics=TaskResults.METRICS,
            wall_time_s=time.time() - self.t0,
            device=session.pair.device,
            dtype=self.config.pair.dtype,
            n_samples={"items": len(self.items)},
            inputs={
                **self.inputs,
                "items_sha256": sha256_json([asdict(i) for i in self.items]),
                "translator": session.translator_info,
                "code_sha256": self.code_sha,
                "rows": rows,
            },
            resume_key=resume.resume_key(log.settings),
            files={log.path.name: rows["sha256"]},
        ).write(self.paths.report(self.name))

    def _say(self, results: TaskResults) -> None:
        """The table and the paired differences, into RESULTS/RUN/NAME.md and on stdout."""
        from ..io import atomic_write_text

        args, paths = self.args, self.paths
        table, line = summary_text(results, self.scored[:2], self.controls)
        title = f"# {args.task} ({args.handoff}, {self.config.mode}, run {paths.run})"
        atomic_write_text(paths.beside(self.name, ".md"), f"{title}\n\n{table}\n{line}\n")
        print(table + line)
        self.session.say_counts("rows", self.sibling, paths.report(self.name))


# --------------------------------------------------------------------------- helpers
def read_items(args, limit: int) -> tuple[list[TaskItem], dict[str, Any]]:
    """(the first `limit` items of the item split, the data's provenance): from --source or the prepared copy."""
    from ..eval.tasks.data import DATASETS, load_data, split_rows

    try:
        rows, data_info = load_data(DATASETS[args.task], args.data_root, args.source)
    except ValueError as e:
        raise Refusal(str(e)) from None
    rows = split_rows(rows, args.split)
    if limit > len(rows):
        print(f"note: --limit {limit} but the data holds {len(rows)} items; scoring all of them")
    return [ITEM_BUILDERS[args.task](r) for r in rows[:limit]], data_info


def summarize(rows: list[dict]) -> dict:
    from ..eval.stats import mean_se

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


def summary_text(results: TaskResults, compared: tuple[str, str], controls: tuple[str, ...]) -> tuple[str, str]:
    """(the per-path table, the paired differences and the traces in words)."""
    from ..records.report import fmt_pm, fmt_table

    pct = lambda m: fmt_pm(m, 100.0, ".1f", missing="-")  # noqa: E731
    table = fmt_table(
        ["path", "items", "accuracy", "no answer", "hit cap", "new tokens"],
        [
            [p, s["accuracy"]["n"], pct(s["accuracy"]), s["no_answer"], s["hit_cap"], round(s["mean_new_tokens"], 1)]
            for p, s in results.paths.items()
        ],
    )
    a, b = compared
    c = results.comparison[f"{a}_vs_{b}"]
    line = (
        f"{a} − {b}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g}; "
        f"{a} only {c['mcnemar']['a_only']}, {b} only {c['mcnemar']['b_only']})"
    )
    for floor in controls:
        c = results.comparison[f"translated_vs_{floor}"]
        line += f"\ntranslated − {floor}: {c['delta_points']:+.1f} points (McNemar exact p = {c['mcnemar']['p']:.3g})"
    if results.trace:
        t = results.trace["source"]
        line += f"\nsource traces: {t['n']}, mean {t['mean_tokens']:.1f} tokens, {t['hit_cap']} cut by the cap"
    return table, line
