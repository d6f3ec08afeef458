"""Llama and Qwen2/2.5 beside Qwen3: capture and injection are exact, the native controls pass, the
attention weighting reads their queries, and every remaining refusal fires before any weights load.

References: transformers' own split execution, its own `apply_rotary_pos_emb`, eager attention's
`output_attentions`."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from tinypair import corpus, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlingo.core.cache import capture, continue_from
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.rope import RopeCache
from kvlingo.core.translator import Geometry
from kvlingo.eval.controls import native_controls, tolerances_for
from kvlingo.inputs.models import PairError, load_pair, resolve_pair
from kvlingo.toy.tokenizer import save_tokenizer, train_chat_tokenizer
from kvlingo.train import weighting as W

BF16_EPS = 2.0**-8
FAMILIES = [("llama", "llama3"), ("llama", "default"), ("qwen2", "yarn"), ("qwen2", "default")]


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 320, (1, n), generator=torch.Generator().manual_seed(seed))


def split_reference(model, prefix, new):
    with torch.no_grad():
        first = model(input_ids=prefix, use_cache=True)
        return model(input_ids=new, cache=first.cache, use_cache=True).logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type,schedule", FAMILIES)
def test_injected_own_cache_reproduces_split_execution(model_type, schedule, dtype):
    model = tiny_model(model_type, schedule, dtype=dtype)
    ids = _ids(48)
    prefix, new = ids[:, :39], ids[:, 39:]
    ref = split_reference(model, prefix, new)
    with torch.no_grad():
        cap = capture(model, prefix)
        got = continue_from(model, cap.keys, cap.values, new).logits[0]
        shifted = continue_from(model, cap.keys[:, :, 1:], cap.values[:, :, 1:], new).logits[0]
    top = ref.float().abs().max().item()
    assert (got.float() - ref.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else BF16_EPS * top)
    assert (shifted.float() - ref.float()).abs().max().item() > 1e-3  # the test can see a wrong cache


@pytest.mark.parametrize("model_type,schedule", FAMILIES)
def test_capture_holds_the_pre_rope_key_and_a_prenorm_identity_is_exact(model_type, schedule):
    """No k_norm: transformers' own RoPE of the captured k_proj output (bias included) is the cached key,
    and head-wise identity maps in the pre-norm key space hand back the model's own cache."""
    model = tiny_model(model_type, schedule)
    assert not hasattr(model.model.layers[0].self_attn, "k_norm")
    if model_type == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias.abs().max() > 0
    ids = _ids(30, 1)
    with torch.no_grad():
        cap = capture(model, ids)
    cos, sin = model.model.rotary_emb(cap.prenorm, torch.arange(30)[None])
    for i in range(model.config.num_hidden_layers):
        k = cap.prenorm[i][None]  # [1, kv_heads, T, head_dim]
        assert torch.equal(apply_rotary_pos_emb(k, k, cos, sin)[1][0], cap.keys[i])
    identity = Headwise.identity(Geometry.of(model, model), "prenorm").bind(model, model)
    with torch.no_grad():
        keys, values = identity(cap)
    assert torch.equal(keys, cap.keys) and torch.equal(values, cap.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type,schedule", FAMILIES + [("qwen3", "yarn"), ("qwen3", "longrope")])
def test_native_controls_pass(model_type, schedule, dtype):
    model = tiny_model(model_type, schedule, dtype=dtype)
    ids = _ids(40, 2)[0].tolist()
    res = native_controls(model, ids[:30], ids[30:], tolerances_for(dtype))
    assert res["reconstruction"]["passed"] and res["identity"]["passed"], res
    assert res["identity"]["values_equal"]


@pytest.mark.parametrize("model_type,schedule", [("llama", "llama3"), ("qwen2", "yarn")])
def test_attention_weights_read_q_proj_queries(model_type, schedule):
    """Without q_norm the queries are hooked on q_proj (Qwen2: bias included); yarn's attention scaling
    rides on both query and key tables. Reference: eager attention's own probabilities."""
    model = tiny_model(model_type, schedule)
    eager = tiny_model(model_type, schedule, attn_implementation="eager")
    P, R = 25, 8
    ids = _ids(P + R, 3)
    with torch.no_grad():
        attn = eager(input_ids=ids, output_attentions=True).attentions  # per layer [1, q_heads, T, T]
        cap, q = W.capture_with_queries(model, ids, False, q_start=P - 1, n_q=R)
    H = model.config.num_key_value_heads
    ref = torch.stack([a[0, :, P - 1 : P - 1 + R, : P - 1].mean(1).view(H, -1, P - 1).mean(1) for a in attn]).double()
    got = W.scored_attention(model, cap.keys, q, P - 1, P - 1, RopeCache(model))
    assert (got - ref).abs().max().item() < 1e-6


def test_qwen2_geometry_reads_the_implicit_head_dim():
    model = tiny_model("qwen2", heads=4, kv_heads=2)
    assert getattr(model.config, "head_dim", None) is None
    assert Geometry.of(model, model).source_head_dim == 16


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


@pytest.mark.parametrize("family", ["crosshead", "crosslayer"])
def test_closed_form_and_translation_across_depth_kv_heads_and_head_dim(family):
    """A Llama source (3 layers × 1 KV head × head_dim 16, llama3 RoPE) and a Qwen3 target (2 × 2 × 8, k_norm):
    the FP64 closed form fits (in sample it beats the mean-only map, as least squares must), the translation
    has the target's layout, and the target continues on it."""
    from kvlingo.core.handoff import capture_source, continue_target, translate
    from kvlingo.records.saved import build
    from kvlingo.train.closed_form import fit_closed_form

    source = tiny_model("llama", "llama3", layers=3, kv_heads=1, seed=1)
    target = tiny_model("qwen3", "default", layers=2, kv_heads=2, head_dim=8, seed=2)
    g = Geometry.of(source, target)
    assert (g.source_layers, g.source_kv_heads, g.source_head_dim) == (3, 1, 16)
    assert (g.target_layers, g.target_kv_heads, g.target_head_dim) == (2, 2, 8)
    tr = build({"family": family, "key_space": "prenorm", "settings": {}, "geometry": asdict(g)}).bind(source, target)
    rows = [
        {"prefix_ids": _ids(20, seed).tolist()[0], "reply_ids": _ids(6, 100 + seed).tolist()[0]} for seed in range(10)
    ]
    stats = fit_closed_form(source, target, tr, rows, "uniform", ridge=0.0)
    assert stats["n_tokens"] == 10 * 26 and tr.plan.shape[-1] == (1 if family == "crosshead" else 2)

    def relative_error(row) -> float:
        ids = torch.tensor([row["prefix_ids"] + row["reply_ids"]])
        with torch.no_grad():
            keys, values = translate(source, tr, ids, torch.float32)
            own = capture(target, ids)
        assert keys.shape == own.keys.shape == (2, 2, 26, 8)
        centred = own.values - own.values.mean(dim=2, keepdim=True)
        return ((values - own.values).norm() / centred.norm()).item()

    assert sum(relative_error(r) for r in rows) / len(rows) < 1.0
    with torch.no_grad():
        ids = _ids(12, 77)
        kv = translate(source, tr, ids, torch.float32, cap=capture_source(source, ids, [tr]))
        out = continue_target(target, kv, _ids(3, 78))
    assert out.logits.shape[-2:] == (3, 320) and torch.isfinite(out.logits).all()


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
