"""Prepare chat data: natural and packed train/validation/test splits in the target's chat template.

    .venv/bin/python prepare.py --help
    make prepare PROFILE=demo          (the toy corpus, offline)

What it reads and writes, and every flag: kvlingo/stages/prepare.py (`Prepare`).
"""

from kvlingo.stages.prepare import Prepare

main = Prepare.main
parse_args = Prepare.parse_args
build_parser = Prepare.parser

if __name__ == "__main__":
    main()
