"""Route 3: closed-form channels derived by SymPy (derive/closed.py), against scipy quadrature
and against the generic noisy route."""
import numpy as np
import pytest
import sympy as sp
import mpmath as mp
from scipy import integrate

from smi_core import LinkModel, index_symbols, register_link

H = index_symbols(1, 1)
register_link("test_sign", sp.sign(H[0, 0]))
register_link("test_affine", 2 * H[0, 0] + 1)
Y = np.array([1.0, -1.0, 1.0, -1.0])
OMEGA = np.array([0.3, 0.5, -2.0, 4.0]).reshape(4, 1, 1)
V = 0.5


def test_sign_channel_matches_quadrature():
    m = LinkModel("test_sign").channel().moments(Y, OMEGA, V)
    for i in range(len(Y)):
        f = lambda z, k: np.exp(-(z - OMEGA[i, 0, 0]) ** 2 / (2 * V)) * (Y[i] * z > 0) * z ** k
        I = [integrate.quad(f, -40, 40, args=(k,), points=[0], epsabs=0, epsrel=1e-13, limit=200)[0]
             for k in range(3)]
        mean, var = I[1] / I[0], I[2] / I[0] - (I[1] / I[0]) ** 2
        assert np.isclose(m.g_out[i, 0, 0], (mean - OMEGA[i, 0, 0]) / V, rtol=1e-8)
        assert np.isclose(m.dg_out[i, 0, 0], var / V ** 2 - 1 / V, rtol=1e-7)
        assert np.isclose(m.log_z[i], np.log(I[0] / np.sqrt(2 * np.pi * V)), rtol=1e-10)


def test_affine_noisy_channel_closed_form_and_generic_route_agree():
    model = LinkModel("test_affine")
    closed = model.channel(noise=0.3, route="closed").moments(Y, OMEGA, V)
    generic = model.channel(noise=0.3, tol=1e-10).moments(Y, OMEGA, V)
    # N(y; 2ω + 1, 4V + Δ): g_out = 2(y - 2ω - 1)/(4V + Δ), ∂g_out = -4/(4V + Δ)
    assert np.allclose(closed.g_out[:, 0, 0], 2 * (Y - 2 * OMEGA[:, 0, 0] - 1) / (4 * V + 0.3), rtol=1e-12)
    assert np.allclose(closed.dg_out, -4 / (4 * V + 0.3), rtol=1e-12)
    assert np.allclose(generic.g_out, closed.g_out, rtol=1e-8)
    assert np.allclose(generic.dg_out, closed.dg_out, rtol=1e-8)
    assert np.allclose(generic.log_z, closed.log_z, rtol=1e-8)


def test_no_closed_form_is_a_clear_error():
    register_link("test_square", H[0, 0] ** 2)
    with pytest.raises(ValueError, match="no elementary closed-form channel"):
        LinkModel("test_square").channel(noise=0.1, route="closed")


register_link("test_phase_retrieval", H[0, 0] ** 2)
register_link("test_abs", sp.Abs(H[0, 0]))


def _two_point_reference(y, omega, V, r, dg):
    """mpmath at 40 digits: log Z_out = log Σ_± N(±r; ω, V) − log|g'(r)| and its ω-derivatives."""
    mp.mp.dps = 40
    r, V = mp.mpf(r), mp.mpf(V)
    log_z = lambda w: mp.log(mp.npdf(r, w, mp.sqrt(V)) + mp.npdf(-r, w, mp.sqrt(V))) - mp.log(dg)
    w = mp.mpf(omega)
    return [float(mp.diff(log_z, w, k)) for k in range(3)]


@pytest.mark.parametrize("name, root, slope", [
    ("test_phase_retrieval", np.sqrt, lambda r: 2 * r),
    ("test_abs", lambda y: y, lambda r: 1.0)])
def test_noiseless_even_link_two_point_channel(name, root, slope):
    """g(z) = z², |z| without noise: P(y|z) = δ(y − g(z)); against mpmath, over V from 1 down to
    1e-6 and |ω r / V| up to 4e6 (where 2cosh overflows a double)."""
    y = np.array([0.3, 2.0, 1e-4, 5.0, 1.0, 0.7])
    omega = np.array([0.2, -1.5, 0.01, 3.0, -1.0, 2.0])
    V = np.array([1.0, 0.5, 1e-2, 1e-6, 1e-3, 1e-6])
    m = LinkModel(name).channel().moments(y, omega.reshape(-1, 1, 1), V)
    for i in range(len(y)):
        r = root(y[i])
        log_z, g, dg = _two_point_reference(y[i], omega[i], V[i], r, slope(r))
        assert np.isclose(m.log_z[i], log_z, rtol=1e-12, atol=1e-12), i
        assert np.isclose(m.g_out[i, 0, 0], g, rtol=1e-10, atol=1e-10 / V[i]), i
        assert np.isclose(m.dg_out[i, 0, 0], dg, rtol=1e-10, atol=1e-10 / V[i] ** 2), i


def test_closed_channel_rejects_outputs_outside_the_range():
    with pytest.raises(ValueError, match=r"y must be > 0 .*sample 1"):
        LinkModel("test_phase_retrieval").channel().moments([1.0, -0.5], [[[0.0]], [[0.0]]], 0.5)
    with pytest.raises(ValueError, match=r"y must be ±1 .*sample 0"):
        LinkModel("test_sign").channel().moments([0.5], [[[0.0]]], 0.5)
