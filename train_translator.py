"""Train a KV-cache translator: closed-form fit, then distillation against the frozen target.

    .venv/bin/python train_translator.py --help
    make train PROFILE=demo            (the toy pair, offline, on the CPU)

What it reads and writes, and every flag: kvlingo/stages/train.py (`Train`).
"""

from kvlingo.stages.train import Train

main = Train.main
parse_args = Train.parse_args
build_parser = Train.parser

if __name__ == "__main__":
    main()
