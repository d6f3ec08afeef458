"""The ablation's rows, costs and choice (kvlingo/stages/ablation.py): costs at the real shapes, the choice of
metric and default on validation only, and the paired share kept against a hand count."""

from __future__ import annotations

import math

import pytest

from kvlingo.core.translator import Geometry
from kvlingo.inputs.profiles import get_profile
from kvlingo.stages import ablation as A

TOY = Geometry(4, 2, 32, 4, 2, 32)  # the packaged toy pair's caches: 4 layers × 2 KV heads × head_dim 32
DEMO = get_profile("demo")


def test_real_cost_counts_flops_at_the_real_shapes():
    by = {s.name: s for s in A.settings_for(DEMO, "l2s", TOY)}
    head = A.real_cost(by["headwise-ridge0"], "l2s", TOY)
    assert abs(head["translate_flops_per_token"] - 14.68e6) < 0.01e6  # 2·2·28·8·128²
    cross = A.real_cost(by["crosshead"], "l2s", TOY)
    assert cross["translate_flops_per_token"] == pytest.approx(2 * 2 * 28 * 1024 * 1024)
    keys = A.real_cost(by["crosshead-key-rquarter"], "l2s", TOY)
    assert keys["real_settings"] == {"rank": 0, "key_rank": 256}  # a quarter of the toy width → of the real one
    assert keys["translate_flops_per_token"] == pytest.approx(2 * 28 * 256 * 2048 + 2 * 28 * 1024 * 1024)
    low = A.real_cost(by["crosslayer-k4-rhalf"], "l2s", TOY)
    assert low["real_settings"]["rank"] == 512  # half the toy width (32 of 64) → half the real width (512 of 1024)
    # exact:0: the translator skips layer 0, which costs one k/v projection of the 0.6B's hidden state per token
    exact = A.real_cost(by["crosshead-exact0"], "l2s", TOY)
    assert exact["translate_flops_per_token"] == pytest.approx(cross["translate_flops_per_token"] * 27 / 28)
    assert exact["layer0_flops_per_token"] == 2 * 1024 * 2 * 1024
    # token identity at rank 32 of the toy's 64 → 512: head-wise maps + shared down-projection + per-layer up
    tok = A.real_cost(by["token-w3"], "l2s", TOY)
    assert tok["real_settings"]["rank"] == 512
    per = 14.68e6 + 2 * 2 * (3 * 2048 * 512 + 28 * 512 * 1024)
    assert tok["translate_flops_per_token"] == pytest.approx(per * 27 / 28, rel=1e-3)
    assert (
        tok["fraction_of_reprefill"]
        < A.MAX_COST_FRACTION
        < A.real_cost(by["token-w3-full"], "l2s", TOY)["fraction_of_reprefill"]
    )
    s2l = A.real_cost(by["crosshead"], "s2l", TOY)
    assert s2l["fraction_of_reprefill"] < cross["fraction_of_reprefill"]  # the 1.7B's re-prefill costs more


def test_each_direction_runs_its_own_default_before_beside_the_levers():
    l2s, s2l = A.default_settings(DEMO, "l2s", TOY), A.default_settings(DEMO, "s2l", TOY)
    assert "crosshead" in l2s and "crosslayer-k4-rhalf" not in l2s
    assert "crosslayer-k4-rhalf" in s2l and "crosshead" not in s2l
    objectives = {f"{DEMO.family_for(d)}-{suffix}" for d in ("l2s", "s2l") for suffix, _, _ in A.OBJECTIVES}
    assert set(l2s) - {"crosshead"} - objectives == set(s2l) - {"crosslayer-k4-rhalf"} - objectives
    assert "token-w3" in l2s
    rows = A.settings_for(DEMO, "l2s", TOY)
    assert not {s.name for s in rows if not s.default_run} & set(l2s + s2l)
    # the objective rows train the profile's default translator under each objective
    default = DEMO.family_for("l2s")
    assert {f"{default}-{suffix}" for suffix, _, _ in A.OBJECTIVES} <= set(l2s)


def _row(name, cost, **metrics):
    return {"name": name, "real": {"fraction_of_reprefill": cost}, **metrics}


def test_the_metric_that_tracks_retention_chooses_the_default_within_the_cap():
    # val KL orders these settings against retention; the context KL orders them as retention does
    rows = [
        _row(
            f"s{i}",
            0.05,
            val_kl=kl,
            val_context_kl=ctx,
            val_top1=0.9,
            val_context_top1=0.5,
            val_context_weighted_kl=ctx,
            val_attention_cosine=0.8,
            val_ifeval={"kept": keep},
            val_gsm8k={"kept": keep},
        )
        for i, (kl, ctx, keep) in enumerate([(0.1, 0.9, 0.3), (0.2, 0.5, 0.6), (0.3, 0.2, 0.8), (0.4, 0.1, 0.95)])
    ]
    corr = A.metric_correlations(rows)
    assert corr["val_context_kl"]["rho"] == pytest.approx(-1) and corr["val_context_kl"]["tracking"] == pytest.approx(1)
    assert corr["val_kl"]["tracking"] == pytest.approx(-1) and math.isnan(corr["val_top1"]["rho"])  # constant
    metric = A.choose_metric(corr)
    assert metric in ("val_context_kl", "val_context_weighted_kl")
    rows.append(_row("costly", 0.4, val_context_kl=0.01, val_context_weighted_kl=0.01, val_kl=0.01))
    choice = A.choose_default(rows, "val_context_kl")
    assert choice["setting"] == "s3" and choice["runner_up"] == "s2" and choice["metric"] == "val_context_kl"
    assert A.choose_default(rows[-1:], "val_context_kl")["setting"] is None
    assert A.choose_default(rows, "val_kl")["setting"] == "s0"  # lower is better for KL metrics


def test_the_share_kept_and_its_paired_se_against_a_hand_count():
    a = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1]  # translated
    b = [1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1]  # native target, the same items
    n = len(a)
    from kvlingo.eval.stats import mean_se, paired_accuracy

    fig = A.kept(mean_se(a), mean_se(b), paired_accuracy(a, b))
    assert fig["kept"] == pytest.approx(sum(a) / sum(b))
    d = [x - y for x, y in zip(a, b)]
    assert fig["delta_points"] == pytest.approx(100 * sum(d) / n)
    assert fig["delta_se_points"] == pytest.approx(100 * mean_se(d)["se"])
    # the delta method's SE of the ratio, against the influence-function form computed item by item
    ma, mb = sum(a) / n, sum(b) / n
    infl = [(x - ma) / mb - ma * (y - mb) / mb**2 for x, y in zip(a, b)]
    assert fig["kept_se"] == pytest.approx(math.sqrt(sum(v * v for v in infl) / (n - 1) / n), rel=1e-9)
