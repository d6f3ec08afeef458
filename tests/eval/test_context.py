"""The context-token metrics (kvlingo/eval/context.py) against a per-position reference."""

from __future__ import annotations

import pytest
import torch
from refs import kl_ref

from kvlingo.eval import context as C

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_context_scores_against_a_per_position_reference():
    g = torch.Generator().manual_seed(0)
    ref, arm, bare = (torch.randn(9, 50, generator=g) * 3 for _ in range(3))
    bare[:4] = ref[:4]  # four positions the context does not change
    change = C.context_change(ref, bare)
    assert torch.allclose(change.double(), kl_ref(ref, bare), atol=1e-5) and (change[:4].abs() < 1e-6).all()
    s = C.score(ref, arm, change)
    kl = kl_ref(ref, arm)
    mask = kl_ref(ref, bare) > C.THRESHOLD
    assert s["ctx_n_tokens"] == int(mask.sum()) and 0 < s["ctx_n_tokens"] <= 5
    assert s["ctx_kl_sum"] == pytest.approx(float(kl[mask].sum()), rel=1e-5)
    assert s["ctx_top1_sum"] == sum(int(ref[i].argmax() == arm[i].argmax()) for i in range(9) if mask[i])
    assert s["wkl_sum"] / s["w_sum"] == pytest.approx(
        float((kl_ref(ref, bare) * kl).sum() / kl_ref(ref, bare).sum()), rel=1e-5
    )
    # the arm that is the reference scores 0 KL and top-1 of 1 on its context tokens
    same = C.score(ref, ref, change)
    assert same["ctx_kl_sum"] == pytest.approx(0, abs=1e-5) and same["ctx_top1_sum"] == same["ctx_n_tokens"]
    # attention agreement: cosine by hand over layers and positions
    a = [torch.randn(5, 8, generator=g) for _ in range(3)]
    b = [x + 0.5 * torch.randn(5, 8, generator=g) for x in a]
    agree = C.attention_agreement(a, b)
    hand = sum(float(x[i] @ y[i] / (x[i].norm() * y[i].norm())) for x, y in zip(a, b) for i in range(5))
    assert agree["attn_n"] == 15 and agree["attn_cos_sum"] == pytest.approx(hand, rel=1e-5)
    assert C.attention_agreement(a, a)["attn_cos_sum"] == pytest.approx(15, rel=1e-6)
    summary = C.summarize([{**s, **agree}, {**same, **C.attention_agreement(a, a)}])
    assert summary["context_tokens"] == 2 * s["ctx_n_tokens"] and summary["attention_cosine"]["n"] == 2
