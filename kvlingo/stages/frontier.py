"""The refresh frontier: quality against cost, from pure translation to re-prefill.

For every refresh setting (kvlingo/core/refresh.py) on a trained run's translator: the test
split's KL/top-1 (benchmark.py --refresh), IFEval and GSM8K after a prompt handoff (with the
native target's rows scored once and shared), the setting's FLOPs as a fraction of re-prefill
at the real Qwen3 shapes (4,096-token context), and its measured time at those shapes with
random weights (the handoff from an existing source cache, including the refresh, against the
target's re-prefill; raw trials kept). Every step is a resumable cell, the timing too
(RESULTS/RUN/frontier-timing.json, keyed by what it times and the thread count); --resume
continues and reads finished cells back.

Writes RESULTS/RUN/frontier.{json,md,png}: pure translation at one end, re-prefill
(`tail:100%`) at the other, and the cheapest setting that keeps ≥ 95% of the native target's
IFEval and GSM8K accuracy named. `--runs` adds other trained runs (other families). A translator
trained with the target's exact layer 0 (refresh exact:0, the default) starts at exact:0, and its
grid holds the settings that recompute layer 0 too (EXACT0_SETTINGS).

Which layers matter: for every target layer l, the test KL with the target's own K/V at layer l
alone and the translator's elsewhere (refresh `layer:l`), against pure translation; the share of
the translation's KL that one native layer removes ranks the layers (`--no-layer-sweep` skips it).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..core.settings import Geometry, Refresh
from ..errors import Failure, Refusal
from ..inputs.argtypes import whole
from ..inputs.flags import CV_LIMIT, add_task_data_args, generative_tasks, refresh_setting
from ..inputs.profiles import get_profile
from ..io import atomic_write_bytes, atomic_write_text, sha256_file
from ..records.paths import MANIFEST_FILE, MAPS_FILE, RunPaths, check_outputs, default_data, run_paths
from ..records.report import Metric, Report, figure, figure_png, fmt_interval, fmt_pm, fmt_table
from ..records.resume import code_hash
from . import cells as K
from .skeleton import Stage, lock_run

if TYPE_CHECKING:
    from ..inputs.models import PairConfig

SETTINGS = (
    "none",
    "tail:10%",
    "tail:25%",
    "tail:50%",
    "layers:25%",
    "layers:50%",
    "layers:75%",
    "select:0.1",
    "select:0.25",
    "select:0.5",
    "tail:100%",
)
# A translator trained with the target's exact layer 0 (exact:0) is never run without it: its frontier starts there
# and goes on through the settings that recompute layer 0 as well (one refresh kind at a time).
EXACT0_SETTINGS = ("exact:0", "layers:25%", "layers:50%", "layers:75%", "tail:100%")
KEEP = 0.95  # the goal: keep this fraction of the native target's IFEval and GSM8K accuracy
REAL_TOKENS = 4096  # context length of the real-shape costs and timings


@dataclass(frozen=True)
class FrontierConfig:
    run: str  # the trained run whose distilled translator is refreshed
    runs: tuple[str, ...]  # every run on the frontier (the first is `run`)
    profile: str
    data: str
    settings: tuple[Refresh, ...]  # refresh settings, cheapest first (reports write each as its text)
    eval_root: str  # prepared IFEval and GSM8K data
    tasks: tuple[str, ...]
    real_tokens: int  # context length of the real-shape costs and timings
    timing_warmups: int
    timing_repeats: int
    layer_sweep: bool  # test KL with one target layer native, for each layer
    artifacts: str
    results: str
    pair: PairConfig


@dataclass
class FrontierResults:
    rows: list  # per (run, setting): costs, measured time, quality and task scores, kept fraction of native
    native: dict  # the native target's IFEval and GSM8K
    cheapest_meeting_goal: dict | None  # the cheapest setting keeping ≥ 95% of native accuracy, per run
    timing: dict  # re-prefill at the real shapes, threads
    layer_sweep: dict  # per run: test KL with each target layer alone native, and the share of KL it removes

    METRICS = (
        Metric("rows.*.fraction_of_reprefill", False, "handoff FLOPs / re-prefill FLOPs at the real shapes"),
        Metric("rows.*.test_kl_token", False, "test KL(native target ‖ refreshed handoff) per reply token"),
        Metric("rows.*.ifeval_strict_prompt", True, "IFEval strict prompt accuracy"),
        Metric("rows.*.gsm8k", True, "GSM8K accuracy"),
        Metric(
            "layer_sweep.*.layers.*.kl_removed",
            True,
            "share of pure translation's test KL removed by the target's own K/V at this layer alone",
        ),
    )


def slug(setting: Refresh | str) -> str:
    return str(setting).replace(":", "-").replace("%", "pct")


class Plan:
    def __init__(self, cfg: FrontierConfig):
        self.cfg, self.paths = cfg, RunPaths(cfg.run, cfg.artifacts, cfg.results)
        p = cfg.pair
        self.flags = K.stage_flags(cfg.profile, p, cfg.artifacts, cfg.results)
        self.inputs = {"data": K.data_hash(cfg.data, cfg.profile), "models": p.identities()}

    def sub(self, run: str, setting: str) -> RunPaths:
        return RunPaths(run, self.cfg.artifacts, self.cfg.results).nested(f"frontier/{slug(setting)}")

    def stage_translator(self, run: str, setting: str) -> None:
        """The run's distilled translator, copied under the setting's own run folder (each cell is the real stage)."""
        src = RunPaths(run, self.cfg.artifacts, self.cfg.results).translator("distilled")
        dst = self.sub(run, setting).translator("distilled")
        if not (dst / MANIFEST_FILE).is_file() or sha256_file(dst / MAPS_FILE) != sha256_file(src / MAPS_FILE):
            tmp = dst.with_name(".distilled.copy")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)

    def cell(self, stage: str, run: str, setting: Refresh, flags: dict, report: str, **kw) -> K.Cell:
        script = _script(stage)
        sub = self.sub(run, setting)
        src = RunPaths(run, self.cfg.artifacts, self.cfg.results).translator("distilled")
        inputs = {**self.inputs, "code_sha256": code_hash(script), "translator": sha256_file(src / MAPS_FILE)}
        return K.Cell(
            f"{stage}/{run}/{slug(setting)}",
            stage,
            script,
            {**self.flags, "--run": sub.run, "--refresh": str(setting), **flags},
            str(sub.report(report)),
            inputs,
            **kw,
        )

    def benchmark(self, run: str, setting: str) -> K.Cell:
        """The test split's KL/top-1 under a refresh setting (no timing, no control dtypes)."""
        return self.cell(
            "benchmark",
            run,
            setting,
            {"--data": self.cfg.data, "--timing-conversations": 0, "--control-dtypes": "none", "--skip-missing": True},
            "benchmark",
            fresh_flag="--force",
            before=lambda: self.stage_translator(run, setting),
        )

    def generative(self, task: str, run: str, setting: str) -> K.Cell:
        stage, report = ("ifeval", "ifeval") if task == "ifeval" else ("task", "task-gsm8k")
        flags = {
            "--data-root": self.cfg.eval_root,
            "--no-controls": True,
            **({"--task": "gsm8k"} if task == "gsm8k" else {}),
        }
        rows = f"{report}-native.rows.jsonl"
        native = self.paths.nested("frontier/native").beside(f"{report}-native", ".rows.jsonl")

        def before() -> None:  # the translator under the setting's folder, the native rows beside it
            self.stage_translator(run, setting)
            K.copy_file(native, self.sub(run, setting).res / rows)

        return self.cell(stage, run, setting, flags, report, resume_flag="--resume", before=before)

    def timing(self, specs: dict[str, dict]) -> K.Cell:
        """The real-shape timing as a cell this process computes (`real_timings`): keyed by what it times, the
        code and the threads it runs on, so a resume reads the recorded trials back instead of timing again,
        and refuses when any of those changed."""
        c = self.cfg
        flags = {
            "--direction": c.pair.direction,
            "--device": c.pair.device,
            "--settings": [str(s) for s in c.settings],
            "--real-tokens": c.real_tokens,
            "--timing-warmups": c.timing_warmups,
            "--timing-repeats": c.timing_repeats,
        }
        import torch

        from ..bench import timing

        inputs = {
            "code_sha256": code_hash(Frontier.script_path()),
            "translators": specs,
            "threads": timing.threads(),
            "torch": torch.__version__,
        }
        return K.Cell(
            "timing/real-shapes",
            "timing",
            str(Frontier.script_path()),
            flags,
            str(self.paths.report("frontier-timing")),
            inputs,
        )

    def native(self, task: str) -> K.Cell:
        stage, report = ("ifeval", "ifeval-native") if task == "ifeval" else ("task", "task-gsm8k-native")
        script = _script(stage)
        sub = self.paths.nested("frontier/native")
        flags = {
            **self.flags,
            "--run": sub.run,
            "--data-root": self.cfg.eval_root,
            "--native": True,
            **({"--task": "gsm8k"} if task == "gsm8k" else {}),
        }
        return K.Cell(
            f"{stage}/native",
            stage,
            script,
            flags,
            str(sub.report(report)),
            {**self.inputs, "code_sha256": code_hash(script)},
            resume_flag="--resume",
        )


def real_timings(cfg: FrontierConfig, family_specs: dict[str, dict], toy) -> dict:
    """Re-prefill and each (run, setting)'s handoff at the real shapes with random weights (seconds), every
    trial interleaved round by round with the others (timing.time_handoffs)."""
    import torch

    from ..bench import timing
    from ..bench.packing import packed
    from ..bench.random_pair import random_pair, random_translator
    from ..bench.shapes import real_settings
    from ..bench.speed import random_ids

    device = cfg.pair.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pair = random_pair("qwen3", cfg.pair.direction, device, dtype)
    T, k = cfg.real_tokens, 16
    ids = random_ids(pair.target.config.vocab_size, T + k, 0, device)
    width = pair.target.config.num_key_value_heads * pair.target.config.head_dim
    handoffs = {}
    for run, spec in family_specs.items():
        tr = random_translator(
            pair.source,
            pair.target,
            spec["key_space"],
            family=spec["family"],
            settings=real_settings(
                spec["family"],
                spec["settings"],
                width / toy.target_width,
                depth_ratio=pair.target.config.num_hidden_layers / toy.target_layers,
            ),
        )
        handoffs.update({f"{run}|{setting}": (tr, setting) for setting in cfg.settings})
    mode = timing.mode_for(cfg.pair.cache)
    with packed(pair.target, on=mode == "optimised"):
        timed = timing.time_handoffs(
            pair.source,
            pair.target,
            handoffs,
            ids[:, :T],
            ids[:, T:],
            timing.Trials(cfg.timing_warmups, cfg.timing_repeats),
            mode,
        )
    return {
        "tokens": T,
        "new_turn_tokens": k,
        "threads": timing.threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "interleaved": True,
        **timed,
    }


def add_times(rows: list[dict], t: dict) -> None:
    """Each row's real-shape handoff time (median and trials), its speedup over re-prefill and that
    speedup's 95% bootstrap interval from both sides' trials, in place."""
    from ..eval.stats import ratio_of_medians_interval

    for row in rows:
        h = t["handoff"][f"{row['run']}|{row['setting']}"]
        row["time_s"], row["speedup"] = h["median_s"], t["reprefill"]["median_s"] / h["median_s"]
        row["speedup_interval"] = ratio_of_medians_interval(t["reprefill"]["trials_s"], h["trials_s"])
        row["time_trials_s"] = h["trials_s"]


def layer_sweep(none: dict, per_layer: list[dict]) -> dict:
    """Per target layer: test KL with that layer alone native, the share of pure translation's KL it removes,
    and its rank (1 removes the most)."""
    base = none["kl_token_mean"]
    layers = [
        {
            "layer": l,
            "test_kl_token": a["kl_token_mean"],
            "test_kl_conversation": a["kl_conversation"],
            "top1": a["top1_agreement"],
            "kl_removed": (base - a["kl_token_mean"]) / base if base else 0.0,
        }
        for l, a in enumerate(per_layer)
    ]
    for rank, row in enumerate(sorted(layers, key=lambda r: -r["kl_removed"]), 1):
        row["rank"] = rank
    return {"none_kl_token": base, "layers": layers}


def kept(score: dict | None, native: dict | None) -> float | None:
    if not score or not native or not native.get("mean"):
        return None
    return score["mean"] / native["mean"]


def layer_table(sweep: dict) -> str:
    if not sweep:
        return ""
    parts = []
    for run, sw in sweep.items():
        body = [
            [
                r["layer"],
                r["test_kl_token"],
                fmt_pm(r["test_kl_conversation"]),
                r["top1"],
                f"{100 * r['kl_removed']:.1f}%",
                r["rank"],
            ]
            for r in sw["layers"]
        ]
        parts.append(
            f"{run} (pure translation: test KL/token {sw['none_kl_token']:.4g}):\n\n"
            + fmt_table(["native layer", "test KL/token", "KL/conv ± SE", "top-1", "KL removed", "rank"], body)
        )
    return (
        "\n## Which layers matter\n\nTest KL with the target's own K/V at one layer alone and the translator's "
        "at every other (refresh `layer:l`); the share of pure translation's KL that this removes ranks the "
        "layers (1 = the layer whose translation does the most damage).\n\n" + "\n".join(parts)
    )


def cv_note(t: dict) -> str:
    """The CV screen of the real-shape times, under the table: which medians came from noisy trials."""
    if not t:
        return ""
    summaries = {"re-prefill": t["reprefill"], **t["handoff"]}
    flagged = [f"{name} {s['cv']:.2f}" for name, s in summaries.items() if s["noisy"]]
    if not flagged:
        return f"\nCV screen (SD / mean ≤ {CV_LIMIT:g}): every timing passed.\n"
    return (
        f"\nCV screen (SD / mean > {CV_LIMIT:g}) flagged {len(flagged)} of {len(summaries)} timings: "
        + ", ".join(flagged)
        + ". Their medians stand in the table; rerun on an idle machine or with more "
        "`--timing-repeats` to firm them up.\n"
    )


def markdown(cfg: FrontierConfig, rows: list[dict], native: dict, best: dict, t: dict, sweep: dict) -> str:
    pct = lambda s: fmt_pm(s, 100.0, ".1f")  # noqa: E731
    table = fmt_table(
        [
            "run",
            "refresh",
            "% of re-prefill FLOPs",
            "time s",
            "speedup (95% interval)",
            "test KL/token",
            "KL/conv ± SE",
            "top-1",
            "IFEval strict %",
            "kept",
            "GSM8K %",
            "kept",
        ],
        [
            [
                r["run"],
                r["setting"],
                f"{100 * r['fraction_of_reprefill']:.1f}",
                None if r.get("time_s") is None else f"{r['time_s']:.2f}",
                None
                if r.get("speedup") is None
                else f"{r['speedup']:.1f}× ({fmt_interval(r.get('speedup_interval'), '.1f')})",
                r["test_kl_token"],
                fmt_pm(r["test_kl_conversation"]),
                r["top1"],
                pct(r.get("ifeval_strict_prompt")),
                _frac(r.get("ifeval_kept")),
                pct(r.get("gsm8k")),
                _frac(r.get("gsm8k_kept")),
            ]
            for r in rows
        ],
    )
    head = (
        f"# Refresh frontier: {cfg.pair.large} / {cfg.pair.small}, {cfg.pair.direction}, profile {cfg.profile}\n\n"
        f"Costs at the real Qwen3-1.7B/0.6B shapes with a {cfg.real_tokens}-token context"
        + (
            f"; times measured there with random weights ({t['threads']} thread(s), {t['dtype']}, "
            f"{cfg.timing_repeats} interleaved trials after {cfg.timing_warmups} warm-up(s); re-prefill "
            f"{t['reprefill']['median_s']:.2f} s)"
            if t
            else ""
        )
        + ".\n\n"
    )
    goal = "\n".join(goal_line(run, b) for run, b in best.items())
    return (
        head
        + table
        + cv_note(t)
        + f"\nNative target: IFEval strict {pct(native.get('ifeval'))}, GSM8K {pct(native.get('gsm8k'))}."
        + f"\n\nCheapest setting keeping ≥ {KEEP:.0%} of the native target's IFEval and GSM8K:\n{goal}\n\n"
        "![quality against cost](frontier.png)\n" + layer_table(sweep)
    )


def goal_line(run: str, best: dict | None) -> str:
    """The report's line for a run's cheapest setting keeping ≥ 95% of both tasks: its FLOPs and, where timed, its
    speed against the re-prefill's (a ratio, below 1 where the setting is slower)."""
    if not best:
        return f"- {run}: no setting keeps ≥ 95% of both"
    speed = f", {best['speedup']:.1f}× the re-prefill's speed" if best.get("speedup") else ""
    return f"- {run}: **{best['setting']}**, {100 * best['fraction_of_reprefill']:.1f}% of re-prefill FLOPs{speed}"


def _frac(x):
    return None if x is None else f"{100 * x:.0f}%"


def plot(rows: list[dict], title: str, sweep: dict) -> bytes:
    fig, axes = figure((16 if sweep else 11, 4.2), 3 if sweep else 2)
    for run in dict.fromkeys(r["run"] for r in rows):
        rs = sorted((r for r in rows if r["run"] == run), key=lambda r: r["fraction_of_reprefill"])
        xs = [100 * r["fraction_of_reprefill"] for r in rs]
        axes[0].errorbar(xs, [r["test_kl_token"] for r in rs], fmt="o-", label=run)
        for key, style in (("ifeval_strict_prompt", "o-"), ("gsm8k", "s--")):
            pts = [(x, r[key]) for x, r in zip(xs, rs) if r.get(key)]
            if pts:
                axes[1].errorbar(
                    [x for x, _ in pts],
                    [100 * s["mean"] for _, s in pts],
                    yerr=[100 * s["se"] if s["se"] == s["se"] else 0 for _, s in pts],
                    fmt=style,
                    label=f"{run} {key.split('_')[0]}",
                    capsize=2,
                )
        for x, r in zip(xs, rs):
            axes[0].annotate(
                r["setting"], (x, r["test_kl_token"]), fontsize=6, xytext=(2, 2), textcoords="offset points"
            )
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("handoff FLOPs, % of re-prefill (real shapes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("test KL per reply token")
    axes[1].set_ylabel("accuracy %")
    if sweep:
        width = 0.8 / len(sweep)
        for i, (run, sw) in enumerate(sweep.items()):
            ls = [r["layer"] for r in sw["layers"]]
            axes[2].bar(
                [l + (i - (len(sweep) - 1) / 2) * width for l in ls],
                [100 * r["kl_removed"] for r in sw["layers"]],
                width,
                label=run,
            )
            axes[2].set_xticks(ls)
        axes[2].set_xlabel("target layer computed natively (alone)")
        axes[2].set_ylabel("% of pure translation's test KL removed")
        axes[2].grid(alpha=0.3, axis="y")
        axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return figure_png(fig)


def _script(stage: str):
    """The script of a stage the frontier runs as a cell."""
    from .registry import STAGES

    return str(STAGES[stage].script)


# --------------------------------------------------------------------------- the stage
class Frontier(Stage):
    name = "frontier"
    script = "frontier.py"
    summary = "The refresh frontier: quality against cost, from pure translation to re-prefill."
    examples = (
        "make frontier PROFILE=demo            (trains the demo's translator first if it is not trained)",
        ".venv/bin/python frontier.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
        "--device cpu --dtype float32 --data-root data/toy-eval --runs demo-l2s-ablate/crosshead --resume",
    )
    resumable = True
    data = True

    @classmethod
    def add_args(cls, p) -> None:
        p.add_argument(
            "--runs", nargs="*", default=[], help="other trained runs to put on the frontier (other families)"
        )
        p.add_argument(
            "--settings",
            nargs="+",
            default=None,
            type=refresh_setting,
            help=f"refresh settings (default: the grid, {' '.join(SETTINGS)}; for a translator trained with the "
            f"target's exact layer 0: {' '.join(EXACT0_SETTINGS)})".replace("%", "%%"),  # argparse formats help with %
        )
        add_task_data_args(p)
        p.add_argument(
            "--real-tokens", type=whole(1), default=REAL_TOKENS, help="context length of the real-shape timing"
        )
        p.add_argument("--no-timing", action="store_true", help="skip the real-shape timing (costs from FLOPs only)")
        p.add_argument("--timing-warmups", type=whole(0), default=1, help="warm-ups per timed path")
        p.add_argument("--timing-repeats", type=whole(1), default=3, help="timed trials per path")
        p.add_argument(
            "--no-layer-sweep",
            action="store_true",
            help="skip the per-layer sweep (test KL with one target layer native, for each layer)",
        )

    def check(self) -> None:
        from ..inputs.models import pair_config_from_args
        from ..records.saved import read_manifest

        args, self.t0 = self.args, time.time()
        profile = get_profile(args.profile)
        run = run_paths(args).run
        trained = self._trained_refresh(run)
        if args.settings is None:
            args.settings = [Refresh.parse(s) for s in (EXACT0_SETTINGS if trained.kind == "exact" else SETTINGS)]
        if trained.kind == "exact" and not args.no_layer_sweep:
            print(
                "note: the run's translator was trained with the target's exact layer 0, which the layer sweep "
                "(one target layer native, layer 0 translated) would drop; it is skipped: layers.py diagnoses "
                "such a translator layer by layer"
            )
            args.no_layer_sweep = True
        pair, _ = pair_config_from_args(args, refresh=args.settings)
        self.tasks = generative_tasks(args)
        self.cfg = cfg = FrontierConfig(
            run=run,
            runs=(run, *args.runs),
            profile=profile.name,
            data=str(args.data or default_data(profile.name)),
            settings=tuple(args.settings),
            eval_root=args.data_root,
            tasks=self.tasks,
            real_tokens=args.real_tokens,
            timing_warmups=args.timing_warmups,
            timing_repeats=args.timing_repeats,
            layer_sweep=not args.no_layer_sweep,
            artifacts=args.artifacts,
            results=args.results,
            pair=pair,
        )
        self.specs = {}
        for r in cfg.runs:
            folder = RunPaths(r, cfg.artifacts, cfg.results).translator("distilled")
            if not (folder / MANIFEST_FILE).is_file():
                raise Refusal(f"no trained translator at {folder}: train the run first (make train RUN={r})")
            m = read_manifest(folder)  # refuses a damaged or edited manifest, or maps that do not match it
            self.specs[r] = {"family": m["family"], "key_space": m["key_space"], "settings": m["settings"]}
        self.toy = Geometry(**pair.geometry)  # the trained pair's shapes, carried to the real ones
        self.plan = plan = Plan(cfg)
        check_outputs(
            [
                plan.paths.report("frontier"),
                plan.paths.report("frontier-timing"),
                *(plan.paths.beside("frontier", x) for x in (".md", ".png")),
                plan.paths.res / K.LEDGER_FILE,
            ]
        )
        lock_run(plan.paths.res, "frontier")

    def _trained_refresh(self, run: str) -> Refresh:
        """The refresh the run's distilled translator was trained under (none when it is not trained yet: make
        frontier trains the profile's default first)."""
        from ..records.saved import trained_refresh

        folder = RunPaths(run, self.args.artifacts, self.args.results).translator("distilled")
        return trained_refresh(folder) if (folder / MANIFEST_FILE).is_file() else Refresh()

    def load(self) -> None:
        ledger = K.Ledger(self.plan.paths.res / "frontier-state.json", asdict(self.cfg), self.args.resume)
        self.cells = K.Cells(ledger, self.args.resume, runner=K.run_in_process)

    def run(self) -> dict:
        try:
            return self._cells()
        except Refusal:
            raise
        except K.StageFailed as e:
            raise Failure(f"{e}. Fix the cause, then re-run with --resume") from None

    def _quality(self, run: str, setting: Refresh) -> dict:
        return self.cells.ensure(self.plan.benchmark(run, setting))["results"]["quality"]["arms"]["distilled"]

    def _cells(self) -> dict:
        from ..bench.shapes import real_pair_configs, translator_at
        from ..core.refresh import refresh_flops

        cfg, cells, plan = self.cfg, self.cells, self.plan
        metric = {"ifeval": "prompt_level_strict_acc"}
        native = {
            t: cells.ensure(plan.native(t))["results"]["paths"]["native_target"][metric.get(t, "accuracy")]
            for t in self.tasks
        }
        rows = []
        src_cfg, tgt_cfg = real_pair_configs(cfg.pair.direction)
        for r in cfg.runs:
            spec = self.specs[r]
            translator = translator_at(spec["family"], spec["settings"], src_cfg, tgt_cfg, spec["key_space"], self.toy)
            for setting in cfg.settings:
                arms = self._quality(r, setting)
                cost = refresh_flops(setting, src_cfg, tgt_cfg, translator, cfg.real_tokens)
                row = {
                    "run": r,
                    "setting": str(setting),
                    **cost,
                    "test_kl_token": arms["kl_token_mean"],
                    "test_kl_conversation": arms["kl_conversation"],
                    "top1": arms["top1_agreement"],
                    "nll_delta": arms["nll_delta_vs_native_target"],
                }
                for t in self.tasks:
                    score = cells.ensure(plan.generative(t, r, setting))["results"]["paths"]["translated"]
                    score = score[metric.get(t, "accuracy")]
                    key = "ifeval_strict_prompt" if t == "ifeval" else "gsm8k"
                    row[key], row[f"{t}_kept"] = score, kept(score, native.get(t))
                rows.append(row)
        n_layers = cfg.pair.geometry["target_layers"]
        layers = [Refresh("layer", float(layer)) for layer in range(n_layers)]
        sweep = (
            {r: layer_sweep(self._quality(r, Refresh()), [self._quality(r, s) for s in layers]) for r in cfg.runs}
            if cfg.layer_sweep
            else {}
        )
        t = None
        if not self.args.no_timing:

            def timed() -> dict:
                print(f"timing at the real shapes ({cfg.real_tokens} tokens, random weights)...", file=sys.stderr)
                return real_timings(cfg, self.specs, self.toy)

            t = cells.ensure_here(plan.timing(self.specs), timed)
            add_times(rows, t)
        return {"rows": rows, "native": native, "sweep": sweep, "timing": t}

    def publish(self, out: dict) -> dict:
        cfg, plan, rows, native, sweep, t = self.cfg, self.plan, out["rows"], out["native"], out["sweep"], out["timing"]
        best = {}
        for r in cfg.runs:
            ok = [
                row for row in rows if row["run"] == r and all((row.get(f"{x}_kept") or 0) >= KEEP for x in self.tasks)
            ]
            best[r] = min(ok, key=lambda row: row["fraction_of_reprefill"]) if ok else None
        results = FrontierResults(
            rows=rows, native=native, cheapest_meeting_goal=best, timing=t or {}, layer_sweep=sweep
        )
        png = plan.paths.beside("frontier", ".png")
        atomic_write_bytes(png, plot(rows, f"{cfg.pair.direction}, profile {cfg.profile}", sweep))
        md = markdown(cfg, rows, native, best, t, sweep)
        atomic_write_text(plan.paths.beside("frontier", ".md"), md)
        report = Report(
            "frontier",
            config=cfg,
            inputs={**plan.inputs, "code_sha256": code_hash(Frontier.script_path())},
            results=results,
            metrics=FrontierResults.METRICS,
            n_samples={"settings": len(rows)},
            wall_time_s=time.time() - self.t0,
            device=cfg.pair.device,
            dtype=cfg.pair.dtype,
            files={png.name: sha256_file(png)},
        )
        data = report.write(plan.paths.report("frontier"))
        print(md)
        return data
