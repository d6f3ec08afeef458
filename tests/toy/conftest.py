"""A mini toy world (corpus, tokenizer, two small models), built once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlingo.io import read_jsonl
from kvlingo.toy import train as toytrain
from kvlingo.toy import world as toyworld


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "mini"
    toytrain.build_toy_world(out, seed=0, mini=True, progress=False, log=quiet)
    return out


@pytest.fixture(scope="module")
def corpus(mini) -> dict[str, list[dict]]:
    return {name: read_jsonl(mini / "corpus" / f"{name}.jsonl") for name in toyworld.WORLD_FILES}
