"""Free convolution S + √Δ Z (AIM.md §3): limits, mass, an mpmath reference of the spec formula,
eigenvalue histograms of sampled matrices, the RIE map."""
import mpmath as mp
import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings, strategies as st

from derive import aim as sym
from smi_core.aim import aim_free_convolution


def sample_eigenvalues(rho, delta, d, rng):
    r = max(1, round(rho * d))
    W = rng.standard_normal((d, r))
    S = W @ W.T / np.sqrt(r * d)
    A = rng.standard_normal((d, d))
    Z = (A + A.T) / np.sqrt(2 * d)
    return np.linalg.eigvalsh(S + np.sqrt(delta) * Z), S, S + np.sqrt(delta) * Z


@pytest.mark.parametrize("rho", [0.1, 0.5, 2.0, 5.0])
def test_small_noise_limit(rho):
    limit = 2 * rho - rho ** 2 if rho <= 1 else 1.0
    assert aim_free_convolution(rho, 1e-8).mmse / 1e-8 == pytest.approx(limit, rel=1e-4)


@pytest.mark.parametrize("rho", [1e-3, 0.5, 1.0, 10.0])
def test_large_noise_limit(rho):
    # mmse → Q0 - ρ = 1; the first correction is O(1/Δ)
    assert abs(aim_free_convolution(rho, 1e6).mmse - 1) < 2e-5


@settings(max_examples=40, deadline=None)
@given(log_rho=st.floats(np.log10(1e-3), 1.0), log_delta=st.floats(-6.0, 6.0))
def test_mass_bounds_and_spec_formula(log_rho, log_delta):
    rho, delta = 10 ** log_rho, 10 ** log_delta
    fc = aim_free_convolution(rho, delta)
    assert fc.bands.shape[0] in (1, 2)
    assert abs(fc.mass - 1) < 1e-10
    m = fc.mmse
    assert 0 < m <= min(delta, 1.0) * (1 + 1e-12)
    if delta <= 100:     # Δ - (4π²/3)Δ²∫μ³ cancels for large Δ; elsewhere both agree
        spec = delta - 4 * np.pi ** 2 / 3 * delta ** 2 * fc.cube_integral
        assert spec == pytest.approx(m, rel=1e-9)


def _mp_reference(rho, delta, dps=30):
    """Δ - (4π²/3)Δ²∫μ³ at `dps` digits: edges from the symbolic discriminant of the cubic,
    μ from mpmath's roots of the cubic, tanh-sinh quadrature over each band."""
    mp.mp.dps = dps
    R, D = mp.mpf(rho), mp.mpf(delta)
    disc = [mp.mpf(sp.N(c.subs({sym.rho: sp.Rational(rho), sym.Delta: sp.Rational(delta)}), dps))
            for c in sym.edge_discriminant().all_coeffs()]
    edges = sorted(mp.re(x) for x in mp.polyroots(disc, maxsteps=200, extraprec=200) if abs(mp.im(x)) < mp.mpf(10) ** (-dps // 2))
    coef = sp.lambdify((sym.rho, sym.Delta, sym.z), sp.Poly(sym.stieltjes_cubic(), sym.G).all_coeffs(), "mpmath")

    def mu(x):
        roots = mp.polyroots(coef(R, D, x), maxsteps=200, extraprec=100)
        return max(mp.im(g) for g in roots) / mp.pi

    total = mp.mpf(0)
    for lo, hi in zip(edges[:-1], edges[1:]):
        if mu((lo + hi) / 2) > 0:
            total += mp.quad(lambda x: mu(x) ** 3, [lo, hi])
    return float(D - 4 * mp.pi ** 2 / 3 * D ** 2 * total), len(edges)


@pytest.mark.parametrize("rho,delta", [(0.25, 0.001), (2.0, 0.1)])
def test_mmse_against_mpmath(rho, delta):
    ref, _ = _mp_reference(rho, delta)
    assert aim_free_convolution(rho, delta).mmse == pytest.approx(ref, rel=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("rho,delta", [(1e-3, 1e3), (10.0, 1e6), (0.5, 1e-6), (0.5, 1.0)])
def test_mmse_against_mpmath_extremes(rho, delta):
    ref, _ = _mp_reference(rho, delta, dps=40)
    assert aim_free_convolution(rho, delta).mmse == pytest.approx(ref, rel=1e-8)


def _cdf(fc, x):
    grid = np.concatenate([np.linspace(lo, hi, 20001) for lo, hi in fc.bands])
    mu = fc.density(grid)
    cum = np.concatenate([[0], np.cumsum((mu[1:] + mu[:-1]) / 2 * np.diff(grid))])
    return np.interp(x, grid, cum)


@pytest.mark.parametrize("rho,delta,d", [(0.3, 0.002, 2000), (2.0, 0.5, 1000)])
def test_density_matches_sampled_eigenvalues(rho, delta, d):
    fc = aim_free_convolution(rho, delta)
    eig, _, _ = sample_eigenvalues(rho, delta, d, np.random.default_rng(0))
    if rho == 0.3:
        assert fc.bands.shape[0] == 2
        gap = (fc.bands[0, 1], fc.bands[1, 0])
        assert np.mean((eig > gap[0] + 0.01) & (eig < gap[1] - 0.01)) == 0
    x = np.quantile(eig, np.linspace(0.05, 0.95, 19))
    empirical = np.array([np.mean(eig <= v) for v in x])
    assert np.abs(_cdf(fc, x) - empirical).max() < 0.01


def test_rie_two_forms_and_sampled_error():
    rho, delta = 0.5, 0.3
    fc = aim_free_convolution(rho, delta)
    x = np.linspace(*fc.bands[0], 50)[1:-1]
    G = fc.stieltjes(x)
    np.testing.assert_allclose(fc.rie(x), x - 2 * delta * G.real, rtol=1e-9, atol=1e-12)
    _, S, Y = sample_eigenvalues(rho, delta, 600, np.random.default_rng(1))
    lam, U = np.linalg.eigh(Y)
    S_hat = (U * fc.rie(lam)) @ U.T
    assert np.sum((S - S_hat) ** 2) / 600 == pytest.approx(fc.mmse, abs=0.02)


@pytest.mark.parametrize("kw,msg", [({"rho": 0, "delta": 1}, "rho"), ({"rho": 1, "delta": -1}, "delta"),
                                    ({"rho": np.nan, "delta": 1}, "rho")])
def test_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        aim_free_convolution(**kw)
