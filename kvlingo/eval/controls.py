"""Native controls: the target with its *own* cache must behave as if nothing was handed over.

Two checks per context (per conversation, with `cache.handoff_split`), both against
ordinary split execution through transformers (prefill the context, continue the new
tokens on that same cache object):

    reconstruction  capture the target's cache, inject it as a fresh cache, continue.
                    Same tensors into the same kernels, so the expected difference is 0.
    identity        the target's cache through identity maps in "cache" key space, target →
                    target: its RoPE stripped and re-applied (FP32, rounded once to the run
                    dtype), then injected. Checks the translator's plumbing without any
                    learned map in the way.

Tolerances are per dtype (`tolerances_for`) and are written into the report with every
measured value, so a reader can judge them. Each bound is `abs + rel × max|reference|`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from ..core.cache import handoff_split
from ..core.families.headwise.maps import Headwise
from ..core.handoff import as_ids, capture_source, continue_target, device_of, translate
from ..core.kl import token_kl, top1_agreement
from ..core.translator import Geometry
from ..inputs.models import dtype_name

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding moves a value by at most half of this, relatively


@dataclass(frozen=True)
class Tolerances:
    dtype: str  # the model dtype these bounds are for
    reconstruction_abs: float  # max |Δlogit|, absolute part
    reconstruction_rel: float  # max |Δlogit|, times max |reference logit|
    identity_key_rel: float  # max |Δkey| after the RoPE round trip, times max |native key|
    identity_logit_abs: float  # max |Δlogit| of the identity round trip, absolute part
    identity_logit_rel: float  # max |Δlogit| of the identity round trip, times max |reference logit|
    identity_kl: float  # mean KL(native ‖ identity) over the new tokens, nats

    def scaled(self, factor: float) -> Tolerances:
        """Every bound times `factor` (a negative factor makes every check fail: used by the tests)."""
        return replace(self, **{k: v * factor for k, v in asdict(self).items() if k != "dtype"})


# Why these numbers:
# - reconstruction: the injected tensors are the very tensors transformers cached. FP32 allows 1e-5.
#   In BF16 a preallocated cache's attention (grouped-query, no repeated K/V) sums in another order than
#   transformers' own, which can move a logit by one BF16 step; a step is 2^-8 to 2^-7 of the value it
#   sits at, so BF16 allows 2^-7 × max|logit|, one step of the largest logit.
# - identity keys: strip and re-apply are exact inverses up to FP32 rounding of cos/sin (measured
#   ≈ 1e-7 relative, 1.9e-6 absolute on real keys); FP32 allows 1e-5 relative. In BF16 the FP32
#   result is rounded once back to BF16, which lands on the model's own key except where the FP32
#   error crosses a rounding boundary: then one BF16 step, ≤ 2^-8 × max|key|.
# - identity logits: those key errors pass through attention and the later layers. FP32: 1e-4
#   relative to max|logit| (hundreds of FP32 ulps; measured 5e-7 relative on the 2-layer tiny pair,
#   2e-6 on a 12-layer random Qwen3 with head_dim 128).
#   BF16: a one-step key change can flip roundings downstream, and BF16 logits themselves are
#   quantised in steps of 2^-8 × |logit|; 4 such steps of the largest logit are allowed.
# - identity KL: FP32 1e-5 nats (measured |KL| ≤ 1e-7 on the tiny pair: FP32 log-softmax over a
#   large vocabulary resolves a KL only to ~1e-7 × |log p|, and can even return it slightly negative);
#   BF16 1e-3 nats per token (logits moved by a few BF16 steps δ change the distribution by
#   KL ≈ ½·Var(δ) ≪ 1e-3 for δ of a few 2^-8 × |logit|).
_TOLERANCES = {
    "float32": Tolerances("float32", 1e-5, 0.0, 1e-5, 0.0, 1e-4, 1e-5),
    "bfloat16": Tolerances("bfloat16", 0.0, 2 * BF16_EPS, BF16_EPS, 0.0, 4 * BF16_EPS, 1e-3),
}


def tolerances_for(dtype: torch.dtype) -> Tolerances:
    name = dtype_name(dtype)
    if name not in _TOLERANCES:
        raise ValueError(f"no control tolerances for {name}; run the controls in float32 or bfloat16")
    return _TOLERANCES[name]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def split_execution_logits(model, context: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The independent reference: transformers' prefill, then its own cache object continued. [new, vocab]"""
    first = model(input_ids=context, use_cache=True, logits_to_keep=1)  # only its cache is used
    return model(input_ids=new, cache=first.cache, use_cache=True).logits[0]


@torch.no_grad()
def native_controls(model, prefix_ids, reply_ids, tol: Tolerances, kind: str = "preallocated") -> dict:
    """Both controls for one conversation (on caches of `kind`): measured values, bounds and pass flags."""
    device = device_of(model)
    dtype = next(model.parameters()).dtype
    context, new, _ = handoff_split(prefix_ids, reply_ids)
    ctx, new_t = as_ids(context, device), as_ids(new, device)
    ref = split_execution_logits(model, ctx, new_t)  # [new, vocab]
    ref_max = ref.float().abs().max().item()

    cap = capture_source(model, ctx, kind=kind)
    recon = continue_target(model, (cap.keys, cap.values), new_t, kind).logits[0]
    recon_diff = _max_abs(recon, ref)
    recon_bound = tol.reconstruction_abs + tol.reconstruction_rel * ref_max

    identity = Headwise.identity(Geometry.of(model, model), "cache").to(device).bind(model, model)
    keys, values = translate(model, identity, out_dtype=dtype, cap=cap)
    key_diff = _max_abs(keys, cap.keys)
    key_bound = tol.identity_key_rel * cap.keys.float().abs().max().item()
    ident = continue_target(model, (keys, values), new_t, kind).logits[0]
    ident_diff = _max_abs(ident, ref)
    ident_bound = tol.identity_logit_abs + tol.identity_logit_rel * ref_max
    kl = token_kl(ref, ident).mean().item()
    return {
        "reconstruction": {
            "max_abs_dlogit": recon_diff,
            "bound": recon_bound,
            "passed": recon_diff <= recon_bound,
        },
        "identity": {
            "max_abs_dkey": key_diff,
            "key_bound": key_bound,
            "max_abs_dlogit": ident_diff,
            "bound": ident_bound,
            "kl_mean": kl,
            "kl_bound": tol.identity_kl,
            "top1_agreement": top1_agreement(ref, ident).mean().item(),
            "values_equal": bool(torch.equal(values, cap.values)),
            "passed": key_diff <= key_bound and ident_diff <= ident_bound and kl <= tol.identity_kl,
        },
        "max_abs_logit": ref_max,
        "context_tokens": len(context),
    }


def summarize_controls(rows: list[dict]) -> dict:
    """Pass counts and worst measured values per control, over conversations."""
    out = {}
    for name in ("reconstruction", "identity"):
        items = [r[name] for r in rows]
        out[name] = {
            "passed": sum(bool(i["passed"]) for i in items),
            "n": len(items),
            "all_passed": all(i["passed"] for i in items),
            "worst_max_abs_dlogit": max(i["max_abs_dlogit"] for i in items),
            "worst_margin": min(i["bound"] - i["max_abs_dlogit"] for i in items),
        }
        if name == "identity":
            out[name]["worst_max_abs_dkey"] = max(i["max_abs_dkey"] for i in items)
            out[name]["worst_kl_mean"] = max(i["kl_mean"] for i in items)
    return out
