"""The bench's statistics and the in-forward ideal: saving weights per sync point, paired bootstrap intervals."""

from __future__ import annotations

import math
import statistics

import pytest

from syncdrop.bench.stats import bootstrap_ci, median_ci, median_of, relative_half_width
from syncdrop.bench.sync_timer import saving_weights
from syncdrop.plan import parse_plan


@pytest.mark.parametrize("spec, want", [
    ("none", [0, 0, 0, 0, 0, 0]),
    ("all", [1, 0, 1, 0, 1, 0]),          # SPD drops each attention sync; the MLP one carries P + Z
    ("blocks:1", [0, 0, 1, 0, 0, 0]),
    ("partial:0.25", [1 - 16 / 64] * 6),  # k = round(0.25 x 64) = 16 of 64 channels still travel
    ("partial:0", [1] * 6),               # nothing travels
])
def test_saving_weights(spec: str, want: list[float]) -> None:
    base = parse_plan("none", 3)
    assert saving_weights(base, parse_plan(spec, 3), 64) == pytest.approx(want)


def test_saving_weights_against_a_partial_baseline() -> None:
    """Relative to a baseline that already sends 1/2: a plan sending 1/4 saves half of each point's time."""
    assert saving_weights(parse_plan("partial:0.5", 2), parse_plan("partial:0.25", 2), 64) == pytest.approx([0.5] * 4)


def test_bootstrap_is_deterministic_and_brackets_the_median() -> None:
    xs = [10.0, 12.0, 11.0, 30.0, 10.5, 11.5, 12.5, 9.5]
    ci = median_ci(xs)
    assert ci == median_ci(xs)  # seeded
    assert ci[0] <= statistics.median(xs) <= ci[1] and ci[0] >= min(xs) and ci[1] <= max(xs)
    assert median_ci([5.0] * 6) == (5.0, 5.0)
    assert median_ci([5.0]) is None and relative_half_width([5.0]) == math.inf
    assert relative_half_width([5.0] * 6) == 0.0


def test_paired_bootstrap_of_a_difference() -> None:
    """Interleaved reps share the machine's state: a plan always 1.0 faster than the baseline in the same
    rep has a difference interval of exactly (1, 1), however noisy the reps are."""
    base = [10.0, 14.0, 9.0, 20.0, 11.0, 13.0]
    plan = [b - 1.0 for b in base]
    ci = bootstrap_ci(lambda idx: statistics.median(base[i] - plan[i] for i in idx), len(base))
    assert ci == pytest.approx((1.0, 1.0))
    wide = bootstrap_ci(lambda idx: median_of(base, idx) - median_of(plan[::-1], idx), len(base))
    assert wide[1] - wide[0] > 1.0  # unpaired (reversed): the noise shows


def test_undefined_statistic_gives_no_interval() -> None:
    assert bootstrap_ci(lambda idx: None, 5) is None


def test_paired_ppl_ratio_is_the_perplexity_ratio_with_a_paired_interval() -> None:
    """A constant per-window NLL shift c is a perplexity ratio of exactly exp(c), and the paired
    interval collapses onto it (every resample sees the same difference); unequal windows are refused."""
    import math

    from syncdrop.bench.stats import paired_ppl_ratio

    base = [2.0 + 0.37 * (i % 7) for i in range(40)]  # windows of very different difficulty
    r, ci = paired_ppl_ratio([b + 0.05 for b in base], base)
    assert r == pytest.approx(math.exp(0.05)) and ci == pytest.approx((math.exp(0.05),) * 2)
    noisy = [b + 0.05 + (0.02 if i % 2 else -0.02) for i, b in enumerate(base)]
    r, (lo, hi) = paired_ppl_ratio(noisy, base)
    assert lo < r < hi and lo > 1.0
    with pytest.raises(ValueError, match="same windows"):
        paired_ppl_ratio(base[:-1], base)


def test_median_ratio_interval_paired_and_independent() -> None:
    """A ratio of medians: paired draws cancel a shared per-rep drift (a tight interval around the true 0.5),
    independent draws do not (a wider interval, still holding 0.5); both contain the point estimate."""
    from syncdrop.bench.stats import median_ratio_ci

    drift = [1.0 + 0.3 * ((7 * i) % 11) / 10 for i in range(15)]  # machine state shared by rep i
    a = [50.0 * d for d in drift]
    b = [100.0 * d for d in drift]
    lo, hi = median_ratio_ci(a, b, paired=True)
    assert lo == hi == 0.5
    lo2, hi2 = median_ratio_ci(a, b, paired=False)
    assert lo2 < 0.5 < hi2 and hi2 - lo2 > 0.05
    assert median_ratio_ci(a[:1], b[:1], paired=False) is None
    with pytest.raises(ValueError, match="same reps"):
        median_ratio_ci(a, b[:3], paired=True)


def test_paired_accuracy_drop_against_a_hand_computation() -> None:
    """Points of average accuracy lost, averaged over tasks (not documents): task a loses 1 of 4 documents
    (25 points), task b gains 1 of 2 (-50): (25 - 50) / 2 = -12.5. Unchanged answers give the interval
    (0, 0); the interval brackets the point and is the same on a second call (seeded)."""
    from syncdrop.bench.stats import paired_accuracy_drop

    base = {"a": [1, 1, 0, 1], "b": [0, 1]}
    other = {"a": [1, 0, 0, 1], "b": [1, 1]}
    point, ci = paired_accuracy_drop(base, other)
    assert point == pytest.approx(-12.5) and ci is not None and ci[0] <= point <= ci[1]
    assert ci == paired_accuracy_drop(base, other)[1] and ci[0] < ci[1]
    assert paired_accuracy_drop(base, base) == (0.0, (0.0, 0.0))
    # every document of both tasks lost: 100 points whatever the draw
    assert paired_accuracy_drop({"a": [1, 1], "b": [1, 1]}, {"a": [0, 0], "b": [0, 0]}) == (100.0, (100.0, 100.0))
    with pytest.raises(ValueError, match="same documents of a"):
        paired_accuracy_drop({"a": [1, 1]}, {"a": [1]})
    with pytest.raises(ValueError, match="same tasks"):
        paired_accuracy_drop({"a": [1, 1]}, {"b": [1, 1]})
