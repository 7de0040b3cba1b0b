"""The unbiased pass@k estimator (Chen et al. 2021, the Codex paper).

For one problem with ``n >= k`` i.i.d. samples of which ``c`` pass the tests,

    pass@k = 1 - C(n - c, k) / C(n, k),
    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

(the mean over k-subsets of "holds a correct sample"; the product does not overflow, and
pass@k is exactly 1.0 when ``n - c < k``). The benchmark score is the mean over problems, each
weighing the same. Design notes: docs/utility.md, "privcode/eval/passk.py".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import NormalDist

from privcode.eval.errors import EvalError

__all__ = ["DEFAULT_KS", "mean_pass_at_k", "pass_at_k", "pass_at_k_table", "wilson_interval"]

#: The ks reported by default (each only where every problem has ``n >= k`` samples).
DEFAULT_KS = (1, 10, 100)


def _count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise EvalError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct samples out of ``n``.

    ``1 - C(n-c, k) / C(n, k)`` computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``.
    Raises :class:`EvalError` if ``n < k`` (the estimator is undefined: draw more
    samples or lower k), ``k < 1`` or ``c`` is not in ``[0, n]``.
    """
    n, k = _count("n", n, 1), _count("k", k, 1)
    c = _count("c", c, 0)
    if c > n:
        raise EvalError(f"c (correct samples) = {c} exceeds n (samples) = {n}")
    if n < k:
        raise EvalError(f"pass@{k} needs at least k = {k} samples per problem, got n = {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean of :func:`pass_at_k` over problems given as ``(n, c)`` pairs (at least one)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise EvalError("pass@k of no problems: there is nothing to average")
    return sum(values) / len(values)


def pass_at_k_table(
    counts: Sequence[tuple[int, int]], ks: Iterable[int] = DEFAULT_KS
) -> tuple[dict[str, float], list[int]]:
    """``({"pass@k": mean}, skipped ks)``: every k with ``k <= min n`` is computed,
    the others are returned as skipped (their estimate would need more samples)."""
    if not counts:
        raise EvalError("pass@k of no problems: there is nothing to average")
    min_n = min(n for n, _ in counts)
    table, skipped = {}, []
    for k in sorted(set(_count("k", k, 1) for k in ks)):
        if k <= min_n:
            table[f"pass@{k}"] = mean_pass_at_k(counts, k)
        else:
            skipped.append(k)
    return table, skipped


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), e.g. pass@1 over tasks.

    With ``p = successes / n`` and ``z`` the two-sided normal quantile::

        (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)

    It stays inside [0, 1] and is not degenerate at 0 or n successes (0 of 150
    gives [0, 2.5%]), unlike the normal approximation. ``successes`` may be
    fractional (pass@1 of n > 1 samples times the number of tasks); the
    interval then treats the tasks as the trials.
    """

    _count("n", n, 1)
    if not 0 <= successes <= n:
        raise EvalError(f"successes must be in [0, {n}], got {successes!r}")
    if not 0 < confidence < 1:
        raise EvalError(f"confidence must be in (0, 1), got {confidence!r}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    scale = 1 + z * z / n
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)
