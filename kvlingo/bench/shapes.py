"""Real model shapes (architecture-exact configs) and FLOP counts at those shapes.

Timing does not depend on weight values, so `make perf` measures speed at the real models'
shapes with random weights (kvlingo.bench.random_pair) without downloading anything. The values
below are the published config.json files of the pinned checkpoints
(kvlingo.inputs.models.PINNED_REVISIONS); tests/bench/test_shapes.py checks each against its model
card's parameter count. Llama 3.2 uses the llama3 RoPE schedule (factor 32 over 8,192
original positions); the Instruct checkpoints share their base model's shape. Light at import (torch and
transformers inside the functions that build something), so perf.py's --help lists the presets at once.
"""

from __future__ import annotations


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool = True) -> dict:
    """A Qwen3 dense config: the fields that differ between sizes; 8 KV heads × 128, the vocabulary and RoPE are
    shared."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=tied,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
    )


QWEN3_ARCH = {
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16),
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32),
    "Qwen/Qwen3-8B": _qwen3(4096, 12288, 36, 32, tied=False),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_ARCH = {
    "meta-llama/Llama-3.2-1B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters=LLAMA3_ROPE,
    ),
    "meta-llama/Llama-3.2-3B": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters=LLAMA3_ROPE,
    ),
}
ALIASES = {f"{name}-Instruct": name for name in LLAMA_ARCH}  # same shapes as the base checkpoints


# A scaled-down stand-in with the same code path, for smoke tests of `--random-weights`.
QWEN3_ARCH["tiny-large"] = dict(
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)
QWEN3_ARCH["tiny-small"] = dict(
    QWEN3_ARCH["tiny-large"], hidden_size=64, intermediate_size=128, num_attention_heads=4, rope_theta=10_000.0
)
# A Llama stand-in of another depth, KV-head count and head_dim than tiny-small (a geometry head-wise maps refuse).
LLAMA_ARCH["tiny-llama"] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=256),
)
RANDOM_PAIRS = {"qwen3": ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B"), "tiny": ("tiny-large", "tiny-small")}


def qwen3_config(name: str):
    from transformers import Qwen3Config

    arch = dict(QWEN3_ARCH[name])
    theta = arch.pop("rope_theta")
    return Qwen3Config(**arch, rope_parameters={"rope_type": "default", "rope_theta": theta})


def preset_names() -> list[str]:
    return sorted([*QWEN3_ARCH, *LLAMA_ARCH, *ALIASES])


def arch_config(name: str):
    """The transformers config of a preset shape (Qwen3 or Llama), by Hub id or stand-in name."""
    from transformers import LlamaConfig

    name = ALIASES.get(name, name)
    if name in QWEN3_ARCH:
        return qwen3_config(name)
    if name in LLAMA_ARCH:
        arch = dict(LLAMA_ARCH[name])
        rope = dict(arch.pop("rope_parameters"))
        return LlamaConfig(**arch, rope_parameters=rope)
    raise KeyError(f"no preset shape {name!r}; known: {', '.join(preset_names())}")


def meta_model(name: str):
    """A preset model on the meta device: its shapes and parameter counts, no memory (for FLOP counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(arch_config(name))


def prefill_flops(model, tokens: int) -> float:
    """≈ 2 · (non-embedding parameters) · tokens: the dense part of a prefill, before attention."""
    n = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.model.embed_tokens.weight.numel()  # the tied LM head still runs a matmul
    return 2.0 * n * tokens


def real_settings(
    family: str, settings: dict, width_ratio: float, source_layers: int | None = None, depth_ratio: float = 1.0
) -> dict:
    """A family's settings carried to other shapes (`Family.carry`: ranks scaled by the ratio of the target widths,
    so that half the width stays half; counts of target layers by the ratio of the depths; a layer plan dropped;
    k capped at `source_layers` when given)."""
    from ..core.families import FAMILIES

    return FAMILIES[family].carry(settings, width_ratio, FAMILIES, source_layers, depth_ratio)


def translator_at(family: str, settings: dict, source_cfg, target_cfg, key_space: str = "prenorm", from_geometry=None):
    """A translator of `family` at the shapes of two configs, on the meta device (for counting), its settings
    carried over from the shapes `from_geometry` (a Geometry) when given."""
    from dataclasses import asdict

    import torch

    from ..core.translator import Geometry
    from ..records.saved import build

    geometry = Geometry.of(source_cfg, target_cfg)
    if from_geometry is not None:
        width, depth = (
            geometry.target_width / from_geometry.target_width,
            geometry.target_layers / from_geometry.target_layers,
        )
        settings = real_settings(family, settings, width, depth_ratio=depth)
    else:
        settings = real_settings(family, settings, 1.0)
    with torch.device("meta"):
        return build({"family": family, "key_space": key_space, "settings": settings, "geometry": asdict(geometry)})


def real_pair_configs(direction: str, arch: str = "qwen3"):
    """(source config, target config) of the real shapes for a direction."""
    large, small = RANDOM_PAIRS[arch]
    return (
        (qwen3_config(large), qwen3_config(small)) if direction == "l2s" else (qwen3_config(small), qwen3_config(large))
    )


def flop_ceiling(target, translation_flops_per_token: float, n: int, k: int) -> dict:
    """Speedup ceilings of a handoff from FLOP counts at context n and new turn k (dense parts only, as
    `prefill_flops`): re-prefill ÷ translation, and re-prefill ÷ (translation + the k-token new turn)."""
    reprefill, new_turn = prefill_flops(target, n + k), prefill_flops(target, k)
    translation = translation_flops_per_token * n
    return {
        "context_tokens": n,
        "target_reprefill_dense": reprefill,
        "translation": translation,
        "new_turn_dense": new_turn,
        "reprefill_over_translation": reprefill / translation,
        "reprefill_over_translation_plus_new_turn": reprefill / (translation + new_turn),
    }
