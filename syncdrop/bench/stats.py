"""Intervals for benchmark figures: a percentile bootstrap over interleaved repetitions.

Plans are timed interleaved (rep 1: A B C, rep 2: A B C, ...), so rep ``r`` of every plan saw the
same machine state; a statistic of several plans (a median, a difference of medians, a ratio) is
resampled by drawing *reps* with replacement, the same draw for every plan (a paired bootstrap).
The interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the statistic over
``n_boot`` draws; the generator is seeded, so the same samples always give the same interval.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence

N_BOOT = 2000
LEVEL = 0.95


def bootstrap_ci(stat: Callable[[list[int]], float | None], n_reps: int, n_boot: int = N_BOOT,
                 level: float = LEVEL, seed: int = 0) -> tuple[float, float] | None:
    """The percentile interval of ``stat(rep indices)`` over ``n_boot`` paired resamples of
    ``range(n_reps)``; None with fewer than 2 reps or when ``stat`` is undefined (None) too often
    (in more than 1 - level of the draws)."""
    if n_reps < 2:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(n_boot):
        v = stat([rng.randrange(n_reps) for _ in range(n_reps)])
        if v is not None and math.isfinite(v):
            values.append(v)
    if len(values) < level * n_boot:
        return None
    values.sort()
    lo = values[int((1 - level) / 2 * (len(values) - 1))]
    hi = values[int(math.ceil((1 + level) / 2 * (len(values) - 1)))]
    return lo, hi


def median_of(xs: Sequence[float], idx: list[int]) -> float:
    return statistics.median(xs[i] for i in idx)


def median_ci(xs: Sequence[float], seed: int = 0) -> tuple[float, float] | None:
    """The bootstrap interval of the median of ``xs``."""
    return bootstrap_ci(lambda idx: median_of(xs, idx), len(xs), seed=seed)


def relative_half_width(xs: Sequence[float]) -> float:
    """Half the width of the median's interval over the median (inf with fewer than 2 samples)."""
    ci = median_ci(xs)
    med = statistics.median(xs) if xs else 0.0
    if ci is None or med <= 0:
        return math.inf
    return (ci[1] - ci[0]) / 2 / med


def paired_ppl_ratio(nll: Sequence[float], base: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """Perplexity ratio of two models scored on the same windows, ``exp(mean_w(nll_w - base_w))``, with
    its paired percentile bootstrap interval (one resample of windows for both); ``nll``/``base``: each
    window's mean token NLL, in the same window order."""
    if len(nll) != len(base):
        raise ValueError(f"paired ratio needs the same windows, got {len(nll)} and {len(base)}")

    def stat(idx: list[int]) -> float:
        return math.exp(sum(nll[i] - base[i] for i in idx) / len(idx))

    return stat(list(range(len(base)))), bootstrap_ci(stat, len(base))


def median_ratio_ci(a: Sequence[float], b: Sequence[float], paired: bool, seed: int = 0) -> tuple[float, float] | None:
    """Interval of ``median(a) / median(b)``: reps drawn together when ``paired`` (the same rep index for
    both: interleaved samples), else each series resampled on its own (separate runs, e.g. one engine per
    plan). With the independent draw the indices of ``a`` are drawn first, then ``b``'s, from one seeded
    generator."""
    if not paired:
        rng = random.Random(seed)
        values = []
        for _ in range(N_BOOT):
            ma = statistics.median(a[rng.randrange(len(a))] for _ in a)
            mb = statistics.median(b[rng.randrange(len(b))] for _ in b)
            if mb > 0:
                values.append(ma / mb)
        if len(a) < 2 or len(b) < 2 or len(values) < LEVEL * N_BOOT:
            return None
        values.sort()
        return (values[int((1 - LEVEL) / 2 * (len(values) - 1))],
                values[int(math.ceil((1 + LEVEL) / 2 * (len(values) - 1)))])
    if len(a) != len(b):
        raise ValueError(f"paired ratio needs the same reps, got {len(a)} and {len(b)}")

    def stat(idx: list[int]) -> float | None:
        mb = median_of(b, idx)
        return median_of(a, idx) / mb if mb > 0 else None

    return bootstrap_ci(stat, len(a), seed=seed)



def paired_accuracy_drop(base: Mapping[str, Sequence[float]], other: Mapping[str, Sequence[float]],
                         seed: int = 0) -> tuple[float, tuple[float, float] | None]:
    """How many points of average zero-shot accuracy ``other`` loses against ``base``, scored on the same
    documents: ``100 * mean_t mean_i (base[t][i] - other[t][i])`` (per-document accuracies 0/1 of task
    ``t``, in the same document order), with its paired percentile bootstrap interval: each draw resamples
    every task's documents with replacement (stratified by task), the same documents for both models. A
    plan that changes no answer has the interval ``(0, 0)``; None when a task has fewer than 2 documents."""
    if set(base) != set(other) or not base:
        raise ValueError(f"paired accuracy needs the same tasks, got {sorted(base)} and {sorted(other)}")
    diffs = []
    for t in sorted(base):
        if len(base[t]) != len(other[t]):
            raise ValueError(f"paired accuracy needs the same documents of {t}, got {len(base[t])} and "
                             f"{len(other[t])}")
        diffs.append([b - o for b, o in zip(base[t], other[t], strict=True)])
    point = 100 * sum(sum(d) / len(d) for d in diffs) / len(diffs)
    if min(len(d) for d in diffs) < 2:
        return point, None
    rng = random.Random(seed)
    values = sorted(100 * sum(sum(d[rng.randrange(len(d))] for _ in d) / len(d) for d in diffs) / len(diffs)
                    for _ in range(N_BOOT))
    return point, (values[int((1 - LEVEL) / 2 * (N_BOOT - 1))], values[int(math.ceil((1 + LEVEL) / 2 * (N_BOOT - 1)))])
