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


def test_the_wider_windows_and_the_cross_layer_base_fit_the_budget_in_both_directions():
    """The deep pair's levers beyond token-w3 (run with --settings) are priced as their own rows: the window adds its
    tokens to the shared down-projection only, the cross-layer base its two source layers at an eighth of the real
    width (128), and each stays within the budget at the real shapes in both directions, dearer than token-w3."""
    deep = Geometry(28, 2, 32, 28, 2, 32)
    names = ("token-w3", "token-w5", "token-w8", "token-w3-crosslayer")
    for direction in ("l2s", "s2l"):
        by = {s.name: s for s in A.settings_for(DEMO, direction, deep)}
        cost = {n: A.real_cost(by[n], direction, deep) for n in names}
        frac = [cost[n]["fraction_of_reprefill"] for n in names]
        assert frac == sorted(frac) and frac[-1] < A.MAX_COST_FRACTION, (direction, frac)
        w3, w5 = cost["token-w3"]["translate_flops_per_token"], cost["token-w5"]["translate_flops_per_token"]
        assert w5 - w3 == pytest.approx(2 * 2 * 2 * 2048 * 512 * 27 / 28, rel=1e-6)  # two more tokens' rows of P
        assert cost["token-w3-crosslayer"]["real_settings"]["base"]["settings"]["rank"] == 128
        assert not any(by[n].default_run for n in ("token-w5", "token-w8", "token-w3-crosslayer"))  # --settings only


def test_the_attention_output_value_fit_is_a_row_of_its_own_at_token_w3s_cost():
    """token-w3-outfit trains token-w3 with `--value-fit output` (a closed-form setting: the handoff's cost is
    token-w3's), run with --settings only, and the training stage's parser takes its flags."""
    from kvlingo.stages.train import Train

    for direction in ("l2s", "s2l"):
        by = {s.name: s for s in A.settings_for(DEMO, direction, TOY)}
        row, w3 = by["token-w3-outfit"], by["token-w3"]
        assert row.train_flags == ("--value-fit", "output") and row.option_flags == w3.option_flags
        assert row.refresh == w3.refresh and not row.default_run
        assert A.real_cost(row, direction, TOY) == A.real_cost(w3, direction, TOY)
    args = Train.parser().parse_args(["--family", row.family, *row.flags])
    assert args.value_fit == "output"


def test_each_direction_runs_its_own_default_before_beside_the_levers():
    l2s, s2l = A.default_settings(DEMO, "l2s", TOY), A.default_settings(DEMO, "s2l", TOY)
    assert "crosshead" in l2s and "crosslayer-k4-rhalf" not in l2s
    assert "crosslayer-k4-rhalf" in s2l and "crosshead" not in s2l
    objectives = {f"{DEMO.family_for(d)}-{suffix}" for d in ("l2s", "s2l") for suffix, _, _ in A.OBJECTIVES}
    assert set(l2s) - {"crosshead"} - objectives == set(s2l) - {"crosslayer-k4-rhalf"} - objectives
    assert "token-w3" in l2s and "token-w3" in s2l
    rows = A.settings_for(DEMO, "l2s", TOY)
    assert not {s.name for s in rows if not s.default_run} & set(l2s + s2l)
    # the objective rows train the profile's default translator under each objective
    default = DEMO.family_for("l2s")
    assert {f"{default}-{suffix}" for suffix, _, _ in A.OBJECTIVES} <= set(l2s)


def test_the_scale_profiles_rows_are_rows_of_both_directions_train_longer_and_set_its_objective():
    scale = get_profile("scale")
    for d in ("l2s", "s2l"):
        assert set(scale.ablate_settings) <= {s.name for s in A.settings_for(scale, d, TOY)}
    assert scale.ablate_long_factor > 1 and not DEMO.ablate_settings and DEMO.ablate_long_factor == 0
    # the objective its ablation chose for l2s is what `train.py --profile scale` trains by default
    assert f"{scale.family_for('l2s')}-onpolicy" in scale.ablate_settings
    assert scale.objective_for("l2s") == {"onpolicy": 0.5} and scale.objective_for("s2l") == {}


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
        for i, (kl, ctx, keep) in enumerate(
            [(0.1, 0.9, 0.3), (0.2, 0.5, 0.6), (0.3, 0.2, 0.8), (0.4, 0.1, 0.95), (0.05, 0.95, 0.2), (0.02, 0.99, 0.1)]
        )
    ]
    corr = A.metric_correlations(rows)
    assert corr["val_context_kl"]["rho"] == pytest.approx(-1) and corr["val_context_kl"]["tracking"] == pytest.approx(1)
    assert corr["val_kl"]["tracking"] == pytest.approx(-1) and math.isnan(corr["val_top1"]["rho"])  # constant
    metric = A.choose_metric(corr)
    assert metric in ("val_context_kl", "val_context_weighted_kl") and corr[metric]["p"] <= A.METRIC_P
    # four settings cannot show a metric tracks retention (exact p of a perfect ρ: 1/12): validation KL chooses
    few = A.metric_correlations(rows[:4])
    assert few["val_context_kl"]["tracking"] == pytest.approx(1) and few["val_context_kl"]["p"] > A.METRIC_P
    assert A.choose_metric(few) == "val_kl"
    rows.append(_row("costly", 0.4, val_context_kl=0.01, val_context_weighted_kl=0.01, val_kl=0.01))
    choice = A.choose_default(rows, "val_context_kl")
    assert choice["setting"] == "s3" and choice["runner_up"] == "s2" and choice["metric"] == "val_context_kl"
    assert A.choose_default(rows[-1:], "val_context_kl")["setting"] is None
    assert A.choose_default(rows, "val_kl")["setting"] == "s5"  # lower is better for KL metrics


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


def _jackknife_se(stat, n: int) -> float:
    """The jackknife SE of stat(kept indices) over n units: an estimator independent of the delta method."""
    loo = [stat([j for j in range(n) if j != i]) for i in range(n)]
    m = sum(loo) / n
    return math.sqrt((n - 1) / n * sum((x - m) ** 2 for x in loo))


def test_a_paired_ratio_difference_has_the_jackknife_se():
    import random

    rng = random.Random(0)
    n = 300
    den = [rng.randint(5, 60) for _ in range(n)]  # reply tokens per conversation
    a = [d * rng.uniform(0.0, 0.1) for d in den]  # KL sums of two settings on the same conversations
    b = [x + d * rng.uniform(-0.02, 0.05) for x, d in zip(a, den)]
    ra, ia = A.ratio_influence(a, den)
    rb, ib = A.ratio_influence(b, den)
    assert ra == pytest.approx(sum(a) / sum(den)) and abs(sum(ia)) < 1e-9
    from kvlingo.eval.stats import paired_t

    se = paired_t(ia, ib)["se"]  # the SE of the influences' paired difference, as `within_noise` takes it

    def diff(idx):
        return sum(a[i] for i in idx) / sum(den[i] for i in idx) - sum(b[i] for i in idx) / sum(den[i] for i in idx)

    assert se == pytest.approx(_jackknife_se(diff, n), rel=0.02)


def _evidenced(name, cost, kl_sums, correct):
    arms = [{"kl_sum": k, "n_tokens": 10} for k in kl_sums]
    value, parts = A.metric_per_conversation(arms, "val_kl")
    return {
        **_row(name, cost, val_kl=value),
        "val_conversations": {"ids": list(range(len(kl_sums))), "val_kl": parts},
        "val_items": {"gsm8k": {str(i): c for i, c in enumerate(correct)}},
    }


def test_the_default_is_the_cheapest_setting_within_noise_of_the_best():
    import random

    rng = random.Random(1)
    base = [rng.uniform(0.5, 1.5) for _ in range(64)]
    right = [i % 4 != 0 for i in range(64)]  # 75% right
    best = _evidenced("best", 0.08, base, right)

    def noisy(shift):  # zero-mean noise of SD ~0.03 per conversation (SE ~0.0004 per token), shifted
        e = [rng.uniform(-0.05, 0.05) for _ in base]
        return [x + v - sum(e) / len(e) + shift for x, v in zip(base, e)]

    near = _evidenced("near", 0.02, noisy(0.002), right)  # worse by a fraction of an SE
    far = _evidenced("far", 0.01, [x + 0.5 for x in base], right)  # clearly worse KL
    down = [r and i % 3 != 0 for i, r in enumerate(right)]  # GSM8K 25 points down
    wrong = _evidenced("wrong", 0.015, noisy(0.002), down)
    costly = _evidenced("costly", 0.5, [x - 0.5 for x in base], right)  # best of all, over the cost cap
    rows = [best, near, far, wrong, costly]
    choice = A.choose_default(rows, "val_kl", ["gsm8k"])
    assert best["val_kl"] < min(near["val_kl"], wrong["val_kl"])  # (the draws keep the best the best)
    assert choice["best"] == "best" and choice["setting"] == "near"
    ties = choice["ties"]
    assert ties["best"]["tied"] and ties["near"]["tied"] and "costly" not in ties
    assert not ties["far"]["tied"] and ties["far"]["metric"]["worse_by"] > 2 * ties["far"]["metric"]["se"]
    assert ties["wrong"]["metric"]["tied"] and not ties["wrong"]["gsm8k"]["tied"] and not ties["wrong"]["tied"]
    assert ties["wrong"]["gsm8k"]["worse_by_points"] == pytest.approx(100 * 16 / 64)  # items right on best only
    assert A.choose_default(rows, "val_kl")["setting"] == "best"  # without the evidence: the best alone
    mixed = [best, {**near, "val_conversations": {**near["val_conversations"], "ids": list(range(1, 65))}}]
    with pytest.raises(ValueError, match="different validation conversations"):
        A.choose_default(mixed, "val_kl", ["gsm8k"])
