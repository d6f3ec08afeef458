"""The ablation's rows, costs and choice (kvlingo/stages/ablation.py): costs at the real shapes, the choice of
metric and default on validation only, and the paired share kept against a hand count."""

from __future__ import annotations

import math

import pytest

from kvlingo.core.translator import Geometry
from kvlingo.inputs.profiles import PROFILES, get_profile
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
    # exact:0 leaves layer 0's head-wise and token up-projection maps out, never the shared down-projection
    per = 14.68e6 * 27 / 28 + 2 * 2 * (3 * 2048 * 512 + 27 * 512 * 1024)
    assert tok["translate_flops_per_token"] == pytest.approx(per, rel=1e-3)
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
        assert w5 - w3 == pytest.approx(2 * 2 * 2 * 2048 * 512, rel=1e-6)  # two more tokens' rows of P
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


def test_the_chosen_layers_row_costs_its_layers_token_maps_and_its_flags_reach_training():
    """token-w3-chosen reads the token features at half the target's layers, chosen by the closed form, and
    token-w3-upper at the second half: at the real shapes each costs 14 layers' token maps (the choice never takes
    layer 0, which exact:0 computes from the ids), token-w3-lower 13 (its first layer is layer 0), less than
    token-w3; they run with --settings only, and the training stage's parser takes their flags."""
    from kvlingo.stages.train import Train

    deep = Geometry(28, 2, 32, 28, 2, 32)
    for geometry in (TOY, deep):
        for direction in ("l2s", "s2l"):
            by = {s.name: s for s in A.settings_for(DEMO, direction, geometry)}
            row = by["token-w3-chosen"]
            cost = A.real_cost(row, direction, geometry)
            lower = A.real_cost(by["token-w3-lower"], direction, geometry)
            up_projection = 2 * 2 * 512 * 1024  # keys and values, one layer's token up-projection at rank 512
            assert cost["translate_flops_per_token"] - lower["translate_flops_per_token"] == pytest.approx(
                up_projection
            )
            assert cost["real_settings"]["token_layers"] == 14 and cost["real_settings"]["token_choice"] == "fit"
            upper = A.real_cost(by["token-w3-upper"], direction, geometry)
            assert upper == cost | {"real_settings": upper["real_settings"]} and not by["token-w3-upper"].default_run
            assert upper["real_settings"]["token_choice"] == "last"
            assert (
                cost["fraction_of_reprefill"]
                < A.real_cost(by["token-w3"], direction, geometry)["fraction_of_reprefill"]
            )
            assert not row.default_run and row.refresh == "exact:0"
    args = Train.parser().parse_args(["--family", row.family, *row.flags])
    assert args.token_choice == "fit" and args.token_layers == geometry.target_layers // 2


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


def test_the_scale_profiles_rows_are_rows_of_both_directions_train_longer_and_weigh_the_on_policy_objective():
    scale = get_profile("scale")
    for d in ("l2s", "s2l"):
        assert set(scale.ablate_settings) <= {s.name for s in A.settings_for(scale, d, TOY)}
    assert scale.ablate_long_factor > 1 and not DEMO.ablate_settings and DEMO.ablate_long_factor == 0
    # its ablation sets the on-policy objective beside the default; the default trains the plain one, as every
    # profile's does (what a run trains of it: test_train.py)
    assert f"{scale.family_for('l2s')}-onpolicy" in scale.ablate_settings
    assert all(p.objective_for(d) == {} for p in PROFILES.values() for d in ("l2s", "s2l"))


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


def _seeded(name, cost, per_seed):
    """A row trained with several seeds: per seed (KL sums per conversation, GSM8K answers), its evidence."""
    ev = []
    for kl_sums, correct in per_seed:
        one = _evidenced(name, cost, kl_sums, correct)
        ev.append(
            {"val_kl": one["val_kl"], "val_conversations": one["val_conversations"], "val_items": one["val_items"]}
        )
    return {**_row(name, cost, val_kl=sum(e["val_kl"] for e in ev) / len(ev)), "val_evidence": ev}


def test_with_one_seed_the_seed_evidence_gives_the_single_runs_verdict():
    import random

    rng = random.Random(3)
    base = [rng.uniform(0.5, 1.5) for _ in range(40)]
    other = [x + rng.uniform(-0.02, 0.06) for x in base]
    right = [i % 3 != 0 for i in range(40)]
    a, b = _evidenced("a", 0.01, base, right), _evidenced("b", 0.01, other, right[::-1])
    single = A.within_noise(a, b, "val_kl", ["gsm8k"])
    listed = A.within_noise(
        _seeded("a", 0.01, [(base, right)]), _seeded("b", 0.01, [(other, right[::-1])]), "val_kl", ["gsm8k"]
    )
    assert listed == single and "seeds" not in single["metric"]


def test_a_gap_one_training_seed_opens_is_a_tie_over_seeds_and_a_steady_gap_is_not():
    """Seed 2 alone puts `lucky` behind `best` by more than ten conversation SEs; seed 1 puts it ahead. Over the
    three seeds the spread of the per-seed differences joins the SE and the verdict is a tie (the SE of a hand
    count: √(se_conv² + var(d_s) / 3)); a gap every seed shows (`steady`) stays a loss."""
    import random

    from kvlingo.eval.stats import paired_t

    rng = random.Random(5)
    base = [rng.uniform(0.5, 1.5) for _ in range(64)]
    right = [True] * 64

    def shifted(d):  # the same conversations, each moved by d per token (10 tokens each) and a little noise
        return [x + 10 * d + rng.uniform(-0.01, 0.01) for x in base]

    best = _seeded("best", 0.01, [(shifted(0.0), right)] * 3)
    lucky = _seeded("lucky", 0.01, [(shifted(-0.03), right), (shifted(0.02), right), (shifted(0.025), right)])
    steady = _seeded("steady", 0.01, [(shifted(0.02), right), (shifted(0.021), right), (shifted(0.019), right)])
    one_seed = {**lucky, "val_evidence": lucky["val_evidence"][1:2]}
    first = A.within_noise({**best, "val_evidence": best["val_evidence"][:1]}, one_seed, "val_kl", ["gsm8k"])
    assert not first["metric"]["tied"] and first["metric"]["worse_by"] > 10 * first["metric"]["se"]
    over = A.within_noise(best, lucky, "val_kl", ["gsm8k"])
    assert over["metric"]["tied"] and over["metric"]["seeds"] == 3
    d = [e["val_kl"] - b["val_kl"] for e, b in zip(lucky["val_evidence"], best["val_evidence"])]
    mean_parts = [
        [sum(p) / 3 for p in zip(*(e["val_conversations"]["val_kl"] for e in r["val_evidence"]))] for r in (best, lucky)
    ]
    se_conv = paired_t(*mean_parts)["se"]
    m = sum(d) / 3
    hand = math.sqrt(se_conv**2 + sum((x - m) ** 2 for x in d) / 2 / 3)
    assert over["metric"]["worse_by"] == pytest.approx(m) and over["metric"]["se"] == pytest.approx(hand)
    assert over["metric"]["se_conversations"] == pytest.approx(se_conv)
    loss = A.within_noise(best, steady, "val_kl", ["gsm8k"])
    assert not loss["metric"]["tied"] and not loss["tied"]
    choice = A.choose_default([best, lucky, steady], "val_kl", ["gsm8k"])
    assert choice["ties"]["lucky"]["tied"] and not choice["ties"]["steady"]["tied"]
    with pytest.raises(ValueError, match="different numbers of seeds"):
        A.within_noise(best, one_seed, "val_kl", ["gsm8k"])


def test_a_tasks_gap_over_seeds_counts_items_and_the_seeds_spread():
    """GSM8K over two seeds: per item, the share of seeds that got it right; the SE adds the per-seed gaps' spread."""
    from kvlingo.eval.stats import paired_t

    kl = [1.0] * 20
    best = _seeded("best", 0.01, [(kl, [True] * 20), (kl, [True] * 20)])
    a = [i >= 4 for i in range(20)]  # 4 items down on seed 1
    b = [i >= 12 for i in range(20)]  # 12 down on seed 2
    other = _seeded("other", 0.01, [(kl, a), (kl, b)])
    out = A.within_noise(best, other, "val_kl", ["gsm8k"])["gsm8k"]
    shares = [(float(x) + float(y)) / 2 for x, y in zip(a, b)]
    d = paired_t([1.0] * 20, shares)
    gaps = [4 / 20, 12 / 20]
    se = math.sqrt(d["se"] ** 2 + (gaps[0] - gaps[1]) ** 2 / 2 / 2)
    assert out["worse_by_points"] == pytest.approx(100 * 8 / 20) and out["se_points"] == pytest.approx(100 * se)
    assert out["n"] == 20 and out["tied"] == (d["mean_diff"] <= A.TIE_SE * se)


def test_a_settings_seeds_make_one_row_of_their_means_with_the_seeds_spread_in_each_se():
    fig = [
        {
            "kept": 0.8,
            "kept_se": 0.03,
            "accuracy": 0.6,
            "accuracy_se": 0.04,
            "native": 0.75,
            "native_se": 0.02,
            "mcnemar_p": 0.01,
            "n": 256,
        },
        {
            "kept": 0.9,
            "kept_se": 0.04,
            "accuracy": 0.7,
            "accuracy_se": 0.03,
            "native": 0.75,
            "native_se": 0.02,
            "mcnemar_p": 0.2,
            "n": 256,
        },
    ]
    rows = [
        {
            "name": "w3",
            "run": "w3",
            "seed": 42,
            "setting": "w3",
            "params": 10,
            "val_kl": 0.1,
            "val_gsm8k": fig[0],
            "best_update": 300,
            "real": {"fraction_of_reprefill": 0.05},
        },
        {
            "name": "w3-s43",
            "run": "w3-s43",
            "seed": 43,
            "setting": "w3",
            "params": 10,
            "val_kl": 0.2,
            "val_gsm8k": fig[1],
            "best_update": None,
            "real": {"fraction_of_reprefill": 0.05},
        },
    ]
    row = A.over_seeds(rows, "w3")
    assert row["name"] == "w3" and row["params"] == 10 and row["seeds"] == rows and "run" not in row
    assert row["val_kl"] == pytest.approx(0.15) and row["best_update"] == [300, None]
    g = row["val_gsm8k"]
    assert g["kept"] == pytest.approx(0.85) and g["n"] == 256 and g["native"] == 0.75 and g["seeds"] == 2
    rms = math.sqrt((0.03**2 + 0.04**2) / 2)
    assert g["kept_se"] == pytest.approx(math.sqrt(rms**2 + 0.1**2 / 2 / 2))
    assert g["native_se"] == pytest.approx(0.02) and g["mcnemar_p"] == [0.01, 0.2]
    assert A.seeds_of(row) == rows and A.over_seeds(rows[1:], "w3")["run"] == "w3-s43"
    assert A.seeds_of(rows[0]) == [rows[0]]
