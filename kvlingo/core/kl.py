"""Distribution distances and likelihoods over reply tokens, always in FP32 with autocast off."""

from __future__ import annotations

import torch


def token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per position. p_logits/q_logits [tokens, vocab] → [tokens].

    P is the reference (the native target), Q the arm being judged.
    """
    with torch.autocast(device_type=p_logits.device.type, enabled=False):
        logp = torch.log_softmax(p_logits.float(), dim=-1)
        logq = torch.log_softmax(q_logits.float(), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position. logits [tokens, vocab], targets [tokens] → [tokens]."""
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -logp.gather(-1, targets[:, None]).squeeze(-1)


def top1_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both put their argmax on the same token. [tokens]"""
    return (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
