"""Switch cost against history length: re-reading a chat vs switching models by translating its cache.

    .venv/bin/python switch_cost.py --help
    make switch PROFILE=demo            (the toy pair, offline, on the CPU)

What it reads and writes, and every flag: kvlingo/stages/switch.py (`Switch`).
"""

from kvlingo.stages.switch import Switch, join_chat  # noqa: F401  (join_chat: the chat a length is cut from)

main = Switch.main
parse_args = Switch.parse_args
build_parser = Switch.parser

if __name__ == "__main__":
    main()
