"""Chi-square tests without scipy: the survival function via the regularized incomplete gamma."""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Hashable, Sequence, Tuple


def _lower_series(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x) by its power series (x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) by Lentz's continued fraction (x >= a + 1)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square with ``dof`` degrees of freedom."""
    if stat <= 0:
        return 1.0
    a, x = dof / 2.0, stat / 2.0
    return 1.0 - _lower_series(a, x) if x < a + 1 else _upper_fraction(a, x)


def _bins(expected: Dict[Hashable, float], min_expected: float):
    """Cells expected at least ``min_expected`` times keep their own bin; the rest share one."""
    keys = sorted(expected, key=lambda k: -expected[k])
    big = [k for k in keys if expected[k] >= min_expected]
    return big, [k for k in keys if expected[k] < min_expected]


def two_sample(a: Sequence[Hashable], b: Sequence[Hashable],
               min_expected: float = 5.0) -> Tuple[float, int, float]:
    """Two-sample chi-square homogeneity test of two lists of outcomes (sizes may differ).
    A cell keeps its own bin when the smaller sample expects it ``min_expected`` times under the
    pooled distribution. Returns (statistic, degrees of freedom, p-value)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    small_n = min(na, nb) / (na + nb)
    expected = {k: (ca[k] + cb[k]) * small_n for k in set(ca) | set(cb)}
    big, small = _bins(expected, min_expected)
    cells = [(ca[k], cb[k]) for k in big]
    if small:
        cells.append((sum(ca[k] for k in small), sum(cb[k] for k in small)))
    k1, k2 = math.sqrt(nb / na), math.sqrt(na / nb)
    stat = sum((k1 * x - k2 * y) ** 2 / (x + y) for x, y in cells if x + y > 0)
    dof = len(cells) - 1
    return stat, dof, chi2_sf(stat, dof)


def goodness_of_fit(outcomes: Sequence[Hashable], probs: Dict[Hashable, float],
                    min_expected: float = 5.0) -> Tuple[float, int, float]:
    """Chi-square goodness of fit of ``outcomes`` to the exact distribution ``probs``. An outcome
    with probability 0 that occurs makes the statistic infinite (p-value 0)."""
    n = len(outcomes)
    counts = Counter(outcomes)
    if any(probs.get(k, 0.0) == 0.0 for k in counts):
        return math.inf, 0, 0.0
    expected = {k: n * p for k, p in probs.items() if p > 0}
    big, small = _bins(expected, min_expected)
    cells = [(counts[k], expected[k]) for k in big]
    if small:
        cells.append((sum(counts[k] for k in small), sum(expected[k] for k in small)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return stat, dof, chi2_sf(stat, dof)
