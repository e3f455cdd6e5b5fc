"""The 95% Student-t interval of one number per seed, which the lab's reports and the experiments' claims state.

mean ± t_{0.975, n-1}·sd/√n, sd the sample standard deviation (n - 1) of the n seeds' values.
"""

from __future__ import annotations

import math

# t_{0.975, df} for df = 1..30; beyond, the normal quantile.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) of `values`, NaNs left out; the half-width is NaN
    for fewer than two values and the mean NaN for none."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.960
    return mean, t * sd / math.sqrt(n)
