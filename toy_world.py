"""Install (or train) the offline toy world: corpus, tokenizer, the toy pair, the mismatched model and the deep pair.

    .venv/bin/python toy_world.py --help
    make toy                           (the packaged pair, installed: seconds)

What it writes, and every flag: kvlingo/stages/toy.py (`Toy`).
"""

from kvlingo.stages.toy import Toy

main = Toy.main
parse_args = Toy.parse_args
build_parser = Toy.parser

if __name__ == "__main__":
    main()
