"""A missing optional dependency is one line naming what installs it, never a ModuleNotFoundError traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvlingo.extras import MissingExtra, optional

ROOT = Path(__file__).resolve().parents[1]


def without(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """A stage script run as a user types it, in this environment with `module` made unimportable."""
    code = (
        f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
        f"runpy.run_path({argv[0]!r}, run_name='__main__')"
    )
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_optional_names_the_extra_and_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk", None)
    with pytest.raises(MissingExtra, match=r"nltk is not installed .*uv sync --locked --extra ifeval"):
        optional("nltk", "ifeval")
    assert optional("json", "ifeval") is sys.modules["json"]


@pytest.mark.parametrize(
    "module, argv, fix",
    [
        ("nltk", ["ifeval.py", "--install-punkt"], "make venv"),
        ("vllm", ["serve_demo.py", "toy", "--l2s", "a", "--s2l", "b"], "make serve-env"),
    ],
)
def test_a_stage_without_its_extra_says_so_in_one_line(module, argv, fix):
    done = without(module, argv)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{module} is not installed" in lines[0] and fix in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
