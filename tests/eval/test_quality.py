"""The quality arms (kvlingo/eval/quality.py) against plain forwards: contexts of other conversations as the
control, and a planted perfect translator scoring zero."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.eval import quality


def test_control_contexts_come_from_other_conversations():
    convs = [{"id": f"c{i}", "prefix_ids": list(range(100 * i, 100 * i + n))} for i, n in enumerate([5, 12, 8, 30, 9])]
    pairs = quality.control_contexts(convs)
    for conv, p in zip(convs, pairs):
        n = len(conv["prefix_ids"]) - 1
        assert conv["id"] not in p["ids"] and len(p["context_ids"]) == n
        own_tokens = set(conv["prefix_ids"])
        assert not own_tokens & set(p["context_ids"])  # ids are disjoint ranges per conversation here
    assert pairs[0] == {"ids": ["c1"], "kind": "cropped", "context_ids": list(range(100, 104))}
    assert pairs[1]["ids"] == ["c3"]  # c2 (7 tokens of context) is too short for 11; c3 is next long enough
    longest = pairs[3]  # nobody else is as long: the others are joined, in order from the next one
    assert longest["kind"] == "joined" and longest["ids"] == ["c4", "c0", "c1", "c2"]
    assert (
        longest["context_ids"]
        == (list(range(400, 408)) + list(range(0, 4)) + list(range(100, 111)) + list(range(200, 207)))[:29]
    )
    two = quality.control_contexts(convs[:2])  # one short other: it is joined with itself until long enough
    assert two[1] == {"ids": ["c0", "c0", "c0"], "kind": "joined", "context_ids": [0, 1, 2, 3] * 2 + [0, 1, 2]}


def test_arms_follow_handoff_split_against_plain_forwards(bench_setup):
    """native_source and no_context NLL vs transformers' plain (cache-free) forward and F.cross_entropy."""
    large, small, conv = bench_setup["large"], bench_setup["small"], bench_setup["test"][0]
    tr = {"closed_form": bench_setup["cf"]}
    other = quality.control_contexts(bench_setup["test"])[0]["context_ids"]
    got = quality.score_conversation(large, small, tr, "closed_form", conv, other, torch.float32)
    assert list(got) == ["native_source", "native_target", "closed_form", "control", "no_context"]
    P, R = conv["prefix_ids"], conv["reply_ids"]
    with torch.no_grad():
        full = large(input_ids=torch.tensor([P + R[:-1]])).logits[0, len(P) - 1 :]  # predicts every reply token
        alone = small(input_ids=torch.tensor([[P[-1]] + R[:-1]])).logits[0]
    ref_src = F.cross_entropy(full, torch.tensor(R), reduction="sum").item()
    ref_none = F.cross_entropy(alone, torch.tensor(R), reduction="sum").item()
    assert got["native_source"]["nll_sum"] == pytest.approx(ref_src, rel=1e-5)
    assert got["no_context"]["nll_sum"] == pytest.approx(ref_none, rel=1e-5)
    assert got["native_target"]["kl_sum"] == 0.0 and got["native_target"]["top1"] == 1.0
    assert all(a["n_tokens"] == len(R) for a in got.values())
    assert got["no_context"]["kl_mean"] > 1e-3  # the prefix matters to the target


def test_planted_perfect_translator_scores_zero_and_control_does_not(bench_setup):
    """Self-translation (target → target, identity maps): its own arm equals native exactly; the control does not."""
    small = bench_setup["small"]
    tr = Headwise.identity(Geometry.of(small, small), "prenorm").bind(small, small)
    convs = bench_setup["test"]
    pairing = quality.control_contexts(convs)
    rows = [
        {
            "arms": quality.score_conversation(
                small, small, {"distilled": tr}, "distilled", c, p["context_ids"], torch.float32
            )
        }
        for c, p in zip(convs, pairing)
    ]
    summary = quality.summarize(rows)["arms"]
    assert summary["distilled"]["kl_token_mean"] == 0.0 and summary["native_source"]["kl_token_mean"] == 0.0
    assert summary["control"]["kl_token_mean"] > 1e-2
    assert summary["control"]["kl_conversation"]["se"] > 0 and summary["control"]["n_conversations"] == len(convs)
    paired = quality.summarize(rows)["paired"]["distilled_vs_control"]  # on NLL, which random models do not order
    assert paired["n"] == len(convs) and math.isfinite(paired["p"])
