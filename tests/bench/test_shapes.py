import pytest
import torch

from kvlingo.bench.shapes import QWEN3_ARCH, arch_config, flop_ceiling, meta_model, prefill_flops, qwen3_config
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry


def test_architecture_values_match_published_parameter_counts():
    """Model cards: Qwen3-0.6B 0.6B params (0.44B non-embedding), Qwen3-1.7B 1.7B (1.4B non-embedding)."""
    from transformers import Qwen3ForCausalLM

    expected = {"Qwen/Qwen3-0.6B": (0.60e9, 0.44e9), "Qwen/Qwen3-1.7B": (1.72e9, 1.41e9)}
    for name, (total, non_emb) in expected.items():
        with torch.device("meta"):
            model = Qwen3ForCausalLM(qwen3_config(name))
        n = sum(p.numel() for p in model.parameters())
        emb = model.model.embed_tokens.weight.numel()
        assert abs(n - total) / total < 0.01 and abs(n - emb - non_emb) / non_emb < 0.01
        assert model.config.layer_types == ["full_attention"] * 28


@pytest.mark.parametrize(
    "name,total,non_emb,layers",
    [
        # Model cards: Qwen3-4B 4.0B (3.6B non-embedding), Qwen3-8B 8.2B (6.95B non-embedding, untied LM head)
        ("Qwen/Qwen3-4B", 4.0e9, 3.6e9, 36),
        ("Qwen/Qwen3-8B", 8.2e9, 6.95e9, 36),
    ],
)
def test_qwen3_4b_and_8b_match_their_model_cards(name, total, non_emb, layers):
    model = meta_model(name)
    n = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel() * (1 if model.config.tie_word_embeddings else 2)
    assert abs(n - total) / total < 0.01 and abs(n - emb - non_emb) / non_emb < 0.01
    assert model.config.layer_types == ["full_attention"] * layers


@pytest.mark.parametrize(
    "name,total",
    [
        # The safetensors totals of the published checkpoints (tied embeddings): 1.23B and 3.21B on the model card
        ("meta-llama/Llama-3.2-1B", 1_235_814_400),
        ("meta-llama/Llama-3.2-3B", 3_212_749_824),
        ("meta-llama/Llama-3.2-3B-Instruct", 3_212_749_824),
    ],
)
def test_llama_3_2_matches_its_published_parameter_count_exactly(name, total):
    model = meta_model(name)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == total
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["original_max_position_embeddings"] == 8192


def test_translation_flops_match_issue_arithmetic():
    # 28 layers × 8 KV heads × 2 (K, V) × 128² multiply-adds ≈ 7.3M per token ≈ 14.7 MFLOP
    assert abs(Headwise(Geometry(28, 8, 128, 28, 8, 128)).flops_per_token() - 14.68e6) < 0.01e6
    a, b = QWEN3_ARCH["Qwen/Qwen3-0.6B"], QWEN3_ARCH["Qwen/Qwen3-1.7B"]
    assert (a["num_hidden_layers"], a["num_key_value_heads"], a["head_dim"]) == (
        b["num_hidden_layers"],
        b["num_key_value_heads"],
        b["head_dim"],
    )


def test_flop_ceiling_counts_the_target_prefill_and_the_maps():
    """The ceiling's re-prefill is 2 × (non-embedding + tied head) parameters per token; against a hand count."""
    target = meta_model("Qwen/Qwen3-0.6B")
    geometry = Geometry.of(arch_config("Qwen/Qwen3-1.7B"), target.config)
    maps = Headwise(geometry)
    row = flop_ceiling(target, maps.flops_per_token(), 1024, 16)
    params = sum(p.numel() for p in target.parameters())  # the tied embedding counted once, as the LM head's matmul
    assert row["target_reprefill_dense"] == prefill_flops(target, 1040) == 2.0 * params * 1040
    assert row["translation"] == 1024 * 2 * 2 * 28 * 8 * 128 * 128
    assert row["reprefill_over_translation"] == pytest.approx(2.0 * params * 1040 / row["translation"])
