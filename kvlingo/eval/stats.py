"""Small, dependency-free statistics for honest reporting: means with SE, paired tests, CV, and a
bootstrap interval for a ratio of medians."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def mean_se(xs: Sequence[float]) -> dict[str, float]:
    """Mean, standard error (sample SD / √n) and n. SE is NaN for n < 2."""
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "se": float("nan"), "n": 0}
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "se": float("nan"), "n": n}
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return {"mean": m, "se": math.sqrt(var / n), "n": n}


def ratio_influence(nums: Sequence[float], dens: Sequence[float]) -> tuple[float, list[float]]:
    """R = Σnum / Σden over conversations and each conversation's influence on it, (num − R·den) / mean(den): the
    delta method's linearisation, whose mean is 0 and whose SD / √n is R's standard error (the conversations are
    the sample; a conversation's tokens are not independent)."""
    total = sum(dens)
    if not total:
        return float("nan"), [0.0] * len(nums)
    r, mean_den = sum(nums) / total, total / len(dens)
    return r, [(a - r * d) / mean_den for a, d in zip(nums, dens)]


def ratio_mean_se(nums: Sequence[float], dens: Sequence[float]) -> dict[str, float]:
    """Σnum / Σden (a KL or NLL per token over conversations) with its SE (`ratio_influence`) and n conversations.
    With equal denominators it is `mean_se` of the per-conversation ratios."""
    r, influence = ratio_influence(nums, dens)
    return {"mean": r, "se": mean_se(influence)["se"], "n": len(nums)}


def _t_sf(t: float, df: int) -> float:
    """Two-sided p-value of Student's t via the regularised incomplete beta function."""
    if df <= 0 or math.isnan(t):
        return float("nan")
    x = df / (df + t * t)
    return _betainc(df / 2.0, 0.5, x)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / (c if abs(c) > tiny else tiny)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def paired_t(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Paired t-test of a - b over the same items: mean difference, SE, t, two-sided p, n."""
    if len(a) != len(b):
        raise ValueError(f"paired test needs equal lengths (got {len(a)} and {len(b)})")
    d = [x - y for x, y in zip(a, b)]
    s = mean_se(d)
    if s["n"] < 2:
        return {"mean_diff": s["mean"], "se": s["se"], "t": float("nan"), "p": float("nan"), "n": s["n"]}
    if s["se"] == 0:
        return {
            "mean_diff": s["mean"],
            "se": 0.0,
            "t": float("inf") if s["mean"] else 0.0,
            "p": 0.0 if s["mean"] else 1.0,
            "n": s["n"],
        }
    t = s["mean"] / s["se"]
    return {"mean_diff": s["mean"], "se": s["se"], "t": t, "p": _t_sf(t, s["n"] - 1), "n": s["n"]}


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float]:
    """Exact (binomial) McNemar test on paired correctness: b01 = a wrong/b right, b10 = a right/b wrong."""
    if len(a) != len(b):
        raise ValueError(f"McNemar needs paired items (got {len(a)} and {len(b)})")
    b10 = sum(1 for x, y in zip(a, b) if x and not y)
    b01 = sum(1 for x, y in zip(a, b) if y and not x)
    n = b10 + b01
    k = min(b10, b01)
    p = min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"a_only": b10, "b_only": b01, "discordant": n, "p": p, "n": len(a)}


def cv(xs: Sequence[float]) -> float:
    """Coefficient of variation (sample SD / mean)."""
    s = mean_se(xs)
    if s["n"] < 2 or s["mean"] == 0:
        return float("nan")
    return s["se"] * math.sqrt(s["n"]) / abs(s["mean"])


def median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    if not n:
        return float("nan")
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0  # what every report's speedup interval uses


def ratio_of_medians_interval(
    num: Sequence[float],
    den: Sequence[float],
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> list[float]:
    """Percentile-bootstrap interval [lo, hi] of median(num) / median(den), e.g. a speedup from the
    trials of a baseline (num) and of a faster path (den).

    Each sample is resampled with replacement on its own, `resamples` times, from a fixed `seed`
    (so a report repeats). The samples are treated as independent: trials interleaved round by
    round share a machine's slow spells, which this ignores, so the interval is if anything wide.
    With a handful of trials the interval is coarse (a median of three can only be one of the
    three) but still shows how far the trials alone move the ratio. NaNs when a sample is empty.
    """
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples ≥ 1 (got {level} and {resamples})")
    if not num or not den:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    ratios = sorted(
        median(rng.choices(num, k=len(num))) / median(rng.choices(den, k=len(den))) for _ in range(resamples)
    )
    tail = (1.0 - level) / 2.0
    lo = ratios[min(resamples - 1, int(math.floor(tail * resamples)))]
    hi = ratios[max(0, int(math.ceil((1.0 - tail) * resamples)) - 1)]
    return [lo, hi]


def paired_accuracy(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """a vs b on the same items: the difference in points and the exact McNemar test."""
    n = len(a)
    delta = 100.0 * (sum(a) - sum(b)) / n if n else float("nan")
    return {"delta_points": delta, "mcnemar": mcnemar_exact(list(a), list(b))}


def _ranks(xs: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def spearman(x: Sequence[float], y: Sequence[float], exact_up_to: int = 8) -> dict[str, float]:
    """Spearman's rank correlation of paired values, with a two-sided p-value: exact over every permutation for
    n ≤ `exact_up_to`, else Student's t with n − 2 degrees of freedom. NaN for n < 3 or constant ranks."""
    import itertools

    if len(x) != len(y):
        raise ValueError(f"spearman needs paired values (got {len(x)} and {len(y)})")
    n = len(x)
    if n < 3:
        return {"rho": float("nan"), "p": float("nan"), "n": n}
    rx, ry = _ranks(x), _ranks(y)
    rho = _pearson(rx, ry)
    if math.isnan(rho):
        return {"rho": rho, "p": float("nan"), "n": n}
    if n <= exact_up_to:
        hits = total = 0
        for perm in itertools.permutations(ry):
            total += 1
            hits += abs(_pearson(rx, perm)) >= abs(rho) - 1e-12
        p = hits / total
    else:
        t = rho * math.sqrt((n - 2) / max(1e-300, 1 - rho * rho))
        p = _t_sf(t, n - 2)
    return {"rho": rho, "p": p, "n": n}
