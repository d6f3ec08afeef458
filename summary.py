"""One table for a run: every arm's KL and perplexity (benchmark), IFEval strict accuracy,
ARC and GSM8K accuracy (prompt handoff), and the handoff's speedup over re-prefill.

Reads the run's reports under RESULTS/RUN/, prints the table and writes RESULTS/RUN/summary.md.

A cell is "—" where that stage did not score that arm (IFEval and the tasks score the native
paths, the distilled translator and, unless run with --no-controls, the control and no-context
floors; the closed-form maps are scored by the benchmark only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlingo.drive.stage import StageParser, refusals_exit
from kvlingo.io import atomic_write_text, read_json
from kvlingo.run.models import DIRECTIONS
from kvlingo.run.paths import add_run_args, run_paths
from kvlingo.run.report import fmt_pm, fmt_table

ARMS = ("native_source", "native_target", "closed_form", "distilled", "control", "no_context")
# Which path of an IFEval/task report stands for an arm (the translated path uses the distilled maps).
GEN_PATH = {"native_source": "native_source", "native_target": "native_target", "distilled": "translated",
            "control": "control", "no_context": "no_context"}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return read_json(path) if path.is_file() else None


def _gen_cell(reports: list[dict | None], arm: str, metric: str) -> str:
    path = GEN_PATH.get(arm)
    for rep in reports:
        if rep and path and path in rep["results"].get("paths", {}):
            return fmt_pm(rep["results"]["paths"][path].get(metric), 100.0, ".1f") + f" (n={rep['results']['paths'][path][metric]['n']})"
    return "—"


def summary_rows(folder: str | Path) -> tuple[list[str], list[list[str]]]:
    folder = Path(folder)
    bench = _load(folder, "benchmark")
    ifeval = [_load(folder, "ifeval"), _load(folder, "ifeval-native")]
    arc = [_load(folder, "task-arc"), _load(folder, "task-arc-native")]
    gsm = [_load(folder, "task-gsm8k"), _load(folder, "task-gsm8k-native")]
    arms = bench["results"]["quality"]["arms"] if bench else {}
    speed = {}
    if bench and bench["results"].get("timing") and bench["results"]["timing"]["contexts"]:
        sp = bench["results"]["timing"]["contexts"][0]["speedup"]
        used = bench["results"]["timing"]["translator"]
        speed = {used: sp["source_cache_handoff"], "native_target": sp["target_cache_continue"]}
    headers = ["arm", "KL/token", "KL/conv ± SE", "reply ppl", "IFEval strict prompt %", "ARC %", "GSM8K %",
               "speedup vs re-prefill"]
    rows = []
    for arm in ARMS:
        a = arms.get(arm)
        rows.append([
            arm,
            f"{a['kl_token_mean']:.4f}" if a else "—",
            fmt_pm(a["kl_conversation"], 1.0, ".4f") if a else "—",
            f"{a['perplexity']:.3g}" if a else "—",
            _gen_cell(ifeval, arm, "prompt_level_strict_acc"),
            _gen_cell(arc, arm, "accuracy"),
            _gen_cell(gsm, arm, "accuracy"),
            f"{speed[arm]:.1f}×" if arm in speed else "—",
        ])
    return headers, rows


def write_summary(folder: str | Path) -> str:
    headers, rows = summary_rows(folder)
    bench = _load(Path(folder), "benchmark")
    n = f"{bench['n_samples']['conversations']} test conversations, {bench['n_samples']['reply_tokens']} reply tokens" \
        if bench else "no benchmark report"
    md = f"## Summary of {Path(folder).name} ({n})\n\n" + fmt_table(headers, rows)
    atomic_write_text(Path(folder) / "summary.md", md)
    return md


@refusals_exit("summary")
def main(argv=None) -> None:
    ap = StageParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python summary.py --profile demo --direction l2s\n"
                                        "  python summary.py --run demo-l2s-recipe/lr1.00e-03-s42")
    ap.add_argument("--profile", default="pilot", help="profile (for the default run name)")
    ap.add_argument("--direction", choices=DIRECTIONS, default="l2s", help="direction (for the default run name)")
    add_run_args(ap)
    print(write_summary(run_paths(ap.parse_args(argv)).res))


if __name__ == "__main__":
    main()
