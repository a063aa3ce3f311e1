"""Forward kernels of deep attention (spec §2): compiled kernel == lambdify twin == mpmath.

The ground truth is tests/reference.py (mpmath at 50 digits, written from the spec alone; its
Jacobians are central differences at 150+ digits).  Inputs are drawn with a controlled softmax
saturation: each layer's largest |β·logit| is 0 or drawn in [1e-6, 50] (so rows of y reach
e^-100 next to 1), β in [0.1, 10] (log-uniform), skip c in [0, 10], over every pre-generated
(L, T, r) of the tied softmax model (helpers.tied_inputs).

Error metrics (all per sample):
- y, Φ: componentwise relative, |x - x_ref| ≤ 1e-12 |x_ref| (all entries are > 0).
- ∂y/∂Z: normwise relative, max|J - J_ref| ≤ 1e-12 · max|J_ref| + S, S the conditioning
  allowance (how far the exact J moves when the inputs and every intermediate value are
  perturbed by relative 1e-13); see test_jacobian_matches_mpmath.
- log|det Φ|: absolute error ≤ 1e-12 · max(1, κ), κ the condition number of det with respect to
  relative perturbations of the entries of Φ (wherever κ ≤ 1e14), however different the scales
  of Φ's columns (the Hadamard ratio κ_H, which once limited the T ≥ 3 kernels, plays no part).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helpers import SETTINGS, betas, logit_sizes, model, raw_entries, rel_err, skips, tied_inputs
from reference import Model, mp, to_mp

PREGENERATED = [(L, T, r) for L in (1, 2, 3) for T in (2, 3, 4) for r in (1, 2)]
DEEP = [case for case in PREGENERATED if case[0] >= 2]
RTOL = 1e-12

FEW = settings(SETTINGS, max_examples=4)


# -- y = g(Z) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", PREGENERATED)
@SETTINGS
@given(data=st.data())
def test_forward_matches_mpmath_and_twin(L, T, r, data):
    """y from the compiled kernel and from the twin agree with mpmath to 1e-12 componentwise
    relative error, saturated rows (entries down to e^-100) included."""
    Z, c, beta = data.draw(tied_inputs(L, T, r))
    y = model(layers=L, tokens=T, rank=r, skip=c, beta=beta).forward(Z)
    y_twin = model("twin", layers=L, tokens=T, rank=r, skip=c, beta=beta).forward(Z)
    y_ref = Model(L, T, r, skip=c, beta=beta).forward(Z)
    assert y.shape == (len(Z), T, T)
    assert rel_err(y, y_ref) <= RTOL
    assert rel_err(y_twin, y_ref) <= RTOL
    assert rel_err(y, y_twin) <= RTOL
    np.testing.assert_allclose(y.sum(axis=2), 1.0, rtol=0, atol=1e-14)
    # a single (R, T) sample gives a single (T, T) output, its row of the batch to rounding: the
    # kernels' loops run by SIMD lanes with glibc's vector exp (libmvec, within 4 ulp) and the
    # remainder with the scalar exp, so a row's last bit can depend on its place in the batch
    # (on a 2-core AMD EPYC with AVX2, 2026-12-01: 1354 of 2000 two-sample batches, L = 1, T = 2,
    # differed from the lone sample by 1 ulp; on the AVX-512 machine before, none)
    single = model(layers=L, tokens=T, rank=r, skip=c, beta=beta).forward(Z[0])
    assert single.shape == (T, T)
    np.testing.assert_allclose(single, y[0], rtol=1e-15, atol=0)


def test_spec_check_value():
    """Spec §2 check value: L = 2, T = 2, r = 1, c = 1, β = 1 gives
    y = softmax((A h₂)(A h₂)ᵀ), A = I + softmax(h₁ᵀh₁) (written out with NumPy)."""
    def softmax(M):
        e = np.exp(M - M.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    Z = np.array([[0.3, -0.7], [1.1, 0.4]])
    h1, h2 = Z
    u = (np.eye(2) + softmax(np.outer(h1, h1))) @ h2
    expected = softmax(np.outer(u, u))
    for backend in ("compiled", "twin"):
        y = model(backend, layers=2, tokens=2, rank=1).forward(Z)
        np.testing.assert_allclose(y, expected, rtol=1e-14, atol=0)
    # L = 1: y = σ_β(h₁ᵀh₁)
    y1 = model(layers=1, tokens=2, rank=1, beta=2.5).forward(Z[:1])
    np.testing.assert_allclose(y1, softmax(2.5 * np.outer(h1, h1)), rtol=1e-14, atol=0)


# -- ∂y/∂Z ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", PREGENERATED)
@FEW
@given(data=st.data())
def test_jacobian_matches_mpmath(L, T, r, data):
    """∂y/∂Z (compiled and twin) against finite differences of the mpmath model at 150+ digits,
    saturated rows included (every layer's |β·logit| up to 50: derivatives down to ≈ 1e-44
    next to entries ≈ 1).

    Metric, per sample: max|J - J_ref| ≤ 1e-12 · max|J_ref| + S, where S is how far the exact
    Jacobian moves when the inputs and every intermediate value (logits, u_ℓ, attention
    matrices, Φ⁽ℓ⁾) are multiplied by fixed random factors 1 ± 1e-13 (≈ 900 unit roundoffs;
    reference.Model.jacobian_sensitivity).  S is the conditioning allowance: where two tokens'
    u_ℓ nearly coincide (e.g. c ≈ 0 and two rows of an attention matrix saturated onto the same
    token, or h_L ∝ (1, …, 1)), y depends on Z only through small differences of large numbers
    (logits u_t u_s - u_t u_t, or entries of two rows of an attention matrix that both sum to
    one), and no float64 evaluation gives J to 1e-12 relative.  Elsewhere S ≪ 1e-12 · max|J|
    and the plain relative criterion applies.  (Measured over 300 random draws up to
    |β·logit| = 50: in the 55 where S is what lets the kernels pass, their error is ≤ 0.012·S.)"""
    Z, c, beta = data.draw(tied_inputs(L, T, r, n_max=1))
    ref = Model(L, T, r, skip=c, beta=beta)
    J_ref, S = ref.forward_jacobian(Z), ref.jacobian_sensitivity(Z)
    for backend in ("compiled", "twin"):
        J = model(backend, layers=L, tokens=T, rank=r, skip=c, beta=beta).forward_jacobian(Z)
        assert J.shape == (len(Z), T * T, L * r * T)
        for i in range(len(Z)):
            err, scale = np.abs(J[i] - J_ref[i]).max(), np.abs(J_ref[i]).max()
            assert err <= RTOL * scale + S[i], (backend, i, err, scale, S[i])


def _saturated(L, T, direction, size, seed=0):
    """A rank-1 sample whose every softmax row is saturated: earlier layers drawn with
    |β·logit| = 50, and h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹ u_L (solved at 50 digits) with u_L ∝ ``direction``
    scaled so that max|u_L u_Lᵀ| = ``size`` (c = 1, β = 1)."""
    ref = Model(L, T, 1)
    Z = ref.scale_layers(np.random.default_rng(seed).uniform(-1, 1, size=(L, T)), [50.0] * L)
    u = np.asarray(direction, dtype=float)
    u *= np.sqrt(size / np.abs(np.outer(u, u)).max())
    Phi = mp.matrix(ref.mixing_mp(to_mp(Z)))
    Z[L - 1] = [float(x) for x in mp.lu_solve(Phi, mp.matrix(to_mp(u)))]
    return Z[None]


SATURATED = {
    # h = √50 (1, -0.6): logits β h hᵀ = [[50, -30], [-30, 18]], y₀₁ ≈ e^-80, y₁₀ ≈ e^-48;
    # max|J| ≈ 2.2e-20 (∂y₁₁/∂h₁).
    "L1_T2": (1, 2, np.array([[[np.sqrt(50.0), -0.6 * np.sqrt(50.0)]]])),
    "L2_T2": (2, 2, _saturated(2, 2, [1.0, -0.6], 50.0)),
    "L3_T2": (3, 2, _saturated(3, 2, [1.0, -0.6], 50.0)),
    "L2_T3": (2, 3, _saturated(2, 3, [1.0, -0.6, 0.3], 100.0)),
}


@pytest.mark.parametrize("backend", ["compiled", "twin"])
@pytest.mark.parametrize("case", sorted(SATURATED))
def test_jacobian_saturated_softmax(case, backend):
    """The 1e-12 relative contract on fully saturated samples (every softmax row saturated;
    |β·logit| up to 50, 100 for T = 3 where it takes more to saturate every row): the whole
    Jacobian is ≈ 1e-20 (T = 2) or 6e-9 (L2_T3) while β|∂M/∂Z| ≈ 10.  Regression test: when
    the chain rule went through e_s = exp(β(M_ts - m_t)) and w = 1/Σ e with the row maximum m_t
    held fixed, ∂y_tt/∂Z of a row with y_tt ≈ 1 was the difference of two terms of size
    β|∂M/∂Z| and came out as 0 (normwise relative error 1.0 on the T = 2 cases, 1e-7 on L2_T3);
    the form dσ_ts = β σ_ts Σ_{k≠s} σ_tk (dM_ts - dM_tk) gives ≤ 6e-14 (S ≤ 1e-19 here)."""
    L, T, Z = SATURATED[case]
    ref = Model(L, T, 1)
    J_ref, S = ref.forward_jacobian(Z), ref.jacobian_sensitivity(Z)
    J = model(backend, layers=L, tokens=T, rank=1).forward_jacobian(Z)
    assert np.abs(J - J_ref).max() <= RTOL * np.abs(J_ref).max() + S[0]


# -- mixing Φ⁽ᴸ⁻¹⁾ and log|det Φ⁽ᴸ⁻¹⁾| ------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", DEEP)
@SETTINGS
@given(data=st.data())
def test_mixing_matches_mpmath(L, T, r, data):
    """Φ⁽ᴸ⁻¹⁾ to 1e-12 componentwise relative error (its entries are positive sums of positive
    products, so there is no cancellation).

    log|det Φ⁽ᴸ⁻¹⁾| to 1e-12 · max(1, κ) absolute, κ the condition number of the determinant
    with respect to relative changes of the entries of Φ (an Φ known to relative accuracy δ
    fixes log|det| only to ≈ κ·δ; κ is large when c < 1 and the attention matrices are nearly
    rank one).  Checked up to κ = 1e14; beyond, a float64 Φ does not determine its determinant
    (κ·u ≳ 0.01) and -inf (a determinant rounded to 0) is as good an answer as any, but never
    NaN.  The kernels sum log|det(c I + A_ℓ)| over the layer factors, each by elimination
    without pivoting (derive/attention.log_abs_det: c I + A_ℓ is diagonally similar to a
    symmetric positive definite matrix), so the accuracy does not depend on how different the
    scales of Φ's columns are (the Hadamard ratio κ_H = Π‖Φ_i‖/|det Φ|, ≫ κ for c ≈ 0 and
    saturated attention), which limited the former Berkowitz determinant of the product Φ to
    ≈ u·κ_H.  Measured (4800 draws in this range, 12 models × 400, c ∈ {0, 10^U(-9,0),
    U(0,10)}; 4162 with κ ≤ 1e14): error ≤ 20·u·max(1, κ), u = 1.1e-16, κ_H > 10·κ included;
    the Berkowitz kernels missed the bound on 333 of the 2814 T ≥ 3 draws (errors up to
    5e10·u·κ, or -inf).  Full Z and the first (L-1)·r rows give identical results."""
    Z, c, beta = data.draw(tied_inputs(L, T, r))
    ref = Model(L, T, r, skip=c, beta=beta)
    phi_ref, logdet_ref, kappa, _ = ref.mixing(Z)
    for backend in ("compiled", "twin"):
        m = model(backend, layers=L, tokens=T, rank=r, skip=c, beta=beta)
        mix, mix_prev = m.mixing(Z), m.mixing(Z[:, :(L - 1) * r])
        np.testing.assert_array_equal(mix.phi, mix_prev.phi)
        np.testing.assert_array_equal(mix.logdet, mix_prev.logdet)
        assert mix.phi.shape == (len(Z), T, T) and mix.logdet.shape == (len(Z),)
        assert rel_err(mix.phi, phi_ref) <= RTOL
        assert not np.isnan(mix.logdet).any()
        checked = kappa <= 1e14
        err = np.abs(mix.logdet[checked] - logdet_ref[checked])
        assert (err <= RTOL * np.maximum(1.0, kappa[checked])).all(), (backend, err, kappa[checked])


ILL_SCALED = {
    # Z = 0 gives Φ⁽¹⁾ = c I + 11ᵀ/T: log|det Φ⁽ᴸ⁻¹⁾| = (L-1)((T-1) log c + log(1+c)) exactly.
    "L3_T3_zero": (3, 3, 1e-4, 1.0, np.zeros((1, 3, 3))),
    "L3_T4_zero": (3, 4, 1e-3, 1.0, np.zeros((1, 3, 4))),
    "L2_T4_zero": (2, 4, 1e-3, 1.0, np.zeros((1, 2, 4))),
    # not nearly singular in the entrywise sense (κ = 31), but the columns of Φ range from 1e-12
    # to 0.9 (κ_H = 2e11)
    "L2_T4_scaled": (2, 4, 1e-9, 2.28, np.array([[[-4.13416574, -1.66618637, -4.38417278, -2.52488719],
                                                  [-1.1076748, -3.99022881, 4.57434461, 1.56077664]]])),
}


@pytest.mark.parametrize("backend", ["compiled", "twin"])
@pytest.mark.parametrize("case", sorted(ILL_SCALED))
def test_logdet_ill_scaled(case, backend):
    """log|det Φ⁽ᴸ⁻¹⁾| to 1e-12 · κ where κ_H ≫ κ (small c, or columns of Φ of very different
    scales).  Regression test: when the kernels took the Berkowitz determinant of the product Φ
    (only normwise stable) their log|det| was off by 0.04 (L3_T3_zero, κ = 1.3e8), 0.80
    (L3_T4_zero: -42.24 for -41.44, κ = 1.5e6), 1e-8 (L2_T4_zero, κ = 1.5e3) and 1.1e-6
    (L2_T4_scaled, κ = 31), while Φ itself was right to ≤ 1e-15 componentwise and
    numpy.linalg.slogdet (LU) of the kernel's own Φ met the bound (errors ≤ 5e-10 on the zero
    cases, 3.2e-14 on L2_T4_scaled).  One factor c I + A_ℓ at a time the kernels' errors are 0
    (L3_T4_zero, L2_T4_zero), 2.1e-13 (L3_T3_zero) and 4.3e-14 (L2_T4_scaled)."""
    L, T, c, beta, Z = ILL_SCALED[case]
    phi_ref, logdet_ref, kappa, _ = Model(L, T, 1, skip=c, beta=beta).mixing(Z)
    if case.endswith("zero"):
        assert abs(logdet_ref[0] - (L - 1) * ((T - 1) * np.log(c) + np.log1p(c))) <= 1e-14 * abs(logdet_ref[0])
    mix = model(backend, layers=L, tokens=T, rank=1, skip=c, beta=beta).mixing(Z)
    bound = RTOL * max(1.0, kappa[0])
    assert rel_err(mix.phi, phi_ref) <= RTOL                                    # Φ is fine ...
    assert abs(np.linalg.slogdet(mix.phi[0])[1] - logdet_ref[0]) <= bound       # ... LU on it too ...
    assert abs(mix.logdet[0] - logdet_ref[0]) <= bound                          # ... and the kernel


# -- evenness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("L,T,r", PREGENERATED)
@FEW
@given(data=st.data())
def test_even_in_each_layer(L, T, r, data):
    """h_ℓ → -h_ℓ leaves y unchanged for every layer ℓ separately (spec §2), and so
    ∂y/∂h_ℓ is odd and ∂y/∂h_k (k ≠ ℓ) even; tolerance 1e-14 (componentwise relative for y,
    normwise relative for J; in practice the results agree bit for bit, since negation is exact
    and rounding is sign-symmetric)."""
    Z, c, beta = data.draw(tied_inputs(L, T, r, n_max=2))
    m = model(layers=L, tokens=T, rank=r, skip=c, beta=beta)
    y, J = m.forward(Z), m.forward_jacobian(Z)
    for layer in range(L):
        flipped = Z.copy()
        flipped[:, layer * r:(layer + 1) * r] *= -1
        y_f, J_f = m.forward(flipped), m.forward_jacobian(flipped)
        assert np.all(np.abs(y_f - y) <= 1e-14 * np.abs(y))
        sign = np.ones(L * r * T)
        sign[layer * r * T:(layer + 1) * r * T] = -1
        for i in range(len(Z)):
            assert np.abs(J_f[i] - J[i] * sign).max() <= 1e-14 * np.abs(J[i]).max()


# -- other links and architectures (compiled on demand, once: ~10 s each) -------------------------

OTHERS = {
    "hardmax": dict(layers=2, tokens=3, rank=1, link="hardmax"),
    "linear": dict(layers=2, tokens=2, rank=1, link="linear"),
    "untied": dict(layers=2, tokens=2, rank=1, architecture="untied"),
    "multihead": dict(layers=2, tokens=2, rank=1, architecture="multihead", heads=2),
    "seq2seq": dict(layers=2, tokens=2, rank=1, architecture="seq2seq"),
}


@st.composite
def other_inputs(draw, structure, n_max=2, max_size=20.0):
    """(Z, c, β, readout, reference model), every layer's largest |β·logit| ≤ ``max_size``."""
    c, beta = draw(skips), draw(betas)
    readout = None
    if structure.get("architecture") == "multihead":
        # 0 or 1e-3 ≤ |a| ≤ 2: a weight like 1e-161 scales ∂y/∂Z below what the finite
        # differences resolve (≈ 1e-100 absolute)
        weights = st.one_of(st.just(0.0), st.floats(1e-3, 2.0), st.floats(-1.0, -1e-3))
        readout = draw(arrays(np.float64, (structure["layers"], structure["heads"]), elements=weights))
    ref = Model(skip=c, beta=beta, readout=None if readout is None else tuple(map(tuple, readout)),
                **structure)
    n = draw(st.integers(1, n_max))
    raw = draw(arrays(np.float64, (n, ref.indices, ref.tokens), elements=raw_entries))
    sizes = draw(arrays(np.float64, (n, ref.layers), elements=logit_sizes(max_size)))
    Z = np.stack([ref.scale_layers(raw[i], sizes[i]) for i in range(n)])
    return Z, c, beta, readout, ref


@pytest.mark.parametrize("name", sorted(OTHERS))
@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_other_models_match_mpmath(name, data):
    """Hardmax / linear links and untied / multi-head / seq2seq architectures against mpmath,
    every layer's |β·logit| ≤ 20: y to 1e-12 (componentwise relative; normwise for the linear
    link and, relative to Σ|a_Lk|, for multi-head, whose entries can have either sign; hardmax:
    exactly, on rows whose two largest logits differ by more than 1e-9 relative), compiled ==
    twin, and ∂y/∂Z (not for hardmax) to 1e-12 · max|J_ref| + S as in
    test_jacobian_matches_mpmath."""
    structure = OTHERS[name]
    Z, c, beta, readout, ref = data.draw(other_inputs(structure))
    m = model(skip=c, beta=beta, readout=readout, **structure)
    twin = model("twin", skip=c, beta=beta, readout=readout, **structure)
    y, y_ref = m.forward(Z), ref.forward(Z)
    if name == "hardmax":
        T = ref.tokens
        logits = np.array([ref.logits_mp(to_mp(z))[-T * T:] for z in Z], dtype=float)
        top = np.sort(logits.reshape(len(Z), T, T), axis=2)[:, :, -2:]
        gap = top[:, :, 1] - top[:, :, 0]
        # near-ties (h_L ∝ 1 makes all logits equal up to rounding) are decided by rounding;
        # exact ties are test_hardmax_ties_take_the_first_maximum
        clear = np.all(gap > 1e-9 * np.abs(top).max(axis=2), axis=1)      # per sample, not per batch
        assume(clear.any())
        np.testing.assert_array_equal(y[clear], y_ref[clear])
        np.testing.assert_array_equal(twin.forward(Z[clear]), y[clear])
        return
    np.testing.assert_allclose(twin.forward(Z), y, rtol=RTOL, atol=0)
    if name == "linear":
        for i in range(len(Z)):
            assert np.abs(y[i] - y_ref[i]).max() <= RTOL * np.abs(y_ref[i]).max()
    elif name == "multihead":
        for i in range(len(Z)):
            assert np.abs(y[i] - y_ref[i]).max() <= RTOL * np.abs(readout[-1]).sum()
    else:
        assert rel_err(y, y_ref) <= RTOL
    J, J_ref, S = m.forward_jacobian(Z), ref.forward_jacobian(Z), ref.jacobian_sensitivity(Z)
    np.testing.assert_allclose(twin.forward_jacobian(Z), J, rtol=0, atol=RTOL * np.abs(J).max())
    for i in range(len(Z)):
        err, scale = np.abs(J[i] - J_ref[i]).max(), np.abs(J_ref[i]).max()
        assert err <= RTOL * scale + S[i], (i, err, scale, S[i])


def test_hardmax_ties_take_the_first_maximum():
    """h_L = 0 makes every last-layer logit 0: each row of y is the first unit vector."""
    rng = np.random.default_rng(1)
    Z = rng.normal(size=(2, 2, 3))
    Z[:, 1] = 0.0
    y = model(**OTHERS["hardmax"], skip=0.5, beta=2.0).forward(Z)
    expected = np.zeros((2, 3, 3))
    expected[:, :, 0] = 1.0
    np.testing.assert_array_equal(y, expected)


def test_untied_with_equal_keys_and_queries_is_tied():
    """k_ℓ = q_ℓ turns the untied model into the tied one (a check that does not depend on the
    order of key and query rows)."""
    rng = np.random.default_rng(2)
    H = 0.8 * rng.normal(size=(3, 2, 2))
    Z = np.repeat(H, 2, axis=1)               # rows k₁ q₁ k₂ q₂ = h₁ h₁ h₂ h₂
    y_untied = model(**OTHERS["untied"], skip=0.4, beta=1.7).forward(Z)
    y_tied = model(layers=2, tokens=2, rank=1, skip=0.4, beta=1.7).forward(H)
    np.testing.assert_allclose(y_untied, y_tied, rtol=1e-13, atol=0)


def test_multihead_with_equal_heads_is_tied():
    """Two identical heads with readout weights a, 1 - a equal one tied head."""
    rng = np.random.default_rng(3)
    H = 0.8 * rng.normal(size=(3, 2, 2))
    Z = np.repeat(H, 2, axis=1)
    readout = np.array([[0.3, 0.7], [0.9, 0.1]])
    y_multi = model(**OTHERS["multihead"], skip=0.6, beta=1.3, readout=readout).forward(Z)
    y_tied = model(layers=2, tokens=2, rank=1, skip=0.6, beta=1.3).forward(H)
    np.testing.assert_allclose(y_multi, y_tied, rtol=1e-13, atol=0)


def test_seq2seq_output_is_the_mixing_matrix():
    """seq2seq with L layers outputs Φ⁽ᴸ⁾, which is the mixing kernel of an (L+1)-layer model."""
    rng = np.random.default_rng(4)
    Z = 0.8 * rng.normal(size=(3, 2, 2))
    y = model(**OTHERS["seq2seq"], skip=0.6, beta=1.3).forward(Z)
    phi = model(layers=3, tokens=2, rank=1, skip=0.6, beta=1.3).mixing(Z).phi
    np.testing.assert_allclose(y, phi, rtol=1e-14, atol=0)
