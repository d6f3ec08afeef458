"""IFEval after a KV-cache handoff, graded by lm-eval's official IFEval code.

    .venv/bin/python ifeval.py --help
    make ifeval-native PROFILE=demo    (the toy pair, offline, on the CPU; make ifeval once it is trained)

What it reads and writes, and every flag: kvlingo/stages/ifeval.py (`IFEval`).
"""

from kvlingo.stages.ifeval import IFEval

main = IFEval.main
parse_args = IFEval.parse_args
build_parser = IFEval.parser

if __name__ == "__main__":
    main()
