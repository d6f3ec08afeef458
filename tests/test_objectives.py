"""Objectives aimed at the context tokens, and the context-token metrics, against independent references
(F.kl_div, a per-position loop, cosine by hand); training flags end to end on the tiny pair."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tinypair import chat_rows, load_tiny_pair, write_prepared

from kvlingo.core.cache import handoff_split
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.handoff import as_ids, translate
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import Geometry
from kvlingo.eval import context as C
from kvlingo.train import distill as D
from kvlingo.train import objectives as O

pytestmark = pytest.mark.usefixtures("one_thread")


def kl_ref(p_logits, q_logits):
    """KL(P ‖ Q) per row by F.kl_div (input log Q, target log P)."""
    return F.kl_div(
        torch.log_softmax(q_logits.double(), -1),
        torch.log_softmax(p_logits.double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)


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


def test_training_under_the_new_objectives_and_early_stopping(tiny_pair_paths, tmp_path):
    from transformers import AutoTokenizer

    import train_translator

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    data = write_prepared(
        tmp_path / "data", tok, {"train": chat_rows(tok, 16, 0, "t"), "validation": chat_rows(tok, 4, 1, "v")}
    )
    args = [
        "--profile",
        "tiny",
        "--data",
        str(data),
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--family",
        "crosshead",
        "--batch",
        "2",
        "--n-fit",
        "8",
        "--ridge",
        "0",
        "--updates",
        "4",
        "--val-every",
        "1",
        "--lr",
        "3e-2",
        "--artifacts",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "r"),
    ]
    rep = train_translator.main(
        [
            *args,
            "--run",
            "x",
            "--refresh",
            "exact:0",
            "--context-weight",
            "0.5",
            "--onpolicy",
            "0.5",
            "--keep-best",
            "--n-train",
            "8",
        ]
    )
    res, cfg = rep["results"], rep["config"]
    assert cfg["refresh"] == "exact:0" and cfg["onpolicy"] == 0.5 and rep["n_samples"]["train_conversations"] == 8
    best = min(res["val_kl_curve"], key=lambda p: p["val_kl"])
    assert (
        res["best"] == {"update": best["update"], "val_kl": best["val_kl"]}
        and res["distilled_val_kl"] == best["val_kl"]
    )
    manifest = json.loads((tmp_path / "a" / "x" / "distilled" / "manifest.json").read_text())
    assert manifest["val_kl"] == best["val_kl"]
    with pytest.raises(SystemExit) as e:
        train_translator.main([*args, "--run", "y", "--n-train", "99"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        train_translator.main([*args, "--run", "y", "--onpolicy", "1.5"])
    assert e.value.code == 2
