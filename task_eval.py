"""ARC-Challenge and GSM8K accuracy after a KV-cache handoff (generate, then parse the answer).

    .venv/bin/python task_eval.py --help
    make task-native PROFILE=demo TASK=arc   (the toy pair, offline, on the CPU; make task once it is trained)

What it reads and writes, and every flag: kvlingo/stages/task.py (`Task`).
"""

from kvlingo.stages.task import Task

main = Task.main
parse_args = Task.parse_args
build_parser = Task.parser

if __name__ == "__main__":
    main()
