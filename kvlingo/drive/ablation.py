"""The translator ablation: which family (and k, rank, objective) carries a conversation, at what cost.

Every setting trains on the same splits with the same distillation budget (the profile's),
then is scored on the test split (benchmark: KL/token, top-1, NLL Δ), IFEval and GSM8K after a
prompt handoff. The two settings with the lowest validation KL are trained again with a longer
budget (`LONG_FACTOR` × the updates), which tells capacity apart from training.

Cost: each setting's translation FLOPs per context token are counted at the real
Qwen3-1.7B → 0.6B shapes (the direction's source and target), with the same k, the rank
scaled by the ratio of the real and toy target widths (so a rank that is half the toy width
stays half the real one), and compared with the target's re-prefill FLOPs per token
(`shapes.prefill_flops`): the fraction, and the ceiling speedup those FLOPs allow.

Choosing the default: the lowest validation KL among the settings whose translation FLOPs are
at most `MAX_COST_FRACTION` of re-prefill at the real shapes. The test split and the task
scores never choose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_COST_FRACTION = 0.10  # the default's translation FLOPs, at most this fraction of re-prefill at the real shapes
LONG_FACTOR = 2  # the longer budget of the best two settings, in multiples of the profile's updates


@dataclass(frozen=True)
class Setting:
    name: str  # a short name: also the run folder under RUN/
    family: str  # translator family
    flags: tuple[str, ...] = ()  # train_translator.py flags besides --family
    note: str = ""  # what the setting tests

    def family_args(self) -> dict[str, Any]:
        """The family flags as train_translator.family_settings takes them."""
        out, it = {}, iter(self.flags)
        for flag in it:
            if flag in ("--k", "--rank", "--key-rank", "--hidden"):
                out[flag[2:].replace("-", "_")] = int(next(it))
            elif flag in ("--pairing", "--base"):
                out[flag[2:]] = next(it)
        return out


SETTINGS = (
    Setting("headwise-ridge0", "headwise", ("--ridge", "0"), "the seed design: head-wise maps, plain least squares"),
    Setting("headwise", "headwise", (), "head-wise maps, ridge chosen on held-out positions"),
    Setting("crosshead", "crosshead", (), "all source heads → all target heads, same relative depth"),
    Setting("crosshead-key-rquarter", "crosshead", ("--key-rank", "16"),
            "cross-head maps, the keys' through a rank of a quarter of the target width (values full)"),
    Setting("crosslayer-k2", "crosslayer", ("--k", "2"), "cross-head input from the top-2 source layers by R²"),
    Setting("crosslayer-k4", "crosslayer", ("--k", "4"), "cross-head input from the top-4 source layers by R²"),
    Setting("crosslayer-k4-rhalf", "crosslayer", ("--k", "4", "--rank", "32"),
            "the top-4 layers through a rank of half the target width"),
    Setting("residual-crosshead", "residual", ("--base", "crosshead", "--hidden", "64"),
            "cross-head maps plus a zero-initialised per-layer MLP"),
    Setting("crosshead-aux", "crosshead", ("--aux-attn-weight", "0.1"),
            "cross-head maps, KL plus 0.1 × attention-output MSE"),
)


def real_cost(setting: Setting, direction: str, toy_target_width: int) -> dict[str, float]:
    """Translation FLOPs per context token at the real shapes, as a fraction of the target's re-prefill."""
    import torch
    from transformers import Qwen3ForCausalLM

    from ..bench.shapes import prefill_flops, real_pair_configs, real_settings, translator_at
    from ..train.config import family_settings

    src_cfg, tgt_cfg = real_pair_configs(direction)
    settings = family_settings(setting.family, **setting.family_args())
    translator = translator_at(setting.family, settings, src_cfg, tgt_cfg, from_width=toy_target_width)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(tgt_cfg)
    flops, reprefill = translator.flops_per_token(), prefill_flops(target, 1)
    return {"translate_flops_per_token": flops, "reprefill_flops_per_token": reprefill,
            "fraction_of_reprefill": flops / reprefill, "ceiling_speedup": reprefill / flops,
            "real_settings": real_settings(settings, _width(tgt_cfg) / toy_target_width)}


def _width(cfg) -> int:
    return cfg.num_key_value_heads * cfg.head_dim


def choose_default(rows: list[dict]) -> dict[str, Any]:
    """The admissible setting (cost ≤ MAX_COST_FRACTION) with the lowest validation KL; ties to the cheaper."""
    ok = [r for r in rows if r["real"]["fraction_of_reprefill"] <= MAX_COST_FRACTION
          and isinstance(r["distilled_val_kl"], (int, float)) and math.isfinite(r["distilled_val_kl"])]
    if not ok:
        return {"setting": None, "why": f"no setting costs at most {MAX_COST_FRACTION:.0%} of re-prefill"}
    best = min(ok, key=lambda r: (r["distilled_val_kl"], r["real"]["fraction_of_reprefill"]))
    return {"setting": best["name"], "distilled_val_kl": best["distilled_val_kl"],
            "fraction_of_reprefill": best["real"]["fraction_of_reprefill"],
            "why": f"lowest validation KL among the {len(ok)} settings costing ≤ {MAX_COST_FRACTION:.0%} of re-prefill "
                   "at the real shapes (the test split and the task scores take no part)"}
