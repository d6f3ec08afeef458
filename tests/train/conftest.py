"""The prepared data of the data-parallel tests."""

from __future__ import annotations

import pytest
from tinypair import chat_rows, write_prepared


@pytest.fixture(scope="module")
def parallel_data(tiny_pair_paths, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    folder = tmp_path_factory.mktemp("data")
    write_prepared(
        folder,
        tok,
        {"train": chat_rows(tok, 16, 0, "train", system_every=3), "validation": chat_rows(tok, 5, 1, "val")},
    )
    return folder
