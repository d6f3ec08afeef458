"""Serve two models with vLLM and switch a conversation between them through kvlingo's KV connector.

    .venv-serve/bin/python serve_demo.py --help     (toy, real: the serving environment, make serve-env)
    .venv/bin/python serve_demo.py prepare-real     (the suite's environment)
    make serve-demo                                 (the toy pair's conversation)

The commands and every flag: kvlingo/stages/serve_demo.py (`ServeDemo`).
"""

import sys

from kvlingo.stages.serve_demo import ServeDemo

main = ServeDemo.main
parse_args = ServeDemo.parse_args
build_parser = ServeDemo.parser

if __name__ == "__main__":
    sys.exit(main())
