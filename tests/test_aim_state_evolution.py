"""AIM state evolution (AIM.md §5): softmax perfect recovery at (2ρ - ρ²)/(T² + T - 2), collapse
in α(T² + T - 2), the linear channel, the small-width limit of the T = 2 hardmax channel."""
import numpy as np
import pytest

from smi_core.aim import (aim_perfect_recovery, aim_small_width, aim_state_evolution,
                          aim_weak_recovery, hardmax_decay_constant)


@pytest.mark.parametrize("T", [2, 3, 4, 5])
@pytest.mark.parametrize("rho", [0.3, 0.8])
def test_softmax_perfect_recovery_threshold(T, rho):
    a_pr = (2 * rho - rho ** 2) / (T * T + T - 2)
    assert aim_perfect_recovery("softmax", T, rho) == pytest.approx(a_pr, rel=1e-15)
    r = aim_state_evolution("softmax", T, rho, a_pr * np.array([0.99, 0.999, 1.001, 1.01]))
    assert r.converged.all()
    assert r.mmse[0] > r.mmse[1] > 0
    assert r.mmse[2] == 0 and r.mmse[3] == 0


def test_perfect_recovery_rho_above_one_and_linear():
    assert aim_perfect_recovery("softmax", 3, 2.0) == pytest.approx(1 / 10)
    a_pr = aim_perfect_recovery("linear", 3, 0.5)
    assert a_pr == pytest.approx(0.75 / 12)
    r = aim_state_evolution("linear", 3, 0.5, a_pr * np.array([0.995, 1.005]))
    assert r.mmse[0] > 0 and r.mmse[1] == 0
    r = aim_state_evolution("softmax", 2, 2.0, np.array([0.995, 1.005]) / 4)
    assert r.mmse[0] > 0 and r.mmse[1] == 0


def test_softmax_curves_collapse_in_rescaled_alpha():
    x = np.linspace(0.02, 0.9, 7)          # α (T² + T - 2)
    curves = [aim_state_evolution("softmax", T, 0.5, x / (T * T + T - 2)).mmse for T in (2, 3, 4, 5)]
    for c in curves[1:]:
        np.testing.assert_allclose(c, curves[0], rtol=1e-9, atol=1e-12)
    assert np.all(np.diff(curves[0]) <= 0) and curves[0][0] < 1


def test_no_data_and_trajectory():
    r = aim_state_evolution("softmax", 2, 0.5, [0.0, 0.1])
    assert r.mmse[0] == 1 and r.q[0] == 0.5
    t = r.trajectory[1]
    assert t[0] == pytest.approx(0.5) and np.all(np.diff(t) >= -1e-12)
    damped = aim_state_evolution("softmax", 2, 0.5, 0.1, damping=0.5)
    assert damped.mmse[0] == pytest.approx(r.mmse[1], abs=1e-9)
    assert damped.to_dict()["mmse"] == damped.mmse.tolist()


def test_hardmax_small_width_limit():
    ac = aim_weak_recovery("hardmax", 2)
    abar = np.array([2.0, 4.0]) * ac
    closed = aim_small_width("hardmax", 2, abar).q
    assert 0 < closed[0] < closed[1] < 1
    gaps = []
    for rho in (1e-2, 1e-3):
        full = 1 - aim_state_evolution("hardmax", 2, rho, abar * rho).mmse    # q - ρ
        gaps.append(np.abs(full - closed).max())
    assert gaps[1] < gaps[0] and gaps[1] < 3e-3
    below = aim_small_width("hardmax", 2, 0.9 * ac)
    assert below.q[0] == 0


def test_hardmax_curve_decreases():
    r = aim_state_evolution("hardmax", 2, 0.5, [0.1, 0.3, 0.6])
    assert r.converged.all() and np.all(np.diff(r.mmse) < 0) and r.mmse[0] < 1


@pytest.mark.parametrize("kw,msg", [({"rho": -1}, "rho"), ({"alpha": -0.1}, "alpha"),
                                    ({"channel": "relu"}, "channel"), ({"tokens": 1}, "tokens"),
                                    ({"damping": 1.0}, "damping")])
def test_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        aim_state_evolution(**kw)
    if "channel" in kw:
        with pytest.raises(ValueError, match="channel"):
            aim_perfect_recovery(kw["channel"], 2, 0.5)


def test_hardmax_needs_mmse_tol():
    with pytest.raises(ValueError, match="mmse_tol"):
        aim_perfect_recovery("hardmax", 2, 0.5)


def test_hardmax_mmse_decays_as_inverse_alpha_squared():
    """No finite perfect-recovery α: at large α the SE MMSE follows ((2ρ - ρ²)/(2αF₁))²."""
    rho = 0.5
    F1 = hardmax_decay_constant(2, rho)
    alpha = np.array([20.0, 80.0])
    r = aim_state_evolution("hardmax", 2, rho, alpha)
    np.testing.assert_allclose(r.mmse, ((2 * rho - rho ** 2) / (2 * alpha * F1)) ** 2, rtol=2e-2)
    assert np.all(r.mmse > 0)


def test_hardmax_recovery_threshold_brackets_the_curve():
    a = aim_perfect_recovery("hardmax", 2, 0.5, mmse_tol=1e-2)
    m = aim_state_evolution("hardmax", 2, 0.5, a * np.array([0.998, 1.002])).mmse
    assert m[0] > 1e-2 >= m[1]
