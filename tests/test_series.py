"""Large-depth series (spec §3): the symbolic derivation against the closed forms, and the exact
deep model approaching the series at the predicted rate."""
from __future__ import annotations

import time

import numpy as np
import pytest
import sympy as sp

from derive.attention import BETA
from derive.series import large_depth_series
from smi_core import DeepAttention, LargeDepthSeries

CASES = [(L, T, r) for L in (2, 3) for T in (2, 3) for r in (1, 2)]
N = 16


# -- numpy references (test-only) ---------------------------------------------------------------

def softmax(M, beta):
    e = np.exp(beta * (M - M.max(axis=-1, keepdims=True)))
    return e / e.sum(axis=-1, keepdims=True)


def dsoftmax(M, V, beta):
    """Directional derivative of the row-wise σ_β at M along V."""
    p = softmax(M, beta)
    return beta * p * (V - (p * V).sum(axis=-1, keepdims=True))


def blocks(Z, L, r):
    return [Z[:, l * r:(l + 1) * r, :] for l in range(L)]


def gram(h):
    """h_ℓᵀ h_ℓ, (n, T, T)."""
    return np.einsum("nat,nas->nts", h, h)


def rescaled_model(Z, L, r, eps, beta, link="softmax"):
    """The rescaled recursion Φ⁽ℓ⁾ = (I + ε σ_β(u uᵀ)) Φ⁽ℓ⁻¹⁾ directly (Φ⁽ᴸ⁻¹⁾, M, y)."""
    n, _, T = Z.shape
    phi = np.broadcast_to(np.eye(T), (n, T, T)).copy()
    hs = blocks(Z, L, r)
    for h in hs[:-1]:
        u = phi @ np.swapaxes(h, 1, 2)
        phi = (np.eye(T) + eps * softmax(u @ np.swapaxes(u, 1, 2), beta)) @ phi
    u = phi @ np.swapaxes(hs[-1], 1, 2)
    M = u @ np.swapaxes(u, 1, 2)
    return phi, M, softmax(M, beta) if link == "softmax" else M


def norm(a):
    return np.linalg.norm(a, axis=(-2, -1))


@pytest.fixture
def rng():
    """A fresh generator per test: module-wide, each test's draws depended on which tests had
    run before it on the same xdist worker (once [2-2-1-softmax] drew a Z whose logits ratio was
    1.027, outside the asymptotic atol of 0.02)."""
    return np.random.default_rng(20240521)


# -- the derivation -----------------------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", CASES)
def test_coefficients_match_closed_forms(L, T, r, rng):
    """Φ₀ = I, Φ₁ = Σ σ_β(h_ℓᵀh_ℓ), M₀ = h_Lᵀh_L, M₁ = Φ₁M₀ + M₀Φ₁ᵀ (spec §3), and the next
    order Φ₂ = Σ_{ℓ'<ℓ} σ_ℓσ_ℓ' + Σ_ℓ Dσ_β[Φ₁⁽ℓ⁾G_ℓ + G_ℓΦ₁⁽ℓ⁾ᵀ], M₂ = Φ₂M₀ + M₀Φ₂ᵀ + Φ₁M₀Φ₁ᵀ."""
    beta = 1.3
    Z = rng.standard_normal((N, L * r, T))
    c = LargeDepthSeries(L, T, r, beta=beta).coefficients(Z)
    G = [gram(h) for h in blocks(Z, L, r)]
    sig = [softmax(g, beta) for g in G[:-1]]
    phi1 = sum(sig)
    M0 = G[-1]
    tr = lambda a: np.swapaxes(a, 1, 2)
    np.testing.assert_allclose(c["phi0"], np.broadcast_to(np.eye(T), (N, T, T)), atol=1e-14)
    np.testing.assert_allclose(c["phi1"], phi1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c["M0"], M0, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(c["M1"], phi1 @ M0 + M0 @ tr(phi1), rtol=1e-12, atol=1e-12)
    phi2, before = np.zeros_like(phi1), np.zeros_like(phi1)
    for s, g in zip(sig, G):
        phi2 += s @ before + dsoftmax(g, before @ g + g @ tr(before), beta)
        before = before + s
    np.testing.assert_allclose(c["phi2"], phi2, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(c["M2"], phi2 @ M0 + M0 @ tr(phi2) + phi1 @ M0 @ tr(phi1), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(c["dy2"], dsoftmax(M0, c["M2"], beta), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(c["y0"], softmax(M0, beta), rtol=1e-12, atol=1e-14)


def test_explicit_phi1_is_the_sum_of_softmaxes():
    """Symbolically: the derived Φ₁, back-substituted into z_a_t and β, equals Σ_ℓ σ_β(h_ℓᵀh_ℓ)
    written with plain exponentials (checked at a random rational point to 30 digits)."""
    L, T, r = 3, 2, 1
    s = large_depth_series(L, T, r)
    Z = s.index_symbols
    closed = sp.zeros(T, T)
    for l in range(L - 1):
        G = Z[l * r:(l + 1) * r, :].T * Z[l * r:(l + 1) * r, :]
        for t in range(T):
            row = [sp.exp(BETA * G[t, k]) for k in range(T)]
            for k in range(T):
                closed[t, k] += row[k] / sp.Add(*row)
    diff = s.explicit("phi1") - closed
    point = {z: sp.Rational(int(v), 7) for z, v in zip(Z, [3, -5, 8, 2, -4, 6])}
    point[BETA] = sp.Rational(3, 2)
    assert max(abs(sp.N(e.xreplace(point), 30)) for e in diff) < 1e-25
    assert s.explicit("phi0") == sp.eye(T)
    assert s.explicit("M0") == (Z[-r:, :].T * Z[-r:, :]).applyfunc(sp.expand)


def test_derivation_is_fast():
    """L = 4, T = 3, r = 2 derives in seconds (the recursion is straight-line, linear in depth)."""
    large_depth_series.cache_clear()
    start = time.perf_counter()
    s = large_depth_series(4, 3, 2)
    elapsed = time.perf_counter() - start
    assert elapsed < 15, f"derivation took {elapsed:.1f} s"
    assert len(s.program.body) < 2000
    Z = np.random.default_rng(1).standard_normal((4, 8, 3))
    c = LargeDepthSeries(4, 3, 2).coefficients(Z)
    np.testing.assert_allclose(c["phi1"], sum(softmax(gram(h), 1.0) for h in blocks(Z, 4, 2)[:-1]), rtol=1e-12)


# -- the exact model ----------------------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", [(2, 2, 1), (2, 3, 2), (3, 2, 1), (3, 3, 2)])
def test_exact_is_the_rescaled_recursion(L, T, r, rng):
    """DeepAttention(skip=1/ε) on the indices h_ℓ ε^ℓ gives c^{L-1} × the rescaled Φ⁽ᴸ⁻¹⁾ and the
    rescaled model's logits and output."""
    beta, eps = 0.8, 0.3
    Z = rng.standard_normal((N, L * r, T))
    S = LargeDepthSeries(L, T, r, beta=beta)
    ex = S.exact(Z, eps)
    phi, M, y = rescaled_model(Z, L, r, eps, beta)
    np.testing.assert_allclose(ex.phi, phi, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ex.logits, M, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(ex.y, y, rtol=1e-11, atol=1e-13)
    c = 1 / eps
    model = DeepAttention(L, T, r, skip=c, beta=beta)
    np.testing.assert_allclose(model.mixing(S.rescale(Z, eps)).phi / c ** (L - 1), phi, rtol=1e-12, atol=1e-13)


def test_rescaling_identity_for_the_last_layer(rng):
    """u_L of the original model = c^{L-1} × rescaled u_L: for L = 2 the rescaled y is the original
    y with h_L / c.  For L = 3 that alone is not enough — layer 2 of the original reads the stream
    Φ⁽¹⁾ = c × rescaled Φ⁽¹⁾ — and h_2 must be divided by c as well (what ``rescale`` does)."""
    beta, eps = 1.0, 0.25
    c = 1 / eps
    for L in (2, 3):
        Z = rng.standard_normal((N, L, 3))
        _, _, y = rescaled_model(Z, L, 1, eps, beta)
        last_only = Z.copy()
        last_only[:, -1] /= c ** (L - 1)
        y_last_only = DeepAttention(L, 3, 1, skip=c, beta=beta).forward(last_only)
        if L == 2:
            np.testing.assert_allclose(y_last_only, y, rtol=1e-12, atol=1e-14)
        else:
            assert np.abs(y_last_only - y).max() > 1e-3
        every = Z / c ** np.arange(L)[None, :, None]
        np.testing.assert_allclose(DeepAttention(L, 3, 1, skip=c, beta=beta).forward(every), y,
                                   rtol=1e-12, atol=1e-14)


# -- convergence at the predicted rate ----------------------------------------------------------

def _errors(S, Z, eps):
    ev, ex = S.evaluate(Z, eps), S.exact(Z, eps)
    c = ev.coefficients
    return dict(
        phi=norm(ex.phi - ev.phi_first_order),
        logits=norm(ex.logits - ev.logits_first_order),
        y=norm(ex.y - ev.y_first_order),
        phi3=norm(ex.phi - ev.phi_first_order - eps ** 2 * c["phi2"]),
        logits3=norm(ex.logits - ev.logits_first_order - eps ** 2 * c["M2"]),
        y3=norm(ex.y - (c["y0"] + eps * c["y1"] + eps ** 2 * c["y2"])),
    ), ev


@pytest.mark.parametrize("link", ["softmax", "linear"])
@pytest.mark.parametrize("L,T,r", CASES)
def test_exact_model_approaches_the_series(L, T, r, link, rng):
    beta = 1.0
    Z = rng.standard_normal((N, L * r, T))
    S = LargeDepthSeries(L, T, r, beta=beta, link=link)
    eps = 5e-4
    e1, ev1 = _errors(S, Z, eps)
    e2, ev2 = _errors(S, Z, eps / 2)

    # Φ: error / ε² → ‖Φ₂‖ (L = 2: Φ⁽¹⁾ = I + εσ₁ is exactly first order, Φ₂ = 0)
    if L == 2:
        assert e1["phi"].max() < 1e-13 and ev1.phi_bound.max() == 0
    else:
        np.testing.assert_allclose(e1["phi"] / ev1.phi_bound, 1, atol=0.02)
        np.testing.assert_allclose(e2["phi"] / ev2.phi_bound, 1, atol=0.01)
        np.testing.assert_allclose(e1["phi"] / e2["phi"], 4, rtol=0.03)
        third = e1["phi3"] / e2["phi3"]                    # Φ₂ itself is right: remainder O(ε³)
        assert abs(np.median(third) / 8 - 1) < 0.05 and third.min() > 5

    # logits: error / ε² → ‖M₂‖ (L = 2: M is quadratic in ε, the ε² term is the whole error)
    np.testing.assert_allclose(e1["logits"] / ev1.logit_bound, 1, atol=0.02)
    np.testing.assert_allclose(e2["logits"] / ev2.logit_bound, 1, atol=0.01)
    np.testing.assert_allclose(e1["logits"] / e2["logits"], 4, rtol=0.03)

    # y = s(M): error / ε² → ‖Ds(M₀)[M₂]‖ ≤ Lip(s)‖M₂‖ (the bound), Taylor remainder O(ε³)
    np.testing.assert_allclose(e1["y"] / ev1.y_error_estimate, 1, atol=0.02)
    np.testing.assert_allclose(e2["y"] / ev2.y_error_estimate, 1, atol=0.01)
    np.testing.assert_allclose(e1["y"] / e2["y"], 4, rtol=0.03)
    assert (e2["y"] <= ev2.y_bound * (1 + 10 * eps)).all()
    assert (ev2.y_error_estimate <= ev2.y_bound * (1 + 1e-12)).all()
    ok = e2["y3"] > 1e-13            # (L = 2, linear: y is exactly quadratic in ε)
    if ok.any():
        third = e1["y3"][ok] / e2["y3"][ok]
        assert abs(np.median(third) / 8 - 1) < 0.05 and third.min() > 5


def test_four_layers_with_the_twin(rng):
    """L = 4 (no committed kernels: ``backend="auto"`` uses the lambdify twin), β = 1.5."""
    S = LargeDepthSeries(4, 2, 1, beta=1.5)
    Z = rng.standard_normal((8, 4, 2))
    e1, ev1 = _errors(S, Z, 2.5e-4)
    e2, ev2 = _errors(S, Z, 1.25e-4)
    np.testing.assert_allclose(e2["phi"] / ev2.phi_bound, 1, atol=0.01)
    np.testing.assert_allclose(e1["phi"] / e2["phi"], 4, rtol=0.03)
    np.testing.assert_allclose(e2["y"] / ev2.y_error_estimate, 1, atol=0.01)
    np.testing.assert_allclose(e1["y"] / e2["y"], 4, rtol=0.03)


def test_softmax_bound_is_honest_at_finite_eps(rng):
    """‖y(ε) - s(M₀+εM₁)‖ ≤ (β/2)‖M(ε) - M₀ - εM₁‖ holds exactly (Lipschitz softmax), and
    the reported y_bound is its leading term."""
    L, T, r, beta = 3, 3, 1, 2.0
    Z = rng.standard_normal((64, L * r, T))
    S = LargeDepthSeries(L, T, r, beta=beta)
    for eps in (0.2, 0.05, 0.01):
        ev, ex = S.evaluate(Z, eps), S.exact(Z, eps)
        assert (norm(ex.y - ev.y_first_order) <= beta / 2 * norm(ex.logits - ev.logits_first_order) + 1e-15).all()
    assert ev.lipschitz == beta / 2
    np.testing.assert_allclose(ev.y_bound, beta / 2 * ev.logit_bound)


def test_single_sample_and_bad_input(rng):
    S = LargeDepthSeries(2, 2, 1)
    Z = rng.standard_normal((2, 2))
    ev = S.evaluate(Z, 0.1)
    assert ev.y_first_order.shape == (2, 2) and np.ndim(ev.phi_bound) == 0
    assert S.exact(Z, 0.1).phi.shape == (2, 2)
    with pytest.raises(ValueError, match="Z must have shape"):
        S.evaluate(rng.standard_normal((3, 3, 2)), 0.1)
    with pytest.raises(ValueError, match="eps"):
        S.exact(Z, 0.0)
    with pytest.raises(ValueError, match="link"):
        LargeDepthSeries(2, 2, 1, link="hardmax")
    with pytest.raises(ValueError, match="layers"):
        large_depth_series(0, 2, 1)
