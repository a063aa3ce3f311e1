"""Route 3: closed-form channels derived by SymPy (derive/closed.py), against scipy quadrature
and against the generic noisy route."""
import numpy as np
import pytest
import sympy as sp
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
