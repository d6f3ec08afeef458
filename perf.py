"""Handoff speed at real model shapes with random weights, as transformers ships and optimised, against the
physical limit.

    .venv/bin/python perf.py --help
    make perf DEVICE=cpu               (each direction's default family at 4,096 tokens)

What it times and writes, and every flag: kvlingo/stages/perf.py (`Perf`).
"""

from kvlingo.stages.perf import Perf

main = Perf.main
parse_args = Perf.parse_args
build_parser = Perf.parser

if __name__ == "__main__":
    main()
