import torch

from kvlingo.core.headwise import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.eval.shapes import QWEN3_ARCH, qwen3_config


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


def test_translation_flops_match_issue_arithmetic():
    # 28 layers × 8 KV heads × 2 (K, V) × 128² multiply-adds ≈ 7.3M per token ≈ 14.7 MFLOP
    assert abs(Headwise(Geometry(28, 8, 128, 28, 8, 128)).flops_per_token() - 14.68e6) < 0.01e6
    a, b = QWEN3_ARCH["Qwen/Qwen3-0.6B"], QWEN3_ARCH["Qwen/Qwen3-1.7B"]
    assert (a["num_hidden_layers"], a["num_key_value_heads"], a["head_dim"]) == (b["num_hidden_layers"], b["num_key_value_heads"], b["head_dim"])
