"""AIM output channels (AIM.md §4): softmax rank, the softmax pre-image and g_out, the T = 2
hardmax g_out against an mpmath quadrature of Z_out and finite differences, the bivariate normal
CDF in its tails, and the q̂ integrand against Monte Carlo."""
import mpmath as mp
import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.special import log_ndtr

from derive import aim as sym
from smi_core.aim.bvn import log_bvn
from smi_core.aim.channels import make_channel, pair_weights


@pytest.mark.parametrize("T", [2, 3, 4, 5, 6])
def test_softmax_rank(T):
    K, null = sym.softmax_rank(T)
    assert K == (T * T + T - 2) // 2
    assert null == (tuple([1] * (T * (T + 1) // 2)),)      # the common shift
    assert sym.linear_rank(T) == T * (T + 1) // 2


def _softmax(h, beta):
    e = np.exp(beta * (h - h.max(axis=-1, keepdims=True)))
    return e / e.sum(axis=-1, keepdims=True)


def _symmetric(rng, n, T):
    h = rng.standard_normal((n, T, T))
    return (h + h.transpose(0, 2, 1)) / 2


@pytest.mark.parametrize("T", [2, 4])
def test_softmax_preimage_up_to_shift(T):
    rng = np.random.default_rng(0)
    h = _symmetric(rng, 50, T)
    ch = make_channel("softmax", T, beta=1.7)
    pre = ch.preimage(_softmax(h, 1.7))
    true = np.stack([h[:, a, b] for a, b in sym.pairs(T)], axis=1)
    diff = pre - true
    np.testing.assert_allclose(diff, diff[:, :1] * np.ones_like(diff), atol=1e-12)


@pytest.mark.parametrize("channel,T", [("softmax", 2), ("softmax", 3), ("linear", 3), ("hardmax", 2)])
def test_fisher_against_monte_carlo(channel, T):
    """E[Σ(1+δ)g²] from g_out on sampled (ω, h, y) against the channel's own fisher(q, V)."""
    rng = np.random.default_rng(1)
    q, V, n = 0.7, 0.4, 200_000
    w = pair_weights(T)
    omega = rng.standard_normal((n, w.size)) * np.sqrt(w * q)
    h = omega + rng.standard_normal((n, w.size)) * np.sqrt(w * V)
    H = np.zeros((n, T, T))
    for i, (a, b) in enumerate(sym.pairs(T)):
        H[:, a, b] = H[:, b, a] = h[:, i]
    if channel == "softmax":
        y = _softmax(H, 1.0)
    elif channel == "linear":
        y = H
    else:
        y = (H == H.max(axis=-1, keepdims=True)).astype(float)
    ch = make_channel(channel, T)
    val = (ch.g_out(y, omega, V) ** 2 * w).sum(axis=1)
    se = val.std() / np.sqrt(n)
    assert abs(val.mean() - ch.fisher(q, V)) < 4 * se + 1e-9


def _z_out_mp(omega, V, s1, s2):
    """Z_out by conditioning on h₀₁ = ω₀₁ + √V ξ (a route that does not use Φ₂).  The integrand
    is log-concave in ξ, so the subdivision is about its peak (found in float64): in the tails
    the peak is narrow and far out (at ξ ≈ 7.2 for ω = (2, 0, 2), V = 0.02, y = (-1, -1))."""
    w00, w01, w11 = omega
    sd = mp.sqrt(2 * V)
    f = lambda x: mp.npdf(x) * mp.ncdf(s1 * (w00 - w01 - mp.sqrt(V) * x) / sd) \
        * mp.ncdf(s2 * (w11 - w01 - mp.sqrt(V) * x) / sd)
    a, b, c, v = (float(t) for t in (w00 - w01, w11 - w01, sd, mp.sqrt(V)))
    log_f = lambda x: -0.5 * x * x + log_ndtr(s1 * (a - v * x) / c) + log_ndtr(s2 * (b - v * x) / c)
    peak = minimize_scalar(lambda x: -log_f(x), bounds=(-60.0, 60.0), method="bounded", options={"xatol": 1e-6}).x
    cuts = [mp.mpf(peak) + d for d in (-40, -20, -10, -5, -3, -1, 0, 1, 3, 5, 10, 20, 40)]
    return mp.quad(f, [-mp.inf] + cuts + [mp.inf])


def _hardmax_cases(n_random):
    rng = np.random.default_rng(2)
    cases = [(rng.normal(size=3) * 1.5, rng.uniform(0.05, 2)) for _ in range(n_random)]
    return cases + [(np.array([-3.0, 1.0, -2.5]), 0.1), (np.array([2.0, 0.0, 2.0]), 0.02)]   # tails


@pytest.mark.parametrize("cases,signs", [
    (_hardmax_cases(1)[:1], ((1, -1),)),
    pytest.param(_hardmax_cases(6), ((1, 1), (1, -1), (-1, 1), (-1, -1)), marks=pytest.mark.slow)])
def test_hardmax_g_out_against_mpmath_finite_differences(cases, signs):
    mp.mp.dps = 20
    ch = make_channel("hardmax", 2)
    for omega, V in cases:
        for s1, s2 in signs:
            if True:
                y = np.array([[[s1 > 0, s1 < 0], [s2 < 0, s2 > 0]]], dtype=float)
                g = ch.g_out(y, omega[None], V)[0]
                logz = ch.log_z(y, omega[None], V)[0]
                ref_z = _z_out_mp([mp.mpf(v) for v in omega], mp.mpf(V), s1, s2)
                assert logz == pytest.approx(float(mp.log(ref_z)), rel=1e-9, abs=1e-9)
                for i in range(3):
                    def logz_i(t, i=i):
                        w = [mp.mpf(v) for v in omega]
                        w[i] += t
                        return mp.log(_z_out_mp(w, mp.mpf(V), s1, s2))
                    ref = float(mp.diff(logz_i, 0, h=mp.mpf("1e-6")))
                    assert g[i] == pytest.approx(ref, rel=1e-7, abs=1e-9), (omega, V, s1, s2, i)


def _log_bvn_mp(h, k, r):
    h, k = min(h, k), max(h, k)
    h, k, r = mp.mpf(h), mp.mpf(k), mp.mpf(r)
    s = mp.sqrt(1 - r * r)
    f = lambda x: mp.npdf(x) * mp.ncdf((k - r * x) / s)
    pts = [-mp.inf] + [h - d for d in (100, 30, 10, 3, 1, 0.3, 0.1, 0.03, 0.01, 0.003)] + [h]
    return mp.log(mp.quad(f, pts, maxdegree=10))


def test_log_bvn_tails():
    mp.mp.dps = 40
    rng = np.random.default_rng(3)
    pts = [(0, 0, 1 / 3), (-3.01, -3.01, -1 / 3), (-2.99, -2.99, -1 / 3), (-8, -8, -1 / 3),
           (-20, 5, 1 / 3), (-20, -25, -1 / 3), (5, -40, 1 / 3), (3, 4, -1 / 3)]
    pts += [(*rng.uniform(-15, 8, 2), rng.choice([-1 / 3, 1 / 3])) for _ in range(12)]
    for h, k, r in pts:
        assert log_bvn(h, k, r) == pytest.approx(float(_log_bvn_mp(h, k, r)), abs=1e-8), (h, k, r)


def test_hardmax_fisher_quadrature_converged():
    from smi_core.aim import channels
    ch = make_channel("hardmax", 2)
    for q, V in [(0.5, 1.0), (1.49, 0.01), (1.5, 1e-4)]:
        coarse = ch.fisher(q, V)
        defaults = channels._grid_1d.__defaults__
        channels._grid_1d.__defaults__ = (96, 48)
        try:
            fine = ch.fisher(q, V)
        finally:
            channels._grid_1d.__defaults__ = defaults
        assert coarse == pytest.approx(fine, rel=1e-8)


def test_hardmax_fisher_at_zero_overlap_closed_form():
    """ω = 0, V = 1: Φ₂(0, 0; r) = 1/4 + asin(r)/(2π), ∂_iΦ₂ = φ(0)/2."""
    total = 0.0
    for s1s2 in (1, -1):
        r = s1s2 / 3
        z = 0.25 + np.arcsin(r) / (2 * np.pi)
        R = 1 / np.sqrt(2 * np.pi) / 2 / z
        total += 2 * z * (2 * R * R + 2 * R * R + (R + s1s2 * R) ** 2) / 3
    assert make_channel("hardmax", 2).fisher(0.0, 1.0) == pytest.approx(total, rel=1e-13)


@pytest.mark.parametrize("args,msg", [(("probit", 2), "channel"), (("softmax", 1), "tokens"),
                                      (("hardmax", 1), "tokens"), (("softmax", 2.5), "tokens")])
def test_bad_channel(args, msg):
    with pytest.raises(ValueError, match=msg):
        make_channel(*args)
