"""Ablate the translator's levers on the same splits and budget: choices on validation, claims on test.

    .venv/bin/python ablate.py --help
    make ablate PROFILE=demo            (both directions on the toy pair, offline, on the CPU)

The rows, how the default is chosen, and the outputs: kvlingo/stages/ablate.py (`Ablate`).
"""

from kvlingo.stages.ablate import Ablate

main = Ablate.main
parse_args = Ablate.parse_args

if __name__ == "__main__":
    main()
