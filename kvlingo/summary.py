"""One table for a run: every arm's KL and perplexity (benchmark), IFEval strict accuracy,
ARC and GSM8K accuracy (prompt handoff), and the handoff's speedup over re-prefill.

    python -m kvlingo.summary results/demo-l2s      # prints it and writes summary.md there

A cell is "—" where that stage did not score that arm (IFEval and the tasks score the native
paths, the distilled translator and, unless run with --no-controls, the control and no-context
floors; the closed-form maps are scored by the benchmark only).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .report import atomic_write_text, fmt_table, read_json

ARMS = ("native_source", "native_target", "closed_form", "distilled", "control", "no_context")
# Which path of an IFEval/task report stands for an arm (the translated path uses the distilled maps).
GEN_PATH = {"native_source": "native_source", "native_target": "native_target", "distilled": "translated",
            "control": "control", "no_context": "no_context"}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return read_json(path) if path.is_file() else None


def _pm(stat: Any, scale: float = 1.0, fmt: str = ".1f") -> str:
    if not isinstance(stat, dict) or stat.get("mean") is None:
        return "—"
    se = stat.get("se")
    se_txt = f" ± {scale * se:{fmt}}" if isinstance(se, (int, float)) and se == se else ""
    return f"{scale * stat['mean']:{fmt}}{se_txt}"


def _gen_cell(reports: list[dict | None], arm: str, metric: str) -> str:
    path = GEN_PATH.get(arm)
    for rep in reports:
        if rep and path and path in rep["results"].get("paths", {}):
            return _pm(rep["results"]["paths"][path].get(metric), 100.0) + f" (n={rep['results']['paths'][path][metric]['n']})"
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
        maps = bench["results"]["timing"]["maps"]
        speed = {maps: sp["source_cache_handoff"], "native_target": sp["target_cache_continue"]}
    headers = ["arm", "KL/token", "KL/conv ± SE", "reply ppl", "IFEval strict prompt %", "ARC %", "GSM8K %",
               "speedup vs re-prefill"]
    rows = []
    for arm in ARMS:
        a = arms.get(arm)
        rows.append([
            arm,
            f"{a['kl_token_mean']:.4f}" if a else "—",
            _pm(a["kl_conversation"], 1.0, ".4f") if a else "—",
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m kvlingo.summary results/RUN")
    print(write_summary(sys.argv[1]))
