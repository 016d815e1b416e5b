"""Arrival processes: rate, burstiness, seeding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workloads.arrivals import arrival_offsets


def gaps(rate: float, burstiness: float, count: int = 20_000, seed: int = 0) -> np.ndarray:
    return np.diff(arrival_offsets(count, rate, burstiness, np.random.default_rng(seed)))


class TestPoisson:
    def test_mean_rate_matches_the_request_rate(self):
        offsets = arrival_offsets(20_000, 8.0, 1.0, np.random.default_rng(1))
        observed_rate = (len(offsets) - 1) / offsets[-1]
        assert observed_rate == pytest.approx(8.0, rel=0.03)

    def test_gaps_are_exponential(self):
        g = gaps(5.0, 1.0)
        cv = g.std() / g.mean()
        assert cv == pytest.approx(1.0, abs=0.05)
        # P(gap > mean) = 1/e for an exponential.
        assert (g > 1 / 5.0).mean() == pytest.approx(math.exp(-1), abs=0.02)

    def test_offsets_start_at_zero_and_never_decrease(self):
        offsets = arrival_offsets(1000, 3.0, 0.3, np.random.default_rng(2))
        assert offsets[0] == 0.0
        assert np.all(np.diff(offsets) >= 0)
        assert offsets.shape == (1000,)


class TestBurstiness:
    @pytest.mark.parametrize("burstiness", [0.25, 4.0])
    def test_keeps_the_mean_rate(self, burstiness):
        assert 1 / gaps(10.0, burstiness).mean() == pytest.approx(10.0, rel=0.05)

    def test_squared_cv_is_one_over_the_shape(self):
        for burstiness in (0.25, 1.0, 4.0):
            g = gaps(10.0, burstiness)
            assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.1)

    def test_lower_burstiness_means_more_variance(self):
        variances = [gaps(10.0, b).var() for b in (0.2, 0.5, 1.0, 2.0, 5.0)]
        assert variances == sorted(variances, reverse=True)


class TestSeeding:
    def test_same_seed_same_arrivals(self):
        a = arrival_offsets(100, 4.0, 0.5, np.random.default_rng(7))
        b = arrival_offsets(100, 4.0, 0.5, np.random.default_rng(7))
        c = arrival_offsets(100, 4.0, 0.5, np.random.default_rng(8))
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)

    def test_other_rates_stretch_the_same_pattern(self):
        slow = arrival_offsets(50, 2.0, 1.0, np.random.default_rng(3))
        fast = arrival_offsets(50, 8.0, 1.0, np.random.default_rng(3))
        np.testing.assert_allclose(slow, 4 * fast)


class TestEdges:
    def test_infinite_rate_sends_everything_at_once(self):
        np.testing.assert_array_equal(
            arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5)
        )

    def test_no_requests(self):
        assert arrival_offsets(0, 1.0, 1.0, np.random.default_rng(0)).shape == (0,)

    @pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
    def test_refuses_non_positive_parameters(self, rate, burstiness):
        with pytest.raises(ValueError):
            arrival_offsets(10, rate, burstiness, np.random.default_rng(0))
