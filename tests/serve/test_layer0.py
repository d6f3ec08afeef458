"""The server's layer 0 (kvlingo/serve/layer0.py), built from the checkpoint's layer-0 tensors alone, against the
loaded model's own (kvlingo.core.layer0.ContextFree): the same token features, keys and values bit for bit, in FP32
and BF16, for Qwen3 (k_norm), Qwen2 (projection biases) and Llama (llama3 RoPE); what it cannot serve refused."""

from __future__ import annotations

import pytest
import torch

from kvlingo.core import layer0 as core_layer0
from kvlingo.core.layer0 import ContextFree
from kvlingo.inputs.models import ModelSpec, checkpoint_files, load_model, read_tensors
from kvlingo.serve.layer0 import Layer0, parts_of


def other_family(kind: str):
    """A random tiny Qwen2 (projection biases) or Llama (llama3 RoPE schedule), FP32."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaForCausalLM(LlamaConfig(**common, head_dim=32, rope_parameters=rope)).eval()


def rotary_of(config):
    """The family's rotary module built from the config alone (what the serving contract hands Layer0)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    return type(shell.model.rotary_emb)(config=config)


def layer0_tensors(model) -> dict[str, torch.Tensor]:
    """The layer-0 tensors of a model in memory, by checkpoint name, as kvlingo.core.layer0 picks them."""
    state = model.state_dict()
    return {n: state[n] for n in core_layer0.read_weight_names(state, exact=True)}


def assert_same(mine: Layer0, model, ids: torch.Tensor) -> None:
    ref = ContextFree(model)
    assert torch.equal(mine.token_features(ids), ref.token_features(ids))
    for start in (0, 17):
        k, v = mine.kv(ids[start:], start=start)
        want_k, want_v = ref.kv(ids[start:], start=start)
        assert k.dtype == want_k.dtype and torch.equal(k, want_k) and torch.equal(v, want_v)
    feats = ref.token_features(ids).float()  # the exact:0 handoff's path: from a token-input translator's features
    k, v = mine.kv_of(*feats.chunk(2, dim=-1))
    assert torch.equal(k, ref.kv(ids)[0]) and torch.equal(v, ref.kv(ids)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer0_from_checkpoint_tensors_is_context_free_bit_for_bit(tiny_pair_paths, one_thread, dtype):
    """Qwen3: the tensors read from the saved checkpoint (and nothing else of it) give the loaded model's layer 0."""
    g = torch.Generator().manual_seed(3)
    for path in tiny_pair_paths:
        spec = ModelSpec.parse(str(path))
        model = load_model(spec, "cpu", dtype)
        tensors = read_tensors(checkpoint_files(spec.identity()), lambda n: core_layer0.read_weight_names(n, True))
        assert len(tensors) == 5 and all("layers.0." in n or "embed_tokens" in n for n in tensors)
        mine = Layer0(model.config, tensors, rotary_of(model.config), dtype)
        assert_same(mine, model, torch.randint(0, model.config.vocab_size, (61,), generator=g))


def test_layer0_of_qwen2_and_llama_is_context_free_bit_for_bit(one_thread):
    g = torch.Generator().manual_seed(4)
    for kind in ("qwen2", "llama"):
        model = other_family(kind)
        tensors = layer0_tensors(model)
        assert any(n.endswith("k_proj.bias") for n in tensors) == (kind == "qwen2")
        mine = Layer0(model.config, tensors, rotary_of(model.config), optional=parts_of(model.model.layers[0]))
        assert mine.k_norm is None and (mine.k_bias is not None) == (kind == "qwen2")
        assert_same(mine, model, torch.randint(0, 300, (70,), generator=g))


def test_model_stub_layer0_is_what_a_translator_reads(tiny_pair_paths):
    """kvlingo.core.layer0.of: a stub's own layer 0 where it carries one, else the model's ContextFree."""
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    assert isinstance(core_layer0.of(model), ContextFree)
    mine = Layer0(model.config, layer0_tensors(model), rotary_of(model.config))

    class Stub:
        config, layer0 = model.config, mine

    assert core_layer0.of(Stub()) is mine


def test_layer0_refuses_what_it_cannot_compute(tiny_pair_paths):
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    tensors = layer0_tensors(model)
    rotary = rotary_of(model.config)
    without = {n: t for n, t in tensors.items() if "v_proj" not in n}
    with pytest.raises(ValueError, match=r"needs layers\.0\.self_attn\.v_proj\.weight"):
        Layer0(model.config, without, rotary)
    optional = parts_of(model.model.layers[0])  # what the family's own layer 0 has: Qwen3's key norm
    assert optional == ("k_norm",)
    no_norm = {n: t for n, t in tensors.items() if "k_norm" not in n}
    with pytest.raises(ValueError, match=r"needs layers\.0\.self_attn\.k_norm\.weight"):
        Layer0(model.config, no_norm, rotary, optional=optional)
    longrope = model.config.__class__.from_dict(
        {
            **model.config.to_dict(),
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        }
    )
    with pytest.raises(ValueError, match="longrope"):
        Layer0(longrope, tensors, rotary)
    qwen3_next = model.config.to_dict()
    qwen3_next["model_type"] = "qwen3_next"
    with pytest.raises(core_layer0.NotContextFree, match="qwen3_next"):
        Layer0(type("Cfg", (), qwen3_next)(), tensors, rotary)
