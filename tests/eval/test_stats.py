import math
import random
import statistics

import pytest

from kvlingo.eval import stats


def test_mean_se_and_cv():
    s = stats.mean_se([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["n"] == 4
    assert math.isclose(s["se"], math.sqrt(1.6666666666666667 / 4))
    assert math.isnan(stats.mean_se([1.0])["se"])
    assert math.isclose(stats.cv([10.0, 10.0, 10.0]), 0.0)
    assert stats.median([3, 1, 2]) == 2 and stats.median([4, 1, 2, 3]) == 2.5


def test_paired_t_against_known_values():
    # t distribution, df=9: two-sided p at t=2.262157 is 0.05 (table value)
    assert math.isclose(stats._t_sf(2.262157, 9), 0.05, abs_tol=1e-5)
    assert math.isclose(stats._t_sf(0.0, 5), 1.0, abs_tol=1e-12)
    rng = random.Random(0)
    a = [rng.gauss(0, 1) for _ in range(40)]
    b = [x + 0.5 + rng.gauss(0, 0.1) for x in a]
    r = stats.paired_t(a, b)
    assert r["mean_diff"] < 0 and r["p"] < 1e-6 and r["n"] == 40
    with pytest.raises(ValueError):
        stats.paired_t([1.0], [1.0, 2.0])


def test_mcnemar_exact():
    # 0 vs 6 discordant pairs: p = 2 * 0.5**6
    r = stats.mcnemar_exact([True] * 6 + [True] * 4, [False] * 6 + [True] * 4)
    assert r["a_only"] == 6 and r["b_only"] == 0 and math.isclose(r["p"], 2 * 0.5**6)
    assert stats.mcnemar_exact([True, False], [True, False])["p"] == 1.0


def test_ratio_of_medians_interval_brackets_the_ratio_and_narrows_with_trials():
    rng = random.Random(1)
    slow = [40.0 * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(30)]
    fast = [1.0 * (1 + 0.10 * rng.gauss(0, 1)) for _ in range(30)]
    lo, hi = stats.ratio_of_medians_interval(slow, fast)
    point = stats.median(slow) / stats.median(fast)
    assert lo < point < hi
    # each bound is a ratio of medians of some resample: inside the extreme trial ratios
    assert min(slow) / max(fast) <= lo and hi <= max(slow) / min(fast)
    lo3, hi3 = stats.ratio_of_medians_interval(slow[:3], fast[:3])
    assert hi3 - lo3 > hi - lo  # three trials a side say less than thirty
    # fixed seed: the same trials give the same interval; a wider level, a wider interval
    assert stats.ratio_of_medians_interval(slow, fast) == [lo, hi]
    lo99, hi99 = stats.ratio_of_medians_interval(slow, fast, level=0.99)
    assert lo99 <= lo and hi <= hi99


def test_ratio_of_medians_interval_matches_a_direct_bootstrap():
    num, den = [10.0, 12.0, 11.0, 13.0], [1.0, 1.5, 1.2]
    rng = random.Random(7)
    ratios = sorted(
        statistics.median(rng.choices(num, k=4)) / statistics.median(rng.choices(den, k=3)) for _ in range(1000)
    )
    assert stats.ratio_of_medians_interval(num, den, level=0.9, resamples=1000, seed=7) == [ratios[50], ratios[949]]
    # constant trials: no spread at all
    assert stats.ratio_of_medians_interval([4.0] * 3, [2.0] * 5) == [2.0, 2.0]
    assert all(math.isnan(x) for x in stats.ratio_of_medians_interval([], [1.0]))
    with pytest.raises(ValueError):
        stats.ratio_of_medians_interval([1.0], [1.0], level=1.0)


def test_a_ratio_of_sums_has_the_delta_method_se_over_conversations():
    """Σy / Σx (KL per token over conversations of unequal length): its SE against the delta method written out,
    √(n/(n−1) · Σ(y − R·x)²) / Σx, and with equal lengths the plain SE of the per-conversation means."""
    ys, xs = [1.0, 4.0, 2.5, 0.5, 3.0], [10, 30, 20, 5, 25]
    r = sum(ys) / sum(xs)
    by_hand = math.sqrt(len(ys) / (len(ys) - 1) * sum((y - r * x) ** 2 for y, x in zip(ys, xs))) / sum(xs)
    got = stats.ratio_mean_se(ys, xs)
    assert got["mean"] == pytest.approx(r) and got["se"] == pytest.approx(by_hand) and got["n"] == 5
    equal = stats.ratio_mean_se(ys, [8] * 5)
    assert equal["se"] == pytest.approx(stats.mean_se([y / 8 for y in ys])["se"])
