"""The stages that run as cells, by name: the script a user types, the `Stage` that runs it, the report it writes
last.

The recipe, the ablation and the frontier run these stages as cells (kvlingo/stages/cells.py) and check the
flags they pass through with those stages' own parsers: they look both up here, by name, rather than by a
script's path. They are not here themselves (none runs another as a cell), so the imports run one way:
driver → registry → stage. The names are the make targets'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import (
    benchmark,
    estimate,
    export,
    gpu_check,
    ifeval,
    layers,
    perf,
    prepare,
    serve_demo,
    summary,
    switch,
    task,
    toy,
    train,
)
from .skeleton import Stage


@dataclass(frozen=True)
class Entry:
    stage: type[Stage]  # runs it: Entry.stage.main(argv)
    report: str | None  # RESULTS/RUN/<report>.json, written last (None: the stage writes elsewhere)

    @property
    def script(self) -> Path:
        """The script a user types (.venv/bin/python SCRIPT)."""
        return self.stage.script_path()


STAGES: dict[str, Entry] = {
    "toy": Entry(toy.Toy, None),
    "prepare": Entry(prepare.Prepare, None),
    "train": Entry(train.Train, "train"),
    "benchmark": Entry(benchmark.Benchmark, "benchmark"),
    "switch": Entry(switch.Switch, "switch"),
    "ifeval": Entry(ifeval.IFEval, "ifeval"),
    "task": Entry(task.Task, None),
    "export": Entry(export.Export, None),
    "summary": Entry(summary.Summary, "summary"),
    "estimate": Entry(estimate.Estimate, None),
    "perf": Entry(perf.Perf, None),
    "gpu-check": Entry(gpu_check.GpuCheck, None),
    "layers": Entry(layers.Layers, "layers"),
    "serve-demo": Entry(serve_demo.ServeDemo, None),
}


def by_script(script: str | Path) -> Entry:
    """The stage whose script is `script` (a path or a file name)."""
    name = Path(script).name
    for entry in STAGES.values():
        if entry.stage.script == name:
            return entry
    raise KeyError(f"no stage runs {name}; the stages are {', '.join(e.stage.script for e in STAGES.values())}")
