"""Objectives aimed at the context tokens (kvlingo/train/objectives.py) against independent references: the
context-weighted loss, the on-policy rows and their schedule."""

from __future__ import annotations

import pytest
import torch
from refs import kl_ref
from tinypair import chat_rows, load_tiny_pair

from kvlingo.core.cache import handoff_split
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.handoff import as_ids, translate
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import Geometry
from kvlingo.train import distill as D
from kvlingo.train import objectives as O

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_context_weights_and_the_onpolicy_schedule():
    c = torch.tensor([0.0, 1.0, 3.0, 0.0])
    for alpha in (0.0, 0.3, 1.0):
        w = O.context_weights(c, alpha)
        assert w.mean() == pytest.approx(1.0) and (alpha == 0 or w[2] > w[1] > w[0])
    assert torch.equal(O.context_weights(torch.zeros(3), 1.0), torch.ones(3))  # nothing to weight: plain mean
    assert [O.onpolicy_at(i, 0.5) for i in range(6)] == [False, True] * 3
    assert sum(O.onpolicy_at(i, 0.25) for i in range(100)) == 25 and not any(O.onpolicy_at(i, 0) for i in range(9))
    assert all(O.onpolicy_at(i, 1.0) for i in range(9))


@pytest.fixture(scope="module")
def setup(tiny_pair_paths):
    from transformers import AutoTokenizer

    pair = load_tiny_pair(tiny_pair_paths)
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    tr = CrossHead(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    with torch.no_grad():
        tr.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    return pair, tok, tr, chat_rows(tok, 4, 3, "r")


def test_context_weighted_loss_is_the_weighted_mean_of_the_token_kls(setup):
    pair, _, tr, rows = setup
    row = rows[0]
    context, new, _ = handoff_split(row["prefix_ids"], row["reply_ids"])
    with torch.no_grad():
        native = pair.target(input_ids=as_ids(context + new, "cpu"), logits_to_keep=len(new)).logits[0]
        bare = pair.target(input_ids=as_ids(new, "cpu")).logits[0]
        kv = translate(pair.source, tr, context, torch.float32, refresh=Refresh.parse("exact:0"), target=pair.target)
        from kvlingo.core.handoff import continue_target

        ours = continue_target(pair.target, kv, new).logits[0]
        change, kl = kl_ref(native, bare), kl_ref(native, ours)
        for alpha in (0.0, 0.5, 1.0):
            w = (1 - alpha) + alpha * change / change.mean()
            got = D.distill_loss(
                pair.source, pair.target, tr, row, torch.float32, refresh=Refresh.parse("exact:0"), context_weight=alpha
            )
            assert float(got) == pytest.approx(float((w * kl).mean()), rel=1e-4), alpha


def test_onpolicy_rows_are_sampled_from_the_translated_cache_and_repeat_under_a_seed(setup):
    pair, tok, tr, rows = setup
    from kvlingo.core.handoff import stop_ids

    eos = stop_ids(tok)
    torch.manual_seed(7)
    a = [O.onpolicy_row(pair.source, pair.target, tr, r, torch.float32, eos_ids=eos) for r in rows]
    torch.manual_seed(7)
    b = [O.onpolicy_row(pair.source, pair.target, tr, r, torch.float32, eos_ids=eos) for r in rows]
    assert [x["reply_ids"] for x in a] == [x["reply_ids"] for x in b]
    assert any(x["reply_ids"] != r["reply_ids"] for x, r in zip(a, rows))  # not the data set's replies
    for x, r in zip(a, rows):
        assert x["prefix_ids"] == r["prefix_ids"] and 1 <= len(x["reply_ids"]) <= len(r["reply_ids"])
        assert all(t not in eos for t in x["reply_ids"][:-1])  # generation stops at the first stop token
