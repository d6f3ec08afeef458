"""The optional dependencies: a module of an extra that is not installed is one line naming the command that
installs it, never a ModuleNotFoundError traceback.

    ifeval   lm-eval's IFEval grader, nltk and its English punkt data: in .venv (`make venv` syncs it)
    serve    vLLM (CPU build) and kvlingo: the separate .venv-serve (`make serve-env`)
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import Refusal

INSTALL = {
    "ifeval": "the 'ifeval' extra of .venv: uv sync --locked --extra ifeval (what `make venv` runs; or "
    "rm .venv/.synced && make venv)",
    "serve": "the serving environment: make serve-env, then run it with .venv-serve/bin/python (the make serve-* "
    "targets do)",
}


class MissingExtra(Refusal, ImportError):
    """A module of an optional extra that is not installed in this environment."""


def optional(module: str, extra: str) -> ModuleType:
    """`module` imported, or MissingExtra naming the extra and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise MissingExtra(
            f"{e.name} is not installed in this environment ({sys.prefix}); it comes with {INSTALL[extra]}"
        ) from None
