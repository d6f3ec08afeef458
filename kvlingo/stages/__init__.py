"""The stages: what each script runs, and running stages as resumable cells.

    skeleton   `Stage` (parse → check → up to date → load → run → publish), one line and one exit status per
               refusal, run locks
    registry   every stage by name: its script, its `Stage`, its report
    toy, prepare, train, benchmark, switch, ifeval, task, export, summary, estimate, perf, gpu_check,
    recipe, ablate, frontier, serve_demo
               each stage's own steps (its script at the top of the repository is three lines)
    session    what IFEval and the tasks share: the pair, the translator and the rows log they resume from
    cells      one stage run with fixed flags, keyed and recorded in the ledger, a dependency level at a time
    ledger     the cells' shared, locked, atomic record
    launch     running cells: in turn, as concurrent local processes, or as SLURM job arrays
    lrsearch   the recipe's learning-rate grid, what it reads from each cell's report, and its summary
    ablation   the ablation's rows (the families' variants), their cost at the real shapes, the default's choice

Nothing below this package imports it. A stage module imports only light modules at its top (no torch), so
`--help` is quick; the heavy ones load inside its steps.
"""
