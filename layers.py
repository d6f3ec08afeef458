"""The per-layer diagnostic: where trained translators' error lives, layer by layer.

    .venv/bin/python layers.py --help
    make layers PROFILE=demo LAYERS_ARGS="--runs demo-l2s-ablate/token-w3 demo-l2s-ablate/crosshead"

What it scores and writes: kvlingo/stages/layers.py (`Layers`).
"""

from kvlingo.stages.layers import Layers

main = Layers.main
parse_args = Layers.parse_args
build_parser = Layers.parser

if __name__ == "__main__":
    main()
