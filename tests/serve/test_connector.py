"""kvlingo's KV connector inside vLLM engines on the CPU (the serving environment: `make test-serve`).

Four engines share this process and its store of source caches: the toy pair's large model (it saves what it
computes), and three of the small model: two translating the large engine's saved cache (cross-head maps, and the
default translator, token-w3 with refresh exact:0, both in the cache key space) and one running the large model
beside it (prenorm maps). The references come from the suite's own environment (build_fixtures.py): `Relay.chat`'s
greedy replies, the small model's own replies, the large model's cache. Without vLLM (the suite's `make test`) the
module is skipped.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines share this process and its store
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here: the serving tests run in .venv-serve (make serve-env test-serve)"
)

import torch  # noqa: E402

from kvlingo.serve import bench  # noqa: E402
from kvlingo.serve.connector import _CONTRACTS, DECISIONS, KvlingoConnector, engine_args  # noqa: E402
from kvlingo.serve.store import STORE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUITE_PY = ROOT / ".venv" / "bin" / "python"


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """The references, built by the suite's environment."""
    if not SUITE_PY.is_file():
        pytest.fail(
            f"{SUITE_PY} is missing: the serving tests take their references from the suite's environment; "
            "run `make venv` first"
        )
    out = tmp_path_factory.mktemp("serve_fixtures")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(
        [str(SUITE_PY), str(ROOT / "tests" / "serve" / "build_fixtures.py"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode:
        pytest.fail(f"build_fixtures.py failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return {**json.loads((out / "fixtures.json").read_text()), "root": out}


@pytest.fixture(scope="module")
def engines(fx):
    from vllm import LLM

    def engine(model, export=None, **kw):
        return LLM(model=model, dtype="float32", max_model_len=1024, seed=0, **engine_args(export, **kw))

    return {
        "large": engine(fx["large"]),
        "small": engine(fx["small"], fx["exports"]["cache"], allow_unproven=True),
        "small-model": engine(fx["small"], fx["exports"]["prenorm"], source="model", allow_unproven=True),
        "small-token": engine(fx["small"], fx["exports"]["tokeninput"], allow_unproven=True),
    }


def decisions_since(mark: int, kind: str = "mode") -> list[dict]:
    return [d for d in DECISIONS[mark:] if kind in d]


def until_stop(ids, stops) -> list[int]:
    """A reply's ids before its first stop token (transformers' decoding drops it, vLLM's keeps it)."""
    ids = list(ids)
    return ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]


# --------------------------------------------------------------------------- the save side and the write path
def test_saved_cache_is_the_models_own(fx, engines):
    """What the save side reads back out of the paged cache (through the layout it learned from vLLM's own writer)
    is the large model's cache of the prompt as transformers computes it (FP32: rounding apart)."""
    from safetensors.torch import load_file

    STORE.clear()
    ids = fx["prompts"][0]
    bench.first_token(engines["large"], ids)
    (entry,) = STORE.entries.values()
    assert entry.exact and entry.n == len(ids) and entry.ids[: entry.n].tolist() == ids
    ref = load_file(str(fx["root"] / "source-cache.safetensors"))
    keys, values = entry.prefix(len(ids))
    for got, want in ((keys, ref["keys"]), (values, ref["values"])):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_own_cache_through_the_connector_reproduces_vllm_greedy_output(fx, engines):
    """The small model's own cache of a prompt (saved by its first request) written back through the connector:
    the greedy reply and its log-probabilities are vLLM's own re-prefill's, and transformers'."""
    small = engines["small"]
    for ids, native_ref in zip(fx["prompts"], fx["native"]):
        STORE.clear()
        first = bench.greedy(small, ids, fx["max_new_tokens"], logprobs=0)  # nothing to load: prefilled, saved
        native = bench.greedy(small, ids, fx["max_new_tokens"], bench.OFF, logprobs=0)
        mark = len(DECISIONS)
        own = bench.greedy(small, ids, fx["max_new_tokens"], bench.NO_SAVE, logprobs=0)
        (plan,) = decisions_since(mark)
        assert plan["mode"] == "own" and plan["matched"] == len(ids) - 1
        assert list(own.token_ids) == list(native.token_ids) == list(first.token_ids)
        assert until_stop(own.token_ids, fx["stop_ids"]) == native_ref
        gaps = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(own.logprobs, native.logprobs, own.token_ids)]
        assert max(gaps) <= 1e-5, gaps


# --------------------------------------------------------------------------- the translated handoff
@pytest.mark.parametrize(
    "export,engine", [("cache", "small"), ("prenorm", "small-model"), ("tokeninput", "small-token")]
)
def test_translated_handoff_gives_relay_chats_replies(fx, engines, export, engine):
    """The small engine starting from the large model's translated cache decodes, token for token, what
    `kvlingo.Relay.chat` decodes with the same maps: cross-head maps in the cache key space from the large engine's
    saved cache, prenorm maps with the large model run beside the engine, and the default translator (token-w3,
    exact:0) from the saved cache and the prompt's token ids."""
    for ids, ref in zip(fx["prompts"], fx["relay"][export]):
        STORE.clear()
        if export != "prenorm":
            bench.first_token(engines["large"], ids)  # the source engine reads the prompt and saves its cache
        mark = len(DECISIONS)
        out = bench.greedy(engines[engine], ids, fx["max_new_tokens"], bench.NO_SAVE)
        (plan,) = decisions_since(mark)
        (load,) = decisions_since(mark, "event")
        assert plan["mode"] == "translated" and plan["matched"] == len(ids) - 1 and load["event"] == "loaded"
        assert until_stop(out.token_ids, fx["stop_ids"]) == ref


def test_the_default_translator_reads_the_targets_layer0_from_its_checked_tensors(fx, engines):
    """The engine serving the default translator runs it under exact:0 with the target's layer 0 computed from the
    tensors its export names (embedding, first norm, layer 0's K/V projections and key norm), each checked against
    its recorded sha256; the translated layer 0 it writes is the target's own."""
    (contract,) = [c for c in _CONTRACTS.values() if c.folder == Path(fx["exports"]["tokeninput"]).resolve()]
    assert str(contract.refresh) == "exact:0" and contract.layer0 is not None
    assert set(contract.target_weights) == set(contract.config["reads"]["target_weights"])
    assert {n.removeprefix("model.") for n in contract.target_weights} == {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.k_norm.weight",
    }
    ids = fx["prompts"][0][:-1]
    keys, values = contract.translate(
        torch.zeros(4, 2, len(ids), 32), torch.zeros(4, 2, len(ids), 32), torch.float32, ids=ids
    )
    own_k, own_v = contract.layer0.kv(ids)
    assert torch.equal(keys[0], own_k) and torch.equal(values[0], own_v)


# --------------------------------------------------------------------------- failing closed
def test_requests_the_contract_refuses_are_prefilled_with_the_reason_logged(fx, engines, caplog):
    """No source cache, a source cache of a model the maps were not made for, and a request that turns the
    connector off: each is prefilled as usual (the reply is the engine's own) and the reason is recorded."""
    small, ids = engines["small"], fx["prompts"][2]
    native = bench.greedy(small, ids, fx["max_new_tokens"], bench.OFF)
    STORE.clear()
    other = {
        "name": "/elsewhere",
        "identity": {"path": "/elsewhere", "weights_sha256": "0" * 64},
        "geometry": [4, 2, 32],
        "tokenizer_sha256": "1" * 64,
    }
    entry = STORE.entry_for("other", "r", other, True, (4, 2, 32), torch.float32, len(ids))
    entry.write(0, ids, torch.randn(4, 2, len(ids), 32), torch.randn(4, 2, len(ids), 32))
    cases = [("the source cache is elsewhere", bench.NO_SAVE), ("off for this request", bench.OFF)]
    for reason, extra in cases:
        mark = len(DECISIONS)
        with caplog.at_level("INFO", logger="kvlingo.serve"):
            out = bench.greedy(small, ids, fx["max_new_tokens"], extra)
        (plan,) = decisions_since(mark)
        assert plan["mode"] == "prefill" and plan["matched"] == 0 and reason in plan["reason"], plan
        assert any(reason in r.getMessage() for r in caplog.records)
        assert list(out.token_ids) == list(native.token_ids)
    STORE.clear()
    mark = len(DECISIONS)
    assert list(bench.greedy(small, ids, fx["max_new_tokens"], bench.NO_SAVE).token_ids) == list(native.token_ids)
    assert "no cache in the store shares a prefix" in decisions_since(mark)[0]["reason"]


def connector(llm, export=None, *, prefix_caching=False, tokenizer=None, **extra):
    """The scheduler side of a connector built on a copy of `llm`'s settings with these changes (what an engine so
    configured would build at start)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = copy.copy(llm.llm_engine.vllm_config)
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.enable_prefix_caching = prefix_caching
    if tokenizer is not None:
        config.model_config = copy.copy(config.model_config)
        config.model_config.tokenizer = tokenizer
    config.kv_transfer_config = copy.copy(config.kv_transfer_config)
    config.kv_transfer_config.kv_connector_extra_config = engine_args(export, **extra)["kv_transfer_config"][
        "kv_connector_extra_config"
    ]
    return KvlingoConnector(config, KVConnectorRole.SCHEDULER)


def claim(conn, ids) -> tuple[int, bool, str]:
    request = SimpleNamespace(
        request_id=f"probe-{len(DECISIONS)}", prompt_token_ids=ids, all_token_ids=ids, kv_transfer_params=None
    )
    mark = len(DECISIONS)
    n, asynchronous = conn.get_num_new_matched_tokens(request, 0)
    return n, asynchronous, decisions_since(mark)[0]["reason"]


def test_engines_the_contract_refuses_load_nothing_and_say_why(fx, engines, tmp_path):
    """An unproven translator (gate not waived), another tokenizer, another target model, a refresh a connector
    cannot run (named with the maps' family), a target tensor other than the one the export recorded, a config
    edited by hand, prefix caching on, and prenorm maps given an engine's cache: each claims 0 matched tokens (vLLM
    then prefills), with the reason logged. Maps measured with a tail refresh, and whole
    blocks, leave the tail of the context to vLLM."""
    import shutil

    from kvlingo.records.saved import sealed

    def refreshed(name: str, setting: str, seal: bool = True, export: str = "cache") -> str:
        """An export with another refresh setting: exported so (sealed), or edited by hand."""
        folder = shutil.copytree(exports[export], tmp_path / name)
        cfg = {**json.loads((folder / "config.json").read_text()), "refresh": setting}
        (folder / "config.json").write_text(json.dumps(sealed(cfg) if seal else cfg))
        return str(folder)

    def other_tensor(name: str) -> str:
        """The default translator's export recording another sha256 for the target's layer-0 k_proj."""
        folder = shutil.copytree(exports["tokeninput"], tmp_path / name)
        cfg = json.loads((folder / "config.json").read_text())
        weights = cfg["reads"]["target_weights"]
        weights[next(n for n in weights if n.endswith("k_proj.weight"))] = "0" * 64
        (folder / "config.json").write_text(json.dumps(sealed(cfg)))
        return str(folder)

    ids = fx["prompts"][1]
    STORE.clear()
    bench.first_token(engines["large"], ids)  # a source cache the maps would read
    exports, small, large = fx["exports"], engines["small"], engines["large"]
    assert not fx["gate_passed"]["cache"]  # six conversations of closed-form fit do not pass the default gate
    cases = {
        "unproven": (connector(small, exports["cache"]), "is unproven"),
        "tokenizer": (
            connector(small, exports["cache"], tokenizer=fx["other_tokenizer"], allow_unproven=True),
            "served tokenizer",
        ),
        "target": (connector(large, exports["cache"], allow_unproven=True), "is not the translator's target"),
        "refresh": (connector(small, refreshed("layers", "layers:1"), allow_unproven=True), "refresh layers:1"),
        "token-input refresh": (
            connector(small, refreshed("token-layers", "layers:1", export="tokeninput"), allow_unproven=True),
            "the tokeninput maps were measured with refresh layers:1",
        ),
        "target tensor": (
            connector(small, other_tensor("other-k-proj"), allow_unproven=True),
            "layers.0.self_attn.k_proj.weight (sha256",
        ),
        "edited": (
            connector(small, refreshed("by-hand", "tail:5", seal=False), allow_unproven=True),
            "was edited after it was written",
        ),
        "prefix caching": (
            connector(small, exports["cache"], prefix_caching=True, allow_unproven=True),
            "prefix caching is on",
        ),
        "prenorm": (connector(small, exports["prenorm"], allow_unproven=True), "pre-norm key features"),
    }
    for name, (conn, reason) in cases.items():
        n, asynchronous, why = claim(conn, ids)
        assert (n, asynchronous) == (0, False) and reason in why, (name, why)
        if name != "prenorm":  # refused when the engine starts, not per request
            assert reason in conn.refusal
    n, _, why = claim(connector(small, exports["cache"], allow_unproven=True), ids)
    assert n == len(ids) - 1 and why is None  # the same request, with the checks passing, loads
    n, _, _ = claim(connector(small, refreshed("tail", "tail:5"), allow_unproven=True), ids)
    assert n == len(ids) - 1 - 5  # maps measured with refresh tail:5 leave the last 5 context tokens to vLLM
    n, _, _ = claim(connector(small, exports["cache"], allow_unproven=True, whole_blocks=True), ids)
    assert n == (len(ids) - 1) // 32 * 32
