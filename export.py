"""Export a finished run's translator as a shareable folder with its evidence (loads with kvlingo.Relay).

    .venv/bin/python export.py --help
    make export PROFILE=demo            (the demo run's distilled maps → artifacts/demo-l2s/export)

What it reads and writes, and every flag: kvlingo/stages/export.py (`Export`).
"""

from kvlingo.stages.export import Export

main = Export.main
parse_args = Export.parse_args
build_parser = Export.parser

if __name__ == "__main__":
    main()
