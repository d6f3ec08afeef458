"""Ablate the translator: every family and setting on the same splits and budget, and the default chosen on validation.

For each setting in kvlingo/drive/ablation.py: train (closed form, then distillation at the
profile's budget), benchmark the test split, IFEval and GSM8K after a prompt handoff (with the
native rows scored once and shared). The two settings with the lowest validation KL are
trained again with a longer budget. Every step is a resumable cell (the recipe's ledger): a
killed run continues with --resume. Writes RESULTS/RUN/ablation.{json,md,png} with, per
setting: parameters, translation FLOPs per token at the real Qwen3 shapes and the ceiling
speedup they allow, closed-form and distilled validation KL, test KL/token ± SE, top-1, NLL Δ,
IFEval strict prompt ± SE, GSM8K ± SE and training wall time; the chosen default is the lowest
validation KL among settings costing at most 10% of re-prefill.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlingo.core.folder import MAPS_FILE
from kvlingo.drive import ablation as A
from kvlingo.drive import cells as K
from kvlingo.drive.ledger import LEDGER_FILE
from kvlingo.drive.stage import add_task_data_args, generative_tasks, lock_run, refusals_exit, stage_parser
from kvlingo.errors import Failure, Refusal
from kvlingo.io import atomic_write_bytes, atomic_write_text, read_json, sha256_file
from kvlingo.run.argtypes import whole
from kvlingo.run.models import PairConfig, pair_config_from_args
from kvlingo.run.paths import TRANSLATORS, RunPaths, check_outputs, default_data, default_run
from kvlingo.run.profiles import get_profile
from kvlingo.run.report import Metric, Report, figure, figure_png, fmt_pm, fmt_table
from kvlingo.run.resume import code_hash

ROOT = Path(__file__).resolve().parent
SCRIPTS = {"train": "train_translator.py", "benchmark": "benchmark.py", "ifeval": "ifeval.py", "task": "task_eval.py"}


@dataclass(frozen=True)
class AblationConfig:
    run: str  # cells live under ARTIFACTS/RUN/<setting> and RESULTS/RUN/<setting>
    profile: str  # profile passed to every stage (budget, splits, evaluation sizes)
    data: str  # prepared chat data
    settings: tuple[str, ...]  # the settings run (kvlingo/drive/ablation.py SETTINGS)
    long_factor: int  # the best two settings are trained again for this many × the profile's updates
    eval_root: str  # prepared IFEval and GSM8K data root
    tasks: tuple[str, ...]  # generative evaluations run per setting (ifeval, gsm8k)
    artifacts: str
    results: str
    pair: PairConfig


@dataclass
class AblationResults:
    rows: list  # one per setting (and long run): cost, validation and test figures, task scores, wall time
    default: dict  # the chosen default and why
    native: dict  # native target (and source) task scores the handoff is compared with

    METRICS = (Metric("rows.*.distilled_val_kl", False, "validation KL after distillation: the only selection metric"),
               Metric("rows.*.test_kl_token", False, "test KL(native target ‖ translated) per reply token"),
               Metric("rows.*.ifeval_strict_prompt", True, "IFEval strict prompt accuracy after the handoff"),
               Metric("rows.*.gsm8k", True, "GSM8K accuracy after a prompt handoff"))


def parse_args(argv=None):
    p = stage_parser(__doc__, ["python ablate.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
                               "--device cpu --dtype float32 --data-root data/toy-eval",
                               "python ablate.py --profile demo --large artifacts/toy/large --small artifacts/toy/small "
                               "--device cpu --dtype float32 --data-root data/toy-eval --settings headwise crosshead --resume"],
                     common=True, data=True)
    p.add_argument("--settings", nargs="+", default=[s.name for s in A.SETTINGS],
                   choices=[s.name for s in A.SETTINGS], help="settings to run (default: all)")
    p.add_argument("--long-factor", type=whole(0), default=A.LONG_FACTOR, help="the best two's longer budget (0: none)")
    add_task_data_args(p)
    return p.parse_args(argv)


class Plan:
    def __init__(self, cfg: AblationConfig):
        self.cfg, self.paths = cfg, RunPaths(cfg.run, cfg.artifacts, cfg.results)
        p = cfg.pair
        self.flags = K.stage_flags(cfg.profile, p, cfg.artifacts, cfg.results)
        self.inputs = {"data": K.data_hash(cfg.data), "models": p.identities(),
                       "eval_data": {t: sha256_file(Path(cfg.eval_root) / t / "manifest.json") for t in cfg.tasks}}

    def cell(self, stage: str, sub: str, flags: dict, report: str, **kw) -> K.Cell:
        script = str(ROOT / SCRIPTS[stage])
        nested = self.paths.nested(sub)
        return K.Cell(f"{stage}/{sub}", stage, script, {**self.flags, "--run": nested.run, **flags},
                      str(nested.report(report)), {**self.inputs, "code_sha256": code_hash(script)}, **kw)

    def train(self, setting: A.Setting, sub: str, updates: int | None = None) -> K.Cell:
        flags = {"--data": self.cfg.data, "--family": setting.family, "--updates": updates}
        return self.cell("train", sub, flags, "train", extra=setting.flags, resume_flag="--resume",
                         outputs=tuple(str(self.paths.nested(sub).translator(k) / MAPS_FILE) for k in TRANSLATORS))

    def benchmark(self, sub: str) -> K.Cell:
        return self.cell("benchmark", sub, {"--data": self.cfg.data, "--timing-conversations": 0,
                                            "--control-dtypes": "none"}, "benchmark", fresh_flag="--force")

    def generative(self, task: str, sub: str, native: bool) -> K.Cell:
        stage, report = ("ifeval", "ifeval") if task == "ifeval" else ("task", "task-gsm8k")
        flags = {"--data-root": self.cfg.eval_root, "--native": native, "--no-controls": not native}
        if task == "gsm8k":
            flags["--task"] = "gsm8k"
        before = None
        if not native:  # the native target's answers are shared: copied beside the setting, reused by input hash
            rows = f"{report}-native.rows.jsonl"
            src, dst = self.paths.nested("native").res / rows, self.paths.nested(sub).res / rows
            before = lambda: K.copy_file(src, dst)  # noqa: E731
        return self.cell(stage, f"{sub}", flags, report + ("-native" if native else ""), resume_flag="--resume",
                         before=before)


def summarise(plan: Plan, setting: A.Setting, sub: str, toy_width: int, long: bool) -> dict:
    res = plan.paths.nested(sub).res
    train = read_json(res / "train.json")["results"]
    arms = read_json(res / "benchmark.json")["results"]["quality"]["arms"]
    d = arms["distilled"]
    row = {"name": sub, "setting": setting.name, "family": setting.family, "flags": list(setting.flags),
           "note": setting.note, "long_budget": long, "params": train["translator"]["n_params"],
           "real": A.real_cost(setting, plan.cfg.pair.direction, toy_width),
           "closed_form_val_kl": train["closed_form_val_kl"], "distilled_val_kl": train["distilled_val_kl"],
           "test_kl_token": d["kl_token_mean"], "test_kl_conversation": d["kl_conversation"],
           "top1": d["top1_agreement"], "nll_delta": d["nll_delta_vs_native_target"],
           "train_wall_s": train["wall_time_s_total"], "n_test": d["n_conversations"]}
    if "ifeval" in plan.cfg.tasks:
        row["ifeval_strict_prompt"] = read_json(res / "ifeval.json")["results"]["paths"]["translated"][
            "prompt_level_strict_acc"]
    if "gsm8k" in plan.cfg.tasks:
        row["gsm8k"] = read_json(res / "task-gsm8k.json")["results"]["paths"]["translated"]["accuracy"]
    return row


def markdown(cfg: AblationConfig, rows: list[dict], default: dict, native: dict) -> str:
    pct = lambda s: fmt_pm(s, 100.0, ".1f")  # noqa: E731
    table = fmt_table(
        ["setting", "params", "FLOP/token (real)", "% of re-prefill", "ceiling", "val KL closed", "val KL distilled",
         "test KL/token", "KL/conv ± SE", "top-1", "ΔNLL", "IFEval strict %", "GSM8K %", "train s"],
        [[r["name"], r["params"], f"{r['real']['translate_flops_per_token'] / 1e6:.1f}M",
          f"{100 * r['real']['fraction_of_reprefill']:.1f}", f"{r['real']['ceiling_speedup']:.1f}×",
          r["closed_form_val_kl"], r["distilled_val_kl"], r["test_kl_token"], fmt_pm(r["test_kl_conversation"]),
          r["top1"], r["nll_delta"], pct(r.get("ifeval_strict_prompt")), pct(r.get("gsm8k")), round(r["train_wall_s"])]
         for r in rows])
    p = cfg.pair
    lines = [f"# Translator ablation: {p.large} / {p.small}, {p.direction}, profile {cfg.profile}\n\n",
             f"Same splits and budget for every setting; the best two by validation KL also ran {cfg.long_factor}× "
             "longer (`-long`). FLOPs: translation per context token at the real Qwen3-1.7B/0.6B shapes, against the "
             "target's re-prefill per token.\n\n", table,
             f"\nNative target: IFEval strict {pct(native.get('ifeval'))}, GSM8K {pct(native.get('gsm8k'))}.\n",
             f"\n**Default: {default['setting']}** — {default['why']}.\n\n![quality against cost](ablation.png)\n"]
    return "".join(lines)


def plot(rows: list[dict], title: str) -> bytes:
    fig, ax = figure((7, 4.5))
    for r in rows:
        x, y = 100 * r["real"]["fraction_of_reprefill"], r["test_kl_token"]
        ax.plot([x], [y], "o", color="C1" if r["long_budget"] else "C0")
        ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(100 * A.MAX_COST_FRACTION, ls="--", c="grey", lw=1, label="cost cap of the default")
    ax.set_xscale("log")
    ax.set_xlabel("translation FLOPs, % of the target's re-prefill (real Qwen3 shapes)")
    ax.set_ylabel("test KL(native ‖ translated), nats per reply token")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return figure_png(fig)


@refusals_exit("ablate", resumable=True)
def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    profile = get_profile(args.profile)
    pair, _ = pair_config_from_args(args)
    tasks = generative_tasks(args)
    cfg = AblationConfig(run=args.run or f"{default_run(profile.name, pair.direction)}-ablate",
                         profile=profile.name, data=str(args.data or default_data(profile.name)),
                         settings=tuple(args.settings), long_factor=args.long_factor, eval_root=args.data_root,
                         tasks=tasks, artifacts=args.artifacts, results=args.results, pair=pair)
    plan = Plan(cfg)
    check_outputs([plan.paths.report("ablation"), *(plan.paths.beside("ablation", x) for x in (".md", ".png")),
                   plan.paths.res / LEDGER_FILE])
    lock_run(plan.paths.res, "ablate")
    ledger = K.Ledger(plan.paths.res / LEDGER_FILE, asdict(cfg), args.resume)
    cells = K.Cells(ledger, args.resume, runner=K.run_in_process)
    chosen = [s for s in A.SETTINGS if s.name in cfg.settings]
    toy_width = pair.geometry["target_kv_heads"] * pair.geometry["target_head_dim"]
    try:
        native = {}
        for t in tasks:
            rep = cells.ensure(plan.generative(t, "native", native=True))
            key = "prompt_level_strict_acc" if t == "ifeval" else "accuracy"
            native[t] = rep["results"]["paths"]["native_target"][key]

        def evaluate(setting, sub, updates=None):
            cells.ensure(plan.train(setting, sub, updates))
            cells.ensure(plan.benchmark(sub))
            for t in tasks:
                cells.ensure(plan.generative(t, sub, native=False))
            return summarise(plan, setting, sub, toy_width, long=updates is not None)

        rows = [evaluate(s, s.name) for s in chosen]
        if cfg.long_factor:
            best = sorted(rows, key=lambda r: r["distilled_val_kl"])[:2]
            by_name = {s.name: s for s in chosen}
            rows += [evaluate(by_name[r["setting"]], f"{r['setting']}-long", cfg.long_factor * profile.updates)
                     for r in best]
    except Refusal:
        raise
    except K.StageFailed as e:
        raise Failure(f"{e}. The ledger marks that cell failed; fix the cause, then re-run with --resume") from None

    default = A.choose_default([r for r in rows if not r["long_budget"]])
    results = AblationResults(rows=rows, default=default, native=native)
    png = plan.paths.beside("ablation", ".png")
    atomic_write_bytes(png, plot(rows, f"{pair.direction}, profile {cfg.profile}"))
    md = markdown(cfg, rows, default, native)
    atomic_write_text(plan.paths.beside("ablation", ".md"), md)
    report = Report("ablation", config=cfg, inputs={**plan.inputs, "code_sha256": code_hash(__file__)},
                    results=results, metrics=AblationResults.METRICS,
                    n_samples={"settings": len(rows), "test_conversations": rows[0]["n_test"] if rows else 0},
                    wall_time_s=time.time() - t0, device=pair.device, dtype=pair.dtype,
                    files={png.name: sha256_file(png)}).write(plan.paths.report("ablation"))
    print(md)
    print(f"report: {plan.paths.report('ablation')}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
