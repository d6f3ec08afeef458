"""Finished runs on the tiny pair that the stages' tests refuse, resume and damage."""

from __future__ import annotations

import json

import pytest
from tinypair import chat_rows, pair_flags, write_prepared

import benchmark
import train_translator
from kvlingo.eval.tasks import grader


@pytest.fixture(scope="module")
def finished(tiny_pair_paths, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("finished")
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        root / "data" / "tiny",
        tok,
        {
            "train": chat_rows(tok, 12, 0, "t"),
            "validation": chat_rows(tok, 4, 1, "v"),
            "test": chat_rows(tok, 4, 2, "x"),
        },
    )
    pair = pair_flags(tiny_pair_paths)
    run = [
        "--profile",
        "tiny",
        "--run",
        "r",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
    ]
    train_args = [*run, *pair, "--data", str(data), "--updates", "2", "--n-fit", "12", "--lr", "1e-3"]
    train_translator.main(train_args)
    return {"root": root, "data": data, "pair": pair, "run": run, "train": train_args, "tok": tok}


@pytest.fixture(scope="module")
def benchmarked_run(tiny_pair_paths, tmp_path_factory):
    """Prepared splits, a 2-prompt IFEval file, punkt_tab, and a finished run `r` (train, benchmark)."""
    import nltk
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("integrity")
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        root / "data" / "tiny",
        tok,
        {
            "train": chat_rows(tok, 12, 0, "t"),
            "validation": chat_rows(tok, 4, 1, "v"),
            "test": chat_rows(tok, 4, 2, "x"),
        },
    )
    docs = [
        {"key": k, "prompt": p, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
        for k, p in ((1, "Describe the cat. Do not use commas."), (2, "Describe the mat. Do not use commas."))
    ]
    (root / "ifeval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    punkt = root / "nltk_data"
    grader.install_punkt(punkt)
    pair = pair_flags(tiny_pair_paths)
    run = [
        "--profile",
        "tiny",
        "--run",
        "r",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
    ]
    train = [*run, *pair, "--data", str(data), "--updates", "2", "--n-fit", "12", "--lr", "1e-3"]
    train_translator.main(train)
    benchmark.main([*run, *pair, "--data", str(data), "--timing-conversations", "0", "--control-dtypes", "none"])
    yield {
        "root": root,
        "data": data,
        "pair": pair,
        "run": run,
        "train": train,
        "punkt": punkt,
        "ifeval": [
            "--profile",
            "tiny",
            *pair,
            "--source",
            str(root / "ifeval.jsonl"),
            "--max-new-tokens",
            "3",
            "--artifacts",
            str(root / "artifacts"),
        ],
    }
    nltk.data.path.remove(str(punkt.resolve()))
