"""Channel reparametrisation (spec §4; tied softmax, r = 1): the round trip
Z → y = g(Z) → reparametrise(y, h_{<L}) → (±u_L, ±h_L), and log|det Φ⁽ᴸ⁻¹⁾|.

Draws: c in [0, 10], β in [0.1, 10] (log-uniform), earlier layers' largest |β·logit| in
{0} ∪ [1e-6, 50], the last layer's in [1e-3, 15].  The last bound keeps y inside the softmax
range in float64: every entry of y is ≥ e^-30 / T ≈ 2e-14 and ≤ 1 - 2e-14.

Error metric (per sample, with the sign ± fixed by u):
    max|u - u_ref| ≤ 1e-12 · max|u_ref| + 1e-13 · A_u
    max|h - h_L|   ≤ 1e-12 · max|h_L|   + 1e-13 · A_h
where A_u, A_h (tests/reference.py, Model.reparam_sensitivity) bound, to first order, how far
u_L and h_L move per unit relative perturbation of the entries of y and of Φ⁽ᴸ⁻¹⁾: the
conditioning of the inversion.  It is large when u_L is nearly constant (y nearly uniform, so
u_L is barely identifiable; e.g. c = 0 with early layers saturated onto one token makes Φ nearly
rank one) or Φ⁽ᴸ⁻¹⁾ is nearly singular.  Draws where the conditioning alone allows less than 1e-8
relative accuracy of h_L are skipped, so every checked sample is held to ≤ 1e-8 relative error
and the well-conditioned majority to ≈ 1e-12.  Achieved (1500 random draws in this range with
L ∈ {2, 3}, T ∈ {2, 3, 4}, c ∈ {0, 10^U(-9,0), U(0,10)}, 914 kept; u = 1.1e-16 the unit
roundoff): h_L to ≤ 3.0·u·A_h, and to relative error ≤ 1.1e-13 where A_h ≤ 1e3·|h_L|; u_L (an
earlier measurement, 1070 kept draws) to ≤ 9.3·u·A_u.  The tolerance 1e-13 ≈ 900·u leaves a
wide margin for rounding.

The kernel solves Φ⁽ᴸ⁻¹⁾ h_L = u_L one layer factor c I + A_ℓ at a time and sums log|det| over
the factors (derive/reparam.last_layer_index, derive/attention.log_abs_det), so the metric holds
however different the scales of Φ's columns are: the Hadamard ratio κ_H = Π‖Φ_i‖/|det Φ|, ≫ κ
for c ≈ 0 and saturated attention, no longer matters (132 of the 914 kept draws above have
κ_H > 10·max(1, κ); their h_L errors are ≤ 1.2·u·A_h).  The former kernel, h_L = adj(Φ) u_L /
det Φ by the Berkowitz expansion of the product Φ, was only normwise stable and was checked
only where κ_H ≤ 10·max(1, κ); on the same draws it reached 2.8e5·u·A_h (test_h_ill_scaled
pins a case).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helpers import betas, model, raw_entries, skips
from reference import Model, det, eye, mp, permanent_abs, to_float, to_mp

CASES = [(L, T) for L in (1, 2, 3) for T in (2, 3, 4)]
RTOL, DELTA = 1e-12, 1e-13

SETTINGS = settings(max_examples=10, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))


@st.composite
def round_trip_inputs(draw, L, T, n_max=3):
    c, beta = draw(skips), draw(betas)
    ref = Model(L, T, 1, skip=c, beta=beta)
    n = draw(st.integers(1, n_max))
    raw = draw(arrays(np.float64, (n, L, T), elements=raw_entries))
    early = st.one_of(st.just(0.0), st.floats(1e-6, 50.0))
    sizes = [draw(st.lists(early, min_size=L - 1, max_size=L - 1)) + [draw(st.floats(1e-3, 15.0))]
             for _ in range(n)]
    Z = np.stack([ref.scale_layers(raw[i], sizes[i]) for i in range(n)])
    return Z, c, beta, ref


def _conditioning(ref, Z):
    """(A_u, A_h, κ, log|det Φ|) of every sample (reference.Model.mixing); Φ⁽⁰⁾ = I."""
    A_u, A_h = ref.reparam_sensitivity(Z)
    if ref.layers == 1:
        return A_u, A_h, np.ones(len(Z)), np.zeros(len(Z))
    _, logdet, kappa, _ = ref.mixing(Z)
    return A_u, A_h, kappa, logdet


@pytest.mark.parametrize("L,T", CASES)
@SETTINGS
@given(data=st.data())
def test_round_trip(L, T, data):
    """reparametrise(g(Z), h_{<L}) gives ±(u_L, h_L) with h_L = Z[L-1] and u_L = Φ⁽ᴸ⁻¹⁾ h_Lᵀ
    (mpmath), to the metric of the module docstring, and the same log|det Φ⁽ᴸ⁻¹⁾| as the
    mixing kernel and as mpmath (to 1e-12 · max(1, κ)); L = 1 gives h_L = u_L and log|det| = 0.
    Compiled and twin kernels alike."""
    Z, c, beta, ref = data.draw(round_trip_inputs(L, T))
    A_u, A_h, kappa, logdet_ref = _conditioning(ref, Z)
    h_true = Z[:, L - 1]
    h_norm = np.abs(h_true).max(axis=1)
    keep = DELTA * A_h <= 1e-8 * h_norm          # conditioning allows ≤ 1e-8 relative error
    assume(keep.any())
    Z, A_u, A_h, kappa, logdet_ref, h_true, h_norm = (
        x[keep] for x in (Z, A_u, A_h, kappa, logdet_ref, h_true, h_norm))
    u_ref = ref.last_layer_vector(Z)
    u_norm = np.abs(u_ref).max(axis=1)
    for backend in ("compiled", "twin"):
        m = model(backend, layers=L, tokens=T, rank=1, skip=c, beta=beta)
        y = m.forward(Z)
        rp = m.reparametrise(y, Z[:, :L - 1])
        assert rp.u.shape == rp.h.shape == (len(Z), T) and rp.logdet.shape == (len(Z),)
        for i in range(len(Z)):
            s = 1.0 if np.abs(rp.u[i] - u_ref[i]).max() <= np.abs(rp.u[i] + u_ref[i]).max() else -1.0
            err_u = np.abs(rp.u[i] - s * u_ref[i]).max()
            assert err_u <= RTOL * u_norm[i] + DELTA * A_u[i], (backend, i, err_u, u_norm[i], A_u[i])
            err_h = np.abs(rp.h[i] - s * h_true[i]).max()
            assert err_h <= RTOL * h_norm[i] + DELTA * A_h[i], (backend, i, err_h, h_norm[i], A_h[i])
        assert np.isfinite(rp.h).all()
        if L == 1:
            np.testing.assert_array_equal(rp.h, rp.u)
            np.testing.assert_array_equal(rp.logdet, 0.0)
            continue
        mix = m.mixing(Z)
        checked = kappa <= 1e14
        tol = RTOL * np.maximum(1.0, kappa[checked])
        assert np.all(np.abs(rp.logdet[checked] - logdet_ref[checked]) <= tol)
        assert np.all(np.abs(rp.logdet[checked] - mix.logdet[checked]) <= tol)


@pytest.mark.parametrize("L,T", [(L, T) for L, T in CASES if L >= 2])
@SETTINGS
@given(data=st.data())
def test_inverse_kernel(L, T, data):
    """The inverse kernel (derive.reparam.inverse_program: the polar rules' node data) against
    (Φ⁽ᴸ⁻¹⁾)⁻¹ in mpmath, to max|X - X_ref| ≤ (1e-12 + 1e-13 · Σ_ℓ κ_ℓ) max|X_ref| with κ_ℓ =
    ‖B_ℓ‖∞ ‖B_ℓ⁻¹‖∞ the condition number of layer factor B_ℓ = c I + A_ℓ (the kernel solves one
    factor at a time, so a relative perturbation δ of each factor's entries moves X by ≤ Σ_ℓ
    κ_ℓ δ |X|), and non-finite only where that bound allows an O(1) error (e.g. c = 1e-38, h =
    0: B_1 = c I + 11ᵀ/2 singular to working precision); log|det Φ⁽ᴸ⁻¹⁾| as ``test_round_trip``
    checks it; by columns (``Kernel.columns``, rows of
    a larger array) the same as by rows.  Compiled and twin kernels alike."""
    Z, c, beta, ref = data.draw(round_trip_inputs(L, T))
    for backend in ("compiled", "twin"):
        m = model(backend, layers=L, tokens=T, rank=1, skip=c, beta=beta)
        x = Z[:, :L - 1].reshape(len(Z), -1)
        out = m.kernel("inverse")(x, m.params)
        big = np.full((x.shape[1] + out.shape[1] + 2, len(Z)), np.nan)
        big[:x.shape[1]] = x.T
        m.kernel("inverse").columns(big[:x.shape[1]], m.params, big[x.shape[1] + 1:-1])
        np.testing.assert_array_equal(big[x.shape[1] + 1:-1].T, out)
        assert np.isnan(big[x.shape[1]]).all() and np.isnan(big[-1]).all()
        _, logdet_ref, kappa_det, _ = ref.mixing(Z)
        checked = kappa_det <= 1e14
        assert np.all(np.abs(out[checked, -1] - logdet_ref[checked]) <= RTOL * np.maximum(1.0, kappa_det[checked]))
        for i, z in enumerate(Z):
            zm, before, kappa = to_mp(z), eye(T), 0.0
            for layer in range(1, L):
                phi = ref.mixing_mp(zm, upto=layer)
                B = (mp.matrix(phi) * mp.matrix(before) ** -1).tolist()
                if abs(det(B)) <= mp.mpf(10) ** (20 - mp.dps) * permanent_abs(B):
                    break                   # a factor singular at 50 digits (c ≈ 0): no inverse to check
                kappa += float(mp.mnorm(mp.matrix(B), "inf") * mp.mnorm(mp.matrix(B) ** -1, "inf"))
                before = phi
            else:
                X_ref = to_float((mp.matrix(before) ** -1).tolist())
                if not np.isfinite(out[i, :-1]).all():      # only where a factor is singular to
                    assert DELTA * kappa >= 1.0, (backend, i, kappa)    # working precision (the
                    continue                                            # rules skip those nodes)
                err = np.abs(out[i, :-1].reshape(T, T) - X_ref).max()
                assert err <= (RTOL + DELTA * kappa) * np.abs(X_ref).max(), (backend, i, err, kappa)


def test_spec_formula_T2():
    """T = 2: u = ±(a, -b)/√(a+b), a = log(1/y₁₂ - 1)/β, b = log(1/y₂₁ - 1)/β (spec §4)."""
    beta = 1.7
    rng = np.random.default_rng(0)
    H = rng.normal(size=(4, 1, 2))
    m = model(layers=1, tokens=2, rank=1, beta=beta)
    y = m.forward(H)
    a = np.log(1 / y[:, 0, 1] - 1) / beta
    b = np.log(1 / y[:, 1, 0] - 1) / beta
    u = np.stack([a, -b], axis=1) / np.sqrt(a + b)[:, None]
    rp = m.reparametrise(y)
    s = np.sign((rp.u * u).sum(axis=1))[:, None]
    np.testing.assert_allclose(s * rp.u, u, rtol=1e-13, atol=0)
    np.testing.assert_allclose(np.abs(rp.u), np.abs(H[:, 0]), rtol=1e-13, atol=0)


def test_both_signs_are_preimages():
    """(u, h) and (-u, -h) both map back to y (the model is even in h_L)."""
    rng = np.random.default_rng(1)
    Z = 0.8 * rng.normal(size=(3, 3, 3))
    m = model(layers=3, tokens=3, rank=1, skip=0.7, beta=1.3)
    y = m.forward(Z)
    rp = m.reparametrise(y, Z[:, :2])
    for sign in (1.0, -1.0):
        back = Z.copy()
        back[:, 2] = sign * rp.h
        np.testing.assert_allclose(m.forward(back), y, rtol=1e-13, atol=0)


@pytest.mark.parametrize("backend", ["compiled", "twin"])
def test_h_ill_scaled(backend):
    """L = 3, T = 4, c = 0.0109, β = 1.266 (κ = 1.1e4, κ_H = 2.3e10, A_h = 9.9e6, |h_L| = 437):
    the conditioning allows an error of 1e-13 · A_h ≈ 1e-6 in h_L.  Regression test: the
    former kernel, h_L = adj(Φ) u_L / det Φ by the Berkowitz expansion of the product Φ, was
    off by 5.5e-5 (1.3e-7 relative, 5e4·u·A_h), while numpy.linalg.solve on the kernel's own Φ
    and u_L is off by 2e-10.  Solving one factor c I + A_ℓ at a time the kernel is off by
    1.8e-10 (0.17·u·A_h).  u_L itself is right to 3e-14."""
    beta, c = 1.265746602915107, 0.010895818311020863
    Z = np.array([[[0.0, -0.0, 0.0, 0.0],
                   [1.4311291880593794e+01, -2.4091026295508328e-01, 1.7728295203362574e+01, -7.4309672435581184e+00],
                   [-2.5978114341600974e+02, -4.3714223625715556e+02, 2.7056105117835608e+02, 4.3439456739566219e+02]]])
    ref = Model(3, 4, 1, skip=c, beta=beta)
    A_u, A_h = ref.reparam_sensitivity(Z)
    m = model(backend, layers=3, tokens=4, rank=1, skip=c, beta=beta)
    rp = m.reparametrise(m.forward(Z), Z[:, :2])
    h, u_ref = Z[0, 2], ref.last_layer_vector(Z)[0]
    s = 1.0 if np.abs(rp.u[0] - u_ref).max() <= np.abs(rp.u[0] + u_ref).max() else -1.0
    assert np.abs(rp.u[0] - s * u_ref).max() <= RTOL * np.abs(u_ref).max() + DELTA * A_u[0]
    h_lu = np.linalg.solve(m.mixing(Z).phi[0], rp.u[0])
    assert np.abs(h_lu - s * h).max() <= RTOL * np.abs(h).max() + DELTA * A_h[0]    # LU: fine
    assert np.abs(rp.h[0] - s * h).max() <= RTOL * np.abs(h).max() + DELTA * A_h[0]  # the kernel too


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(D=st.floats(np.log(1e-3), np.log(30.0)).map(np.exp), ell=st.floats(-30.0, 30.0), beta=betas)
def test_chart_kernel(D, ell, beta):
    """The chart kernel (derive.reparam.chart_program, T = 2, L = 1) against its definitions,
    D = u_1 - u_2 and ℓ = log(σ_21/σ_22)/β = u_2 (u_1 - u_2): its σ is the mpmath forward of
    tests/reference.py at its u; log|det ∂u/∂(D, ℓ)| is -log|det ∂(D, ℓ)/∂u| with
    ∂(D, ℓ)/∂u = [[1, -1], [u_2, u_1 - 2u_2]]; and D·u = Σ_k poly_k D^k.  Tolerances scale with
    the rounding of the logits β u_t u_s (≤ 1e-15 β |u|²)."""
    m = model(layers=1, tokens=2, rank=1, beta=beta)
    out = m.kernel("chart")(np.array([[D, ell]]), m.params)[0]
    u, sig, logdet, poly = out[:2], out[2:6], out[6], out[7:13].reshape(2, 3)
    scale = np.abs(u).max()
    assert abs((u[0] - u[1]) - D) <= 1e-14 * scale
    assert abs(u[1] * (u[0] - u[1]) - ell) <= 1e-14 * scale ** 2
    ref = np.array([float(v) for v in np.ravel(Model(1, 2, 1, beta=beta).forward_mp([[u[0], u[1]]]))])
    tol = 1e-13 * (1 + beta * scale ** 2)
    assert np.all(np.abs(sig - ref) <= tol * np.maximum(np.abs(ref), 1e-300)), (sig, ref)
    jac = np.array([[1.0, -1.0], [u[1], u[0] - 2 * u[1]]])
    assert abs(logdet + np.log(abs(np.linalg.det(jac)))) <= 1e-12 * (1 + scale ** 2 / D)
    assert np.allclose(D * u, poly @ np.array([1.0, D, D * D]), rtol=1e-14, atol=1e-14 * scale * D)
