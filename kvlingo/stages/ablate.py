"""Ablate the translator's levers on the same splits and budget: choices on validation, claims on test.

For each setting in kvlingo/stages/ablation.py (a family, its refresh setting, its objective):
train (closed form, then distillation at the profile's budget), then score the validation
conversations (benchmark --split validation: KL/token, the context-token metrics, attention-output
agreement) and the validation halves of IFEval and GSM8K after a prompt handoff. Across the
settings, each validation metric's rank correlation with task retention says which tracks the
tasks; the default is the best setting by that metric among those costing at most 10% of a
re-prefill at the real shapes. The chosen default, the profile's default and the direction's default
before are then scored on the test conversations and the test halves of the tasks, beside the native
rows (scored once and shared); a choice that is not the profile's default is paired against it there.
With --seeds, every setting is trained and scored with each seed (the default seed's cells in the
setting's folder, the others in SETTING-sSEED): a row is the mean over its seeds, and its ties and SEs
add the seeds' spread (kvlingo/stages/ablation.py, `within_noise`). Every step is a resumable cell (the
recipe's ledger): a killed run continues with --resume. Writes RESULTS/RUN/ablation.{json,md,png}.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.settings import Geometry
from ..errors import Failure, Refusal
from ..eval.itemrows import read_rows
from ..inputs.argtypes import whole
from ..inputs.flags import add_task_data_args, generative_tasks
from ..inputs.profiles import get_profile
from ..io import atomic_write_bytes, atomic_write_text, read_jsonl, sha256_file
from ..records.paths import MAPS_FILE, TRANSLATORS, RunPaths, check_outputs, default_data, default_run
from ..records.report import Metric, Report, figure, figure_png, fmt_pm, fmt_table, read_report
from ..records.resume import code_hash
from ..train.config import DEFAULT_SEED
from . import ablation as A
from . import cells as K
from .ledger import LEDGER_FILE
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


SPLITS = ("val", "test")  # row-field prefixes; the stages call them validation and test


@dataclass(frozen=True)
class AblationConfig:
    run: str  # cells live under ARTIFACTS/RUN/<setting> and RESULTS/RUN/<setting>
    profile: str  # profile passed to every stage (budget, splits)
    data: str  # prepared chat data
    settings: tuple[str, ...]  # the settings run (kvlingo/stages/ablation.py SETTINGS)
    long_factor: int  # the best two settings are trained again for this many × the profile's updates (0: not)
    seeds: tuple[int, ...]  # each setting trained with each seed; its figures the mean, its ties with their spread
    eval_root: str  # prepared IFEval and GSM8K data root
    tasks: tuple[str, ...]  # generative evaluations run per setting (ifeval, gsm8k)
    items: tuple[int, int]  # IFEval prompts and GSM8K items per row: validation half, test half
    artifacts: str
    results: str
    pair: PairConfig


ROW_FIELDS = ("settings", "seeds")  # which rows run: not part of what a resume must find unchanged (Ablate.load)


@dataclass
class AblationResults:
    rows: list  # one per setting (and long run): cost, validation figures, test figures where scored
    correlations: dict  # each validation metric's Spearman correlation with validation task retention
    metric: str  # the validation metric that tracks retention best: the one the default is chosen by
    default: dict  # the chosen default and why
    native: dict  # native target and source: task accuracy per split, KL of the native source on test

    METRICS = (
        Metric("rows.*.val_context_kl", False, "validation KL on the reply tokens the context decides"),
        Metric("rows.*.test_kl", False, "test KL(native target ‖ translated) per reply token"),
        Metric(
            "rows.*.test_ifeval.kept",
            True,
            "IFEval strict prompt accuracy after the handoff as a share of the native target's (test half)",
        ),
        Metric(
            "rows.*.test_gsm8k.kept",
            True,
            "GSM8K accuracy after a prompt handoff as a share of the native target's (test half)",
        ),
    )


class Plan:
    def __init__(self, cfg: AblationConfig):
        self.cfg, self.paths = cfg, RunPaths(cfg.run, cfg.artifacts, cfg.results)
        p = cfg.pair
        self.flags = K.stage_flags(cfg.profile, p, cfg.artifacts, cfg.results)
        self.inputs = {
            "data": K.data_hash(cfg.data, cfg.profile),
            "models": p.identities(),
            "eval_data": {t: sha256_file(Path(cfg.eval_root) / t / "manifest.json") for t in cfg.tasks},
        }

    def cell(self, stage: str, sub: str, flags: dict, report: str, **kw) -> K.Cell:
        from .registry import STAGES

        script = str(STAGES[stage].script)
        nested = self.paths.nested(sub)
        return K.Cell(
            f"{stage}/{sub}/{report}",
            stage,
            script,
            {**self.flags, "--run": nested.run, **flags},
            str(nested.report(report)),
            {**self.inputs, "code_sha256": code_hash(script)},
            **kw,
        )

    def train(self, setting: A.Setting, sub: str, updates: int | None = None, seed: int = DEFAULT_SEED) -> K.Cell:
        flags = {
            "--data": self.cfg.data,
            "--family": setting.family,
            "--updates": updates,
            "--refresh": setting.refresh,
            **({"--seed": seed} if seed != DEFAULT_SEED else {}),  # the default seed's cells keep their keys
        }
        return self.cell(
            "train",
            sub,
            flags,
            "train",
            extra=setting.flags,
            resume_flag="--resume",
            outputs=tuple(str(self.paths.nested(sub).translator(k) / MAPS_FILE) for k in TRANSLATORS),
        )

    def benchmark(self, setting: A.Setting, sub: str, split: str) -> K.Cell:
        flags = {
            "--data": self.cfg.data,
            "--split": split,
            "--timing-conversations": 0,
            "--control-dtypes": "none",
            "--refresh": setting.refresh,
        }
        return self.cell("benchmark", sub, flags, _benchmark_report(split), fresh_flag="--force")

    def generative(self, task: str, sub: str, split: str, native: bool, refresh: str = "none") -> K.Cell:
        stage, report = ("ifeval" if task == "ifeval" else "task"), task_report(task)
        limit = self.cfg.items[0 if split == "validation" else 1]
        flags = {
            "--data-root": self.cfg.eval_root,
            "--native": native,
            "--no-controls": not native,
            "--split": split,
            "--limit": limit,
            "--refresh": None if native else refresh,
        }
        if task == "gsm8k":
            flags["--task"] = "gsm8k"
        before = None
        if not native:  # the native target's answers are shared: copied beside the setting, reused by input hash
            rows = f"{report}-native{_split_suffix(split)}.rows.jsonl"
            src, dst = self.paths.nested("native").res / rows, self.paths.nested(sub).res / rows
            before = lambda: K.copy_file(src, dst)  # noqa: E731
        name = report + ("-native" if native else "") + _split_suffix(split)
        return self.cell(stage, sub, flags, name, resume_flag="--resume", before=before)


def task_figures(report: dict, task: str) -> dict:
    """A translated task report's accuracy, its share of the native target's (± SE) and the paired difference."""
    key = "prompt_level_strict_acc" if task == "ifeval" else "accuracy"
    res = report["results"]
    comparison = res["comparison"]["translated_vs_native_target"]
    return A.kept(
        res["paths"]["translated"][key],
        res["paths"]["native_target"][key],
        comparison[key] if task == "ifeval" else comparison,
    )


def arm_figures(report: dict, prefix: str) -> dict:
    d = report["results"]["quality"]["arms"]["distilled"]
    return {
        f"{prefix}_kl": d["kl_token_mean"],
        f"{prefix}_kl_conversation": d["kl_conversation"],
        f"{prefix}_top1": d["top1_agreement"],
        f"{prefix}_nll_delta": d["nll_delta_vs_native_target"],
        f"{prefix}_context_kl": d["context_kl_token_mean"],
        f"{prefix}_context_kl_conversation": d["context_kl_conversation"],
        f"{prefix}_context_top1": d["context_top1"],
        f"{prefix}_context_weighted_kl": d["context_weighted_kl"],
        f"{prefix}_attention_cosine": d["attention_cosine"]["mean"],
        f"{prefix}_n": d["n_conversations"],
        f"{prefix}_context_tokens": d["context_tokens"],
    }


def seed_run(sub: str, seed: int) -> str:
    """The folder of a setting's cells trained with `seed` (the default seed's: the setting's own)."""
    return sub if seed == DEFAULT_SEED else f"{sub}-s{seed}"


def summarise(plan: Plan, setting: A.Setting, sub: str, toy_geometry, long: bool) -> dict:
    res = plan.paths.nested(sub).res
    train = read_report(res / "train.json")["results"]
    row = {
        "name": sub,
        "run": sub,
        "setting": setting.name,
        "family": setting.family,
        "flags": list(setting.flags),
        "refresh": setting.refresh,
        "note": setting.note,
        "long_budget": long,
        "params": train["translator"]["n_params"],
        "real": A.real_cost(setting, plan.cfg.pair.direction, toy_geometry),
        "closed_form_val_kl": train["closed_form_val_kl"],
        "distilled_val_kl": train["distilled_val_kl"],
        "best_update": (train.get("best") or {}).get("update"),
        "train_wall_s": train["wall_time_s_total"],
        **arm_figures(read_report(res / "benchmark-validation.json"), "val"),
    }
    for t in plan.cfg.tasks:
        row[f"val_{t}"] = task_figures(read_report(res / f"{task_report(t)}-validation.json"), t)
    return row


def task_report(task: str) -> str:
    """The report name of a generative task's translated scores (ifeval, task-gsm8k)."""
    return "ifeval" if task == "ifeval" else f"task-{task}"


def tie_evidence(res: Path, metric: str, tasks: Sequence[str], split: str = "validation") -> dict:
    """A row's evidence for `A.within_noise` on `split`, from its rows files: the choosing metric (its value, and
    each conversation's part of it in the benchmark's conversation order) and each task's translated answer per item
    (right or not). The keys are `within_noise`'s whatever the split."""
    convs = read_jsonl(res / f"{_benchmark_report(split)}.rows.jsonl")
    value, parts = A.metric_per_conversation([c["arms"]["distilled"] for c in convs], metric)
    items: dict[str, dict] = {}
    for t in tasks:
        _, rows, _ = read_rows(res / f"{task_report(t)}{_split_suffix(split)}.rows.jsonl")
        items[t] = {
            str(r.get("doc_key", r.get("item_id"))): bool(
                r["grades"]["prompt_level_strict_acc"] if t == "ifeval" else r["correct"]
            )
            for r in rows
            if r.get("kind") == "item" and r.get("path") == "translated"
        }
    return {metric: value, "val_conversations": {"ids": [c["id"] for c in convs], metric: parts}, "val_items": items}


def add_test(plan: Plan, row: dict) -> None:
    """A trained row's test figures (one seed's: the row's `run` folder)."""
    res = plan.paths.nested(row["run"]).res
    bench = read_report(res / "benchmark.json")
    row.update(arm_figures(bench, "test"))
    for t in plan.cfg.tasks:
        row[f"test_{t}"] = task_figures(read_report(res / f"{task_report(t)}-test.json"), t)


def _pct(fig: dict | None, with_kept: bool = True) -> str:
    if not fig:
        return ""
    out = f"{100 * fig['accuracy']:.1f} ± {100 * fig['accuracy_se']:.1f}"
    return out + (f" ({100 * fig['kept']:.0f} ± {100 * fig['kept_se']:.0f}%)" if with_kept else "")


def _tie(row: dict, default: dict) -> str:
    """best / yes / no: the row's standing against the best on the choosing metric and each validation task."""
    tie = row.get("val_tie")
    if not tie:
        return ""
    if row["name"] == default.get("best"):
        return "best"
    return "yes" if tie["tied"] else "no"


KL = ".3g"  # KL columns: three significant figures (a translator's KL can be 0.0014 where the source's is 0.14)


def _num(x, fmt=".3f") -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def markdown(cfg: AblationConfig, results: AblationResults) -> str:
    rows, native = results.rows, results.native
    table = fmt_table(
        [
            "setting",
            "% of re-prefill",
            "val KL",
            "val context KL",
            "val IFEval kept",
            "val GSM8K kept",
            f"ties the best (≤ {A.TIE_SE:g} SE)",
            "test KL/token",
            "KL/conv ± SE",
            "test context KL ± SE",
            "test context top-1",
            "test IFEval % (kept)",
            "test GSM8K % (kept)",
        ],
        [
            [
                r["name"] + (" **(default)**" if r["name"] == results.default.get("setting") else ""),
                f"{100 * r['real']['fraction_of_reprefill']:.1f}",
                _num(r["val_kl"], KL),
                _num(r["val_context_kl"], KL),
                _num(100 * r["val_ifeval"]["kept"], ".0f") + "%" if "val_ifeval" in r else "",
                _num(100 * r["val_gsm8k"]["kept"], ".0f") + "%" if "val_gsm8k" in r else "",
                _tie(r, results.default),
                _num(r.get("test_kl"), KL),
                fmt_pm(r["test_kl_conversation"], fmt=".3f") if "test_kl_conversation" in r else "",
                fmt_pm(r["test_context_kl_conversation"], fmt=".3f") if "test_context_kl_conversation" in r else "",
                _num(r.get("test_context_top1")),
                _pct(r.get("test_ifeval")),
                _pct(r.get("test_gsm8k")),
            ]
            for r in rows
        ]
        + [
            [
                "native target",
                "100",
                "0",
                "0",
                "",
                "",
                "",
                "0",
                "",
                "",
                "1",
                _pct(native.get("test_ifeval_target"), False),
                _pct(native.get("test_gsm8k_target"), False),
            ],
            [
                "native source (the source answers)",
                "",
                "",
                "",
                "",
                "",
                "",
                _num(native.get("test_source_kl"), KL),
                "",
                _num(native.get("test_source_context_kl"), KL),
                _num(native.get("test_source_context_top1")),
                _pct(native.get("test_ifeval_source"), False),
                _pct(native.get("test_gsm8k_source"), False),
            ],
        ],
    )
    corr = fmt_table(
        ["validation metric", "Spearman ρ with retention", "p (exact)", "settings", "tracks (signed ρ)"],
        [
            [m, _num(c["rho"]), _num(c["p"], ".3g"), c["n"], _num(c["tracking"])]
            for m, c in results.correlations.items()
        ],
    )
    seeds = cfg.seeds
    per_seed = ""
    if len(seeds) > 1:
        per_seed = (
            f"\nEach row is the mean over {len(seeds)} training seeds ({', '.join(map(str, seeds))}); its SEs and its "
            "ties add the seeds' spread to the conversations' and items' (√(se² + var_seeds / N)). Per seed:\n\n"
            + fmt_table(
                ["setting", "seed", "val KL", "test KL/token", "test IFEval %", "test GSM8K %"],
                [
                    [
                        r["name"],
                        s["seed"],
                        _num(s["val_kl"], KL),
                        _num(s.get("test_kl"), KL),
                        _pct(s.get("test_ifeval"), False),
                        _pct(s.get("test_gsm8k"), False),
                    ]
                    for r in rows
                    for s in A.seeds_of(r)
                ],
            )
        )
    n_val = rows[0]["val_n"] if rows else 0
    n_test = next((r["test_n"] for r in rows if "test_n" in r), "—")  # the tested rows share the test split
    p = cfg.pair
    long_note = (
        f", and the longer budget of either where it ran (rows named SETTING-long: the best two settings by "
        f"validation KL trained again for {cfg.long_factor}× the updates, a budget lever outside the choice)"
        if cfg.long_factor
        else ""
    )
    lines = [
        f"# Translator ablation: {p.large} / {p.small}, {p.direction}, profile {cfg.profile}\n\n",
        f"Same splits and budget for every setting. Validation: {n_val} conversations, the first "
        f"{cfg.items[0]} items of the validation half of IFEval and GSM8K (where the choice is made). Test: "
        f"{n_test} conversations and the first {cfg.items[1]} items of the "
        f"test half of each task, for the chosen default, the profile's default and the direction's default "
        f"before{long_note}. "
        "Kept: the share of the native target's accuracy on the same items (± SE, paired). Cost: handoff FLOPs per "
        "context token at the real Qwen3-1.7B/0.6B shapes (translation, plus the exact layer 0 where a setting "
        "uses it) against the target's re-prefill per token. Context KL: KL on the reply tokens whose native "
        "prediction the context moves by more than 1 nat.\n\n",
        table,
        per_seed,
        "\nWhich validation metric tracks task retention (the mean of the IFEval and GSM8K shares kept) across "
        "the settings:\n\n",
        corr,
        f"\n**Default: {results.default['setting']}**, chosen by {results.metric} — {results.default['why']}.\n\n",
        _on_test_line(results.default),
        "![retention against cost](ablation.png)\n",
    ]
    return "".join(lines)


def plot(rows: list[dict], title: str) -> bytes:
    fig, ax = figure((7, 4.5))
    for r in rows:
        x = 100 * r["real"]["fraction_of_reprefill"]
        test = A.retention(r, "test")
        y = 100 * (test if test is not None else A.retention(r, "val") or float("nan"))
        ax.plot([x], [y], "o", color="C1" if test is not None else "C0", mfc="C1" if test is not None else "none")
        ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot([], [], "o", color="C1", label="test halves (claims)")
    ax.plot([], [], "o", color="C0", mfc="none", label="validation halves")
    ax.axvline(100 * A.MAX_COST_FRACTION, ls="--", c="grey", lw=1, label="cost cap of the default")
    ax.axhline(90, ls=":", c="grey", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("handoff FLOPs, % of the target's re-prefill (real Qwen3 shapes)")
    ax.set_ylabel("task retention, % of the native target (mean of IFEval, GSM8K)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return figure_png(fig)


def chosen_settings(args, profile, pair) -> tuple[str, ...]:
    """--settings, else the profile's `ablate_settings`, each a row of this direction (refused with the names there
    are); else the default rows."""
    geometry = Geometry(**pair.geometry)
    wanted = args.settings or profile.ablate_settings
    if not wanted:
        return tuple(A.default_settings(profile, pair.direction, geometry))
    names = [s.name for s in A.settings_for(profile, pair.direction, geometry)]
    unknown = [s for s in wanted if s not in names]
    if unknown:
        where = "--settings" if args.settings else f"profile {profile.name}'s ablate_settings:"
        raise Refusal(f"{where} {unknown[0]}: no such row; choose among {', '.join(names)}")
    return tuple(wanted)


def _on_test_line(default: dict) -> str:
    """The chosen default against the profile's default on test, in words (empty where they are the same row)."""
    c = default.get("on_test_against_profile_default")
    if not c:
        return ""
    parts = [f"KL/token {c['kl_per_token']['worse_by']:+.3g} ± {c['kl_per_token']['se']:.2g}"]
    parts += [
        f"{A.TASK_NAMES[t]} {c[t]['worse_by_points']:+.1f} ± {c[t]['se_points']:.1f} points (n {c[t]['n']})"
        for t in A.TASK_NAMES
        if t in c
    ]
    verdict = "not worse beyond two SE on any" if c["tied"] else "worse beyond two SE on at least one"
    return (
        f"On test, {default['setting']} against the profile's default {c['profile_default']}, paired and averaged "
        f"over the seeds (positive: {default['setting']} is worse): {'; '.join(parts)}; {verdict}.\n\n"
    )


def _benchmark_report(split: str) -> str:
    """The benchmark's report name on a split: the test split's is the plain `benchmark` (as `make benchmark`'s)."""
    return "benchmark" + ("" if split == "test" else f"-{split}")


def _split_suffix(split: str) -> str:
    from ..eval.tasks.data import split_suffix

    return split_suffix(split)


# --------------------------------------------------------------------------- the stage
class Ablate(Stage):
    name = "ablate"
    script = "ablate.py"
    summary = "Ablate the translator's levers on the same splits and budget: choices on validation, claims on test."
    examples = (
        "make ablate PROFILE=demo            (both directions on the toy pair, data prepared offline)",
        "make ablate PROFILE=scale ABLATE_DIRECTIONS=l2s   (8,192 conversations, the default and its on-policy "
        "objective, then both for 8x the updates)",
        ".venv/bin/python ablate.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32 --data-root data/toy-eval --settings crosshead token-w3 --resume",
    )
    resumable = True
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--settings",
            nargs="+",
            default=None,
            help="rows to run: variants of the families (kvlingo/core/families) and the profile's default "
            "translator under another objective (DEFAULT-context, -onpolicy, -reg); default: the profile's "
            "ablate_settings, else every default row, the other direction's default before excepted",
        )
        p.add_argument(
            "--long-factor",
            type=whole(0),
            default=None,
            help="train the best two by validation KL again for this many × the updates (0: not; default: the "
            "profile's ablate_long_factor, 0 but for scale)",
        )
        p.add_argument(
            "--items",
            type=whole(1),
            nargs=2,
            default=None,
            metavar=("VALIDATION", "TEST"),
            help="IFEval prompts and GSM8K items per row on the validation and test halves (default: the "
            "profile's ablate_items)",
        )
        p.add_argument(
            "--seeds",
            type=int,
            nargs="+",
            default=None,
            help=f"train every setting with each of these seeds (its figures the mean over them; a tie counts the "
            f"seeds' spread beside the conversations'); default: {DEFAULT_SEED}, one training run per setting",
        )
        add_task_data_args(
            p,
            "; --settings and --seeds may differ from the first run's: the cells the rows share are kept, new rows run",
        )

    def check(self) -> None:
        from ..inputs.models import pair_config_from_args

        args, self.t0 = self.args, time.time()
        self.profile = profile = get_profile(args.profile)
        pair, _ = pair_config_from_args(args)
        self.tasks = generative_tasks(args)
        seeds = tuple(args.seeds or (DEFAULT_SEED,))
        if len(set(seeds)) != len(seeds):
            raise Refusal(f"--seeds {' '.join(map(str, seeds))}: name each seed once")
        self.cfg = AblationConfig(
            run=args.run or f"{default_run(profile.name, pair.direction)}-ablate",
            profile=profile.name,
            data=str(args.data or default_data(profile.name)),
            settings=chosen_settings(args, profile, pair),
            long_factor=profile.ablate_long_factor if args.long_factor is None else args.long_factor,
            seeds=seeds,
            eval_root=args.data_root,
            tasks=self.tasks,
            items=tuple(args.items or profile.ablate_items),
            artifacts=args.artifacts,
            results=args.results,
            pair=pair,
        )
        self.plan = plan = Plan(self.cfg)
        check_outputs(
            [
                plan.paths.report("ablation"),
                *(plan.paths.beside("ablation", x) for x in (".md", ".png")),
                plan.paths.res / LEDGER_FILE,
            ]
        )
        lock_run(plan.paths.res, "ablate")

    def load(self) -> None:
        # The rows and seeds may change on --resume (rows added, dropped or reordered): every cell is keyed by its own
        # setting, seed, inputs and code, so another set of rows reuses exactly the cells it shares with the first.
        shared = {k: v for k, v in asdict(self.cfg).items() if k not in ROW_FIELDS}
        self.ledger = K.Ledger(self.plan.paths.res / LEDGER_FILE, shared, self.args.resume)
        self.cells = K.Cells(self.ledger, self.args.resume, runner=K.run_in_process)
        self.geometry = Geometry(**self.cfg.pair.geometry)
        rows = A.settings_for(self.profile, self.cfg.pair.direction, self.geometry)
        self.by_name = {s.name: s for s in rows if s.name in self.cfg.settings}

    def run(self) -> dict:
        try:
            native = self._native()
            rows = [self._validate(s, s.name) for s in self.by_name.values()]
            if self.cfg.long_factor:
                best = sorted(rows, key=lambda r: r["val_kl"])[:2]
                rows += [
                    self._validate(
                        self.by_name[r["setting"]], f"{r['setting']}-long", self.cfg.long_factor * self.profile.updates
                    )
                    for r in best
                ]
            return self._choose_and_claim(rows, native)
        except Refusal:
            raise
        except K.StageFailed as e:
            raise Failure(f"{e}. The ledger marks that cell failed; fix the cause, then re-run with --resume") from None

    def _native(self) -> dict:
        native: dict = {}
        for t in self.tasks:
            key = "prompt_level_strict_acc" if t == "ifeval" else "accuracy"
            for split, short in (("validation", "val"), ("test", "test")):
                paths = self.cells.ensure(self.plan.generative(t, "native", split, native=True))["results"]["paths"]
                for role in ("target", "source"):
                    figure_ = paths[f"native_{role}"][key]
                    native[f"{short}_{t}_{role}"] = {"accuracy": figure_["mean"], "accuracy_se": figure_["se"]}
        return native

    def _validate(self, setting, sub: str, updates: int | None = None) -> dict:
        """The setting trained with each seed and scored on validation: one row (`A.over_seeds`)."""
        cells, plan, rows = self.cells, self.plan, []
        for seed in self.cfg.seeds:
            run = seed_run(sub, seed)
            cells.ensure(plan.train(setting, run, updates, seed))
            cells.ensure(plan.benchmark(setting, run, "validation"))
            for t in self.tasks:
                cells.ensure(plan.generative(t, run, "validation", native=False, refresh=setting.refresh))
            rows.append({**summarise(plan, setting, run, self.geometry, long=updates is not None), "seed": seed})
        return A.over_seeds(rows, sub)

    def _choose_and_claim(self, rows: list[dict], native: dict) -> dict:
        """The metric and the default chosen on validation; the default and the default before scored on test."""
        plain = [r for r in rows if not r["long_budget"]]
        correlations = A.metric_correlations(plain)
        metric = A.choose_metric(correlations)
        evidence = {
            r["name"]: [
                {**tie_evidence(self.plan.paths.nested(s["run"]).res, metric, self.tasks), metric: s[metric]}
                for s in A.seeds_of(r)
            ]
            for r in plain
        }
        default = A.choose_default([{**r, "val_evidence": evidence[r["name"]]} for r in plain], metric, self.tasks)
        ties = default.pop("ties", {})
        for r in plain:  # each row's standing against the best (the evidence itself stays in the rows files)
            r["val_tie"] = ties.get(r["name"])
        # Scored on test: the chosen default, the profile's own default (what users get: the chosen one is paired
        # against it on test), the default before, and the longer budget of any of them where it ran (a budget lever
        # beside its setting: no choice is made on it).
        by_row = {r["name"]: r for r in rows}
        shipped = self.profile.family_for(self.cfg.pair.direction)
        claims = [default.get("setting"), shipped, A.before(self.profile, self.cfg.pair.direction)]
        claimed = [n for n in dict.fromkeys(claims) if n in self.by_name]  # in order, once each
        for name in [s for n in claimed for s in (n, f"{n}-long") if s in by_row]:
            row, setting = by_row[name], self.by_name[by_row[name]["setting"]]
            for s in A.seeds_of(row):
                self.cells.ensure(self.plan.benchmark(setting, s["run"], "test"))
                for t in self.tasks:
                    self.cells.ensure(self.plan.generative(t, s["run"], "test", native=False, refresh=setting.refresh))
                add_test(self.plan, s)
            if "seeds" in row:
                row.update(A.seed_means(row["seeds"], "test_"))
        if default.get("setting") not in (None, shipped) and shipped in by_row:
            default["on_test_against_profile_default"] = self._on_test(by_row[shipped], by_row[default["setting"]])
        tested = next((r for r in rows if "test_kl" in r), None)
        if tested is not None:  # the native source's KL on the same test conversations (any test benchmark holds it)
            run = A.seeds_of(tested)[0]["run"]
            report = read_report(self.plan.paths.nested(run).res / "benchmark.json", "benchmark")
            src = report["results"]["quality"]["arms"]["native_source"]
            native.update(
                test_source_kl=src["kl_token_mean"],
                test_source_context_kl=src["context_kl_token_mean"],
                test_source_context_top1=src["context_top1"],
            )
        results = AblationResults(rows=rows, correlations=correlations, metric=metric, default=default, native=native)
        return {"results": results, "tested": tested}

    def _on_test(self, shipped: dict, chosen: dict) -> dict:
        """The chosen row against the profile's default on the test halves, paired conversation by conversation and
        item by item and averaged over the seeds (`A.within_noise` with test evidence: worse_by > 0 where the chosen
        row is worse). A claim beside the choice: it does not change it."""
        metric = "val_kl"  # per reply token: the figure the tables report as test KL/token

        def evidence(row: dict) -> list[dict]:
            res = lambda s: self.plan.paths.nested(s["run"]).res  # noqa: E731
            return [tie_evidence(res(s), metric, self.tasks, "test") for s in A.seeds_of(row)]

        out = A.within_noise(
            {"name": shipped["name"], "val_evidence": evidence(shipped)},
            {"name": chosen["name"], "val_evidence": evidence(chosen)},
            metric,
            self.tasks,
        )
        return {"profile_default": shipped["name"], "kl_per_token": out.pop("metric"), **out}

    def publish(self, out: dict) -> dict:
        cfg, plan, results, tested = self.cfg, self.plan, out["results"], out["tested"]
        rows = results.rows
        png = plan.paths.beside("ablation", ".png")
        atomic_write_bytes(png, plot(rows, f"{cfg.pair.direction}, profile {cfg.profile}"))
        md = markdown(cfg, results)
        atomic_write_text(plan.paths.beside("ablation", ".md"), md)
        report = Report(
            "ablation",
            config=cfg,
            inputs={**plan.inputs, "code_sha256": code_hash(Ablate.script_path())},
            results=results,
            metrics=AblationResults.METRICS,
            n_samples={
                "settings": len(rows),
                "validation_conversations": rows[0]["val_n"] if rows else 0,
                "test_conversations": tested["test_n"] if tested else 0,
                "validation_items_per_task": cfg.items[0],
                "test_items_per_task": cfg.items[1],
                "training_seeds": len(cfg.seeds),
            },
            wall_time_s=time.time() - self.t0,
            device=cfg.pair.device,
            dtype=cfg.pair.dtype,
            seeds={"training": list(cfg.seeds)},
            files={png.name: sha256_file(png)},
        ).write(plan.paths.report("ablation"))
        print(md)
        print(f"report: {plan.paths.report('ablation')}", file=sys.stderr)
        return report
