"""Driving stages: what the stage scripts share, and running stages as resumable cells.

    stage     the common flags, the one place refusals and failures become one line and an exit status, run locks
    session   the pair, translator and rows log the generative evaluations (ifeval.py, task_eval.py) answer with
    cells     one stage run with fixed flags, keyed and recorded in the ledger, run a dependency level at a time
    ledger    the cells' shared, locked, atomic record (recipe-state.json)
    launch    running cells: in turn, as concurrent local processes, or as SLURM job arrays
    lrsearch  the recipe's learning-rate grid, what it reads from each cell's report, and its summary
    ablation  the translator families the ablation compares, their cost at the real shapes, the default's choice

Nothing below this package imports it.
"""
