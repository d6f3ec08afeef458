"""Architecture-exact Qwen3-0.6B and Qwen3-1.7B with random weights, for timing at real shapes.

Timing does not depend on weight values, so `--random-weights` measures speed at the real
models' shapes without downloading anything. The values below are the published configs
of the pinned checkpoints (see kvlingo.models.PINNED_REVISIONS).
"""

from __future__ import annotations

import torch

from .maps import HeadwiseMaps

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


def random_model(name: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A frozen, eval-mode Qwen3 of `name`'s exact shape with small random weights.

    Weights are drawn N(0, 0.02) directly in the run dtype (no denormals, no NaNs: those
    would distort CPU timings). Built outside inference_mode (see NOTES on BF16 speed).
    """
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(name)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty breaks the embedding/LM-head tie
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "norm" in name_:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        # to_empty leaves buffers uninitialised: recompute RoPE's inverse frequencies.
        rot = model.model.rotary_emb
        inv_freq, _ = rot.compute_default_rope_parameters(cfg)
        rot.inv_freq = inv_freq.to(device)
        rot.original_inv_freq = inv_freq.to(device)
    model.eval().requires_grad_(False)
    return model


def random_maps(source, target, key_space: str = "prenorm", seed: int = 0) -> HeadwiseMaps:
    """Near-identity random maps for a pair (values are irrelevant to timing, but kept finite and tame)."""
    maps = HeadwiseMaps.for_pair(source, target, key_space)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        L, H, d_in, d_out = maps.shape
        maps.weight.copy_(torch.eye(d_in, d_out) + 0.01 * torch.randn(2, L, H, d_in, d_out, generator=g))
    return maps.to(next(target.parameters()).device)


def translation_flops(layers: int, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Multiply-adds ×2 of the head-wise maps for K and V: 2 · (L · H · 2 · d²) · tokens."""
    return 2.0 * layers * kv_heads * 2 * head_dim * head_dim * tokens


def prefill_flops(model, tokens: int) -> float:
    """≈ 2 · (non-embedding parameters) · tokens: the dense part of a prefill, before attention."""
    n = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.model.embed_tokens.weight.numel()  # the tied LM head still runs a matmul
    return 2.0 * n * tokens


def random_pair(arch: str = "qwen3", direction: str = "l2s", device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A `models.Pair` of random-weight models (no tokenizer): the large/small of `arch` in `direction`."""
    from .models import ModelSpec, Pair, check_pair, pair_specs

    large, small = (ModelSpec(name, "random-weights") for name in RANDOM_PAIRS[arch])
    src, tgt = pair_specs(direction, large, small)
    source = random_model(src.name_or_path, device, dtype, seed=1)
    target = random_model(tgt.name_or_path, device, dtype, seed=2)
    check_pair(source.config, target.config)
    return Pair(source, target, None, src, tgt, direction, device, dtype)
