"""AUP (d3LLM's accuracy under parallelism) against hand-computed values."""

import math

import pytest

from unmask.eval.aup import aup, aup_weight


def test_one_point_is_its_rectangle():
    assert aup([(1.0, 90.0)]) == pytest.approx(90.0)


def test_trapezoids_with_the_accuracy_weight():
    points = [(2.0, 80.0), (1.0, 82.0), (4.0, 70.0)]  # 70 is > 5 below 82: dropped
    w80 = math.exp(-3 * (1 - 80 / 82))
    expected = 1.0 * 82.0 + (2.0 - 1.0) * (82.0 + w80 * 80.0) / 2
    assert aup(points) == pytest.approx(expected)
    assert aup_weight(82.0, 82.0) == 1.0 and aup_weight(90.0, 82.0) == 1.0


def test_bad_points():
    with pytest.raises(ValueError, match="at least one"):
        aup([])
    with pytest.raises(ValueError, match="must be positive"):
        aup([(0.0, 50.0)])
