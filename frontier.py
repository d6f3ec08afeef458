"""The refresh frontier: quality against cost, from pure translation to re-prefill.

    .venv/bin/python frontier.py --help
    make frontier PROFILE=demo            (the toy pair, offline, on the CPU; trains the run's translator first)

The settings, the costs, the layer sweep and the outputs: kvlingo/stages/frontier.py (`Frontier`).
"""

from kvlingo.stages.frontier import Frontier, add_times, cv_note  # noqa: F401  (used by the tests)

main = Frontier.main
parse_args = Frontier.parse_args

if __name__ == "__main__":
    main()
