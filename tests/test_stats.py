import math
import random

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
