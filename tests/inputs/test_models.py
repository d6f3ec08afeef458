"""The pair (kvlingo/inputs/models.py): every refusal of the pair check fires before any weights load, naming the
field and both values; Llama, Qwen2 and Qwen3 may pair; a Hub id resolves to a recorded commit; a device is one
of those known."""

from __future__ import annotations

import pytest
from tinypair import corpus, load_tiny_pair, qwen3_config, tiny_model

from kvlingo.inputs.models import (
    PYTHON_API,
    ModelSpec,
    PairError,
    check_pair,
    load_pair,
    load_tokenizer,
    pair_specs,
    resolve_device,
    resolve_dtype,
    resolve_pair,
)
from kvlingo.toy.tokenizer import save_tokenizer, train_chat_tokenizer


def cfg(**kw):
    base = dict(vocab=320, hidden=64, heads=4, rope_theta=10_000.0)
    base.update(kw)
    return qwen3_config(**base)


def test_real_tiny_pair_passes(tiny_pair_paths):
    pair = load_tiny_pair(tiny_pair_paths)
    assert pair.source.config.hidden_size == 96 and pair.target.config.hidden_size == 64
    swapped = load_tiny_pair(tiny_pair_paths, direction="s2l")
    assert swapped.source.config.hidden_size == 64
    cfg_, _ = resolve_pair(str(tiny_pair_paths[0]), str(tiny_pair_paths[1]), "l2s", "auto", "bf16")
    assert cfg_.device == "cpu" and cfg_.dtype == "bfloat16"  # resolved values, never "auto"
    assert cfg_.source["weights_sha256"] != cfg_.target["weights_sha256"] and len(cfg_.tokenizer_sha256) == 64
    assert all(not p.requires_grad for p in pair.target.parameters())


@pytest.mark.parametrize(
    "field,src,tgt",
    [
        ("num_hidden_layers", dict(layers=2), dict(layers=3)),
        ("num_key_value_heads", dict(kv_heads=2), dict(kv_heads=1)),
        ("head_dim", dict(head_dim=16), dict(head_dim=32)),
    ],
)
def test_other_geometries_pass_the_pair_check_and_head_wise_refuses_them(field, src, tgt):
    """Depth, KV heads and head_dim may differ between the models; a family that cannot map a geometry refuses it."""
    from kvlingo.core.families.headwise.maps import Headwise
    from kvlingo.core.translator import Geometry, TranslatorError

    a, b = cfg(**src), cfg(**tgt)
    check_pair(a, b)
    if field == "head_dim":
        Headwise(Geometry.of(a, b))  # head-wise maps d_in → d_out per head: any head_dim
    else:
        with pytest.raises(TranslatorError, match="--family crosslayer"):
            Headwise(Geometry.of(a, b))


def test_unsupported_family_refused():
    from transformers import LlamaConfig, MistralConfig

    check_pair(LlamaConfig(num_hidden_layers=2), cfg())  # Llama, Qwen2 and Qwen3 pair with each other
    with pytest.raises(PairError, match="'mistral', not one of 'qwen3', 'qwen2', 'llama'"):
        check_pair(MistralConfig(num_hidden_layers=2), cfg())


def test_sliding_window_refused():
    sliding = cfg(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(PairError, match="non-full attention"):
        check_pair(cfg(), sliding)


def test_static_rope_scaling_passes_and_dynamic_is_refused():
    scaled = cfg()
    scaled.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}
    check_pair(scaled, cfg())
    scaled.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    with pytest.raises(PairError, match="'dynamic' rescales its frequencies"):
        check_pair(scaled, cfg())


def test_different_tokenizer_refused():
    a = train_chat_tokenizer(corpus(), vocab_size=320, min_frequency=1)
    b = train_chat_tokenizer(corpus()[:50], vocab_size=300, min_frequency=1)
    with pytest.raises(PairError, match="tokenizer"):
        check_pair(cfg(), cfg(), a, b)


def test_chat_template_rendering_must_match_but_text_may_differ(tiny_pair_paths):
    a = load_tokenizer(ModelSpec.parse(str(tiny_pair_paths[0])))
    b = load_tokenizer(ModelSpec.parse(str(tiny_pair_paths[1])))
    b.chat_template = "{#- same rendering, different text -#}" + a.chat_template
    check_pair(cfg(), cfg(), a, b)  # no refusal
    b.chat_template = a.chat_template.replace("<think>\\n\\n</think>\\n\\n", "<think>\\n</think>\\n")
    with pytest.raises(PairError, match="enable_thinking=False"):
        check_pair(cfg(), cfg(), a, b)
    b.chat_template = a.chat_template.replace(
        "'<|im_start|>' + message['role']", "'<|im_start|>' + message['role'] + ' '"
    )
    with pytest.raises(PairError, match="enable_thinking=True"):
        check_pair(cfg(), cfg(), a, b)


def test_missing_hub_model_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PairError, match="pass a folder that exists"):
        load_tokenizer(ModelSpec.parse("Qwen/Qwen3-0.6B"))


def test_a_missing_or_damaged_model_folder_is_named_as_a_folder(tiny_pair_paths, tmp_path):
    """A path that does not exist is not sent to the Hub as a repo id, and a folder that cannot be loaded is
    named as a folder to save again (no download hint for it)."""
    import shutil

    from kvlingo.inputs.models import load_config, load_model

    for missing in (tmp_path / "nowhere", "./nowhere", "runs/a/b"):
        with pytest.raises(PairError, match="no model folder at .*nowhere|no model folder at runs/a/b"):
            ModelSpec.parse(str(missing))
    assert ModelSpec.parse("Qwen/Qwen3-0.6B").revision  # a Hub id still parses as one

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        PairError, match=r"(?s)could not load the model folder .*empty.*save or copy the model there"
    ) as e:
        load_config(ModelSpec.parse(str(empty)))
    assert "huggingface-cli" not in str(e.value)

    cut = tmp_path / "cut"
    shutil.copytree(tiny_pair_paths[1], cut)
    weights = next(cut.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(PairError, match=r"could not load the model folder .*cut: SafetensorError"):
        load_model(ModelSpec.parse(str(cut)))


# --------------------------------------------------------------------------- refusals before any weights
def _folder(root, name, cfg, tok):
    """A model folder with config and tokenizer only (no weights): what `resolve_pair` refuses here, it
    refuses before any weights exist to load."""
    path = root / name
    cfg.save_pretrained(path)
    save_tokenizer(tok, path)
    return str(path)


def _config(model_type="llama", rope="default", **kw):
    return tiny_model(model_type, rope, layers=1, **kw).config


@pytest.fixture(scope="module")
def tokenizers():
    return (
        train_chat_tokenizer(corpus(), vocab_size=320, min_frequency=1),
        train_chat_tokenizer(corpus()[:50], vocab_size=300, min_frequency=1),
    )


@pytest.mark.parametrize(
    "case,message",
    [
        ("sliding", r"non-full attention.*set use_sliding_window=false"),
        ("dynamic", r"'dynamic'.*depends on the sequence length.*'linear' or 'yarn'"),
        ("tokenizer", r"tokenizer .*share one tokenizer"),
        ("mistral", r"'mistral', not one of 'qwen3', 'qwen2', 'llama'.*pick a checkpoint"),
    ],
)
def test_refusals_fire_before_any_weights_load(tmp_path, tokenizers, case, message):
    from transformers import MistralConfig

    tok, other = tokenizers
    good = _folder(tmp_path, "good", _config("llama"), tok)
    bad_cfg = {
        "sliding": _config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0),
        "dynamic": _config("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}),
        "tokenizer": _config("qwen2"),
        "mistral": MistralConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
    }[case]
    bad = _folder(tmp_path, "bad", bad_cfg, other if case == "tokenizer" else tok)
    with pytest.raises(PairError, match=message):
        resolve_pair(good, bad, "l2s", "cpu", "float32")
    # without the flaw the same check passes on these weightless folders; only loading needs weights
    fine = _folder(tmp_path, "fine", _config("qwen2", "yarn"), tok)
    cfg, tok_ = resolve_pair(good, fine, "l2s", "cpu", "float32")
    with pytest.raises(PairError, match="no file named model.safetensors"):
        load_pair(cfg, tok_)


def test_llama_qwen2_and_qwen3_may_pair(tmp_path, tokenizers):
    """Families may mix (a cross-family pair still shares one tokenizer); the resolved geometry is recorded."""
    tok, _ = tokenizers
    paths = []
    for name, model in (
        ("llama", tiny_model("llama", "llama3", layers=3)),
        ("qwen2", tiny_model("qwen2", "yarn")),
        ("qwen3", tiny_model("qwen3", "longrope")),
    ):
        model.save_pretrained(tmp_path / name)
        save_tokenizer(tok, tmp_path / name)
        paths.append(str(tmp_path / name))
    cfg, _ = resolve_pair(paths[0], paths[1], "l2s", "cpu", "float32")
    assert cfg.geometry["source_layers"] == 3 and cfg.geometry["target_head_dim"] == 16
    resolve_pair(paths[2], paths[0], "s2l", "cpu", "float32")


# --------------------------------------------------------------------------- Hub revisions
def test_unpinned_hub_ids_resolve_to_a_commit_recorded_and_loaded(tmp_path, tokenizers, monkeypatch, capsys):
    """A local Hub cache (offline) stands in for the Hub: 'main' resolves to the commit it points to, with a
    warning naming the pin; the resolved pair keeps loading that commit after the branch moves on."""
    import huggingface_hub.constants

    from kvlingo.inputs.models import PINNED_REVISIONS, ModelSpec

    tok, _ = tokenizers
    cache = tmp_path / "hub"
    for name, sha, layers in (("large", "a" * 40, 3), ("small", "b" * 40, 2), ("large", "c" * 40, 4)):
        repo = cache / f"models--toyorg--{name}"
        tiny_model("llama", layers=layers).save_pretrained(repo / "snapshots" / sha)
        save_tokenizer(tok, repo / "snapshots" / sha)
        (repo / "refs").mkdir(exist_ok=True)
        if sha != "c" * 40:
            (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    cfg, tok_ = resolve_pair("toyorg/large", f"toyorg/small@{'b' * 40}", "l2s", "cpu", "float32")
    err = capsys.readouterr().err
    assert f"toyorg/large has no pinned revision; 'main' resolved to {'a' * 40}" in err
    assert f"Pin it: pass toyorg/large@{'a' * 40}" in err and "toyorg/small" not in err  # the pinned one is quiet
    assert cfg.source == {"id": "toyorg/large", "revision": "a" * 40} and cfg.large == "toyorg/large"
    (cache / "models--toyorg--large" / "refs" / "main").write_text("c" * 40)  # the branch moves on
    assert load_pair(cfg, tok_).source.config.num_hidden_layers == 3  # still the commit the run recorded
    assert ModelSpec.parse("Qwen/Qwen3-4B").revision == PINNED_REVISIONS["Qwen/Qwen3-4B"]


def test_resolve_device_refuses_a_device_it_does_not_know():
    assert resolve_device("cpu") == "cpu"
    for bad in ("tpu", "cuda:x", "gpu", "CPU"):
        with pytest.raises(PairError, match="cuda \\(or cuda:N\\), mps, cpu or auto"):
            resolve_device(bad)


def test_a_bad_device_or_dtype_is_named_as_the_caller_s_user_gives_it(monkeypatch):
    """The command line names its make variables (DEVICE=, DTYPE=); the Python API (naming=PYTHON_API, as
    kvlingo.Relay passes it) names its keyword arguments, with the values to give as Python strings."""
    for naming, unknown, cuda, dtype in (
        (
            {},
            "^DEVICE=cpux is not a device this suite runs on; use cuda \\(or cuda:N\\), mps, cpu or auto$",
            "^DEVICE=cuda but torch sees no CUDA device; use DEVICE=cpu or DEVICE=auto$",
            "^DTYPE=fp8 is not supported; use one of bfloat16, float32, float16$",
        ),
        (
            {"naming": PYTHON_API},
            "^device='cpux' is not a device this suite runs on; use 'cuda' \\(or 'cuda:N'\\), 'mps', 'cpu' or 'auto'$",
            "^device='cuda' but torch sees no CUDA device; use device='cpu' or device='auto'$",
            "^dtype='fp8' is not supported; use one of 'bfloat16', 'float32', 'float16'$",
        ),
    ):
        with pytest.raises(PairError, match=unknown):
            resolve_device("cpux", **naming)
        with monkeypatch.context() as m:
            m.setattr("torch.cuda.is_available", lambda: False)
            with pytest.raises(PairError, match=cuda):
                resolve_device("cuda", **naming)
        with pytest.raises(PairError, match=dtype):
            resolve_dtype("fp8", **naming)


def test_a_direction_that_is_neither_is_named_without_a_make_variable():
    """The check is reached from an export's recorded pair (kvlingo.Relay, the connector) as well as from scripts,
    so its message names the two directions, not `DIRECTION=`, which neither caller takes."""
    large, small = ModelSpec("L", None), ModelSpec("S", None)
    assert pair_specs("l2s", large, small) == (large, small) and pair_specs("s2l", large, small) == (small, large)
    with pytest.raises(PairError, match=r"direction 'l2r' is not one of \('l2s', 's2l'\): l2s \(the large") as err:
        pair_specs("l2r", large, small)
    assert "DIRECTION=" not in str(err.value)
