"""Real model shapes (architecture-exact configs) and FLOP counts at those shapes.

Timing does not depend on weight values, so `make perf` measures speed at the real models'
shapes with random weights (kvlingo.toy.random) without downloading anything. The values
below are the published configs of the pinned checkpoints (kvlingo.run.models.PINNED_REVISIONS).
"""

from __future__ import annotations

import torch


QWEN3_ARCH = {
    "Qwen/Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                            rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "Qwen/Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                            rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
}


# A scaled-down stand-in with the same code path, for smoke tests of `--random-weights`.
QWEN3_ARCH["tiny-large"] = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
                                num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                                rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)
QWEN3_ARCH["tiny-small"] = dict(QWEN3_ARCH["tiny-large"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                rope_theta=10_000.0)
RANDOM_PAIRS = {"qwen3": ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B"), "tiny": ("tiny-large", "tiny-small")}


def qwen3_config(name: str):
    from transformers import Qwen3Config

    arch = dict(QWEN3_ARCH[name])
    theta = arch.pop("rope_theta")
    return Qwen3Config(**arch, rope_parameters={"rope_type": "default", "rope_theta": theta})


def prefill_flops(model, tokens: int) -> float:
    """≈ 2 · (non-embedding parameters) · tokens: the dense part of a prefill, before attention."""
    n = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.model.embed_tokens.weight.numel()  # the tied LM head still runs a matmul
    return 2.0 * n * tokens


def real_settings(settings: dict, width_ratio: float) -> dict:
    """A family's settings carried to other shapes: the layer plan dropped (re-derived there), the rank
    scaled by the ratio of the target widths (so a rank that is half the width stays half)."""
    out = {k: v for k, v in settings.items() if k != "layers"}
    if out.get("rank"):
        out["rank"] = max(1, round(out["rank"] * width_ratio))
    if isinstance(out.get("base"), dict):
        out["base"] = {**out["base"], "settings": real_settings(out["base"].get("settings", {}), width_ratio)}
    return out


def translator_at(family: str, settings: dict, source_cfg, target_cfg, key_space: str = "prenorm",
                  from_width: int | None = None):
    """A translator of `family` at the shapes of two configs, on the meta device (for counting), its settings
    carried over from a target of width `from_width` (kv_heads · head_dim) when given."""
    from dataclasses import asdict

    from ..core.translator import Geometry, build

    geometry = Geometry.of(source_cfg, target_cfg)
    width = geometry.target_kv_heads * geometry.target_head_dim
    carried = real_settings(settings, width / from_width if from_width else 1.0)
    with torch.device("meta"):
        return build({"family": family, "key_space": key_space, "settings": carried, "geometry": asdict(geometry)})


def real_pair_configs(direction: str, arch: str = "qwen3"):
    """(source config, target config) of the real shapes for a direction."""
    large, small = RANDOM_PAIRS[arch]
    return (qwen3_config(large), qwen3_config(small)) if direction == "l2s" else (qwen3_config(small), qwen3_config(large))
