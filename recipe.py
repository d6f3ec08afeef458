"""The recipe: native rows, one closed-form fit, a learning-rate search on validation KL, then seeds.

    .venv/bin/python recipe.py --help
    make recipe PROFILE=demo            (the toy pair, offline, on the CPU)

Its steps, cells, launchers and outputs: kvlingo/stages/recipe.py (`Recipe`).
"""

from kvlingo.stages.recipe import SCRIPTS, Recipe, make_config, passthrough  # noqa: F401  (used by the tests)

main = Recipe.main
parse_args = Recipe.parse_args

if __name__ == "__main__":
    main()
