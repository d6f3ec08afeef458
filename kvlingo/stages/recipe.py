"""The recipe: native rows, one closed-form fit, a learning-rate search on validation KL, then seeds.

Steps, each one or more resumable cells (see kvlingo/stages/cells.py); every cell is a subprocess
of its stage script with the pair flags, --profile, --data and the run folders passed through,
and its own run name RUN/<cell>:
  1. native rows: benchmark.py on no maps (native source, native target, no-context arms) and
     ifeval.py --native. They come first so that a failing native control or missing IFEval
     data stops the recipe before any training.
  2. closed form: train_translator.py --closed-form-only, once; every training cell starts
     from these maps (--init-from).
  3. learning-rate search: profile.lr_grid_size rates half a decade apart around the
     direction's default rate, trained with the first seed; the rate with the lowest final
     validation KL wins, and the grid grows past an edge winner (at most --max-extensions times,
     default the profile's).
  4. seeds: every seed trained at the chosen rate (the first seed's search cell is reused),
     then benchmark.py and ifeval.py on its distilled maps.

Cells that do not depend on each other run together through a launcher (--launcher local: up to
--max-parallel processes on this machine, one GPU group each; --launcher slurm: one SLURM job
array per level, through submitit); see kvlingo/stages/launch.py. The summary is written once
every cell has finished; a level with failed cells stops the recipe, naming them and their logs.
A cell that finished with the same key (its stage, flags and input hashes) and whose report is
unchanged is up to date and does not run again; --resume also continues an interrupted cell,
--force runs every cell again.

Outputs under RESULTS/RUN/: recipe.json (the report, written last), recipe.md (summary),
recipe.png (validation KL against learning rate), recipe-state.json (the cell ledger), logs/
(each cell's output when several run at once), slurm/ (submitit's jobs and logs), and one
folder per stage run: native/, closed/, lr<rate>-s<seed>/ (maps under ARTIFACTS/RUN/).
"""

from __future__ import annotations

import math
import shlex
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Failure, Refusal
from ..inputs.flags import check_passthrough
from ..inputs.profiles import get_profile
from ..io import atomic_write_bytes, atomic_write_text, sha256_file
from ..records.paths import MAPS_FILE, RunPaths, check_outputs, default_data, run_paths
from ..records.report import Metric, Report, figure, figure_png, fmt_table
from ..records.resume import code_hash
from . import cells as K
from . import lrsearch
from .launch import add_launch_args, launcher_from_args
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


SCRIPTS: dict[str, Path] = {}  # a stage's script in place of the registry's (tests run stand-ins)
EVALS = ("benchmark", "ifeval")  # evaluation stages run on the native models and on each seed's maps, in order
PAIR_FLAGS = ("--large", "--small", "--direction", "--device", "--dtype")
RUN_FLAGS = ("--profile", "--run", "--artifacts", "--results", *PAIR_FLAGS)
RESERVED = {  # flags the recipe sets itself; a pass-through string may not override them
    "train": (
        "--data",
        "--lr",
        "--seed",
        "--updates",
        "--init-from",
        "--closed-form-only",
        "--resume",
        "--force",
        *RUN_FLAGS,
    ),
    "benchmark": ("--data", "--skip-missing", "--force", *RUN_FLAGS),
    "ifeval": (
        "--data-root",
        "--source",
        "--native",
        "--translator",
        "--resume",
        "--force",
        "--prepare",
        "--install-punkt",
        *RUN_FLAGS,
    ),
}


@dataclass(frozen=True)
class RecipeConfig:
    run: str  # every cell lives under ARTIFACTS/RUN/<cell> and RESULTS/RUN/<cell>
    profile: str  # run profile passed to every stage (budgets, grid size and seeds by default)
    data: str  # prepared data folder passed to train and benchmark
    lr_center: float  # centre of the learning-rate grid
    grid_size: int  # rates in the first grid, half a decade apart
    max_extensions: int  # at most this many half-decade steps past an edge winner
    seeds: tuple[int, ...]  # seeds trained and evaluated at the chosen rate; the first one runs the search
    updates: int  # distillation updates per training cell
    evals: tuple[str, ...]  # evaluation stages run (benchmark, ifeval)
    ifeval_source: str | None  # local IFEval JSONL (None: the prepared copy under ifeval_data_root)
    ifeval_data_root: str  # prepared IFEval data root (ROOT/ifeval/)
    train_args: tuple[str, ...]  # extra train_translator.py flags for every training cell (closed form included)
    benchmark_args: tuple[str, ...]  # extra benchmark.py flags
    ifeval_args: tuple[str, ...]  # extra ifeval.py flags
    artifacts: str  # artifacts root
    results: str  # results root
    pair: PairConfig  # the resolved pair every stage runs on


@dataclass
class RecipeResults:
    pair: str
    direction: str
    profile: str
    seeds: list
    lr_search: dict  # grid cells, validation KLs, the chosen rate, extensions, whether the cap was hit
    closed_form: dict  # the shared closed-form start: validation KL, maps sha256
    native: dict  # native rows of the benchmark and IFEval
    per_seed: dict  # {seed: {stage: {metric: value}}}
    ifeval_item_level: dict  # {seed: {metric: mean ± SE over items}}
    across_seeds: dict  # {stage: {metric: mean ± SE over seeds}}
    cells: list  # every cell: stage, action this run, key, runs, wall time, report

    METRICS = (
        Metric("lr_search.chosen_lr", False, "the learning rate with the lowest final validation KL"),
        Metric("across_seeds.benchmark.distilled.kl_token_mean", False, "test KL/token, mean over seeds"),
        Metric(
            "across_seeds.ifeval.translated.prompt_level_strict_acc",
            True,
            "IFEval strict prompt accuracy after the handoff, mean over seeds",
        ),
    )


def stage_parser_of(stage: str):
    """(a fresh parser of the stage's own flags, its script's name), for checking a pass-through string."""
    from .registry import STAGES

    entry = STAGES[stage]
    return entry.stage.parser(), entry.stage.script


def passthrough(stage: str, text: str) -> tuple[str, ...]:
    """The tokens of --STAGE-args, refused up front when they set a flag the recipe sets, or when the stage's
    own parser does not take them (an unknown flag, a bad value)."""
    try:
        tokens = tuple(shlex.split(text))
    except ValueError as err:
        raise Refusal(f"--{stage}-args {text!r} does not split into flags: {err}") from None
    for t in tokens:
        if t.split("=")[0] in RESERVED[stage]:
            raise Refusal(
                f"--{stage}-args may not set {t.split('=')[0]}: the recipe sets it "
                "(use the recipe's own flag, e.g. --updates, --seeds, --lr-center, --data)"
            )
    try:
        parser, script = stage_parser_of(stage)
        check_passthrough(parser, tokens, script)
    except ValueError as err:
        raise Refusal(f"--{stage}-args: {err}") from None
    return tokens


def make_config(args, pair: PairConfig) -> RecipeConfig:
    profile = get_profile(args.profile)
    grid = (
        args.grid_size
        if args.grid_size is not None
        else (min(2, profile.lr_grid_size) if args.quick else profile.lr_grid_size)
    )
    seeds = tuple(args.seeds) if args.seeds else (profile.recipe_seeds[:1] if args.quick else profile.recipe_seeds)
    ext = (
        args.max_extensions
        if args.max_extensions is not None
        else (min(1, profile.recipe_max_extensions) if args.quick else profile.recipe_max_extensions)
    )
    center = (
        args.lr_center if args.lr_center is not None else (profile.recipe_lr_center or profile.lr_for(pair.direction))
    )
    updates = args.updates if args.updates is not None else (profile.recipe_updates or profile.updates)
    if grid < 1 or ext < 0 or not center > 0 or updates < 1:
        raise Refusal(
            "--grid-size, --updates must be ≥ 1 (with no updates every rate gives the closed-form "
            "maps: nothing to choose), --max-extensions ≥ 0 and --lr-center > 0"
        )
    if len(set(seeds)) != len(seeds):
        raise Refusal(f"--seeds {' '.join(map(str, seeds))} repeats a seed")
    return RecipeConfig(
        run=run_paths(args).run,
        profile=profile.name,
        data=str(args.data or default_data(profile.name)),
        lr_center=center,
        grid_size=grid,
        max_extensions=ext,
        seeds=seeds,
        updates=updates,
        evals=tuple(e for e in EVALS if e not in args.skip),
        ifeval_source=args.ifeval_source,
        ifeval_data_root=args.ifeval_data_root,
        train_args=args.train_args,
        benchmark_args=args.benchmark_args,
        ifeval_args=args.ifeval_args,
        artifacts=args.artifacts,
        results=args.results,
        pair=pair,
    )


# --------------------------------------------------------------------------- the cells
class Plan:
    """Builds each cell's flags and input hashes from the config. A cell's run is RUN/<cell>."""

    def __init__(self, cfg: RecipeConfig):
        self.cfg = cfg
        self.paths = RunPaths(cfg.run, cfg.artifacts, cfg.results)
        self.art, self.res = self.paths.art, self.paths.res
        p = cfg.pair
        self.flags = K.stage_flags(cfg.profile, p, cfg.artifacts, cfg.results)
        try:
            self.common = {"data": K.data_hash(cfg.data, cfg.profile), "models": p.identities()}
        except ValueError as e:
            raise Refusal(str(e)) from None
        self.ifeval_data = self._ifeval_data() if "ifeval" in cfg.evals else None

    def _ifeval_data(self) -> dict:
        if self.cfg.ifeval_source:
            if not Path(self.cfg.ifeval_source).is_file():
                raise Refusal(f"--ifeval-source {self.cfg.ifeval_source} not found")
            return {"source_sha256": sha256_file(self.cfg.ifeval_source)}
        manifest = Path(self.cfg.ifeval_data_root) / "ifeval" / "manifest.json"
        if not manifest.is_file():
            raise Refusal(
                f"no IFEval data at {manifest.parent}: run `python ifeval.py --prepare` "
                "(needs the Hub), pass --ifeval-source PATH, or --skip ifeval"
            )
        return {"manifest_sha256": sha256_file(manifest)}

    def maps_sha(self, sub: str, kind: str) -> str:
        return sha256_file(self.paths.nested(sub).translator(kind) / MAPS_FILE)

    def cell(self, stage: str, sub: str, flags: dict, inputs: dict, report: str, **kw) -> K.Cell:
        script = script_of(stage)
        return K.Cell(
            f"{stage}/{sub}",
            stage,
            str(script),
            {**self.flags, "--run": self.paths.nested(sub).run, **flags},
            str(self.paths.nested(sub).report(report)),
            {**self.common, "code_sha256": code_hash(script), **inputs},
            **kw,
        )

    def train(self, sub: str, seed: int, lr: float | None = None) -> K.Cell:
        """The closed-form cell (lr None) or a distillation cell started from the closed-form translator."""
        closed = lr is None
        flags, inputs = {"--data": self.cfg.data, "--seed": seed}, {}
        if closed:
            flags["--closed-form-only"] = True
        else:
            flags.update(
                {
                    "--init-from": str(self.paths.nested("closed").translator("closed_form")),
                    "--lr": repr(lr),
                    "--updates": self.cfg.updates,
                }
            )
            inputs["closed_form_sha256"] = self.maps_sha("closed", "closed_form")
        kind = "closed_form" if closed else "distilled"
        return self.cell(
            "train",
            sub,
            flags,
            inputs,
            "train",
            outputs=(str(self.paths.nested(sub).translator(kind) / MAPS_FILE),),
            extra=self.cfg.train_args,
            resume_flag="--resume",
            fresh_flag="--force",
        )

    def benchmark(self, sub: str, trained: bool) -> K.Cell:
        inputs = (
            {}
            if not trained
            else {
                "closed_form_sha256": self.maps_sha(sub, "closed_form"),
                "distilled_sha256": self.maps_sha(sub, "distilled"),
            }
        )
        return self.cell(
            "benchmark",
            sub,
            {"--data": self.cfg.data, "--skip-missing": not trained},
            inputs,
            "benchmark",
            extra=self.cfg.benchmark_args,
            fresh_flag="--force",
        )

    def ifeval(self, sub: str, trained: bool) -> K.Cell:
        flags = {"--data-root": self.cfg.ifeval_data_root, "--source": self.cfg.ifeval_source, "--native": not trained}
        inputs, before = {"ifeval_data": self.ifeval_data}, None
        if trained:
            inputs["distilled_sha256"] = self.maps_sha(sub, "distilled")
            # The native target's answers are the same for every seed: the native cell's rows, copied beside
            # this run, are reused by ifeval.py wherever their input hash matches instead of regenerated.
            native_rows = self.paths.nested("native").beside("ifeval-native", ".rows.jsonl")
            here = self.paths.nested(sub).beside("ifeval-native", ".rows.jsonl")
            before = lambda: K.copy_file(native_rows, here)  # noqa: E731
        return self.cell(
            "ifeval",
            sub,
            flags,
            inputs,
            "ifeval" if trained else "ifeval-native",
            extra=self.cfg.ifeval_args,
            resume_flag="--resume",
            fresh_flag="--force",
            before=before,
        )

    def evaluation(self, stage: str, sub: str, trained: bool) -> K.Cell:
        return {"benchmark": self.benchmark, "ifeval": self.ifeval}[stage](sub, trained)


def script_of(stage: str) -> Path:
    """The script a cell of `stage` runs (`SCRIPTS`, else the registry's)."""
    from .registry import STAGES

    return SCRIPTS.get(stage) or STAGES[stage].script


def cell_sub(lr: float, seed: int) -> str:
    return f"lr{lr:.2e}-s{seed}"


def cells_pair(args) -> PairConfig:
    """The pair the cells run on. Under SLURM they run on the cluster's nodes, not where the recipe
    waits (a login node may have no GPU): the device is taken as given, and must be named."""
    from ..inputs.models import PairError, pair_config_from_args, resolve_pair

    if args.launcher != "slurm":
        return pair_config_from_args(args)[0]
    if args.device in (None, "", "auto"):
        raise PairError(
            "--launcher slurm needs an explicit --device (cuda): the cells run on the cluster's nodes, "
            "whose devices this machine cannot see"
        )
    pair = resolve_pair(args.large, args.small, args.direction, "cpu", args.dtype, args.cache)[0]
    return replace(pair, device=args.device)


# --------------------------------------------------------------------------- outputs
def plot_lr(path: Path, search: dict, title: str) -> None:
    cells = sorted(search["cells"], key=lambda c: c["lr"])
    ok = [
        c for c in cells if isinstance(c["val_kl"], (int, float)) and math.isfinite(c["val_kl"])
    ]  # diverged: left out
    fig, ax = figure((6.5, 4))
    ax.plot([c["lr"] for c in ok], [c["val_kl"] for c in ok], "o-", label="distilled (final validation KL)")
    best = next(c for c in cells if c["lr"] == search["chosen_lr"])
    ax.plot([best["lr"]], [best["val_kl"]], "o", ms=12, mfc="none", mec="red", label=f"chosen lr {best['lr']:g}")
    if search.get("closed_form_val_kl") is not None:
        ax.axhline(search["closed_form_val_kl"], ls="--", c="grey", label="closed form")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation KL(native ‖ translated), nats/token")
    ax.set_title(title)
    ax.legend()
    atomic_write_bytes(path, figure_png(fig))


# --------------------------------------------------------------------------- the stage
class Recipe(Stage):
    name = "recipe"
    script = "recipe.py"
    summary = "The recipe: native rows, one closed-form fit, a learning-rate search on validation KL, then seeds."
    examples = (
        ".venv/bin/python recipe.py --profile pilot --run pilot-l2s --device cuda",
        ".venv/bin/python recipe.py --profile pilot --run pilot-l2s --device cuda --resume",
        ".venv/bin/python recipe.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32 --ifeval-source artifacts/toy/corpus/ifeval.jsonl --run demo-l2s-recipe",
        ".venv/bin/python recipe.py --profile paper-budget --run qwen --device cuda --max-parallel 8",
        ".venv/bin/python recipe.py --profile paper-budget --run qwen --device cuda --launcher slurm --partition gpu "
        "--account proj --gpus-per-cell 8 --time-limit 1440 --max-parallel 5",
    )
    resumable = True
    data = True

    def __init__(self, args, runner=None):
        super().__init__(args)
        self.runner = runner or K.run_stage  # each cell's stage, run as a process (tests inject their own)

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--lr-center",
            type=float,
            default=None,
            help="centre of the rate grid (default: the profile's recipe centre, else its rate for the direction)",
        )
        p.add_argument(
            "--grid-size", type=int, default=None, help="rates in the first grid (default: profile.lr_grid_size)"
        )
        p.add_argument(
            "--max-extensions",
            type=int,
            default=None,
            help="half-decade steps added past an edge winner, at most (default: the profile's; --quick: 1)",
        )
        p.add_argument(
            "--seeds",
            type=int,
            nargs="+",
            default=None,
            help="seeds at the chosen rate; the first one runs the search (default: profile.recipe_seeds)",
        )
        p.add_argument(
            "--updates",
            type=int,
            default=None,
            help="distillation updates per training cell (default: the profile's recipe budget)",
        )
        p.add_argument(
            "--quick",
            action="store_true",
            help="a reduced recipe for checks: 2 rates, the first seed only, at most 1 extension "
            "(explicit --grid-size/--seeds/--max-extensions win)",
        )
        p.add_argument("--skip", nargs="+", choices=EVALS, default=[], help="evaluation stages to leave out")
        p.add_argument(
            "--ifeval-source",
            default=None,
            help="local IFEval JSONL (default: the copy prepared by ifeval.py --prepare)",
        )
        p.add_argument("--ifeval-data-root", default="data", help="prepared IFEval data root (ROOT/ifeval/)")
        p.add_argument(
            "--train-args", default="", help="extra train_translator.py flags, e.g. --train-args='--batch 2'"
        )
        p.add_argument(
            "--benchmark-args", default="", help="extra benchmark.py flags, e.g. --benchmark-args=--allow-cv"
        )
        p.add_argument(
            "--ifeval-args", default="", help="extra ifeval.py flags, e.g. --ifeval-args='--max-new-tokens 64'"
        )
        p.add_argument(
            "--resume",
            action="store_true",
            help="keep finished cells whose key matches, continue an interrupted one, refuse changed settings",
        )
        p.add_argument(
            "--force",
            action="store_true",
            help="run every cell again, even those that finished with the same key (up to date)",
        )
        add_launch_args(p)

    @classmethod
    def parse_args(cls, argv=None):
        args = super().parse_args(argv)
        for stage in RESERVED:  # each --STAGE-args string becomes its tokens, refused here before anything else runs
            setattr(args, f"{stage}_args", passthrough(stage, getattr(args, f"{stage}_args")))
        return args

    def check(self) -> None:
        args = self.args
        self.t0 = time.time()
        pair = cells_pair(args)  # refuses a bad pair before any cell runs
        self.cfg = make_config(args, pair)
        self.plan = Plan(self.cfg)
        plan = self.plan
        check_outputs(
            [
                plan.paths.report("recipe"),
                *(plan.paths.beside("recipe", x) for x in (".md", ".png")),
                plan.res / K.LEDGER_FILE,
            ]
        )
        self.launcher = launcher_from_args(args, plan.res)  # refuses launch settings this machine cannot honour
        lock_run(plan.res, "recipe")  # the ledger serialises cells; this keeps a second recipe off the same run
        if args.force and args.resume:
            raise Refusal("--force runs every cell again and --resume keeps finished ones: give one of them")

    def load(self) -> None:
        self.ledger = K.Ledger(
            self.plan.res / K.LEDGER_FILE, asdict(self.cfg), self.args.resume, reuse=not self.args.force
        )
        self.cells = K.Cells(self.ledger, self.args.resume, self.runner, launcher=self.launcher)

    def run(self) -> dict:
        """The four steps (module docstring), each a level of cells; a failed cell stops the recipe."""
        try:
            return self._steps()
        except Refusal:
            raise
        except K.StageFailed as e:
            raise Failure(
                f"{e}. The ledger marks the failed cells; fix the cause, then re-run with --resume "
                "(finished cells are kept)"
            ) from None
        except ValueError as e:  # no rate of the grid to choose (every one diverged)
            raise Failure(str(e)) from None

    def _steps(self) -> dict:
        cfg, plan, cells = self.cfg, self.plan, self.cells
        seed0 = cfg.seeds[0]
        # 1. native rows
        native = dict(
            zip(cfg.evals, cells.ensure_all([plan.evaluation(s, "native", trained=False) for s in cfg.evals]))
        )
        # 2. closed form, once
        closed = cells.ensure(plan.train("closed", seed0))
        # 3. learning-rate search
        train_reports: dict[int, dict] = {}

        def evaluate(steps: list[int]) -> list:
            lrs = [lrsearch.lr_for_step(cfg.lr_center, k) for k in steps]
            reports = cells.ensure_all([plan.train(cell_sub(lr, seed0), seed0, lr) for lr in lrs])
            train_reports.update(zip(steps, reports))
            return [r["results"][lrsearch.SELECTION_METRIC] for r in reports]

        search = lrsearch.search_lr(evaluate, cfg.grid_size, cfg.max_extensions)
        chosen = lrsearch.lr_for_step(cfg.lr_center, search["winner"])
        print(
            f"[recipe] chosen learning rate {chosen:g} (validation KL {search['val_kl'][search['winner']]:.5g})"
            + ("; WARNING: still at an edge of the grid, the extension cap was hit" if search["cap_hit"] else "")
        )
        # 4. seeds at the chosen rate
        trained = cells.ensure_all([plan.train(cell_sub(chosen, seed), seed, chosen) for seed in cfg.seeds])
        per_seed = {str(seed): {"train": lrsearch.train_metrics(r)} for seed, r in zip(cfg.seeds, trained)}
        item_level = {}
        evals = [(seed, stage) for seed in cfg.seeds for stage in cfg.evals]
        reports = cells.ensure_all(
            [plan.evaluation(stage, cell_sub(chosen, seed), trained=True) for seed, stage in evals]
        )
        for (seed, stage), report in zip(evals, reports):
            if stage == "ifeval":
                per_seed[str(seed)]["ifeval"], item_level[str(seed)] = lrsearch.ifeval_metrics(report)
            else:
                per_seed[str(seed)]["benchmark"] = lrsearch.benchmark_metrics(report)
        return {
            "native": native,
            "closed": closed,
            "search": search,
            "chosen": chosen,
            "per_seed": per_seed,
            "item_level": item_level,
            "train_reports": train_reports,
        }

    def publish(self, out: dict) -> dict:
        cfg, plan, ledger = self.cfg, self.plan, self.ledger
        cell_rows = self._cell_rows()
        results = self._results(out, cell_rows)
        plot = plan.paths.beside("recipe", ".png")
        plot_lr(plot, results.lr_search, f"{cfg.run}: {cfg.pair.direction}, {cfg.profile}")
        atomic_write_text(
            plan.paths.beside("recipe", ".md"),
            lrsearch.summary_markdown(cfg.run, asdict(results), cell_rows, "recipe.png"),
        )
        scripts = [script_of(s) for s in ("train", "benchmark", "ifeval")]
        cells = {
            c["cell"]: {"key": c["key"], "report": c["report"], "report_sha256": c["report_sha256"]} for c in cell_rows
        }
        report = Report(
            "recipe",
            config=cfg,
            metrics=RecipeResults.METRICS,
            inputs={
                **plan.common,
                "ifeval_data": plan.ifeval_data,
                "code_sha256": code_hash(Recipe.script_path(), *scripts),
                "ledger": {"path": str(ledger.path), "sha256": sha256_file(ledger.path)},
                "cells": cells,
            },
            results=results,
            n_samples={"cells": len(cell_rows), "lr_cells": len(out["search"]["order"]), "seeds": len(cfg.seeds)},
            seeds=list(cfg.seeds),
            wall_time_s=time.time() - self.t0,
            device=cfg.pair.device,
            dtype=cfg.pair.dtype,
            files={plot.name: sha256_file(plot)},
        ).write(plan.paths.report("recipe"))
        print(
            fmt_table(
                ["cell", "this run", "runs", "wall s"],
                [[c["cell"], c["action"], c["runs"], c["wall_time_s"]] for c in cell_rows],
                ".3g",
            )
        )
        print(
            f"chosen lr {out['chosen']:g}; report {plan.paths.report('recipe')}, summary "
            f"{plan.paths.beside('recipe', '.md')}"
        )
        return report

    def _cell_rows(self) -> list[dict]:
        actions = {}
        for entry in self.cells.log:
            actions.setdefault(entry["cell"], entry["action"])
        return [
            {
                "cell": name,
                "stage": e["stage"],
                "action": actions.get(name, "not needed"),
                "key": e["key"],
                "runs": e.get("runs"),
                "wall_time_s": e.get("wall_time_s"),
                "report": e["report"],
                "report_sha256": e.get("report_sha256"),
            }
            for name, e in self.ledger.cells.items()
        ]

    def _results(self, out: dict, cell_rows: list[dict]) -> RecipeResults:
        cfg, search, seed0, native = self.cfg, out["search"], self.cfg.seeds[0], out["native"]
        search_cells = [
            {
                "step": k,
                "lr": lrsearch.lr_for_step(cfg.lr_center, k),
                "val_kl": search["val_kl"][k],
                "closed_form_val_kl": out["train_reports"][k]["results"].get("closed_form_val_kl"),
                "cell": f"train/{cell_sub(lrsearch.lr_for_step(cfg.lr_center, k), seed0)}",
            }
            for k in search["order"]
        ]
        closed_kl = out["closed"]["results"].get("closed_form_val_kl")
        return RecipeResults(
            pair=f"large {cfg.pair.large}, small {cfg.pair.small}",
            direction=cfg.pair.direction,
            profile=cfg.profile,
            seeds=list(cfg.seeds),
            lr_search={
                "center": cfg.lr_center,
                "grid_size": cfg.grid_size,
                "search_seed": seed0,
                "metric": f"train.json results.{lrsearch.SELECTION_METRIC}: final validation-split KL; "
                "the test split takes no part in the choice",
                "cells": search_cells,
                "order": search["order"],
                "chosen_step": search["winner"],
                "chosen_lr": out["chosen"],
                "extensions": search["extensions"],
                "max_extensions": cfg.max_extensions,
                "cap_hit": search["cap_hit"],
                "closed_form_val_kl": closed_kl,
            },
            closed_form={"val_kl": closed_kl, "maps_sha256": self.plan.maps_sha("closed", "closed_form")},
            native={
                **({"benchmark": native["benchmark"]["results"]["quality"]["arms"]} if "benchmark" in native else {}),
                **({"ifeval": native["ifeval"]["results"]["paths"]} if "ifeval" in native else {}),
            },
            per_seed=out["per_seed"],
            ifeval_item_level=out["item_level"],
            across_seeds=lrsearch.across_seeds(out["per_seed"]),
            cells=cell_rows,
        )
