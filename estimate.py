"""Estimate the peak memory per rank and the time per update of a profile's distillation, from shapes alone.

    .venv/bin/python estimate.py --help
    make estimate PROFILE=paper-budget NPROC=8 GPU=H100

What it reads, and every flag: kvlingo/stages/estimate.py (`Estimate`).
"""

from kvlingo.stages.estimate import Estimate

main = Estimate.main
parse_args = Estimate.parse_args
build_parser = Estimate.parser

if __name__ == "__main__":
    main()
