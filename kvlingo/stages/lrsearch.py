"""The recipe's learning-rate search, what it reads from each cell's report, and its summary.

Learning-rate grid
  Rates sit on a half-decade lattice around a centre c: step k (an integer) is the rate
  c·10^(k/2), rounded to 3 significant digits (1e-4, 3.16e-4, 1e-3, ...). Steps are
  integers so that grid membership, edges and extensions never compare floats. A grid of
  n rates holds the steps k - (n-1)//2 for k in 0..n-1: centred for odd n (5: -2..2),
  the centre and the step above it for n = 2.
  Selection: the step with the lowest final validation KL (train.json
  results.distilled_val_kl, measured on the validation split). Nothing else is read: the
  test split never takes part in the choice. A non-finite KL (a diverged run) counts as
  +inf; ties go to the step nearest the centre, then to the lower rate.
  Edges: while the winner is the lowest (highest) step of the grid, one step beyond it is
  added and trained, so the chosen rate ends up with a measured neighbour on both sides,
  or the number of extensions reaches its cap (reported as `cap_hit`).

Levels (recipe.py builds each from the reports of the one before, as cells: kvlingo.stages.cells):
  the native rows, then the closed form, then each round of the learning-rate grid, then the
  other seeds' training, then every evaluation of every seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..eval.stats import mean_se
from ..records.report import fmt_pm, fmt_table

SELECTION_METRIC = "distilled_val_kl"  # train.json results key: final validation KL of the distilled maps


# --------------------------------------------------------------------------- the learning-rate grid
def lr_for_step(center: float, step: int) -> float:
    """The rate `step` half-decades from `center`, rounded to 3 significant digits."""
    return float(f"{center * 10 ** (step / 2):.3g}")


def initial_steps(size: int) -> list[int]:
    if size < 1:
        raise ValueError(f"the learning-rate grid needs at least 1 rate (got {size})")
    return [k - (size - 1) // 2 for k in range(size)]


def _score(value: Any) -> float:
    """A validation KL as a sortable number: missing or non-finite (diverged) is +inf."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.inf
    return v if math.isfinite(v) else math.inf


def select_step(val_kl: dict[int, Any]) -> int:
    """The step with the lowest validation KL; ties go to the step nearest the centre, then the lower one."""
    if not val_kl:
        raise ValueError("no learning rate has a validation KL to choose from")
    best = min(val_kl, key=lambda k: (_score(val_kl[k]), abs(k), k))
    if _score(val_kl[best]) == math.inf:
        raise ValueError(
            "every learning rate in the grid diverged or has no validation KL; "
            "lower --lr-center or check the training reports"
        )
    return best


def extension_steps(steps: Iterable[int], winner: int) -> list[int]:
    """Steps to add so that `winner` gets a neighbour beyond it; [] when it is interior."""
    steps = sorted(set(steps))
    out = []
    if winner == steps[0]:
        out.append(winner - 1)
    if winner == steps[-1]:
        out.append(winner + 1)
    return out


def search_lr(evaluate: Callable[[list[int]], list[Any]], size: int, max_extensions: int) -> dict[str, Any]:
    """Evaluate the initial grid, then extend past an edge winner until it is interior or the cap is hit.

    `evaluate(steps)` returns the validation KLs of the rates at `steps` (it runs or resumes their
    cells, which do not depend on each other: together, where a launcher allows).
    Returns the steps in evaluation order, their KLs, the winner, the extensions made and
    whether the cap stopped the search with the winner still on an edge.
    """
    if max_extensions < 0:
        raise ValueError(f"max_extensions must be ≥ 0 (got {max_extensions})")
    val_kl: dict[int, Any] = {}
    order: list[int] = []
    todo = initial_steps(size)
    extensions = 0
    while True:
        new = [k for k in todo if k not in val_kl]
        for k, v in zip(new, evaluate(new)):
            val_kl[k] = v
            order.append(k)
        winner = select_step(val_kl)
        todo = extension_steps(val_kl, winner)
        if not todo:
            return {"order": order, "val_kl": val_kl, "winner": winner, "extensions": extensions, "cap_hit": False}
        if extensions == max_extensions:
            return {"order": order, "val_kl": val_kl, "winner": winner, "extensions": extensions, "cap_hit": True}
        extensions += 1


# --------------------------------------------------------------------------- reading stage reports
def train_metrics(report: dict) -> dict[str, float]:
    r = report.get("results", {})
    return {k: r.get(k) for k in ("distilled_val_kl", "closed_form_val_kl")}


BENCH_ARM_METRICS = ("kl_token_mean", "perplexity", "top1_agreement", "nll_delta_vs_native_target")


def benchmark_metrics(report: dict) -> dict[str, float]:
    """Per-arm quality metrics, plus the median-based timing speedups averaged over timed contexts."""
    res = report.get("results", {})
    out: dict[str, float] = {}
    for arm, m in res.get("quality", {}).get("arms", {}).items():
        for name in BENCH_ARM_METRICS:
            out[f"{arm}.{name}"] = m.get(name)
        out[f"{arm}.kl_conversation_mean"] = (m.get("kl_conversation") or {}).get("mean")
    contexts = (res.get("timing") or {}).get("contexts") or []
    for path in sorted({p for c in contexts for p in c.get("speedup", {})}):
        xs = [c["speedup"][path] for c in contexts if path in c.get("speedup", {})]
        out[f"timing.speedup.{path}"] = sum(xs) / len(xs)
    return out


def ifeval_metrics(report: dict) -> tuple[dict[str, float], dict[str, dict]]:
    """(item-level means per path and metric, the same with their item-level SE and n)."""
    means, full = {}, {}
    for path, s in report.get("results", {}).get("paths", {}).items():
        for name, v in s.items():
            if isinstance(v, dict) and "mean" in v:
                means[f"{path}.{name}"] = v["mean"]
                full[f"{path}.{name}"] = v
    for comp, metrics in report.get("results", {}).get("comparison", {}).items():
        for name, v in metrics.items():
            if isinstance(v, dict) and "delta_points" in v:
                means[f"{comp}.{name}.delta_points"] = v["delta_points"]
    return means, full


def across_seeds(per_seed: dict[Any, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict]]:
    """{stage: {metric: mean_se over seeds}} for every metric that every seed reports as a finite number."""
    out: dict[str, dict[str, dict]] = {}
    seeds = list(per_seed)
    if not seeds:
        return out
    for stage in per_seed[seeds[0]]:
        names = per_seed[seeds[0]][stage]
        for name in names:
            xs = [per_seed[s].get(stage, {}).get(name) for s in seeds]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs):
                out.setdefault(stage, {})[name] = mean_se([float(x) for x in xs])
    return out


# --------------------------------------------------------------------------- the summary
def _fmt(s: dict | None, scale: float = 1.0) -> str:
    return fmt_pm(s, scale, ".4g", ".2g")


HEADLINE = (  # (stage, metric, label, scale) rows of the per-seed table
    ("train", "distilled_val_kl", "validation KL, distilled (nats/token)", 1.0),
    ("benchmark", "distilled.kl_token_mean", "test KL/token, distilled", 1.0),
    ("benchmark", "closed_form.kl_token_mean", "test KL/token, closed form", 1.0),
    ("benchmark", "control.kl_token_mean", "test KL/token, control", 1.0),
    ("benchmark", "distilled.top1_agreement", "test top-1 agreement, distilled", 1.0),
    ("benchmark", "distilled.nll_delta_vs_native_target", "test ΔNLL vs native target, distilled", 1.0),
    ("benchmark", "timing.speedup.source_cache_handoff", "speedup, cache handoff vs re-prefill", 1.0),
    ("ifeval", "translated.prompt_level_strict_acc", "IFEval prompt strict %, translated", 100.0),
    ("ifeval", "translated.inst_level_strict_acc", "IFEval instruction strict %, translated", 100.0),
    ("ifeval", "native_target.prompt_level_strict_acc", "IFEval prompt strict %, native target", 100.0),
    (
        "ifeval",
        "translated_vs_native_target.prompt_level_strict_acc.delta_points",
        "IFEval prompt strict Δ points (translated − native)",
        1.0,
    ),
)


def summary_markdown(run: str, results: dict[str, Any], cells: list[dict[str, Any]], plot_name: str) -> str:
    search, text = results["lr_search"], [f"# recipe: {run}\n\n"]
    text.append(
        f"{results['pair']} ({results['direction']}), profile {results['profile']}; "
        f"seeds {', '.join(map(str, results['seeds']))}.\n\n## Learning-rate search (validation split only)\n\n"
    )
    rows = [
        [c["lr"], c["step"], c["val_kl"], c["closed_form_val_kl"], "← chosen" if c["lr"] == search["chosen_lr"] else ""]
        for c in sorted(search["cells"], key=lambda c: c["step"])
    ]
    text.append(fmt_table(["lr", "step", "val KL (distilled)", "val KL (closed form)", ""], rows))
    text.append(
        f"\nChosen rate: **{search['chosen_lr']:g}** (lowest final validation KL; centre {search['center']:g}, "
        f"{search['extensions']} extension(s) of at most {search['max_extensions']})."
    )
    if search["cap_hit"]:
        text.append(
            " **The winner is still at an edge of the grid: the extension cap was hit**; "
            "raise --max-extensions or move --lr-center."
        )
    text.append(f"\n\n![validation KL against learning rate]({plot_name})\n")
    native = results.get("native", {})
    if native:
        text.append("\n## Native rows\n\n")
        rows = [
            [f"benchmark {arm}", m.get("kl_token_mean"), m.get("top1_agreement"), m.get("perplexity")]
            for arm, m in native.get("benchmark", {}).items()
        ]
        if rows:
            text.append(fmt_table(["row", "test KL/token", "top-1", "ppl"], rows) + "\n")
        rows = [
            [f"IFEval {p}", _fmt(s.get("prompt_level_strict_acc"), 100), _fmt(s.get("inst_level_strict_acc"), 100)]
            for p, s in native.get("ifeval", {}).items()
        ]
        if rows:
            text.append(fmt_table(["row", "prompt strict %", "instruction strict %"], rows))
    seeds = [str(s) for s in results["seeds"]]
    per_seed, agg = results["per_seed"], results["across_seeds"]
    rows = []
    for stage, metric, label, scale in HEADLINE:
        vals = [per_seed.get(s, {}).get(stage, {}).get(metric) for s in seeds]
        if all(v is None for v in vals):
            continue
        rows.append(
            [label, *[None if v is None else scale * v for v in vals], _fmt(agg.get(stage, {}).get(metric), scale)]
        )
    text.append(f"\n## Seeds at lr {search['chosen_lr']:g} (test split; mean ± SE across seeds)\n\n")
    text.append(fmt_table(["metric", *[f"seed {s}" for s in seeds], "mean ± SE"], rows))
    text.append("\nIFEval: each seed's item-level mean (prompts, or instructions); ± is the SE across seeds.\n")
    text.append("\n## Cells\n\n")
    text.append(
        fmt_table(
            ["cell", "stage", "this run", "key", "runs", "wall s", "report"],
            [
                [
                    c["cell"],
                    c["stage"],
                    c["action"],
                    c["key"][:12],
                    c["runs"],
                    c["wall_time_s"],
                    "/".join(Path(c["report"]).parts[-2:]),
                ]
                for c in cells
            ],
            ".3g",
        )
    )
    return "".join(text)
