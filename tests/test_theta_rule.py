"""The θ rule (smi_core.theta_rule): two layers, T = 2, the first layer not learned (ω_1 = 0,
V₁₂ = 0) — its weights against independent integrals of the prior, the channel's results against
the nested reference (tests/nested_reference.py), and where it applies."""
from __future__ import annotations

import numpy as np
import pytest

import nested_reference as nested
import theta3_reference as theta3
from channel_reference import metric
from smi_core import DeepAttention, theta3_rule, theta_rule
from smi_core.reparam_channel import ReparamChannel

RTOL = 1e-6


def _prior_expectation(f, b, n=6000, L=np.eye(2)):
    """E[f(p, r, x)] for x = L z, z ~ N(0, I), θ = σ(b·a(x)), by a plain Gauss–Legendre product in
    (d, m) = (z_1 − z_2, (z_1 + z_2)/2) on [−13, 13] × [−7, 7], n nodes per axis in panels of 50
    (independent of the θ rule's graded panels and its (p, v) map)."""
    t, w = np.polynomial.legendre.leggauss(50)

    def axis(half):
        ends = np.linspace(-half, half, n // 50 + 1)
        return ((ends[:-1, None] + ends[1:, None]) / 2 + np.diff(ends)[:, None] / 2 * t).ravel(), \
            (np.diff(ends)[:, None] / 2 * w).ravel()

    (D, WD), (M, WM) = axis(13.0), axis(7.0)
    total = 0.0
    for d, wd in zip(D, WD):
        z1, z2 = M + d / 2, M - d / 2
        x1, x2 = L[0, 0] * z1 + L[0, 1] * z2, L[1, 0] * z1 + L[1, 1] * z2
        p = 1 / (1 + np.exp(-b * x1 * (x1 - x2)))
        r = 1 / (1 + np.exp(-b * x2 * (x2 - x1)))
        total += wd * np.sum(WM * np.exp(-d * d / 4 - M * M) / (2 * np.pi) * f(p, r, x1, x2))
    return total


@pytest.mark.parametrize("b", [1.0, 2.0])
def test_theta_weights_integrate_the_prior(b):
    """Both weight sets at every level integrate 1, x_1², x_1x_2 and x_2² exactly (1, 1, 0, 1),
    and a Gaussian bump in θ (sd 0.15, times x_1 x_2 for the moment weights) as the plain
    product rule in (d, m) does."""
    def bump(p, r):
        return np.exp(-((p - 0.7) ** 2 + (r - 0.6) ** 2) / (2 * 0.15 ** 2))

    want = [_prior_expectation(lambda p, r, x1, x2: bump(p, r), b),
            _prior_expectation(lambda p, r, x1, x2: bump(p, r) * x1 * x2, b)]
    for n in ReparamChannel.THETA["levels"]:
        W = theta_rule.weights(b, n)
        assert np.allclose(W.sum(axis=1), [1, 1, 0, 1] * 2, rtol=0, atol=1e-13), (n, W.sum(axis=1))
        x = theta_rule.points(n)[0]
        p, v = x[:, None], x[None, :]               # node i·n + j at (p_i, v_j), r = 1 − p + p v
        f = bump(p, 1 - p + p * v).ravel()
        assert abs(W[0] @ f - want[0]) < 1e-9 * want[0], (n, W[0] @ f, want[0])
        assert abs(W[2] @ f - want[1]) < 1e-9 * abs(want[1]), (n, W[2] @ f, want[1])


def test_theta_moments_of_a_correlated_prior():
    """``_moments`` for x ~ N(0, S), S = LLᵀ correlated (the second layer's u = Φ_1 h_2 of three
    layers): 1, x_1², x_1x_2, x_2² integrate to (1, S), and the weights at n = 21 integrate a θ
    bump (times x_1 x_2) as the plain product rule in z does."""
    L = np.array([[2.0, 0.0], [0.7, 1.2]])
    S = L @ L.T
    mu = theta_rule._moments(1.0, S, 21, 8)
    assert np.allclose(mu[:, 0, 0], [1, S[0, 0], S[0, 1], S[1, 1]], rtol=1e-12, atol=1e-12), mu[:, 0, 0]
    n = 21
    W = theta_rule.weights_of(mu, n)
    x = theta_rule.points(n)[0]
    p, v = x[:, None], x[None, :]
    bump = np.exp(-((p - 0.7) ** 2 + (1 - p + p * v - 0.6) ** 2) / (2 * 0.25 ** 2)).ravel()
    for k, f in ((0, lambda x1, x2: 1.0), (2, lambda x1, x2: x1 * x2)):
        want = _prior_expectation(lambda p, r, x1, x2: np.exp(-((p - 0.7) ** 2 + (r - 0.6) ** 2) / (2 * 0.25 ** 2))
                                  * f(x1, x2), 1.0, L=L)
        assert abs(W[k] @ bump - want) < 1e-7 * abs(want), (k, W[k] @ bump, want)


@pytest.mark.slow
def test_reparam_l3_pinned_against_the_nested_theta_reference():
    """Three layers at q = diag(0, 0, 0.99) (seed 0, 24 draws: benchmarks/channels.py's): the
    channel by default (the three-layer θ rule) within 1e-4 of the nested θ reference
    (tests/theta3_reference.py at (57, 33) nodes per layer) where that is within 1e-5 of its
    (45, 33) level, and its estimate below the default target (1e-4) there.  Before the rule
    (2026-12-03) the default was up to 4.3e-3 off on these draws and `tol=1e-4` 1.7e-4."""
    m = DeepAttention(3, 2)
    y, omega, V = _draws(m, [0.0, 0.0, 0.99], 24, 0)
    ch = m.channel()
    g, dg, error = theta3.reference(ch._polar_input(y), omega, V, levels=((45, 33), (57, 33)))
    good = error <= 1e-5
    assert good.sum() >= 3 * len(y) // 4, error
    mo = ch.moments(y[good], omega[good], V)
    worst = max(metric(mo.g_out[i], mo.dg_out[i], a, b) for i, (a, b) in enumerate(zip(g[good], dg[good])))
    assert worst <= 1e-4, worst
    assert (mo.error <= 1e-4).all(), mo.error


@pytest.mark.parametrize("skip, beta", [(1.0, 1.0), (0.6, 2.0)])
def test_reparam_l3_theta_rule_is_the_nested_rule(skip, beta, tmp_path, monkeypatch):
    """The channel's three-layer θ rule (one ``theta_product`` pass over the n_1² n_2² nodes, Φ from
    the generated kernels) is the numpy nested rule of tests/theta3_reference.py (a loop over θ_1,
    Φ written out) at the same levels, to rounding: a small rule (inner DEGREE 13, K = 3, level
    (9, 13)) at q = diag(0, 0, 0.99), and the channel returns it; c and β other than 1 too."""
    monkeypatch.setenv("SMI_CACHE", str(tmp_path))
    monkeypatch.setattr(theta3_rule, "DEGREE", 13)
    monkeypatch.setattr(theta3_rule, "K", 3)
    monkeypatch.setattr(theta3_rule, "NODES", 4)
    monkeypatch.setattr(theta_rule, "DEGREES", (9,))        # the outer moments (the same weights at n = 9)
    for f in (theta_rule.moments, theta_rule.weights):
        f.cache_clear()
    try:
        m = DeepAttention(3, 2, skip=skip, beta=beta)
        y, omega, V = _draws(m, [0.0, 0.0, 0.99], 8, 3)
        ch = m.channel()
        ch.THETA3 = dict(ch.THETA3, levels=((9, 13),))
        Vb = np.broadcast_to(V, (len(y), 3, 3))
        assert ch._theta_applies(omega, Vb).all()
        mo = ch.moments(y, omega, V)
        full, cut = theta3.moments(ch._polar_input(y), omega, V, skip, beta, 9, 13)
        g, dg = theta3.denoiser(omega, V, *full[1:])
        for i in range(len(y)):
            assert metric(mo.g_out[i], mo.dg_out[i], g[i], dg[i]) <= 1e-10, i
    finally:
        for f in (theta_rule.moments, theta_rule.weights):
            f.cache_clear()
    assert m.channel(escalation={"theta": False})._theta_applies(omega, Vb).sum() == 0
    assert not DeepAttention(3, 2, skip=0.1).channel()._theta_applies(omega, Vb).any()         # c < THETA3['skip']
    assert not ch._theta_applies(omega, np.broadcast_to(np.diag([1.0, 1.0, 0.5]), Vb.shape)).any()   # not pinned


def test_theta_moments_cached_on_disk(tmp_path, monkeypatch):
    """``moments`` writes its table under $SMI_CACHE/theta and reads it back (a small rule: degree
    9); another rule is another file."""
    monkeypatch.setenv("SMI_CACHE", str(tmp_path))
    monkeypatch.setattr(theta_rule, "DEGREES", (9,))
    theta_rule.moments.cache_clear()
    try:
        first = theta_rule.moments(1.5)
        path = theta_rule.cache_path(1.5)
        assert path.parent == tmp_path / "theta" and path.exists()
        theta_rule.moments.cache_clear()
        np.save(path, 2 * first)                # read back, not computed again
        assert np.array_equal(theta_rule.moments(1.5), 2 * first)
        monkeypatch.setattr(theta_rule, "DEGREES", (8,))
        assert theta_rule.cache_path(1.5) != path
    finally:
        theta_rule.moments.cache_clear()


def _draws(m, q, n, seed):
    rng = np.random.default_rng(seed)
    q = np.array(q)[:, None]
    omega = np.sqrt(q) * rng.standard_normal((n, len(q), 2))
    y = m.forward(omega + np.sqrt(1 - q) * rng.standard_normal((n, len(q), 2)))
    keep = (y > 0).all(axis=(1, 2))
    return y[keep], omega[keep], np.diag(1 - q[:, 0])


@pytest.mark.parametrize("skip, beta", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("q22", [0.5, 0.99, 0.999])
def test_reparam_l2_theta_rule_against_the_nested_rule(skip, beta, q22, monkeypatch):
    """State-evolution draws at q = diag(0, q₂₂) (seed 11): the θ rule takes them by default (its
    estimate ends below the target), within RTOL of the nested reference, and is what the
    channel returns."""
    m = DeepAttention(2, 2, skip=skip, beta=beta)
    y, omega, V = _draws(m, [0.0, q22], 8, 11)
    taken, theta = [], ReparamChannel._theta

    def spy(self, y, omega, V, Vinv, out, idx):
        done = theta(self, y, omega, V, Vinv, out, idx)
        taken.extend(idx[done])
        return done

    monkeypatch.setattr(ReparamChannel, "_theta", spy)
    mo = m.channel().moments(y, omega, V)
    assert len(taken) >= len(y) // 2, (len(taken), len(y))
    for i in taken:
        r = nested.reparam_l2_nested(y[i], omega[i], V, skip, beta)
        assert r.error <= RTOL / 4, (i, r.error)
        assert metric(mo.g_out[i], mo.dg_out[i], r.g_out, r.dg_out) <= RTOL, i


def test_reparam_l2_theta_rule_leaves_what_it_does_not_resolve():
    """The ridge draw 119 of test_channels (V = diag(1, 1e-4), the likelihood's sd in θ w = 0.0055,
    81·w < ``resolve``): the θ rule leaves it to the polar rules.  Without that guard it took it
    at 1.5e3 off, its estimate (4.7e-7) below the target: the grid missed the peak."""
    y = np.array([[1.0 - 2.15895513e-13, 2.15895513e-13], [9.93471053e-01, 1.0 - 9.93471053e-01]])
    omega = np.array([[[0.0, 0.0], [-3.89922675, 0.46330717]]])
    V = np.diag([1.0, 1e-4])[None]
    ch = DeepAttention(2, 2).channel()
    assert ch._theta_applies(omega, V).all()
    assert 81 * ch._theta_width(omega, V)[0] < ch.THETA["resolve"]
    out = np.empty(1), np.empty((1, 4)), np.empty((1, 4, 4)), np.empty(1)
    assert not ch._theta(y[None], omega, V, np.linalg.inv(V), out, np.arange(1)).any()


def test_reparam_l2_theta_rule_where_it_applies():
    """Only ω_1 = 0 and V₁₂ = 0, with a target: ω_1 ≠ 0 (q₁₁ = 0.3) gives the same moments with the
    rule on or off, and so does the channel without the estimate."""
    m = DeepAttention(2, 2)
    y, omega, V = _draws(m, [0.3, 0.99], 16, 12)
    on, off = (m.channel(escalation={"theta": t}).moments(y, omega, V) for t in (True, False))
    assert np.array_equal(on.g_out, off.g_out) and np.array_equal(on.dg_out, off.dg_out)
    y, omega, V = _draws(m, [0.0, 0.99], 16, 12)
    ch = m.channel(error_estimate=False)
    assert not ch._theta_applies(omega, np.broadcast_to(V, (len(y), 2, 2))).any()
    assert m.channel()._theta_applies(omega, np.broadcast_to(V, (len(y), 2, 2))).all()
    with pytest.raises(ValueError, match="theta"):
        m.channel(escalation={"theta": 1})


def test_theta3_next_level_jumps_by_the_estimate():
    """``_theta_next``: after level k a sample goes to the first later level whose estimate,
    extrapolated by THETA3["slopes"] (log10 per level), is at most the goal, else to the last.
    With slopes (−1.5, −1.4, −1.2, −2.0) and goal 1e-5: an estimate of 1e-4 after level 0 needs
    one level (1e-4 → 10^−5.5), 1e-2 needs three (→ 10^−6.1), 1 needs the last (→ 10^−6.1 only
    after all four), and 1e3 too (never below: the last)."""
    ch = DeepAttention(3, 2).channel()
    ch.THETA3 = dict(ch.THETA3, slopes=(-1.5, -1.4, -1.2, -2.0))
    est = np.array([1e-4, 1e-2, 1.0, 1e3])
    assert ch._theta_next(0, est, 1e-5).tolist() == [1, 3, 4, 4]
    assert ch._theta_next(2, np.array([1e-6, 1e-4, 1.0]), 1e-5).tolist() == [3, 3, 4]
