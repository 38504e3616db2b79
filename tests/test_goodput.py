"""Young/Daly checkpoint intervals and the goodput model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.manager.config import daly_interval, effective_ratio, estimate, young_interval

costs = st.floats(min_value=0.01, max_value=600.0)
mtbfs = st.floats(min_value=600.0, max_value=30 * 86400.0)


def test_young_is_sqrt_2cm() -> None:
    assert young_interval(8.0, 3600.0) == pytest.approx(math.sqrt(2 * 8.0 * 3600.0))


@given(c=costs, m=mtbfs)
def test_daly_approaches_young_for_cheap_checkpoints(c: float, m: float) -> None:
    # Daly's correction terms vanish as C/M -> 0: within C plus a relative (C/2M)^(1/2)/3 term.
    y, d = young_interval(c, m), daly_interval(c, m)
    x = c / (2 * m)
    assert d == pytest.approx(y * (1 + math.sqrt(x) / 3 + x / 9) - c)
    assert abs(d - y) <= c + y * (math.sqrt(x) / 3 + x / 9) + 1e-9


def test_daly_caps_at_mtbf_for_expensive_checkpoints() -> None:
    assert daly_interval(5000.0, 2000.0) == 2000.0


@settings(max_examples=60)
@given(c=costs, m=mtbfs)
def test_daly_interval_is_near_the_optimum_of_the_model(c: float, m: float) -> None:
    # Daly's interval is a series approximation of the optimum of the same
    # wall-time model: halving or doubling it must not do better by more than a hair.
    tau = daly_interval(c, m)
    best = effective_ratio(tau, c, m)
    assert 0 < best <= 1
    for f in (0.5, 2.0):
        assert effective_ratio(tau * f, c, m) <= best + 1e-6


def test_effective_ratio_limits() -> None:
    # No failures to speak of and free checkpoints: all time is useful.
    assert effective_ratio(100.0, 0.0, 1e12) == pytest.approx(1.0, abs=1e-9)
    # Commit lag and restart time are lost work: the ratio can only fall.
    base = effective_ratio(600.0, 5.0, 3600.0)
    assert effective_ratio(600.0, 5.0, 3600.0, commit_lag_s=60.0) < base
    assert effective_ratio(600.0, 5.0, 3600.0, restart_s=120.0) < base


def test_bad_inputs_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="mtbf_s must be a finite number >= 0"):
        young_interval(1.0, -5.0)
    with pytest.raises(InvalidArgumentError, match="save at least once"):
        estimate([], [], [], mtbf_s=3600.0)
    # zero is finite and >= 0, but no interval follows from a zero MTBF, nor a ratio from zero
    with pytest.raises(InvalidArgumentError, match=r"^daly_interval: mtbf_s must be > 0, got 0$"):
        daly_interval(1.0, 0.0)
    with pytest.raises(InvalidArgumentError, match=r"^effective_ratio: interval_s and mtbf_s must be > 0, got interval_s=0, mtbf_s=3600.0$"):
        effective_ratio(0, 1.0, 3600.0)
    with pytest.raises(InvalidArgumentError, match=r"got interval_s=60.0, mtbf_s=0$"):
        effective_ratio(60.0, 1.0, 0)


def test_estimate_uses_means() -> None:
    e = estimate([1.0, 3.0], [10.0, 20.0], [100, 300], mtbf_s=3600.0, restart_s=30.0)
    assert (e.saves, e.blocking_s, e.write_s, e.bytes) == (2, 2.0, 15.0, 200.0)
    assert e.optimal_interval_s == pytest.approx(daly_interval(2.0, 3600.0))
    assert e.effective_ratio == pytest.approx(
        effective_ratio(e.optimal_interval_s, 2.0, 3600.0, restart_s=30.0, commit_lag_s=15.0)
    )
