"""kvlingo.serve without vLLM: the connector's contract (what it accepts, what it refuses and why), its
translation on model stubs (RoPE tables and the checked target tensors) against `kvlingo.Relay`'s on the loaded
pair, the default translator's (token-w3, exact:0) included, the source model run beside an engine; and serving as
a leaf that nothing else imports. The engines' tests are tests/serve/test_connector.py (make test-serve)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from exports import export_run
from tinypair import chat_rows, write_prepared

from kvlingo import Relay
from kvlingo.core.handoff import capture_source
from kvlingo.core.keyspace import read_weight_names
from kvlingo.core.layer0 import ContextFree, NotContextFree
from kvlingo.core.refresh import Refresh
from kvlingo.core.rope import RopeCache
from kvlingo.inputs.data import read_split
from kvlingo.inputs.models import ModelSpec, checkpoint_files, load_pair, read_tensors, resolve_pair
from kvlingo.serve.contract import Contract, Refused, ServedModel, SourceModel, load_config, model_stub
from kvlingo.serve.layer0 import Layer0
from kvlingo.stages.serve_demo import default_translator


@pytest.fixture(scope="module")
def exports(tiny_pair_paths, tmp_path_factory):
    """Self-pair exports (the tiny small model on both sides, exact fits, so the gate passes honestly) in the
    cache and prenorm key spaces, and large → small ones in the cache key space: cross-head, and the default
    translator (token-w3: head-wise maps plus the target's layer-0 features of each token and the two before it,
    measured with refresh exact:0)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("serve_contract")
    large, small = tiny_pair_paths
    _, tok = resolve_pair(str(small), str(small), "l2s", "cpu", "float32")
    data = write_prepared(
        root / "data" / "tiny", tok, {"train": chat_rows(tok, 8, 0, "tr"), "test": chat_rows(tok, 6, 1, "te")}
    )
    train = read_split(data, "train")
    out = {
        space: export_run(root, f"self-{space}", small, small, train, data, space, family="headwise")
        for space in ("cache", "prenorm")
    }
    out["l2s"] = export_run(root, "l2s", large, small, train, data, "cache")
    _, family, flags = default_translator()  # the l2s default's family and its variant's options
    out["token"] = export_run(
        root, "token", large, small, train, data, "cache", family=family, refresh="exact:0", flags=flags
    )
    return {**out, "root": root, "large": large, "small": small, "tok": tok}


def served(path) -> ServedModel:
    return ServedModel.describe(str(path))


def prompt(tok) -> list[int]:
    return chat_rows(tok, 1, 7, "p", user_words=(20, 20))[0]["prefix_ids"]


@pytest.mark.parametrize("space", ["cache", "prenorm"])
def test_contract_translation_is_the_relays_bit_for_bit(exports, space):
    """The connector's translator (maps on RoPE tables and k_norm weights read from the folders) turns a capture
    into exactly what Relay's translator, bound to the loaded models, does."""
    contract = Contract.load(exports[space], served(exports["small"]))
    assert contract.verdict.passed and contract.key_space == space
    relay = Relay.load(exports[space], device="cpu", dtype="float32")
    cap = relay.capture(prompt(exports["tok"]))
    want = relay.translator(cap, torch.float32)
    got = contract.translate(cap.keys, cap.values, torch.float32, cap.prenorm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # written token-major (the layout an engine's cache writer reads): the same values
    keys, values = contract.translate(cap.keys, cap.values, torch.float32, cap.prenorm, token_major=True)
    assert keys.transpose(1, 2).is_contiguous() and torch.equal(keys, want[0]) and torch.equal(values, want[1])


def test_model_stub_has_the_models_rope_and_key_norms(exports):
    pair = load_pair(*resolve_pair(str(exports["large"]), str(exports["small"]), "l2s", "cpu", "float32"))
    for model, path in ((pair.source, exports["large"]), (pair.target, exports["small"])):
        norms = read_tensors(
            checkpoint_files(ModelSpec.parse(str(path)).identity()), lambda n: read_weight_names(n, "prenorm")
        )
        stub = model_stub(load_config(str(path)), tensors=norms, key_norms=True)
        real, mine = RopeCache(model), RopeCache(stub)
        for a, b in zip((*real(300), *real.inverse(300)), (*mine(300), *mine.inverse(300))):
            assert torch.equal(a, b)
        for layer, stub_layer in zip(model.model.layers, stub.model.layers):
            assert torch.equal(layer.self_attn.k_norm.weight.float(), stub_layer.self_attn.k_norm.weight)
            assert layer.self_attn.k_norm.variance_epsilon == stub_layer.self_attn.k_norm.variance_epsilon


def test_source_model_capture_is_the_suites(exports):
    """The source run beside an engine (transformers' own cache) captures what the suite's capture does."""
    relay = Relay.load(exports["prenorm"], device="cpu", dtype="float32")
    ids = prompt(exports["tok"])
    mine = SourceModel(str(exports["small"]), torch.float32, relay.config["models"]["source"]).capture(ids)
    ref = capture_source(relay.source, ids, [relay.translator])
    for a, b in ((mine.keys, ref.keys), (mine.values, ref.values), (mine.prenorm, ref.prenorm)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(Refused, match="is not the translator's source"):
        SourceModel(str(exports["large"]), torch.float32, relay.config["models"]["source"])


# --------------------------------------------------------------------------- refusals, one line each
def edited(src: Path, dst: Path, reseal: bool = True, **config_changes) -> Path:
    """A copy of an export whose config.json has `config_changes` (dotted keys), sealed again as an export made
    that way would be (`reseal`), or left with its old seal, as a hand edit leaves it."""
    from kvlingo.records.saved import sealed

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        node, *path = key.split(".")
        target = cfg
        for part in [node, *path][:-1]:
            target = target[part]
        target[[node, *path][-1]] = value
    (dst / "config.json").write_text(json.dumps(sealed(cfg) if reseal else cfg))
    return dst


def refusal(folder, target, **kw) -> str:
    with pytest.raises(Refused) as err:
        Contract.load(folder, target, **kw)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_contract_refuses_an_unproven_translator_unless_waived(exports, tmp_path):
    folder = shutil.copytree(exports["cache"], tmp_path / "no-evidence")
    (folder / "evidence.json").unlink()
    assert "unproven (evidence.json is missing)" in refusal(folder, served(exports["small"]))
    assert not Contract.load(folder, served(exports["small"]), allow_unproven=True).verdict.passed


def test_contract_refuses_another_tokenizer_model_revision_or_geometry(exports, tmp_path):
    small = served(exports["small"])
    other_tok = ServedModel(small.name, small.identity, small.geometry, "0" * 64)
    assert "served tokenizer" in refusal(exports["cache"], other_tok)
    assert "is not the translator's target" in refusal(exports["cache"], served(exports["large"]))
    hub = edited(
        exports["cache"], tmp_path / "hub", **{"models.target": {"id": "Qwen/Qwen3-0.6B", "revision": "a" * 40}}
    )
    other_rev = ServedModel(
        "Qwen/Qwen3-0.6B", {"id": "Qwen/Qwen3-0.6B", "revision": "b" * 40}, small.geometry, small.tokenizer_sha256
    )
    text = refusal(hub, other_rev)
    assert "a" * 40 in text and "b" * 40 in text
    wrong_shape = ServedModel(small.name, small.identity, (3, 2, 16), small.tokenizer_sha256)
    assert "caches [layers, kv_heads, head_dim] = [3, 2, 16]" in refusal(exports["cache"], wrong_shape)


def test_contract_refuses_refresh_a_connector_cannot_run_and_damaged_maps(exports, tmp_path):
    small = served(exports["small"])
    assert "refresh layers:1" in refusal(edited(exports["cache"], tmp_path / "layers", refresh="layers:1"), small)
    assert Contract.load(edited(exports["cache"], tmp_path / "tail", refresh="tail:4"), small).refresh == Refresh(
        "tail", 4
    )
    damaged = shutil.copytree(exports["cache"], tmp_path / "damaged")
    data = bytearray((damaged / "maps.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / "maps.safetensors").write_bytes(bytes(data))
    assert "does not match its manifest hash" in refusal(damaged, small)
    by_hand = edited(exports["cache"], tmp_path / "by-hand", reseal=False, refresh="tail:4")
    assert "was edited after it was written" in refusal(by_hand, small)


def test_admit_checks_the_source_cache_and_its_key_space(exports):
    small = served(exports["small"]).to_dict()
    contract = Contract.load(exports["l2s"], served(exports["small"]), allow_unproven=True)
    contract.admit(served(exports["large"]).to_dict())  # the recorded source: admitted
    with pytest.raises(Refused, match="the source cache is small"):
        contract.admit(small)
    with pytest.raises(Refused, match="translator reads"):
        contract.admit({**served(exports["large"]).to_dict(), "geometry": [2, 2, 32]})
    with pytest.raises(Refused, match="tokenizer"):
        contract.admit({**served(exports["large"]).to_dict(), "tokenizer_sha256": "0" * 64})
    prenorm = Contract.load(exports["prenorm"], served(exports["small"]))
    with pytest.raises(Refused, match="pre-norm key features"):
        prenorm.admit(small)
    prenorm.admit(small, with_prenorm=True)


def test_usable_tokens_leave_the_last_token_and_the_refresh_tail(exports, tmp_path):
    small = served(exports["small"])
    plain = Contract.load(exports["cache"], small)
    assert plain.usable_tokens(100, 50) == 49 and plain.usable_tokens(30, 50) == 30
    assert plain.usable_tokens(100, 50, granule=32) == 32 and plain.usable_tokens(100, 1) == 0
    for setting in ("tail:5", "tail:10%"):
        c = Contract.load(
            edited(exports["cache"], tmp_path / setting.replace(":", "-").replace("%", "pc"), refresh=setting), small
        )
        assert c.usable_tokens(100, 50) == 49 - Refresh.parse(setting).tail_tokens(49) == 44


def test_token_major_cross_head_translation_is_the_same(exports):
    """Cross-head maps written straight into token-major buffers (no copy before the engine's writer) give the
    same values as the head-major translation."""
    contract = Contract.load(exports["l2s"], served(exports["small"]), allow_unproven=True)
    relay = Relay.load(exports["l2s"], device="cpu", dtype="float32", allow_unproven=True)
    cap = relay.capture(prompt(exports["tok"]))
    want = contract.translate(cap.keys, cap.values, torch.float32)
    keys, values = contract.translate(cap.keys, cap.values, torch.float32, token_major=True)
    assert keys.transpose(1, 2).is_contiguous() and values.transpose(1, 2).is_contiguous()
    assert torch.equal(keys, want[0]) and torch.equal(values, want[1])


@pytest.mark.parametrize(
    "dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "fast")]
)
def test_reused_buffers_strip_rope_bit_for_bit(exports, dtype, precision):
    """The connector's key space strips the source's RoPE into reused buffers: the translation is the plain key
    space's bit for bit, in every output dtype and precision, across calls of different lengths."""
    from kvlingo.core.keyspace import KeySpace
    from kvlingo.serve.contract import ReusingKeySpace

    contract = Contract.load(exports["l2s"], served(exports["large"].parent / "small"), allow_unproven=True)
    assert isinstance(contract.translator.space, ReusingKeySpace)
    relay = Relay.load(exports["l2s"], device="cpu", dtype="float32", allow_unproven=True)
    ids = prompt(exports["tok"])
    for n in (len(ids), 9, len(ids) - 3):  # shorter and longer calls reuse and regrow the buffers
        cap = relay.capture(ids[:n])
        keys, values = cap.keys.to(dtype), cap.values.to(dtype)
        got = contract.translate(keys, values, dtype, precision=precision)
        plain = contract.translator.space
        contract.translator.space = KeySpace.__new__(KeySpace)
        contract.translator.space.__dict__.update(
            {k: v for k, v in plain.__dict__.items() if k not in ("_buffers", "_negated")}
        )
        try:
            want = contract.translate(keys, values, dtype, precision=precision)
        finally:
            contract.translator.space = plain
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reused_buffers_made_under_inference_mode_serve_a_call_outside_it(exports):
    """An engine translates under inference mode; the same contract called afterwards outside it (a benchmark, a
    user's check) reuses those buffers and gives the same bits."""
    contract = Contract.load(exports["l2s"], served(exports["large"].parent / "small"), allow_unproven=True)
    relay = Relay.load(exports["l2s"], device="cpu", dtype="float32", allow_unproven=True)
    cap = relay.capture(prompt(exports["tok"]))
    with torch.inference_mode():
        inside = contract.translate(cap.keys, cap.values, torch.float32)
    outside = contract.translate(cap.keys, cap.values, torch.float32)
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])


# --------------------------------------------------------------------------- where serving sits
ROOT = Path(__file__).resolve().parents[2]


SERVE_IMPORTS = (
    "kvlingo.errors",
    "kvlingo.io",
    "kvlingo.core",
    "kvlingo.records",
    "kvlingo.inputs",
    "kvlingo.bench",
    "kvlingo.serve",
)
# The serving environment's own tests (make test-serve): the only ones that may import vLLM and the connector.
SERVING_ENVIRONMENT = {"tests/serve/test_connector.py"}


def imported(path: Path) -> set[str]:
    """The absolute module names a file imports (relative imports resolved against its package)."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.update([base] + [f"{base}.{a.name}" for a in node.names])
    return names


def test_serving_is_a_leaf_and_nothing_the_suite_runs_imports_vllm():
    """kvlingo/serve imports the foundation only (errors, io, core, run, bench); no other package, stage script or
    main-suite test imports it or vLLM, so `make test` and the stages run without the serving environment."""
    serve = sorted((ROOT / "kvlingo" / "serve").glob("*.py"))
    for path in serve:
        inside = {n for n in imported(path) if n.startswith("kvlingo")}
        assert all(n.startswith(SERVE_IMPORTS) for n in inside), (path.name, sorted(inside))
    rest = [
        p
        for p in [*(ROOT / "kvlingo").rglob("*.py"), *ROOT.glob("*.py"), *(ROOT / "examples").glob("*.py")]
        if "serve" not in p.relative_to(ROOT).parts and p.name != "serve_demo.py"
    ]
    assert len(rest) > 50
    for path in rest:
        names = imported(path)
        assert not any(n == "vllm" or n.startswith(("vllm.", "kvlingo.serve")) for n in names), path
    for path in (ROOT / "tests").rglob("*.py"):  # the main suite's tests may use the contract, never vLLM
        if path.relative_to(ROOT).as_posix() in SERVING_ENVIRONMENT:
            continue
        assert not any(n == "vllm" or n.startswith(("vllm.", "kvlingo.serve.connector")) for n in imported(path)), path


def test_the_contract_store_and_demo_parser_load_without_vllm():
    import os
    import subprocess
    import sys

    code = (
        "import sys, kvlingo.serve.contract, kvlingo.serve.store, kvlingo.serve.paged, kvlingo.serve.bench, "
        "serve_demo; print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the default translator: token-w3, exact:0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_input_exact0_translation_is_the_relays_bit_for_bit(exports, dtype):
    """The default translator's handoff through the contract (the token ids passed beside the cache; the target's
    layer 0 and token features from its checked layer-0 tensors alone) is Relay's (the loaded target's own layer 0,
    layers 1.. translated), head-major and token-major, in FP32 and BF16."""
    from kvlingo.core.translator import Translator
    from kvlingo.serve.contract import ReusingKeySpace

    contract = Contract.load(exports["token"], served(exports["small"]), allow_unproven=True, dtype=dtype)
    assert contract.config["family"] == "tokeninput" and contract.refresh == Refresh("exact", 0)
    spaces = {id(m.space) for m in contract.translator.modules() if isinstance(m, Translator)}
    assert spaces == {id(contract.translator.space)} and isinstance(contract.translator.space, ReusingKeySpace)
    assert contract.translator.base.space is contract.translator.space  # the base's maps read the reused buffers
    assert isinstance(contract.layer0, Layer0) and contract.translator.layer0 is contract.layer0
    relay = Relay.load(exports["token"], device="cpu", dtype=str(dtype).removeprefix("torch."), allow_unproven=True)
    assert relay.refresh == contract.refresh
    ctx = prompt(exports["tok"])[:-1]
    cap = relay.capture(ctx)
    want = relay.translate(cap)
    own = ContextFree(relay.target).kv(ctx)
    assert torch.equal(want[0][0], own[0]) and torch.equal(want[1][0], own[1])  # layer 0: the target's own
    for token_major in (False, True):
        got = contract.translate(cap.keys, cap.values, dtype, ids=ctx, token_major=token_major)
        assert got[0].dtype == dtype and got[0].transpose(1, 2).is_contiguous() == token_major
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if dtype == torch.bfloat16:  # the engine's BF16 paths: token-major (keys finished in place, values through
        # the engine's scratch) the same bits as head-major
        for precision in ("fast", "fast-fused"):
            head = contract.translate(cap.keys, cap.values, dtype, ids=ctx, precision=precision)
            tok = contract.translate(cap.keys, cap.values, dtype, ids=ctx, precision=precision, token_major=True)
            assert tok[1].transpose(1, 2).is_contiguous() and not torch.equal(head[1], want[1])  # BF16 maths ran
            assert torch.equal(tok[0], head[0]) and torch.equal(tok[1], head[1]), precision
    with pytest.raises(ValueError, match="pass ids="):
        contract.translate(cap.keys, cap.values, dtype)
    with pytest.raises(ValueError, match="token ids for a source cache"):
        contract.translate(cap.keys, cap.values, dtype, ids=ctx[:-1])


def test_contract_reads_only_the_recorded_target_tensors(exports, monkeypatch):
    """The default translator reads the target's embedding, first norm and layer 0's K/V projections and key norm:
    the contract reads those tensors of the served checkpoint (the ones config.json records with their sha256) and
    no other; maps of a family without token features, measured with refresh none, read none."""
    import kvlingo.serve.contract as contract_module

    read = []

    def recording(files, select):
        out = read_tensors(files, select)
        read.extend(out)
        return out

    monkeypatch.setattr(contract_module, "read_tensors", recording)
    contract = Contract.load(exports["token"], served(exports["small"]), allow_unproven=True)
    recorded = contract.config["reads"]["target_weights"]
    assert sorted(read) == sorted(recorded) == sorted(contract.target_weights)
    assert {n.removeprefix("model.") for n in recorded} == {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.k_norm.weight",
    }
    read.clear()
    plain = Contract.load(exports["l2s"], served(exports["small"]), allow_unproven=True)
    assert read == [] and plain.target_weights == () and plain.layer0 is None


def resealed(src: Path, dst: Path, change) -> Path:
    """A copy of an export whose config.json `change(config)` edits, sealed again (as an export made so would be)."""
    from kvlingo.records.saved import sealed

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(sealed(cfg)))
    return dst


def test_contract_refuses_a_target_tensor_that_is_not_the_recorded_one(exports, tmp_path):
    small = served(exports["small"])
    name = next(
        n
        for n in json.loads((exports["token"] / "config.json").read_text())["reads"]["target_weights"]
        if n.endswith("k_proj.weight")
    )
    other = resealed(
        exports["token"], tmp_path / "other", lambda c: c["reads"]["target_weights"].update({name: "0" * 64})
    )
    text = refusal(other, small, allow_unproven=True)
    assert f"tensor {name} (sha256" in text and "serve the recorded target's weights" in text
    earlier = resealed(exports["token"], tmp_path / "earlier", lambda c: c.pop("reads"))
    text = refusal(earlier, small, allow_unproven=True)
    assert "records no sha256" in text and "export it again" in text
    fewer = resealed(exports["token"], tmp_path / "fewer", lambda c: c["reads"]["target_weights"].pop(name))
    assert f"records no sha256 of the target tensor {name}" in refusal(fewer, small, allow_unproven=True)


def test_contract_refuses_what_it_cannot_serve_by_family_and_refresh(exports, tmp_path, monkeypatch):
    """A refresh that runs the target's layers, and token-feature maps whose target's first layer is not known to
    be context-free: each refused in one line naming the family, the refresh and why."""
    import kvlingo.serve.layer0 as serve_layer0

    small = served(exports["small"])
    layers = edited(exports["token"], tmp_path / "layers", refresh="layers:1")
    text = refusal(layers, small, allow_unproven=True)
    assert "the tokeninput maps were measured with refresh layers:1" in text and "exact:0" in text

    def not_context_free(_config):
        raise NotContextFree("the first layer of a 'qwen3_next' model is not known to be context-free; use layer:0")

    monkeypatch.setattr(serve_layer0, "check", not_context_free)
    text = refusal(exports["token"], small, allow_unproven=True)
    assert "the tokeninput maps with refresh exact:0 read the target's layer 0 from the token ids" in text
    assert "'qwen3_next'" in text and "use layer:0" not in text
