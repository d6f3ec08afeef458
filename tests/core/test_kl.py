"""The token KL and NLL (kvlingo/core/kl.py) against F.kl_div and F.cross_entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def test_token_kl_matches_f_kl_div():
    from kvlingo.core.kl import token_kl, token_nll

    p, q = torch.randn(7, 50) * 3, torch.randn(7, 50) * 3
    ref = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="none").sum(-1)
    assert torch.allclose(token_kl(p, q), ref, atol=1e-6)
    assert token_kl(p, p).abs().max().item() <= 1e-6
    # bf16 inputs are upcast: same answer as the fp32 computation on the rounded logits
    assert torch.allclose(token_kl(p.bfloat16(), q.bfloat16()), token_kl(p.bfloat16().float(), q.bfloat16().float()))
    t = torch.randint(0, 50, (7,))
    assert torch.allclose(token_nll(p, t), F.cross_entropy(p, t, reduction="none"), atol=1e-6)
