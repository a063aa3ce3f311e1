"""Hardmax channel for general T (AIM.md §4, Gaussian orthant probabilities by QMC): against the
T = 2 closed form, Monte Carlo of the T = 3 channel, Σ_y Z_out = 1, finite differences of log Z_out,
and the state-evolution curve at T = 3."""
from itertools import product

import numpy as np
import pytest

from derive import aim as sym
from smi_core.aim import aim_state_evolution
from smi_core.aim.channels import HardmaxChannel, make_channel, pair_weights


def _onehot(winners):
    winners = np.atleast_2d(winners)
    y = np.zeros((*winners.shape, winners.shape[1]))
    for a in range(winners.shape[1]):
        y[np.arange(len(y)), a, winners[:, a]] = 1
    return y


def test_general_code_matches_t2_closed_form():
    rng = np.random.default_rng(0)
    omega, V = rng.normal(size=(8, 3)), 0.3
    y = _onehot(rng.integers(0, 2, (8, 2)))
    exact, general = make_channel("hardmax", 2), HardmaxChannel(2, n_inner=4096)
    np.testing.assert_allclose(general.log_z(y, omega, V), exact.log_z(y, omega, V), atol=1e-3)
    np.testing.assert_allclose(general.g_out(y, omega, V), exact.g_out(y, omega, V), atol=5e-3)
    for q, V in [(0.5, 1.0), (1.4, 0.1)]:
        assert HardmaxChannel(2).fisher(q, V) == pytest.approx(exact.fisher(q, V), rel=1e-2)


def test_t3_outputs_partition_the_space():
    """Σ over the 27 outputs of Z_out(y; ω, V) = 1."""
    ch = HardmaxChannel(3, n_inner=4096)
    omega = np.random.default_rng(1).normal(size=(3, 6))
    total = sum(np.exp(ch.log_z(_onehot([w] * 3), omega, 0.5)) for w in product(range(3), repeat=3))
    np.testing.assert_allclose(total, 1, atol=3e-4)


@pytest.mark.parametrize("seed", [2, 3])
def test_t3_against_monte_carlo(seed):
    """Z_out = P(hardmax(ω + √((1+δ)V) ξ) = y) and g = E[ξ 1{y}]/(Z √((1+δ)V)) by direct sampling,
    within 4 standard errors."""
    rng = np.random.default_rng(seed)
    T, n = 3, 400_000
    w = pair_weights(T)
    omega, V = rng.normal(size=6), rng.uniform(0.2, 1.0)
    xi = rng.standard_normal((n, 6))
    h = omega + xi * np.sqrt(w * V)
    H = np.zeros((n, T, T))
    for i, (a, b) in enumerate(sym.pairs(T)):
        H[:, a, b] = H[:, b, a] = h[:, i]
    winners = H.argmax(axis=-1)
    for win in (winners[0], winners[1]):
        hit = (winners == win).all(axis=1)
        z = hit.mean()
        ch = HardmaxChannel(T, n_inner=4096)
        y = _onehot(win)
        assert abs(np.exp(ch.log_z(y, omega[None], V)[0]) - z) < 4 * np.sqrt(z * (1 - z) / n)
        g_mc = (xi * hit[:, None]).mean(axis=0) / z / np.sqrt(w * V)
        resid = (xi - xi[hit].mean(axis=0)) * hit[:, None] / z / np.sqrt(w * V)
        se = resid.std(axis=0) / np.sqrt(n)
        assert np.all(np.abs(ch.g_out(y, omega[None], V)[0] - g_mc) < 4 * se), (win, se)


def test_t3_g_out_is_gradient_of_log_z():
    """g_out (Stein: E[ξ | cone]) against central differences of log Z_out (same QMC points)."""
    ch = HardmaxChannel(3, n_inner=16384)
    rng = np.random.default_rng(4)
    omega, V = rng.normal(size=6) * 0.7, 0.4
    y = _onehot([1, 1, 2])
    g = ch.g_out(y, omega[None], V)[0]
    eps = 1e-4
    fd = [(ch.log_z(y, (omega + eps * e)[None], V)[0] - ch.log_z(y, (omega - eps * e)[None], V)[0])
          / (2 * eps) for e in np.eye(6)]
    np.testing.assert_allclose(g, fd, atol=2e-3)


def test_t3_fisher_against_monte_carlo():
    """fisher(q, V) = E[Σ(1+δ) g²] with (ω, h, y) sampled, against the QMC expectation over ω
    summed over output classes."""
    rng = np.random.default_rng(5)
    T, q, V, n = 3, 0.7, 0.4, 20_000
    w = pair_weights(T)
    omega = rng.standard_normal((n, 6)) * np.sqrt(w * q)
    h = omega + rng.standard_normal((n, 6)) * np.sqrt(w * V)
    H = np.zeros((n, T, T))
    for i, (a, b) in enumerate(sym.pairs(T)):
        H[:, a, b] = H[:, b, a] = h[:, i]
    ch = HardmaxChannel(T, n_inner=128)
    val = (ch.g_out(_onehot(H.argmax(axis=-1)), omega, V) ** 2 * w).sum(axis=1)
    assert abs(val.mean() - ch.fisher(q, V)) < 4 * val.std() / np.sqrt(n)


@pytest.mark.slow
def test_t3_state_evolution_curve():
    r3 = aim_state_evolution("hardmax", 3, 0.5, [0.1, 0.3, 0.6])
    r2 = aim_state_evolution("hardmax", 2, 0.5, [0.1, 0.3, 0.6])
    assert r3.converged.all() and np.all(np.diff(r3.mmse) < 0)
    assert np.all((0 < r3.mmse) & (r3.mmse < r2.mmse))      # T = 3 outputs carry more information
