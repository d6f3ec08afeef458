"""Every refusal of the pair check fires, with a message naming the field and both values."""

from __future__ import annotations

import pytest
import torch
from tinypair import corpus, load_tiny_pair, qwen3_config

from kvlingo.core.cache import check_batch
from kvlingo.inputs.models import ModelSpec, PairError, check_pair, load_tokenizer, resolve_pair
from kvlingo.toy.tokenizer import train_chat_tokenizer


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


def test_batch_larger_than_one_refused():
    check_batch(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch-one"):
        check_batch(torch.zeros(2, 5, dtype=torch.long))


def test_missing_hub_model_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PairError, match="pass a local folder"):
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
