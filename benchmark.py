"""Benchmark a trained translator on the held-out test split: reply quality, native controls, timing.

    .venv/bin/python benchmark.py --help
    make benchmark PROFILE=demo            (the toy pair, offline, on the CPU)

What it reads and writes, and every flag: kvlingo/stages/benchmark.py (`Benchmark`).
"""

from kvlingo.stages.benchmark import Benchmark

main = Benchmark.main
parse_args = Benchmark.parse_args
build_parser = Benchmark.parser

if __name__ == "__main__":
    main()
