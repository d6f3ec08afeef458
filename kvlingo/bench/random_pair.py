"""Random-weight models at real or tiny shapes, and random translators for them: what speed is timed on.

Weights are drawn N(0, 0.02) directly in the run dtype (no denormals, no NaNs: those would
distort CPU timings). Values are irrelevant to timing, so these measure speed at the exact
shapes of kvlingo.bench.shapes without any download.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..core.families.headwise.maps import Headwise
from ..core.translator import Geometry
from ..inputs.models import ModelSpec, Pair, PairConfig, check_pair, dtype_name, pair_specs
from ..records.saved import build
from .shapes import RANDOM_PAIRS, arch_config, meta_model


def random_model(name: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A frozen, eval-mode model (Qwen3 or Llama) of preset `name`'s exact shape with small random weights.

    Built outside inference_mode: CPU BF16 matmuls of a model built inside it run far slower.
    """
    cfg = arch_config(name)
    model = meta_model(name)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty breaks the embedding/LM-head tie
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "norm" in name_:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        # to_empty leaves buffers uninitialised: a fresh rotary module of the model's own schedule
        # computes RoPE's inverse frequencies (and attention scaling) again.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)
    model.eval().requires_grad_(False)
    return model


def random_translator(
    source, target, key_space: str = "prenorm", seed: int = 0, family: str = "headwise", settings: dict | None = None
):
    """A random translator of `family` bound to a pair (values are irrelevant to timing, but finite and tame):
    near-identity head-wise maps, or every parameter drawn N(0, 0.02) for the other families."""
    g = Geometry.of(source, target)
    gen = torch.Generator().manual_seed(seed)
    if family == "headwise":
        maps = Headwise(g, key_space)
        with torch.no_grad():
            shape = maps.weight.shape
            maps.weight.copy_(
                torch.eye(g.source_head_dim, g.target_head_dim) + 0.01 * torch.randn(*shape, generator=gen)
            )
    else:
        maps = build({"family": family, "key_space": key_space, "settings": settings or {}, "geometry": asdict(g)})
        with torch.no_grad():
            for p in maps.parameters():
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return maps.to(next(target.parameters()).device).bind(source, target).requires_grad_(False)


def random_pair(
    arch: str = "qwen3",
    direction: str = "l2s",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    names: tuple[str, str] | None = None,
):
    """A `Pair` of random-weight models (no tokenizer): the large/small of `arch` (or the preset shapes
    `names` = (large, small)) in `direction`."""
    large, small = names or RANDOM_PAIRS[arch]
    src, tgt = pair_specs(direction, ModelSpec(large, "random-weights"), ModelSpec(small, "random-weights"))
    source = random_model(src.name_or_path, device, dtype, seed=1)
    target = random_model(tgt.name_or_path, device, dtype, seed=2)
    check_pair(source.config, target.config)
    cfg = PairConfig(
        large=f"{large}@random-weights",
        small=f"{small}@random-weights",
        direction=direction,
        device=device,
        dtype=dtype_name(dtype),
        source=src.identity(),
        target=tgt.identity(),
        tokenizer_sha256="none (random weights, random token ids)",
        chat_template_sha256="none",
        geometry=asdict(Geometry.of(source, target)),
    )
    return Pair(source, target, None, cfg)
