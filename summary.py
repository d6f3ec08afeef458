"""One page for a run: every arm's quality, its IFEval, ARC and GSM8K accuracy, the speedup and the gate's verdict.

    .venv/bin/python summary.py --help
    make summary PROFILE=demo            (the demo run's page → results/demo-l2s/summary.md)

What it reads and writes, and every flag: kvlingo/stages/summary.py (`Summary`).
"""

from kvlingo.stages.summary import ARMS, LEGEND, Summary, summary_rows  # noqa: F401  (the page's rows, for tests)

main = Summary.main
parse_args = Summary.parse_args
build_parser = Summary.parser

if __name__ == "__main__":
    main()
