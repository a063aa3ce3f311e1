"""Exact output channels (issue 3, spec §4): ``model.channel(...).moments(y, omega, V)``.

Ground truth: tests/channel_reference.py (independent of derive/, codegen/, smi_core/):
L = 1 in closed form (two points), L = 2 (T = 2) and the noisy L = 1 (T = 2) by nested adaptive
Gauss–Legendre whose certified rule is evaluated in mpmath at 32 digits, L = 3 (T = 2) and
L = 2 (T = 3) by nested product rules in float64 with a self-convergence error estimate.  Every comparison first checks
that the reference's own error bound is well below the tolerance.

Metric (per sample): max abs error over all entries of (g_out, dg_out) divided by the max abs
entry of the reference.  Tolerances: 1e-6 (L = 1, 2, noisy), 1e-4 (L = 3); the channel runs with
``tol=1e-7``.  A failure prints the draw (y, omega, V and the model) at full precision, the
expected and the obtained g_out / dg_out.

Draws "as state evolution draws them" (spec §5): q ∈ [0, 0.999] (q·I, or q = U diag(λ) Uᵀ with
λ ∈ [0, 0.999]), ω = q^{1/2} ξ, V = I - q, Z = ω + (I - q)^{1/2} ζ, y = model.forward(Z) (plus
√Δ ε for the noisy route), ξ, ζ, ε standard normal.  Adversarial draws: near-singular V
(eigenvalues down to 1e-4), large |ω| (up to 8), outputs at the edge of the softmax range
(smallest entry 1e-11 … 1e-17) and outputs unrelated to ω (y from an independent Z, V small).

Cost: the default run keeps a few examples per property (≈ 2–5 s per L = 2 / noisy reference,
≈ 10–30 s per L = 3 reference); ``--runslow`` runs the heavier versions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import channel_reference as ref
import nested_reference as nested
from reference import Model
from smi_core import DeepAttention, LinkModel, index_symbols, register_link
from smi_core import chart, cusp_rule, logit_rule
from smi_core.channels import Channel, _spread_of
from smi_core.noisy_channel import NoisyChannel
from smi_core.quadrature import gauss_legendre
from smi_core.reparam_channel import ReparamChannel

RTOL = 1e-6          # L = 1, 2, noisy
RTOL_L3 = 1e-4       # L = 3
CHANNEL_TOL = 1e-7
REF_TOL = 1e-8       # the reference's own error bound must be below this (L = 1, 2, noisy) …
REF_TOL_L3 = 5e-5    # … and this for L = 3 (n = 5 rules; 1e-5 with n = 6 … 8 under --runslow)

# Reference integrals are expensive: no shrinking (the first failing draw is reported as is).
# Derandomised: the default run draws the same examples every time (a reproducible CI); the
# slow *_many tests explore further, and a failing draw found there is kept as a test of its own.
BASE = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=True, derandomize=True)


def examples(n: int):
    return settings(BASE, max_examples=n)


@lru_cache(maxsize=None)
def model(layers: int, tokens: int = 2, skip: float = 1.0, beta: float = 1.0) -> DeepAttention:
    return DeepAttention(layers=layers, tokens=tokens, rank=1, skip=skip, beta=beta)


@lru_cache(maxsize=None)
def channel(layers: int, tokens: int = 2, skip: float = 1.0, beta: float = 1.0, noise=None):
    return model(layers, tokens, skip, beta).channel(noise=noise, tol=CHANNEL_TOL)


# -- draws ----------------------------------------------------------------------------------------

@dataclass
class Draw:
    y: np.ndarray          # (T, T)
    omega: np.ndarray      # (R, T)
    V: np.ndarray          # (R, R)
    kind: str
    q: np.ndarray | None = None
    noise: float | None = None


def sqrt_psd(A):
    w, U = np.linalg.eigh(0.5 * (A + A.T))
    return (U * np.sqrt(np.clip(w, 0, None))) @ U.T


def rotation(rng, R):
    Q, Rm = np.linalg.qr(rng.standard_normal((R, R)))
    return Q * np.sign(np.diag(Rm))


def symmetric(A):
    return 0.5 * (A + A.T)


seeds = st.integers(0, 2 ** 32 - 1)
q_values = st.floats(0.0, 0.999)


@st.composite
def overlaps(draw, R, correlated):
    """q = λ I, or q = U diag(λ) Uᵀ with a random rotation U (0 ⪯ q ⪯ 0.999 I)."""
    if not correlated:
        return draw(q_values) * np.eye(R)
    lam = draw(arrays(np.float64, R, elements=q_values))
    U = rotation(np.random.default_rng(draw(seeds)), R)
    return symmetric((U * lam) @ U.T)


@st.composite
def se_draws(draw, layers, tokens=2, correlated=False, noise=None, skip=1.0, beta=1.0):
    """(y, ω, V) exactly as state evolution draws them (spec §5)."""
    R, T = layers, tokens
    q = draw(overlaps(R, correlated))
    rng = np.random.default_rng(draw(seeds))
    xi, zeta = rng.standard_normal((R, T)), rng.standard_normal((R, T))
    omega = sqrt_psd(q) @ xi
    V = symmetric(np.eye(R) - q)
    Z = omega + sqrt_psd(V) @ zeta
    y = model(layers, tokens, skip, beta).forward(Z)
    if noise is not None:
        y = y + math.sqrt(noise) * rng.standard_normal(y.shape)
    return Draw(y, omega, V, "se-correlated" if correlated else "se-scalar", q, noise)


ADVERSARIAL = ("near-singular V", "large omega", "softmax edge", "unrelated y")


@st.composite
def adversarial_draws(draw, layers, tokens=2, noise=None, kinds=ADVERSARIAL):
    """Near-singular / anisotropic V (eigenvalues 1e-4 … 1e-2 next to 0.3 … 1), large |ω|
    (max entry 3 … 8), y at the edge of the softmax range (last layer's largest |β·logit| 25 … 40,
    i.e. entries e^-25 … e^-40), and y unrelated to ω (Z ~ N(0, I) independent of ω, q ≥ 0.9)."""
    R, T = layers, tokens
    kind = draw(st.sampled_from(kinds))
    rng = np.random.default_rng(draw(seeds))
    m = model(layers, tokens)
    if kind == "near-singular V":
        small = 10 ** draw(st.floats(-4.0, -2.0))
        lam = np.array([draw(st.floats(0.3, 1.0)) for _ in range(R - 1)] + [small])
        U = rotation(rng, R)
        V = symmetric((U * lam) @ U.T)
        omega = draw(st.floats(0.0, 2.0)) * rng.standard_normal((R, T))
        Z = omega + sqrt_psd(V) @ rng.standard_normal((R, T))
    elif kind == "large omega":
        V = 10 ** draw(st.floats(-2.0, 0.0)) * np.eye(R)
        xi = rng.standard_normal((R, T))
        omega = draw(st.floats(3.0, 8.0)) * xi / np.abs(xi).max()
        Z = omega + sqrt_psd(V) @ rng.standard_normal((R, T))
    elif kind == "softmax edge":
        V = 10 ** draw(st.floats(-2.0, 0.0)) * np.eye(R)
        sizes = [draw(st.floats(0.5, 10.0)) for _ in range(R - 1)] + [draw(st.floats(25.0, 40.0))]
        Z = Model(layers, tokens).scale_layers(rng.uniform(-1, 1, (R, T)), sizes)
        omega = Z + sqrt_psd(V) @ rng.standard_normal((R, T))
    else:  # unrelated y
        q = draw(st.floats(0.9, 0.999))
        V = (1 - q) * np.eye(R)
        omega = math.sqrt(q) * rng.standard_normal((R, T))
        Z = rng.standard_normal((R, T))
    y = m.forward(Z)
    if noise is not None:
        y = y + math.sqrt(noise) * rng.standard_normal(y.shape)
    return Draw(y, omega, V, kind, None, noise)


noises = st.floats(math.log(1e-3), 0.0).map(math.exp)


# -- comparison -----------------------------------------------------------------------------------

def fmt(a) -> str:
    return np.array2string(np.asarray(a), precision=17, floatmode="unique", separator=", ",
                           max_line_width=150, threshold=10_000)


def describe(d: Draw, label, expected, mo, err) -> str:
    lines = [f"{label}: {d.kind} draw, metric {err:.3e}",
             f"y = np.array({fmt(d.y)})", f"omega = np.array({fmt(d.omega)})", f"V = np.array({fmt(d.V)})"]
    if d.q is not None:
        lines.append(f"q = np.array({fmt(d.q)})")
    if d.noise is not None:
        lines.append(f"noise = {d.noise!r}")
    lines += [f"expected g_out = {fmt(expected.g_out)}", f"got      g_out = {fmt(mo.g_out[0])}",
              f"expected dg_out = {fmt(expected.dg_out)}", f"got      dg_out = {fmt(mo.dg_out[0])}",
              f"channel error estimate {mo.error[0]:.3e}; reference error bound {expected.error:.3e}, "
              f"{expected.seconds:.1f} s"]
    if expected.log_z is not None and d.noise is not None:
        lines.append(f"log_z expected {expected.log_z!r}, got {mo.log_z[0]!r}")
    return "\n".join(lines)


def compare(label, ch, d: Draw, expected, rtol, ref_tol, log_z=False):
    R, T = d.omega.shape
    mo = ch.moments(d.y[None], d.omega[None], d.V)
    assert mo.g_out.shape == (1, R, T) and mo.dg_out.shape == (1, R * T, R * T)
    assert mo.log_z.shape == (1,) and mo.error.shape == (1,)
    err = ref.metric(mo.g_out[0], mo.dg_out[0], expected.g_out, expected.dg_out, d.V)
    msg = describe(d, label, expected, mo, err)
    # the reference's bound is relative to its largest entry: the same floor as the metric's
    bound = expected.error * ref.metric_scale(expected.g_out, expected.dg_out) / ref.metric_scale(
        expected.g_out, expected.dg_out, d.V)
    assert bound <= ref_tol, "reference not accurate enough\n" + msg
    assert err <= rtol, msg
    if log_z:
        assert abs(mo.log_z[0] - expected.log_z) <= rtol * max(1.0, abs(expected.log_z)), msg
    return err


# -- the reference itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("T", [2, 3, 4])
def test_reference_preimage_and_mixing(T):
    """The reference's u_L from y reproduces y = σ_β(u uᵀ) (checked with tests/reference.py), and
    its L = 2 / L = 3 integrands recover h_L with Φ⁽ᴸ⁻¹⁾h_Lᵀ = ±u_L, i.e. Z ↦ y ↦ Z is exact."""
    rng = np.random.default_rng(T)
    for beta in (0.7, 1.0, 2.3):
        mm = Model(1, T, beta=beta)
        for _ in range(5):
            h = 1.5 * rng.standard_normal((1, T))
            y = mm.forward(h[None])[0]
            u = np.array([float(v) for v in ref.u_from_y(y, beta)])
            assert min(np.abs(u - h[0]).max(), np.abs(u + h[0]).max()) <= 1e-12 * max(1, np.abs(h).max())
    if T != 2:
        return
    for skip, beta in ((1.0, 1.0), (0.5, 2.0)):
        Z = rng.standard_normal((3, 2))
        y2 = Model(2, 2, skip=skip, beta=beta).forward(Z[None, :2])[0]
        p2 = ref.ReparamL2(y2, Z[:2], np.eye(2), skip, beta)
        rows, _ = p2.rows(Z[None, 0])
        assert min(np.abs(rows[1][0] - s * Z[1]).max() for s in (1, -1)) <= 1e-12
        y3 = Model(3, 2, skip=skip, beta=beta).forward(Z[None])[0]
        p3 = ref.ReparamL3(y3, Z, np.eye(3), skip, beta)
        phi1 = Model(2, 2, skip=skip, beta=beta).mixing(Z[None, :1])[0][0]
        x = np.concatenate([Z[0], phi1 @ Z[1]])[None]
        rows, _ = p3.rows(x)
        assert np.abs(rows[1][0] - Z[1]).max() <= 1e-12
        assert min(np.abs(rows[2][0] - s * Z[2]).max() for s in (1, -1)) <= 1e-12


# -- L = 1: closed form -----------------------------------------------------------------------------

def check_l1(T, d):
    compare("L=1", channel(1, T), d, ref.reparam_l1(d.y, d.omega, d.V, 1.0), RTOL, REF_TOL)


@pytest.mark.parametrize("T", [2, 3, 4])
@examples(25)
@given(data=st.data())
def test_reparam_l1_state_evolution_draws(T, data):
    check_l1(T, data.draw(se_draws(1, T)))


@pytest.mark.parametrize("T", [2, 3])
@examples(25)
@given(data=st.data())
def test_reparam_l1_adversarial(T, data):
    check_l1(T, data.draw(adversarial_draws(1, T, kinds=("large omega", "softmax edge", "unrelated y"))))


@pytest.mark.slow
@pytest.mark.parametrize("T", [2, 3, 4])
@examples(300)
@given(data=st.data())
def test_reparam_l1_many(T, data):
    check_l1(T, data.draw(st.one_of(se_draws(1, T), adversarial_draws(
        1, T, kinds=("large omega", "softmax edge", "unrelated y")))))


# -- L = 2 (T = 2): 2-D integral ------------------------------------------------------------------

def check_l2(d, skip=1.0, beta=1.0):
    compare(f"L=2 (c={skip!r}, beta={beta!r})", channel(2, 2, skip, beta), d,
            ref.reparam_l2(d.y, d.omega, d.V, skip, beta), RTOL, REF_TOL)


@pytest.mark.parametrize("correlated", [False, True], ids=["q-scalar", "q-correlated"])
@examples(3)
@given(data=st.data())
def test_reparam_l2_state_evolution_draws(correlated, data):
    check_l2(data.draw(se_draws(2, correlated=correlated)))


Q_NEAR_SINGULAR = np.array([[0.681553038265343, -0.26036692192505667], [-0.26036692192505667, 0.7854495736160405]])
NEAR_SINGULAR = Draw(y=np.array([[0.9885683523297595, 0.01143164767024055],
                                 [0.012937935600836344, 0.9870620643991636]]),
                     omega=np.array([[0.9450008978431229, -1.7350580184536326],
                                     [-0.7922034229392325, 1.110551667148496]]),
                     V=np.eye(2) - Q_NEAR_SINGULAR, kind="se-correlated", q=Q_NEAR_SINGULAR)


def test_reparam_l2_correlated_near_singular_draw():
    """Found by test_reparam_l2_state_evolution_draws[q-correlated] (randomised then): a
    near-singular V (eigenvalues 0.53, 1.0e-3) at an angle to the layers makes the posterior a
    thin curved ridge; the Laplace rule alone was off by 1.3e-6 while estimating 8.8e-8 (now
    cross-checked by the adaptive rule: 4.2e-10).  An independent brute-force rule (composite
    Gauss–Legendre over the ridge's box) agrees with the reference to 5.7e-11."""
    check_l2(NEAR_SINGULAR)


def test_reparam_l2_laplace_path_is_cross_checked():
    """With ``tol`` the Laplace-path samples of two layers are integrated again by the adaptive
    rule: on the draw above the result is within 1e-6 and the error estimate covers the actual
    error (it did not: 8.8e-8 against 1.3e-6); without ``tol`` the Laplace rule stands."""
    d = NEAR_SINGULAR
    y, omega = d.y[None], d.omega[None]
    r = ref.reparam_l2(d.y, d.omega, d.V)
    with_tol = channel(2).moments(y, omega, d.V)
    plain = model(2).channel().moments(y, omega, d.V)
    assert channel(2)._polar_weight(omega, d.V[None])[0] == 0      # the Laplace path
    err = ref.metric(with_tol.g_out[0], with_tol.dg_out[0], r.g_out, r.dg_out)
    assert err <= RTOL and err <= with_tol.error[0]
    assert ref.metric(plain.g_out[0], plain.dg_out[0], r.g_out, r.dg_out) > 1e-7


def test_reparam_l2_cross_check_batch():
    """With ``tol`` the Laplace path's cross-check runs each sample to its own tolerance
    (tol/100/κ): a batch gives each sample's moments as it gives them alone (a batch of
    several had raised a ValueError on the per-sample tolerances)."""
    rng = np.random.default_rng(5)
    omega = rng.standard_normal((3, 2, 2))
    y = model(2).forward(omega + 0.1 * rng.standard_normal((3, 2, 2)))
    V = np.array([[0.011, 0.004], [0.004, 0.009]])
    ch = channel(2)
    assert (ch._polar_weight(omega, np.broadcast_to(V, (3, 2, 2))) == 0).all()     # the Laplace path
    batch = ch.moments(y, omega, V)
    for i in range(3):
        alone = ch.moments(y[i:i + 1], omega[i:i + 1], V)
        np.testing.assert_allclose(batch.dg_out[i], alone.dg_out[0], rtol=1e-12, atol=1e-12 * np.abs(alone.dg_out).max())
        np.testing.assert_allclose(batch.g_out[i], alone.g_out[0], rtol=1e-12, atol=1e-12 * np.abs(alone.g_out).max())


EDGE_NARROW = Draw(y=np.array([[0.9999190792054868, 8.092079451306853e-05],
                               [0.0021690705715755472, 0.9978309294284244]]),
                   omega=np.array([[1.2064496713466424, -0.19055825686602823],
                                   [-1.4396973168381253, 1.3344428069513163]]),
                   V=np.array([[0.06570495311538994, 0.025576060144581265],
                               [0.025576060144581265, 0.012509342494323084]]), kind="near-singular V")


def _check_laplace_rule_alone(d):
    """The Laplace path's adaptive rule alone (``Channel._laplace``, tol=1e-6, nodes=3 so that
    Gauss–Hermite leaves the sample to it) within RTOL of the reference and of its estimate."""
    y, omega, V = d.y[None], d.omega[None], d.V[None]
    ch = model(2).channel(tol=1e-6, nodes=3)
    Vinv = np.linalg.inv(V)
    got = ch._assemble(omega, V, Vinv, *Channel._laplace(ch, y, omega, V, Vinv, np.log(np.linalg.det(V))))
    r = ref.reparam_l2(d.y, d.omega, d.V)
    err = ref.metric(got.g_out[0], got.dg_out[0], r.g_out, r.dg_out)
    assert err <= RTOL and err <= got.error[0]


def test_laplace_path_adaptive_rule_starts_fine_enough():
    """The Laplace path's own adaptive rule (``Channel._laplace``, without the two-layer
    cross-check; nodes=3 so that Gauss–Hermite leaves the sample to it) on a near-singular V
    (eigenvalues 2.2e-3, 0.076) with y at the softmax edge: started from the 2^d orthant boxes of
    each piece it was 2.5e-5 off the reference while estimating 1e-6 (a narrow feature that no
    starting box's points saw); from 4^d boxes (``ADAPTIVE_SPLIT``) 2.5e-8.  Three layers, T = 3
    and the noisy route's other links use this rule with ``tol`` without a cross-check."""
    _check_laplace_rule_alone(EDGE_NARROW)


MISSED_MODE = Draw(y=np.array([[0.9999999999677061, 3.229396566775099e-11],
                               [0.9996185417110353, 3.814582889647419e-04]]),
                   omega=np.array([[-1.2015325177448104, -0.10128663497016879],
                                   [-3.1564058213814006, -0.5021199453648301]]),
                   V=np.array([[0.2246053658436184, -0.072155254798084],
                               [-0.072155254798084, 0.02344554522796905]]), kind="near-singular V")


def test_laplace_path_prior_piece_starts_finer():
    """As above (eigenvalues 2.4e-4, 0.25): the posterior over h_1 has a third mode, 3 % of the
    mass at (-1.68, 1.28), that Gauss–Newton from ±ω_1 does not find, so only the prior's piece
    of the partition integrates it, on the prior's scale.  Started from 4^d boxes there it was
    8.1e-4 off the reference while estimating 1e-6, at every budget up to 300 000 regions; the
    prior's piece starts from PRIOR_SPLIT^d = 8^d boxes."""
    _check_laplace_rule_alone(MISSED_MODE)


UNINFORMATIVE = Draw(y=np.array([[0.5899310010872008, 0.4100689989127992],
                                 [0.5542154394121421, 0.44578456058785787]]),
                     omega=np.array([[0.836948746158859, 1.1163576382929181],
                                     [0.5397818801766787, 1.2360529929535773]]),
                     V=np.array([[0.11667523194814422, -0.28241941672037185],
                                 [-0.28241941672037185, 0.6849194576045936]]), kind="near-singular V")


@pytest.mark.slow
def test_reparam_l2_near_singular_uninformative_draw():
    """A near-singular V (eigenvalues 0.80, 1.9e-4) with y barely informative along its thin
    direction: max|dg_out| = 1.3 against ‖V⁻¹‖ = 5.3e3, so dg_out = V⁻¹(Cov - V)V⁻¹ needs Cov
    to ≈ 1e-13 relative.  With tol = 1e-7 the cross-check's adaptive rule ran to a whitened
    1e-9 and was 4.5e-6 off (its estimate said so); its estimate now includes the
    amplification κ ≈ 3e3 (``channels._amp``).  The reference takes 1.5–3 minutes
    here; an independent brute-force rule agrees with it to 4e-10."""
    check_l2(UNINFORMATIVE)


@examples(3)
@given(data=st.data())
def test_reparam_l2_adversarial(data):
    """Large |ω|, y at the softmax edge, y unrelated to ω.  Near-singular V: the fixed draws above,
    and every kind under --runslow (test_reparam_l2_adversarial_many, which carries the
    reference's known defect there)."""
    check_l2(data.draw(adversarial_draws(2, kinds=ADVERSARIAL[1:])))


@examples(2)
@given(data=st.data(), skip=st.floats(0.5, 2.0), beta=st.floats(0.5, 3.0))
def test_reparam_l2_skip_and_beta(data, skip, beta):
    """Runtime parameters: skip c ∈ [0.5, 2], β ∈ [0.5, 3] (SE draws, scalar q)."""
    check_l2(data.draw(se_draws(2, skip=skip, beta=beta)), skip, beta)


@pytest.mark.slow
@pytest.mark.parametrize("correlated", [False, True], ids=["q-scalar", "q-correlated"])
@examples(40)
@given(data=st.data())
def test_reparam_l2_state_evolution_draws_many(correlated, data):
    check_l2(data.draw(se_draws(2, correlated=correlated)))


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="known defect of the reference (issue 3 open), near-singular V only (24 replicated draws against an independent brute-force rule): where max|dg_out| is ≈ 1e-4 ‖V⁻¹‖ (y barely informative along V's thin direction) the metric needs Cov(Z|y) to ≈ 1e-13 relative, and the reference either certifies only 1.6e-8 … 4.2e-8 (> REF_TOL) or needs minutes (4 of 24 over 300 s); the channel at tol = 1e-7 is within 3.1e-7 of the brute-force rule on all 24")
@examples(60)
@given(data=st.data())
def test_reparam_l2_adversarial_many(data):
    check_l2(data.draw(adversarial_draws(2)))


@pytest.mark.slow
@examples(20)
@given(data=st.data(), skip=st.floats(0.5, 2.0), beta=st.floats(0.5, 3.0))
def test_reparam_l2_skip_and_beta_many(data, skip, beta):
    check_l2(data.draw(se_draws(2, skip=skip, beta=beta)), skip, beta)


# -- L = 2, T = 3: 3-D integral (the spherical rule) --------------------------------------------------

REF_N_T3 = 11       # the T = 3 reference's nodes per panel (its bound ≤ 1e-9 on the draws below)


@examples(2)
@given(data=st.data())
def test_reparam_l2_t3_state_evolution_draws(data):
    """Two layers, T = 3 (q scalar or rotated), with ``tol``: against the 3-D reference."""
    d = data.draw(se_draws(2, tokens=3, correlated=data.draw(st.booleans())))
    expected = ref.reparam_l2_t3(d.y, d.omega, d.V, n=REF_N_T3)
    compare("L=2 T=3", channel(2, tokens=3), d, expected, RTOL, REF_TOL)


@pytest.mark.parametrize("N", [6, 17, 40])
def test_sphere_rule_integrates_polynomials(N):
    """A shell of the spherical rule (node and antipode) integrates the monomials x^a y^b z^c
    of degree ≤ 4 over S² exactly: ∫ = 2 Γ(α)Γ(β)Γ(γ)/Γ(α + β + γ), α = (a + 1)/2, … (zero
    when a degree is odd)."""
    from smi_core.polar import _sphere_rule
    unit, log_w = _sphere_rule(N)
    w = np.exp(log_w)
    for a, b, c in [(i, j, k) for i in range(5) for j in range(5) for k in range(5) if i + j + k <= 4]:
        f = unit[:, 0] ** a * unit[:, 1] ** b * unit[:, 2] ** c
        got = w @ (f + (-1) ** (a + b + c) * f)                 # the antipode -x
        al, be, ga = (a + 1) / 2, (b + 1) / 2, (c + 1) / 2
        exact = 0.0 if (a % 2 or b % 2 or c % 2) else 2 * math.gamma(al) * math.gamma(be) * math.gamma(ga) / math.gamma(al + be + ga)
        assert abs(got - exact) <= 1e-13, (a, b, c, got, exact)


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9])
def test_reparam_l2_t3_default_spherical_rule(q):
    """The default two-layer T = 3 rule (shells about the origin, no tol) on state-evolution
    draws at q·I: within RTOL of the reference; the Laplace rule it replaced was 1.2e-3 / 2.3e-4
    / 8.7e-6 off (median) at q = 0 / 0.3 / 0.9 (see the README)."""
    rng = np.random.default_rng(21)
    omega = math.sqrt(q) * rng.standard_normal((4, 2, 3))
    y = model(2, 3).forward(omega + math.sqrt(1 - q) * rng.standard_normal((4, 2, 3)))
    V = (1 - q) * np.eye(2)
    ch = model(2, 3).channel()
    assert (ch._polar_weight(omega, np.broadcast_to(V, (4, 2, 2))) == 1).all()
    m = ch.moments(y, omega, V)
    for i in range(4):
        r = ref.reparam_l2_t3(y[i], omega[i], V, n=REF_N_T3)
        assert r.error <= REF_TOL
        assert ref.metric(m.g_out[i], m.dg_out[i], r.g_out, r.dg_out) <= RTOL, (i, m.error[i])


@pytest.mark.parametrize("T, q, draws", [(2, 0.965, (83, 106)), (3, 0.965, (0, 1, 2, 3))])
def test_reparam_l2_narrow_first_layer_escalates(T, q, draws):
    """h_1 narrow: by default the Laplace rule grows its nodes (×1.5) where its estimate is
    above ``escalate``.  Before (2026-11-26) it did not: on 1024 draws at q = 0.965·I, T = 2,
    nine were 1.4e-5 … 3.2e-5 off (draws 83 and 106 the worst two, confirmed by the reference),
    and with T = 3 up to 1.1e-5 on 8 draws."""
    n = max(draws) + 1 if T == 3 else 1024
    y, omega, V = se_batch(2, n, q * np.eye(2), np.random.default_rng(5), tokens=T)
    ch = model(2, T).channel()
    assert (ch._polar_weight(omega[list(draws)], np.broadcast_to(V, (len(draws), 2, 2))) == 0).all()
    m = ch.moments(y, omega, V)
    plain = model(2, T).channel(error_estimate=False).moments(y, omega, V)
    worst_plain = 0.0
    for i in draws:
        r = ref.reparam_l2(y[i], omega[i], V) if T == 2 else ref.reparam_l2_t3(y[i], omega[i], V, n=REF_N_T3)
        assert r.error <= REF_TOL
        assert ref.metric(m.g_out[i], m.dg_out[i], r.g_out, r.dg_out) <= RTOL, (i, m.error[i])
        worst_plain = max(worst_plain, ref.metric(plain.g_out[i], plain.dg_out[i], r.g_out, r.dg_out))
    if T == 2:
        assert worst_plain > 1e-5          # the rule at the default nodes alone misses these


def test_reparam_l2_t3_pinned_estimate_bounds_the_error():
    """T = 3 with the last layer pinned (q = diag(0, 0.99)), with ``tol`` and three spherical
    rounds (state evolution's setting): where the spherical rule stays flagged, the Laplace
    rule's result is kept only with an estimate no lower than the two rules' difference.  On
    this draw (y at the softmax edge, smallest entry 2e-10) the Laplace rule's adaptive cubature
    was kept with an estimate of 1.4e-4 while 29 off the reference; now the error (5.7e-4) stays
    below the estimate (0.26).  The default six rounds resolve it (``test_reparam_l2_t3_pinned_six_rounds``)."""
    y, omega, V = se_batch(2, 64, np.diag([0.0, 0.99]), np.random.default_rng(11), tokens=3)
    i = 52
    ch = model(2, 3).channel(tol=CHANNEL_TOL, escalation=dict(rounds=3))
    m = ch.moments(y[i:i + 1], omega[i:i + 1], V)
    r = ref.reparam_l2_t3(y[i], omega[i], V, n=REF_N_T3)
    assert r.error <= 1e-3
    err = ref.metric(m.g_out[0], m.dg_out[0], r.g_out, r.dg_out)
    assert err <= max(m.error[0], RTOL) + r.error, (err, m.error[0])


@pytest.mark.parametrize("case", [
    (0.999, 32, 0, 8, 14),
    pytest.param((0.99, 64, 11, 52, 20), marks=pytest.mark.slow)])
def test_reparam_l2_t3_pinned_six_rounds(case):
    """T = 3 with the last layer pinned, by default: six finer spherical rounds
    (``ReparamChannel.ESCALATION[3]``) resolve draws that three rounds leave flagged.  Against
    the reference at n = 14 / 20 (bound 1.1e-6 / 1.2e-6): 7.7e-7 / 1.6e-6 off, estimating 2.9e-8
    / 1.8e-9; three rounds were 1.9e-3 / 5.7e-4 off (estimates 0.036 / 0.26, the second by the
    Laplace rule)."""
    q, n, seed, i, n_ref = case
    y, omega, V = se_batch(2, n, np.diag([0.0, q]), np.random.default_rng(seed), tokens=3)
    m = model(2, 3).channel().moments(y[i:i + 1], omega[i:i + 1], V)
    old = model(2, 3).channel(escalation=dict(rounds=3)).moments(y[i:i + 1], omega[i:i + 1], V)
    r = ref.reparam_l2_t3(y[i], omega[i], V, n=n_ref)
    assert r.error <= 2e-6
    assert ref.metric(m.g_out[0], m.dg_out[0], r.g_out, r.dg_out) <= RTOL + r.error, m.error[0]
    assert m.error[0] <= 1e-5
    assert ref.metric(old.g_out[0], old.dg_out[0], r.g_out, r.dg_out) > 1e-4


# -- L = 3 (T = 2): 4-D integral ------------------------------------------------------------------

def check_l3(d, n=5, ref_tol=REF_TOL_L3, n_max=None, ch=None):
    """The three-layer channel (default: ``channel(3)``) against the reference with n nodes per
    panel, raised up to n_max while the reference's own bound is above ref_tol (its bound falls
    ≈ 5–20× per order)."""
    expected = ref.reparam_l3(d.y, d.omega, d.V, n=n)
    while n_max is not None and expected.error > ref_tol and n < n_max:
        n += 1
        expected = ref.reparam_l3(d.y, d.omega, d.V, n=n)
    compare("L=3", ch or channel(3), d, expected, RTOL_L3, ref_tol)


def laplace3(**options):
    """A three-layer channel whose polar rule stops at POLAR_MIN_SD, blended, whatever V (before
    2026-11-27 every three-layer channel did): the Laplace rule below it, also where every
    layer is about as narrow."""
    ch = model(3).channel(**options)
    ch.POLAR3_MIN_SD = dict(ch.POLAR3_MIN_SD, ratio=(1e300, 2e300))      # ρ never reaches it
    return ch


@examples(1)
@given(data=st.data())
def test_reparam_l3_state_evolution_draws(data):
    check_l3(data.draw(se_draws(3, correlated=data.draw(st.booleans()))))


@pytest.mark.parametrize("q", [0.0, 0.3, 0.9])
def test_reparam_l3_default_polar_rule(q):
    """The default three-layer rule (polar in h_1 and h_2, no tol) on a state-evolution draw at
    overlap q·I: within 1e-3 of the reference (measured 3.4e-5 / 5.4e-6 / 2.5e-6 at q = 0 / 0.3 /
    0.9, the reference's own bound at n = 5 2.0e-5 / 2.2e-5 / 8.8e-6; on 64 draws per q the rule
    is within 6.9e-5 of an independent fine rule, see the README)."""
    y, omega, V = se_batch(3, 1, q * np.eye(3), np.random.default_rng(12))
    ch = model(3).channel()
    assert (ch._polar_weight(omega, V[None]) == 1).all()
    m = ch.moments(y, omega, V)
    r = ref.reparam_l3(y[0], omega[0], V, n=5)
    assert r.error <= 1e-4                  # ten times below the tolerance checked
    assert ref.metric(m.g_out[0], m.dg_out[0], r.g_out, r.dg_out) <= 1e-3


def _check_l2_default(y, omega, V):
    """The default two-layer channel within RTOL of the reference, its estimate within
    PINNED["escalate"] (samples above it are refined below a tenth of it)."""
    r = ref.reparam_l2(y, omega, V)
    m = model(2).channel().moments(y[None], omega[None], V)
    assert r.error <= REF_TOL
    assert ref.metric(m.g_out[0], m.dg_out[0], r.g_out, r.dg_out) <= RTOL
    assert m.error[0] <= model(2).channel().PINNED["escalate"]


def test_reparam_l2_pinned_escalation_refines_past_the_threshold():
    """Two layers, the last layer pinned (q = diag(0, 0.999)): the samples whose polar estimate
    is above ``escalate`` are refined to ESCALATION["refine"] × it (ten finer polar rounds,
    then the adaptive rule), the others kept.  On these 24 draws (all above ``escalate``),
    against the channel at tol = 1e-8: the default within 1e-6 (measured 2.5e-8; three rounds
    to ``escalate`` itself, the rule before 2026-11-28, 1.1e-7) with every refined sample's
    estimate at most 1e-6 (measured 7.3e-7), which the rule before leaves above 1e-6 on 20 of
    them (up to 1.0e-5)."""
    y, omega, V = se_batch(2, 24, np.diag([0.0, 0.999]), np.random.default_rng(5))
    exact = model(2).channel(tol=1e-8).moments(y, omega, V)
    ch = model(2).channel()
    before = ch._polar_refined(y, omega, np.broadcast_to(V, (24, 2, 2)).copy(),
                               np.broadcast_to(np.linalg.inv(V), (24, 2, 2)).copy(),
                               np.full(24, np.linalg.slogdet(V)[1]))
    m = ch.moments(y, omega, V)
    flagged = np.isfinite(before[4])
    assert flagged.any() and (m.error[flagged] <= 1e-6).all(), m.error[flagged]
    assert max(ref.metric(m.g_out[i], m.dg_out[i], exact.g_out[i], exact.dg_out[i]) for i in range(24)) <= 1e-6
    old = model(2).channel(escalation=dict(rounds=3, refine=1.0)).moments(y, omega, V)
    assert old.error.max() > 1e-6


def test_gauss_legendre_cache_is_numpys_rule_and_read_only():
    """The polar rules' radii come from a cache of Gauss–Legendre rules: the same nodes and
    weights as numpy's, and read-only, so that no caller can change them for the next."""
    for n in (4, 32, 431):
        t, w = gauss_legendre(n)
        assert gauss_legendre(n)[0] is t
        np.testing.assert_array_equal(np.stack([t, w]), np.stack(np.polynomial.legendre.leggauss(n)))
        with pytest.raises(ValueError):
            w[0] = 1.0


@pytest.mark.parametrize("layers, noise", [(2, None), (3, None), (2, 0.1)])
def test_channel_kernels_run_on_the_channels_threads(layers, noise):
    """``threads=1`` reaches the model's kernels the channel calls directly (the polar rule's
    node data): they are copies on one thread, the model's own keep its setting, and the
    moments are those of the channel on every core."""
    mo = DeepAttention(layers=layers, tokens=2, threads=2)
    one = mo.channel(noise=noise, threads=1)
    kernels = [k for k in vars(one).values() if hasattr(k, "columns") and hasattr(k, "threads")]
    assert kernels and all(k.threads == 1 for k in kernels)
    assert all(k.threads == 2 for k in mo._kernels.values())
    rng = np.random.default_rng(0)
    omega = 0.5 * rng.standard_normal((16, layers, 2))
    Z = omega + np.sqrt(0.75) * rng.standard_normal(omega.shape)
    y = mo.forward(Z) + (0.0 if noise is None else np.sqrt(noise) * rng.standard_normal((16, 2, 2)))
    a, b = one.moments(y, omega, 0.75 * np.eye(layers)), mo.channel(noise=noise).moments(y, omega, 0.75 * np.eye(layers))
    np.testing.assert_allclose(a.dg_out, b.dg_out, rtol=1e-12, atol=1e-12 * np.abs(b.dg_out).max())


def test_reparam_l2_rounds_grow_angles_and_radii_apart():
    """The finer polar rounds (two layers) multiply the angles by 1.5^a and the radii by
    1.5^(2 − a), a = ``escalation["angular"]`` (1.2 by default; three layers: 1.5 both): the
    rings at (radial, angular) multipliers are the rings at the angular one with the radial
    count scaled apart."""
    ch = model(2).channel()
    a = ch.escalation["angular"]
    assert np.allclose(ch._polar_round_scales(1.0, 2),
                       [[1.5 ** (2 - a), 1.5 ** a], [1.5 ** (4 - 2 * a), 1.5 ** (2 * a)]])
    isotropic = model(2).channel(escalation=dict(angular=1.0))
    assert np.allclose(isotropic._polar_round_scales(1.0, 2), [[1.5] * 2, [2.25] * 2])
    assert np.allclose(model(3).channel()._polar_round_scales(1.0, 2), [1.5, 2.25])
    group, mu, var = np.zeros(3, dtype=int), np.array([0.1, 0.2, 0.3]), np.full(3, 0.5)
    both = ch._polar_rings(group, mu, var, np.array([2.0, 3.0]), 1.0)
    ch.POLAR = dict(ch.POLAR, radial=ch.POLAR["radial"] * 2.0 / 3.0)
    apart = ch._polar_rings(group, mu, var, 3.0, 1.0)
    assert len(both.radius[0]) == 2 * ReparamChannel.POLAR["radial"]
    assert np.array_equal(both.count, apart.count) and np.array_equal(both.x, apart.x)


def test_reparam_l2_pinned_last_layer():
    """The last layer pinned (V₂₂ = 1e-3) while h_1 is broad: the posterior over h_1 is a narrow
    peak on a ridge.  The default polar rule was off by 39 here (its estimate 0.63); the
    adaptive rule it escalates to must reach 1e-6."""
    Z = np.array([[-0.19224071152595104, -0.8137724218420405], [1.4154566200488867, -1.056339817648993]])
    omega = np.array([[0.0, 0.0], [1.367866004494648, -1.0771362174117753]])
    V = np.diag([1.0, 1e-3])
    _check_l2_default(model(2).forward(Z[None])[0], omega, V)


def test_reparam_l2_pinned_estimate_in_the_metric():
    """A state-evolution draw at q = diag(0, 0.999) with y at the softmax edge: the adaptive
    rule stopped at 1e-5 of its whitened moments and was 7.0e-5 off, because the metric
    (relative to max|(g_out, dg_out)|) amplifies those by κ ≈ 250 here; its stopping rule and
    estimate now include κ (``channels._amp``)."""
    y = np.array([[9.9999976781660993e-01, 2.3218339013809019e-07],
                  [2.4387625214110212e-05, 9.9997561237478594e-01]])
    omega = np.array([[0.0, 0.0], [1.8211001297812919, -1.319770589391837]])
    V = np.diag([1.0, 1e-3])
    _check_l2_default(y, omega, V)


# State-evolution draws of 128 at q = diag(0, 0.9999) (the benchmark's draws, seed 0):
# ((y₁₂, y₂₁), ω_2), the other entries of y 1 - these, ω_1 = 0.
PINNED_RIDGES = {"draw-119": ([2.15895513e-13, 9.93471053e-01], [-3.89922675, 0.46330717]),
                 "draw-100": ([0.0030842257663253273, 2.180318575668564e-05], [-1.4384507210597457, 2.1186970879291485]),
                 "draw-101": ([0.03817990598249723, 0.06925113403970548], [-1.1210666214038028, 1.1508254856415152]),
                 "draw-74": ([0.006188987119297709, 0.08449610009193392], [-1.2608972304752517, 0.832852803597197])}


@pytest.mark.parametrize("draw", list(PINNED_RIDGES))
def test_reparam_l2_pinned_ridge(draw, monkeypatch):
    """The posterior over h_1 is a narrow ridge.  Before 2026-11-28 the adaptive rule's initial
    boxes were bisected down to the peak's sd only, leaving long thin siblings whose nodes
    straddled the ridge's tails: draw 119 (y₁₂ = 2.2e-13, the ridge sd 0.007 × 0.026) lost 42 %
    of its mass (default 5.2e2 off estimating 1.0e-6, `tol=1e-7` 2.7e2 off estimating 1.0e-8),
    draw 100 was 57 off (default) and 4.9e-3 off (`tol=1e-8`).  Draw 101: a long curved ridge
    whose tail (8.6e-9 of the mass, h_2 5 sd from its mean) crosses the cliff θ = 0 far beyond
    the peak's window; `tol=1e-7` was 4.5e-5 off estimating 5.2e-7 until the boxes followed the
    ridge.  Draw 74 was 2.3e-2 off both by default and at `tol=1e-8`, so that comparing the two
    did not show it.  The mpmath reference agrees on draw 119 with an integration in other
    coordinates (d = h₁₁ - h₁₂, m = (h₁₁ + h₁₂)/2) to 3e-14 in log Z.  Since 2026-12-01 the
    logit rule takes these four draws by default (their windows avoid θ = (½, ½); since
    2026-12-02 the Gauss–Hermite rule in θ where their Gaussians fit), so the adaptive rule is
    checked with both off (``escalation={"logit": False, "gauss": False}``), and the test checks
    that by default one of them ran and its result stood."""
    (a, b), w2 = PINNED_RIDGES[draw]
    y = np.array([[1.0 - a, a], [b, 1.0 - b]])
    omega = np.array([[0.0, 0.0], w2])
    V = np.diag([1.0, 1e-4])
    r = ref.reparam_l2(y, omega, V)
    assert r.error <= 1e-7          # measured 1.1e-8 / 9.3e-9 / 1.7e-9 / 9.8e-9: ample for RTOL
    taken, shortcut = [], ReparamChannel._polar_shortcut

    def spy(self, u, omega, V, Vinv, logdetV, fine, error, target):
        before = error.copy()
        shortcut(self, u, omega, V, Vinv, logdetV, fine, error, target)
        taken.append(bool(error[0] < before[0] and error[0] <= target[0]))

    monkeypatch.setattr(ReparamChannel, "_polar_shortcut", spy)
    for ch in (model(2).channel(), channel(2), model(2).channel(escalation={"logit": False, "gauss": False})):
        mo = ch.moments(y[None], omega[None], V)
        assert ref.metric(mo.g_out[0], mo.dg_out[0], r.g_out, r.dg_out) <= RTOL, (mo.log_z[0], r.log_z, mo.error[0])
    assert taken[0] and not taken[2], taken      # with tol=1e-7 (taken[1]) it stands only below 1e-8


def test_reparam_l2_logit_rule_draw_the_rounds_miss():
    """Benchmark draw 53 at q = diag(0, 0.9999) (y near the identity): the polar rounds and the
    adaptive rule were 2.1e-3 off the mpmath reference there by default and at tol = 1e-9
    (estimate 3.1e-6); the logit rule, which took it by default from 2026-12-01, 2.4e-8, and the
    Gauss–Hermite rule in θ, which takes it since 2026-12-02, 7.7e-8."""
    y = np.array([[0.9999999883482783, 1.1651721570595643e-08], [1.4653529090777638e-09, 0.999999998534647]])
    omega = np.array([[0.0, 0.0], [1.8968069066937314, -2.35962280532581]])
    V = np.diag([1.0, 1e-4])
    r = ref.reparam_l2(y, omega, V)
    assert r.error <= 1e-7
    errors = [ref.metric(mo.g_out[0], mo.dg_out[0], r.g_out, r.dg_out)
              for mo in (model(2).channel(**options).moments(y[None], omega[None], V)
                         for options in ({}, {"escalation": {"gauss": False}},
                                         {"escalation": {"logit": False, "gauss": False}}))]
    assert errors[0] <= RTOL and errors[1] <= RTOL and errors[2] > 1e-4, errors


def test_reparam_l2_pinned_without_skip_runs():
    """skip = 0 (Φ = A, singular on θ_1 + θ_2 = 1): the adaptive rule's Gauss–Newton Hessians can
    be singular; until 2026-12-01 that raised numpy's LinAlgError from inside the channel (35 of
    these 96 state-evolution draws at q = diag(0, 0.9999) reach that rule)."""
    m = model(2, skip=0.0)
    rng = np.random.default_rng(5)
    q = np.array([0.0, 0.9999])[:, None]
    omega = np.sqrt(q) * rng.standard_normal((96, 2, 2))
    y = m.forward(omega + np.sqrt(1 - q) * rng.standard_normal((96, 2, 2)))
    keep = (y > 0).all(axis=(1, 2))
    mo = m.channel().moments(y[keep], omega[keep], np.diag(1 - q[:, 0]))
    assert np.isfinite(mo.dg_out).all() and np.isfinite(mo.error).all()


def test_logit_rule_windows():
    """θ* solves (cI + A(θ*)) ω_2 = ±u_2 (A row-stochastic with diagonal θ*); the rule leaves out
    windows that hold θ = (½, ½), correlated layers (V₁₂ ≠ 0) and ω_21 = ω_22."""
    rng = np.random.default_rng(3)
    c = 0.7
    u, omega = rng.standard_normal((5, 2)), rng.standard_normal((5, 2, 2))
    V = np.broadcast_to(np.diag([1.0, 1e-6]), (5, 2, 2)).copy()
    centre, w, meets, applies = logit_rule.windows(u, omega, V, c)
    for i, k in np.ndindex(5, 2):
        p, r = centre[i, k]
        A = np.array([[p, 1 - p], [1 - r, r]])
        assert np.allclose((c * np.eye(2) + A) @ omega[i, 1], (1 - 2 * k) * u[i], atol=1e-12)
    assert np.allclose(w, 1e-3 * (c + np.sqrt(2)) / np.abs(omega[:, 1, 0] - omega[:, 1, 1]))
    # a window about (½, ½): ω_2 = (1, 0), u_2 = Φ(½, ½) ω_2 = (c + ½, ½)
    om = np.array([[[0.0, 0.0], [1.0, 0.0]]] * 3)
    Vs = np.array([np.diag([1.0, 1e-6]), np.diag([1.0, 1e-6]), [[1.0, 1e-4], [1e-4, 1e-6]]])
    uu = np.array([[c + 0.5, 0.5], [c + 0.8, 0.1], [c + 0.8, 0.1]])
    assert logit_rule.windows(uu, om, Vs, c)[3].tolist() == [False, True, False]


@examples(6)
@given(data=st.data())
def test_reparam_l2_pinned_against_the_nested_rule(data):
    """Two layers pinned, V diagonal (q = diag(q₁₁, 1 − 10^-k), q₁₁ ∈ [0, 0.5], k ∈ [2, 4]), with
    skip c ∈ [0.5, 2] and β ∈ [0.5, 2.5]: the default channel against the nested reference (on
    128 draws each of (c, β) = (0.3, 1), (2, 1), (1, 0.5), (1, 2.5), (0.5, 2) at q = 0.5·I,
    diag(0, 0.999), diag(0.5, 0.9999), 2026-12-02: within 3.2e-7)."""
    skip, beta = data.draw(st.floats(0.5, 2.0)), data.draw(st.floats(0.5, 2.5))
    q = np.array([data.draw(st.floats(0.0, 0.5)), 1.0 - 10 ** -data.draw(st.floats(2.0, 4.0))])[:, None]
    rng = np.random.default_rng(data.draw(seeds))
    omega = np.sqrt(q) * rng.standard_normal((2, 2))
    V = np.diag(1 - q[:, 0])
    y = model(2, 2, skip, beta).forward(omega + np.sqrt(1 - q) * rng.standard_normal((2, 2)))
    r = nested.reparam_l2_nested(y, omega, V, skip, beta)
    assert r.error <= 1e-6, r.error
    mo = model(2, 2, skip, beta).channel().moments(y[None], omega[None], V)
    err = ref.metric(mo.g_out[0], mo.dg_out[0], r.g_out, r.dg_out)
    assert err <= RTOL, (err, mo.error[0])


def test_nested_reference_against_the_mpmath_reference():
    """The second reference against the first on a draw with ω_11 − ω_12 < 0 and ω_11 + ω_12 ≠ 0
    (q = 0.9·I, seed 6), where the prior over the half plane d > 0 peaks at m = −m_0 (its
    reflection): before its m walls and range covered ±m_0 the nested rule was 2.4 off here."""
    rng = np.random.default_rng(6)
    q = np.array([0.9, 0.9])[:, None]
    omega = np.sqrt(q) * rng.standard_normal((2, 2))
    y = model(2).forward(omega + np.sqrt(1 - q) * rng.standard_normal((2, 2)))
    V = np.diag(1 - q[:, 0])
    r, n = ref.reparam_l2(y, omega, V), nested.reparam_l2_nested(y, omega, V)
    assert r.error <= REF_TOL and n.error <= REF_TOL, (r.error, n.error)
    assert ref.metric(n.g_out, n.dg_out, r.g_out, r.dg_out) <= 1e-9


def test_reparam_l2_pinned_cusp_windows_against_the_nested_rule():
    """Two layers pinned, V diagonal: the samples whose window in θ holds θ = (½, ½), which the
    logit rule leaves to the cusp rule (near ½), the polar rounds and the adaptive rule, against a
    second reference, the nested (d, m) rule (tests/nested_reference.py: the fold of h_1 ↦ θ is
    flat there).  The
    first three such state-evolution draws per q (seed 11).  On all 147 / 226 such draws of the
    channel benchmark at q₂₂ = 0.9999 / 0.999 (seed 0) that rule is within 1.5e-9 / 8.2e-10 of
    the channel at tol = 1e-9 (measured 2026-12-02)."""
    m, c = model(2), 1.0
    rng = np.random.default_rng(11)
    for q in ([0.0, 0.99], [0.0, 0.999], [0.0, 0.9999], [0.3, 0.9999]):
        q = np.array(q)[:, None]
        omega = np.sqrt(q) * rng.standard_normal((64, 2, 2))
        y = m.forward(omega + np.sqrt(1 - q) * rng.standard_normal((64, 2, 2)))
        V = np.diag(1 - q[:, 0])
        u = np.array([[float(x) for x in ref.u_from_y(yi, 1.0)] for yi in y])
        centre, w, meets, _ = logit_rule.windows(u, omega, np.broadcast_to(V, (64, 2, 2)), c)
        cusp = ((np.abs(centre - 0.5) < 9 * w[:, None, None]).all(axis=2) & meets).any(axis=1)
        pick = np.flatnonzero(cusp)[:3]
        assert len(pick) == 3, (q.ravel(), cusp.sum())
        mo = m.channel().moments(y[pick], omega[pick], V)
        for k, i in enumerate(pick):
            r = nested.reparam_l2_nested(y[i], omega[i], V)
            assert r.error <= 1e-6, (q.ravel(), i, r.error)
            err = ref.metric(mo.g_out[k], mo.dg_out[k], r.g_out, r.dg_out)
            assert err <= RTOL, (q.ravel(), i, err, mo.error[k])


def test_cusp_rule_applies_and_its_gaussian():
    """The cusp rule takes windows about θ = (½, ½) only (V₁₂ = 0, V₁₁ ≥ BROAD, one sign meeting
    the range, θ* within NEAR − 3w of ½), and its Gaussian in the logits a is the likelihood's: P against
    the Hessian of −log N(Φ(σ(βa))⁻¹u; ω_2, V₂₂) at a* by central differences."""
    c, beta, v2 = 0.7, 1.3, 1e-6
    om = np.array([[[0.0, 0.0], [1.0, 0.0]]] * 5)
    Vs = np.array([np.diag([1.0, v2])] * 3 + [[[1.0, 1e-4], [1e-4, v2]], np.diag([0.3, v2])])
    theta = np.array([[0.5, 0.5], [0.51, 0.495], [0.8, 0.9], [0.5, 0.5], [0.5, 0.5]])
    uu = c * om[:, 1] + np.stack([theta[:, 0], 1 - theta[:, 1]], axis=1)     # (cI + A(θ)) (1, 0)
    centre, w, meets, logit = logit_rule.windows(uu, om, Vs, c)
    ok, near = cusp_rule.applies(centre, w, meets, om, Vs, c, beta)
    assert ok.tolist() == [True, True, False, False, False]
    assert logit.tolist() == [False, False, True, False, False]
    assert np.allclose(near[:2], theta[:2], atol=1e-12)
    astar, P, s_star, sigma_s = cusp_rule.gaussian(near[1:2], om[1:2, 1], np.array([v2]), c, beta)

    def log_l(a):
        t = 1 / (1 + np.exp(-beta * a))
        phi = c * np.eye(2) + np.array([[t[0], 1 - t[0]], [1 - t[1], t[1]]])
        return -((np.linalg.solve(phi, uu[1]) - om[1, 1]) ** 2).sum() / (2 * v2)

    h, H = 1e-5, np.empty((2, 2))
    for i, j in np.ndindex(2, 2):
        e_i, e_j = np.eye(2)[i] * h, np.eye(2)[j] * h
        H[i, j] = (log_l(astar[0] + e_i + e_j) - log_l(astar[0] + e_i - e_j) - log_l(astar[0] - e_i + e_j)
                   + log_l(astar[0] - e_i - e_j)) / (4 * h * h)
    assert np.allclose(-H, P[0], rtol=1e-4, atol=1e-4 * np.abs(P[0]).max()), (H, P[0])
    assert np.isclose(s_star[0], astar[0].sum()) and np.isclose(sigma_s[0] ** 2, np.linalg.inv(P[0]).sum())


def _node_rule_against_the_nested_rule(rule, qs, seed, skip, beta, pick_of, monkeypatch):
    """Two layers pinned, V diagonal: per q the first three state-evolution draws that
    ``pick_of(u, omega, V)`` picks (a mask) get ``rule`` (the name of a ``_node_rule`` setting)
    by default (with the θ rule off: at ω_1 = 0 it takes first the draws it resolves), its result
    stands, and is within RTOL of the nested reference."""
    m = DeepAttention(2, 2, skip=skip, beta=beta)
    rng = np.random.default_rng(seed)
    stood, node_rule = [], ReparamChannel._node_rule

    def spy(self, idx, settings, nodes_of, *args):
        out = node_rule(self, idx, settings, nodes_of, *args)
        if settings is getattr(self, rule):
            stood.extend(set(idx) - set(out[0]))
        return out

    monkeypatch.setattr(ReparamChannel, "_node_rule", spy)
    for q in qs:
        q = np.array(q)[:, None]
        omega = np.sqrt(q) * rng.standard_normal((256, 2, 2))
        y = m.forward(omega + np.sqrt(1 - q) * rng.standard_normal((256, 2, 2)))
        V = np.broadcast_to(np.diag(1 - q[:, 0]), (256, 2, 2)).copy()
        u = np.array([[float(x) for x in ref.u_from_y(yi, beta)] for yi in y])
        pick = np.flatnonzero(pick_of(u, omega, V))[:3]
        assert len(pick) == 3, q.ravel()
        stood.clear()
        mo = m.channel(escalation={"theta": False}).moments(y[pick], omega[pick], V[pick])
        assert sorted(stood) == [0, 1, 2], (q.ravel(), stood)
        for k, i in enumerate(pick):
            r = nested.reparam_l2_nested(y[i], omega[i], V[i], skip, beta)
            if r.error > RTOL / 4:      # (0.5, 2): cusp draw 16 at diag(0, 0.9999) 8.4e-6, at 1.5× 6.1e-12
                r = nested.reparam_l2_nested(y[i], omega[i], V[i], skip, beta, n=36, nd=27)
            assert r.error <= RTOL / 4, (q.ravel(), i, r.error)
            err = ref.metric(mo.g_out[k], mo.dg_out[k], r.g_out, r.dg_out)
            assert err <= RTOL, (q.ravel(), i, err, mo.error[k])


@pytest.mark.parametrize("skip, beta", [(1.0, 1.0), (0.5, 2.0)])
def test_reparam_l2_cusp_rule_against_the_nested_rule(skip, beta, monkeypatch):
    """The cusp rule's draws (seed 5; q = diag(0, 0.999), diag(0, 0.9999), diag(0.3, 0.9999): ω_1
    = 0 runs over the half plane d > 0, ω_1 ≠ 0 over the plane)."""
    def cusp(u, omega, V):
        centre, w, meets, _ = logit_rule.windows(u, omega, V, skip)
        return cusp_rule.applies(centre, w, meets, omega, V, skip, beta)[0] & ~_gauss_fits(u, omega, V, skip, None)

    _node_rule_against_the_nested_rule("CUSP", ([0.0, 0.999], [0.0, 0.9999], [0.3, 0.9999]), 5, skip, beta, cusp,
                                       monkeypatch)


@pytest.mark.parametrize("skip, beta", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("logit", [True, False], ids=["logit-windows", "one-window"])
def test_reparam_l2_gauss_rule_against_the_nested_rule(skip, beta, logit, monkeypatch):
    """The Gauss–Hermite rule in θ: draws whose every window's Gaussian lies inside the range
    (``logit_rule.gauss``; seed 7; q = diag(0, 0.9999), diag(0.3, 0.9999)), the logit rule's or
    (``logit`` False) with one window that holds θ = (½, ½)."""
    _node_rule_against_the_nested_rule("GAUSS", ([0.0, 0.9999], [0.3, 0.9999]), 7, skip, beta,
                                       lambda u, omega, V: _gauss_fits(u, omega, V, skip, logit), monkeypatch)


def _gauss_fits(u, omega, V, skip, logit):
    """The draws the Gauss–Hermite rule takes (``logit_rule.gauss``): those of the logit rule
    (``logit``), the others (not ``logit``), or (None) both."""
    centre, w, meets, logit_rule_applies = logit_rule.windows(u, omega, V, skip)
    fits = logit_rule.gauss(centre, omega, V, meets, logit_rule_applies, skip)[1]
    return fits if logit is None else fits & (logit_rule_applies == logit)


def test_reparam_l2_node_rules_by_parts(monkeypatch):
    """The node rules (Gauss–Hermite in θ, logit panels, cusp) set up their nodes NODE_RULE_NODES
    at a time: one sample per part and every sample in one part give the same moments (64
    state-evolution draws at q = diag(0, 0.9999), seed 3, of which each rule takes some)."""
    m = model(2)
    rng = np.random.default_rng(3)
    q = np.array([0.0, 0.9999])[:, None]
    omega = np.sqrt(q) * rng.standard_normal((64, 2, 2))
    y = m.forward(omega + np.sqrt(1 - q) * rng.standard_normal((64, 2, 2)))
    keep = (y > 0).all(axis=(1, 2))
    taken, rule = {}, ReparamChannel._node_rule

    def spy(self, idx, settings, *args):
        taken[id(settings)] = taken.get(id(settings), 0) + len(idx)
        return rule(self, idx, settings, *args)

    monkeypatch.setattr(ReparamChannel, "_node_rule", spy)
    runs = []
    for nodes, first in ((1, 1), (1 << 40, 1 << 20)):
        monkeypatch.setattr(ReparamChannel, "NODE_RULE_NODES", nodes)
        monkeypatch.setattr(ReparamChannel, "NODE_RULE_FIRST", first)
        runs.append(m.channel().moments(y[keep], omega[keep], np.diag(1 - q[:, 0])))
    assert all(taken.get(id(getattr(ReparamChannel, rule)), 0) >= 4 for rule in ("GAUSS", "LOGIT", "CUSP")), taken
    for a, b in zip((runs[0].log_z, runs[0].g_out, runs[0].dg_out), (runs[1].log_z, runs[1].g_out, runs[1].dg_out)):
        assert np.array_equal(a, b)


@st.composite
def pinned_draws(draw, correlated=False):
    """SE draws of two-layer attention with the last layer pinned and the first broad:
    q = diag(q₁₁, q₂₂) (or rotated by a small angle), q₁₁ ∈ [0, 0.5], q₂₂ = 1 - 10^-k, k ∈ [1, 4]."""
    q = np.diag([draw(st.floats(0.0, 0.5)), 1.0 - 10 ** -draw(st.floats(1.0, 4.0))])
    if correlated:
        a = draw(st.floats(-0.05, 0.05))
        U = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
        q = symmetric(U @ q @ U.T)
    rng = np.random.default_rng(draw(seeds))
    omega = sqrt_psd(q) @ rng.standard_normal((2, 2))
    V = symmetric(np.eye(2) - q)
    Z = omega + sqrt_psd(V) @ rng.standard_normal((2, 2))
    return Draw(model(2).forward(Z), omega, V, "se-pinned", q)


@pytest.mark.parametrize("correlated", [False, True], ids=["q-diagonal", "q-rotated"])
@examples(2)
@given(data=st.data())
def test_reparam_l2_pinned_state_evolution_draws(correlated, data):
    """The regime the polar rule flags (the posterior over h_1 collapses onto narrow peaks and
    ridges): the adaptive rule takes over."""
    check_l2(data.draw(pinned_draws(correlated)))


@pytest.mark.slow
@examples(12)
@given(data=st.data(), correlated=st.booleans())
def test_reparam_l2_pinned_state_evolution_draws_many(data, correlated):
    check_l2(data.draw(pinned_draws(correlated)))


@pytest.mark.slow
@examples(10)
@given(data=st.data())
def test_reparam_l3_state_evolution_draws_many(data):
    check_l3(data.draw(se_draws(3, correlated=data.draw(st.booleans()))), n=6, ref_tol=1e-5, n_max=8)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="known defect (issue 3 open): near-singular V with h_1, h_2 correlated 0.98 (conditional sd 0.011 / 0.029, so the Laplace rule runs): the reference reaches only 1.5e-2 at n = 8 (311-819 s) and is 0.19 from the channel at tol = 1e-7 (adaptive rule at its three-layer budget of 200 000 regions: estimate 7.2e-5, 2.3e-5 from 1 000 000 regions), while the Gauss-Hermite tensor rule approaches the channel as its nodes grow (1.45e-4 from it at 80 per dimension): probably the reference is off, but no rule confirms 1e-4")
@examples(8)
@given(data=st.data())
def test_reparam_l3_adversarial(data):
    check_l3(data.draw(adversarial_draws(3, kinds=("near-singular V", "large omega", "softmax edge"))),
             n=6, ref_tol=1e-5, n_max=8)


# -- noisy route: L = 1, T = 2 (2-D) ----------------------------------------------------------------

def check_noisy(d):
    compare("noisy L=1", channel(1, noise=d.noise), d, ref.noisy_l1(d.y, d.omega, d.V, 1.0, d.noise),
            RTOL, REF_TOL, log_z=True)


NOISY_ADVERSARIAL = ("large omega", "softmax edge", "unrelated y")
small_noises = st.floats(math.log(1e-4), 0.0).map(math.exp)


@examples(5)
@given(data=st.data(), noise=noises)
def test_noisy_l1_state_evolution_draws(data, noise):
    """P(y|Z) = N(y; g(Z), Δ I), Δ ∈ [1e-3, 1]: g_out, dg_out to 1e-6 and log Z_out (exact on
    this route) to 1e-6 · max(1, |log Z_out|)."""
    check_noisy(data.draw(se_draws(1, noise=noise)))


@examples(3)
@given(data=st.data(), noise=small_noises)
def test_noisy_l1_adversarial(data, noise):
    check_noisy(data.draw(adversarial_draws(1, noise=noise, kinds=NOISY_ADVERSARIAL)))


@pytest.mark.slow
@examples(60)
@given(data=st.data(), noise=noises)
def test_noisy_l1_state_evolution_draws_many(data, noise):
    check_noisy(data.draw(se_draws(1, noise=noise)))


@pytest.mark.slow
@examples(40)
@given(data=st.data(), noise=small_noises)
def test_noisy_l1_adversarial_many(data, noise):
    check_noisy(data.draw(adversarial_draws(1, noise=noise, kinds=NOISY_ADVERSARIAL)))


# -- the noisy route, other links (two indices, R = 2, T = 1) ----------------------------------------

_H2 = index_symbols(2, 1)
# the links of the reference's LINKS in SymPy (the channel's), registered as chan_<name>
TWO_INDEX_LINKS = {"chan_product": ("product", _H2[0, 0] * _H2[1, 0]),
                   "chan_mixed": ("tanh_square", sp.tanh(2 * _H2[0, 0]) + _H2[1, 0] ** 2 / 2)}
for _name, (_, _expr) in TWO_INDEX_LINKS.items():
    register_link(_name, _expr)


def link_draw(name, q, noise, rng) -> Draw:
    """A two-index link's (y, ω, V) as state evolution draws them at q·I."""
    omega = math.sqrt(q) * rng.standard_normal((2, 1))
    Z = omega + math.sqrt(1 - q) * rng.standard_normal((2, 1))
    y = ref.LINKS[TWO_INDEX_LINKS[name][0]][0](Z[None])[0, 0] + math.sqrt(noise) * rng.standard_normal()
    return Draw(np.asarray(y), omega, (1 - q) * np.eye(2), f"se-{name}", np.array([q]), noise)


def link_reference(name, d: Draw):
    return ref.noisy_link(d.y, d.omega, d.V, TWO_INDEX_LINKS[name][0], 2, 1, noise=d.noise)


def test_noisy_link_reference_against_brute_force():
    """The two-index reference against a dense trapezoid rule (4001² nodes over ω ± 12√V; the
    integrand is smooth and negligible at the box's edge, so the rule converges spectrally) on a
    curved posterior: y = h_1 h_2 + noise at Δ = 1e-3, q = 0.5 (a hyperbola 0.05 wide)."""
    d = link_draw("chan_product", 0.5, 1e-3, np.random.default_rng(5))
    expected = link_reference("chan_product", d)
    w, v = d.omega[:, 0], d.V[0, 0]
    a, b = (np.linspace(w[k] - 12 * math.sqrt(v), w[k] + 12 * math.sqrt(v), 4001) for k in (0, 1))
    A, B = np.meshgrid(a - w[0], b - w[1], indexing="ij")
    f = np.exp(-(A ** 2 + B ** 2) / (2 * v) - (d.y - (A + w[0]) * (B + w[1])) ** 2 / (2 * d.noise))
    S = [np.sum(f * m) for m in (1, A, B, A * A, A * B, B * B)]
    mean = np.array(S[1:3]) / S[0]
    cov = np.array([[S[3], S[4]], [S[4], S[5]]]) / S[0] - np.outer(mean, mean)
    err = ref.metric(mean / v, cov / v ** 2 - np.eye(2) / v, expected.g_out[:, 0], expected.dg_out)
    assert expected.error <= REF_TOL and err <= 1e-9, (err, expected.error)


@examples(4)
@given(name=st.sampled_from(sorted(TWO_INDEX_LINKS)), q=st.floats(0.99, 0.999), noise=noises, seed=seeds)
def test_noisy_link_narrow_posteriors(name, q, noise, seed):
    """Where the posterior is narrow on the prior's scale (q ≥ 0.99) the Laplace rule holds for
    other links: g_out, dg_out and log Z_out to 1e-6 with ``tol=1e-6``."""
    d = link_draw(name, q, noise, np.random.default_rng(seed))
    compare(f"noisy {name}", LinkModel(name).channel(noise=noise, tol=1e-6), d, link_reference(name, d),
            RTOL, REF_TOL, log_z=True)


def test_noisy_link_curved_posterior_starting_boxes(monkeypatch):
    """y = h_1 h_2 + noise at Δ = 1e-3, q = 0.5 (a hyperbola 0.05 wide across the prior): with
    ``tol=1e-6`` the adaptive rule's starting boxes refined onto the ridge give 1e-6; from the
    equal boxes alone it was 1.1e-2 off while estimating 9.7e-6."""
    d = link_draw("chan_product", 0.5, 1e-3, np.random.default_rng(5))
    expected = link_reference("chan_product", d)
    assert expected.error <= REF_TOL
    ch = LinkModel("chan_product").channel(noise=d.noise, tol=1e-6)
    mo = ch.moments(d.y[None], d.omega[None], d.V)
    err = ref.metric(mo.g_out[0], mo.dg_out[0], expected.g_out, expected.dg_out)
    assert err <= RTOL, describe(d, "noisy chan_product", expected, mo, err)
    monkeypatch.setattr(NoisyChannel, "_ridge_rule", lambda self: None)
    mo = ch.moments(d.y[None], d.omega[None], d.V)
    assert ref.metric(mo.g_out[0], mo.dg_out[0], expected.g_out, expected.dg_out) > 1e-3 > 100 * mo.error[0]


def test_noisy_link_default_escalates():
    """R·T = 2: by default samples whose Laplace estimate is above ``escalate`` (1e-4) go to the
    adaptive rule at that tolerance; the hyperbola draw then within 1e-5, where the Laplace rule
    alone (``error_estimate=False``) is 0.34 off."""
    d = link_draw("chan_product", 0.5, 1e-3, np.random.default_rng(5))
    expected = link_reference("chan_product", d)
    model = LinkModel("chan_product")
    assert model.channel(noise=d.noise).ridges
    for options, bound in (({}, 1e-5), ({"error_estimate": False}, None)):
        mo = model.channel(noise=d.noise, **options).moments(d.y[None], d.omega[None], d.V)
        err = ref.metric(mo.g_out[0], mo.dg_out[0], expected.g_out, expected.dg_out)
        assert err <= bound if bound else err > 0.1, (options, err)


QUADRATIC = (1.0, 1.0, 0.5)       # y = h_1² + h_2² + h_3²/2 + noise: R·T = 3, a shell
register_link("chan_quadratic", sum(c * h ** 2 for c, h in zip(QUADRATIC, index_symbols(3, 1)[:, 0])))


def quadratic_link_errors(name, coefficients, noise, y, **options):
    """The channel of y = Σ_k d_k z_k² + noise at ω = 0, V = I against the characteristic-function
    reference: (moments, the metric per draw, log p(y))."""
    R, n = len(coefficients), len(y)
    log_p, c = ref.quadratic_link(coefficients, noise, y)
    mo = LinkModel(name).channel(noise=noise, **options).moments(y, np.zeros((n, R, 1)), np.eye(R))
    err = np.array([ref.metric(mo.g_out[k], mo.dg_out[k], np.zeros((R, 1)), np.diag(c[k])) for k in range(n)])
    return mo, err, log_p


@pytest.mark.parametrize("noise, bound", [(0.1, 1e-3), (0.01, 3e-2)])
def test_three_index_link_escalates_by_default(noise, bound):
    """R·T = 3: at q = 0 the posterior is a thin shell, which the Laplace rule alone misses
    (> 0.1 off); by default the ridge-refined adaptive rule takes it (``channel.ridges``).  On
    12 draws y from the model, against the characteristic-function reference: every draw within
    its estimate, and within ``bound`` (measured on 64 other draws: ≤ 9.7e-5 at Δ = 0.1, ≤ 3.8e-3
    at Δ = 0.01, where the adaptive rule stops at its budget; estimates ≥ 50× the errors)."""
    rng = np.random.default_rng(3)
    Z = rng.standard_normal((12, 3))
    y = Z ** 2 @ np.array(QUADRATIC) + np.sqrt(noise) * rng.standard_normal(12)
    model = LinkModel("chan_quadratic")
    assert model.channel(noise=noise).ridges and not model.channel(noise=noise).unresolved
    for options in ({}, {"error_estimate": False}):
        mo, err, log_p = quadratic_link_errors("chan_quadratic", QUADRATIC, noise, y, **options)
        if options:
            assert err.max() > 0.1
        else:
            assert (err <= mo.error).all() and err.max() <= bound and np.abs(mo.log_z - log_p).max() < bound


register_link("chan_square", index_symbols(1, 1)[0, 0] ** 2)


@pytest.mark.parametrize("noise", [0.1, 0.01, 0.001])
def test_one_index_even_link_escalates_by_default(noise):
    """y = z² + noise through the noisy route (no elementary closed form): at ω = 0 the mode
    search stays on the saddle z = 0 and the Laplace rule alone misses the peaks ±√y (more than
    0.1 off); by default such samples escalate (``channel.ridges`` covers R·T = 1), within 1e-6
    of the characteristic-function reference on 16 draws (measured ≤ 3.8e-8) and of log p(y)."""
    rng = np.random.default_rng(5)
    y = rng.standard_normal(16) ** 2 + np.sqrt(noise) * rng.standard_normal(16)
    for options in ({}, {"error_estimate": False}):
        mo, err, log_p = quadratic_link_errors("chan_square", (1.0,), noise, y, **options)
        if options:
            assert err.max() > 0.1
        else:
            assert err.max() <= 1e-6 and np.abs(mo.log_z - log_p).max() <= 1e-6


register_link("chan_square_tokens", [index_symbols(1, 3)[0, t] ** 2 for t in range(3)])


def test_token_wise_link_factorises_over_tokens():
    """y_t = z_t² + noise on each of 3 tokens: the channel is the product of one-token channels
    (a 1-D rule per token, not a 3-D one): at ω ≠ 0 with ``tol=1e-9`` within 1e-8 of a 1-D
    trapezoid rule per token written here; at q = 0 by default within 1e-6 of the
    characteristic-function reference, and with the estimate switched off after construction
    (as state evolution and the thresholds do) the one-token channels follow (the Laplace rule
    alone, > 0.1 off)."""
    rng, noise, n = np.random.default_rng(1), 0.01, 8
    model = LinkModel("chan_square_tokens")
    y = model.forward(rng.standard_normal((n, 1, 3))) + np.sqrt(noise) * rng.standard_normal((n, 3, 1))
    omega, V = 0.6 * rng.standard_normal((n, 1, 3)), 0.64
    mo = model.channel(noise=noise, tol=1e-9).moments(y, omega, np.array([[V]]))
    h = np.linspace(-12, 12, 400001)
    for k, t in np.ndindex(n, 3):
        w = np.exp(-(h - omega[k, 0, t]) ** 2 / (2 * V) - (y[k, t, 0] - h ** 2) ** 2 / (2 * noise))
        mean = (w * h).sum() / w.sum()
        g, dg = (mean - omega[k, 0, t]) / V, ((w * h * h).sum() / w.sum() - mean ** 2 - V) / V ** 2
        assert abs(mo.g_out[k, 0, t] - g) <= 1e-8 * max(1, abs(g)) and abs(mo.dg_out[k, t, t] - dg) <= 1e-8 * max(1, abs(dg))
    log_p, c = ref.quadratic_link([1.0], noise, y.reshape(-1))
    channel = model.channel(noise=noise)
    assert channel.ridges and not channel.unresolved            # the one-token channel's
    for alone in (False, True):
        channel.error_estimate = not alone
        mo = channel.moments(y, np.zeros((n, 1, 3)), np.eye(1))
        err = max(ref.metric(mo.g_out[k], mo.dg_out[k], np.zeros((1, 3)), np.diag(c.reshape(n, 3)[k])) for k in range(n))
        assert err > 0.1 if alone else err <= 1e-6 and np.abs(mo.log_z - log_p.reshape(n, 3).sum(axis=1)).max() <= 1e-6


def test_adaptive_result_with_a_negative_mass_is_not_kept(monkeypatch):
    """A budget far too small leaves boxes too coarse for the degree-7 rule, whose negative
    weights can give a negative mass (log Z NaN); the sample then keeps the Laplace rule's
    result and its large estimate, instead of a non-finite moment."""
    monkeypatch.setattr(NoisyChannel, "RIDGE", dict(NoisyChannel.RIDGE, cap=1000))
    channel = LinkModel("chan_quadratic").channel(noise=0.1, escalate=1e-3, max_regions=1)
    mo = channel.moments(np.array([7.025427512477323]), np.zeros((1, 3, 1)), np.eye(3))
    assert np.isfinite(mo.log_z).all() and mo.error[0] > 1e-2


@examples(4)
@given(name=st.sampled_from(sorted(TWO_INDEX_LINKS)), q=st.floats(0.0, 0.9), noise=noises, seed=seeds)
def test_noisy_link_curved_posteriors(name, q, noise, seed):
    """Broad priors (q ≤ 0.9), where the posterior of y = h_1 h_2 or tanh(2h_1) + h_2²/2 (plus
    noise) is a curved ridge: with ``tol=1e-6`` g_out, dg_out and log Z_out to 1e-6."""
    d = link_draw(name, q, noise, np.random.default_rng(seed))
    compare(f"noisy {name}", LinkModel(name).channel(noise=noise, tol=1e-6), d, link_reference(name, d),
            RTOL, REF_TOL, log_z=True)


# -- identities under the model's own outputs ---------------------------------------------------------

def se_batch(layers, n, q, rng, noise=None, tokens=2):
    R, T = layers, tokens
    xi, zeta = rng.standard_normal((n, R, T)), rng.standard_normal((n, R, T))
    omega = np.einsum("ab,nbt->nat", sqrt_psd(q), xi)
    V = symmetric(np.eye(R) - q)
    Z = omega + np.einsum("ab,nbt->nat", sqrt_psd(V), zeta)
    y = model(layers, tokens).forward(Z)
    if noise is not None:
        y = y + math.sqrt(noise) * rng.standard_normal(y.shape)
    return y, omega, V


def _spread(a, b):
    """The channel's own distance between two moment sets (relative, on g_out and dg_out)."""
    return _spread_of([a, b])[0]


def _pinned3(ch, y, omega, V, polar):
    """The channel's four-dimensional adaptive rule alone, about the polar rule's moments."""
    n = len(y)
    Vb = np.broadcast_to(V, (n, 3, 3)).copy()
    Vinv = np.linalg.inv(Vb)
    ref_mean = (omega + np.einsum("ab,nbt->nat", V, polar.g_out)).reshape(n, 6)
    out = ch._pinned3(y, omega, Vb, Vinv, np.log(np.linalg.det(Vb)), ref=ref_mean, shift=polar.log_z)
    return ch._assemble(omega, Vb, Vinv, *out)


def test_reparam_l3_adaptive_rule_against_polar_rule():
    """The three-layer adaptive rule (Genz–Malik in (t_1, θ_1, t_2, θ_2)) against the polar rule,
    an independent rule, where the latter converges: last layer pinned at q = diag(0, 0, 0.9),
    where the polar rule at 1× and 2× its counts agree to 7.1e-7.  At tol = 1e-3 (its estimate
    overstates: measured 2.7e-6 off, 2.9 s) it must be within the three-layer target 1e-4."""
    y, omega, V = se_batch(3, 1, np.diag([0.0, 0.0, 0.9]), np.random.default_rng(1))
    fine = model(3).channel(nodes=14).moments(y, omega, V)
    assert _spread(model(3).channel().moments(y, omega, V), fine) < 1e-5       # the polar rule converged
    ch = model(3).channel(tol=1e-3)
    got = _pinned3(ch, y, omega, V, fine)
    assert got.error[0] <= 1e-3
    assert _spread(got, fine) < RTOL_L3


def test_reparam_l3_adaptive_rule_only_above_its_floor(monkeypatch):
    """At tol = 1e-7 a broad draw (q = 0) stalls the polar rounds near 1e-6, below what the
    adaptive rule reaches with its boxes (measured 3.4e-6 after 25 s, result discarded): only
    samples above max(tol, PINNED3["floor"]) may take it."""
    y, omega, V = se_batch(3, 1, np.zeros((3, 3)), np.random.default_rng(3))
    called = []
    monkeypatch.setattr(ReparamChannel, "_pinned3", lambda self, y, *a, **k: called.append(len(y)))
    m = model(3).channel(tol=1e-7).moments(y, omega, V)
    assert not called
    assert 1e-7 < m.error[0] < ReparamChannel.PINNED3["floor"]


@pytest.mark.slow
def test_reparam_l3_pinned_worst_draw_converges():
    """Three layers, last layer pinned (q = diag(0, 0, 0.99)), the state-evolution draw where the
    polar rule is 0.89 off twice its counts (an output at the softmax edge).  Without the θ rule
    (``escalation={"theta": False}``) the default flags it, and with tol = 1e-3 (polar rounds
    stall, the adaptive rule runs) the channel is within 1e-4 of the same rule at tol = 1e-5
    (measured 7.2e-5; the rule at tol = 1e-4 is 5.9e-6 from it, so the rule converges).  The
    default, the three-layer θ rule (an independent rule: nested product integration in the
    attention weights), agrees with it within 1e-4 (estimating 7.3e-6)."""
    rng = np.random.default_rng(7)
    qv = np.array([0.0, 0.0, 0.99])[:, None]
    omega = np.sqrt(qv) * rng.standard_normal((64, 3, 2))
    Z = omega + np.sqrt(1 - qv) * rng.standard_normal((64, 3, 2))
    y = model(3).forward(Z)
    keep = (y > 0).all(axis=(1, 2))
    y, omega, V = y[keep][[41]], omega[keep][[41]], np.diag(1 - qv[:, 0])
    polar = dict(escalation={"theta": False})
    default = model(3).channel(**polar).moments(y, omega, V)
    assert default.error[0] > 0.1
    got = model(3).channel(tol=1e-3, **polar).moments(y, omega, V)
    fine = model(3).channel(tol=1e-5, **polar)
    fine.PINNED3 = {**fine.PINNED3, "max_regions": 1500000}
    expected = fine.moments(y, omega, V)
    assert _spread(default, expected) > 0.1
    assert _spread(got, expected) < RTOL_L3
    theta = model(3).channel().moments(y, omega, V)
    assert theta.error[0] <= 1e-4 and _spread(theta, expected) < RTOL_L3


@pytest.mark.parametrize("blend, continuous", [(None, True), (0.0, False)])
def test_moments_continuous_across_the_polar_switch(blend, continuous):
    """Three layers, last layer pinned (q = diag(0.96, 0.945, 0.9995)): V₁₁ across the polar
    rule's threshold (conditional sd 0.2 ∓ 1e-7).  The two rules disagree there (the pinned
    regime, where neither is accurate: measured up to 13× on 32 draws); with the blend the
    moments move by ≤ 1e-3 (measured 3.0e-5), with a hard switch (blend 0, as for two layers)
    by > 0.1."""
    y, omega, V = se_batch(3, 32, np.diag([0.96, 0.945, 0.9995]), np.random.default_rng(5))
    ch = model(3).channel(error_estimate=False)
    keep = ch.representable(y)
    y, omega = y[keep], omega[keep]
    if blend is not None:
        ch.POLAR_BY_LAYERS = {3: dict(ch.POLAR_BY_LAYERS[3], blend=blend)}
    out = []
    for s in (1 - 1e-6, 1 + 1e-6):
        Vs = V.copy()
        Vs[0, 0] = 0.04 * s
        m = ch.moments(y, omega, Vs)
        out.append(np.concatenate([m.g_out.reshape(len(y), -1), m.dg_out.reshape(len(y), -1)], 1))
    jump = (np.abs(out[1] - out[0]).max(axis=1) / np.abs(out[0]).max(axis=1)).max()
    assert (jump <= 1e-3) if continuous else (jump > 0.1)


@pytest.mark.parametrize("layers, n, tol", [(2, 48, 1e-6), (3, 96, 3e-4)])
def test_polar_nodes_shared_by_a_batch_match_single_samples(monkeypatch, layers, n, tol):
    """Polar rule (two and three layers): a state-evolution batch (one V) shares nodes between
    samples with close |ω_ℓ| (three layers: the whole batch); each sample computed alone (its
    own rule) agrees to the rule's accuracy (three layers: max error ≤ 6.9e-5 on 64 draws per
    q, see the README; the batch's rule spans every |ω_ℓ|, so its radial and angle counts differ
    from a lone sample's), processing the groups in chunks changes nothing, and holding the nodes
    by pieces of 1000 (their moments merged by mass) changes them by rounding only."""
    y, omega, V = se_batch(layers, n, 0.5 * np.eye(layers), np.random.default_rng(3))
    ch = model(layers).channel(error_estimate=False)
    Vn = np.broadcast_to(V, (n, layers, layers))
    assert (ch._polar_weight(omega, Vn) == 1).all()
    groups = ch._polar_groups(omega, Vn)[0]
    assert (groups.max() > 0) if layers == 2 else (groups == 0).all()
    batch = ch.moments(y, omega, V)
    for i in np.flatnonzero(np.bincount(groups)[groups] > 1)[:8]:
        alone = ch.moments(y[i:i + 1], omega[i:i + 1], V)
        assert ref.metric(batch.g_out[i], batch.dg_out[i], alone.g_out[0], alone.dg_out[0]) < tol
    monkeypatch.setattr(ReparamChannel, "POLAR_CHUNK", {2: 3, 4: 3})
    chunked = ch.moments(y, omega, V)
    np.testing.assert_array_equal(chunked.g_out, batch.g_out)
    np.testing.assert_array_equal(chunked.dg_out, batch.dg_out)
    monkeypatch.setattr(ReparamChannel, "POLAR_PIECE", 1000)     # nodes by pieces, merged by mass
    pieces = ch.moments(y, omega, V)
    for a, b in ((pieces.g_out, batch.g_out), (pieces.dg_out, batch.dg_out), (pieces.log_z, batch.log_z)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11 * np.abs(b).max())


@pytest.mark.parametrize("layers, tokens", [(2, 2), (2, 3), (3, 2)])
def test_polar_factored_signed_sums_match_the_general_ones(layers, tokens):
    """With V diagonal the polar kernels sum each node's 2^L reflections in factored form
    (D_A = e^c Π 2 sinh a_l Π 2 cosh a_l, 1 + L exponentials); an off-diagonal entry of 1e-13
    sends the same nodes through the general Walsh–Hadamard sums of the 2^L weights.  The moments
    agree to rounding (a wrong sign or factor in either moves them by O(1))."""
    y, omega, V = se_batch(layers, 24, 0.5 * np.eye(layers), np.random.default_rng(5), tokens=tokens)
    ch = model(layers, tokens).channel(error_estimate=False)
    assert (ch._polar_weight(omega, np.broadcast_to(V, (24, layers, layers))) == 1).all()
    Vc = V.copy()
    Vc[0, 1] = Vc[1, 0] = 1e-13
    a, b = ch.moments(y, omega, V), ch.moments(y, omega, Vc)
    for x, z in ((a.g_out, b.g_out), (a.dg_out, b.dg_out), (a.log_z, b.log_z)):
        np.testing.assert_allclose(x, z, rtol=1e-10, atol=1e-10 * np.abs(z).max())


def test_polar_arcs_leave_out_only_the_prior_beyond_reach(monkeypatch):
    """Three layers at q = 0.9: each sample skips the first layer's nodes and the second
    layer's angles farther than reach from ±ω_ℓ (``polar._arc``, ``polar._window``, walked
    ring by ring by integrate_polar).  Without the cut (every node of the sample's radial ball)
    the moments agree to 5e-5, half the three-layer target: the prior left out is below e^-15,
    the posterior there slightly more (measured on these 64 draws: max 1.7e-5, median 3.2e-6;
    each of the two cuts alone up to 1.4e-5 — as the radial ball's, a fraction of the rule's
    own error, see the README).  The cut keeps at most three quarters of the second layer's
    angles."""
    from smi_core import polar
    y, omega, V = se_batch(3, 64, 0.9 * np.eye(3), np.random.default_rng(5))
    ch = model(3).channel(error_estimate=False)
    kept = []
    window = polar._window
    def record(*args):
        w = window(*args)
        kept.append((w[..., 2] - w[..., 1] + w[..., 4] - w[..., 3]).sum() / w[..., 0].sum())
        return w
    monkeypatch.setattr(polar, "_window", record)
    cut = ch.moments(y, omega, V)
    assert kept[0] <= 0.75
    monkeypatch.setattr(polar, "_window", lambda *a: (lambda w: np.ascontiguousarray(
        np.stack([w[..., 0], 0 * w[..., 0], w[..., 0], 0 * w[..., 0], 0 * w[..., 0]], axis=2)))(window(*a)))
    monkeypatch.setattr(polar, "_arc", lambda rings, group, col, sample, omega: np.zeros(len(col)))
    full = ch.moments(y, omega, V)
    assert max(ref.metric(cut.g_out[i], cut.dg_out[i], full.g_out[i], full.dg_out[i]) for i in range(len(y))) <= 5e-5


@given(seed=seeds)
@settings(BASE, max_examples=30)
def test_polar_segments_cut_by_piece(seed):
    """``polar._by_piece`` (``_quadrature.piece_counts``, ``piece_segments``) against a node-by-node
    construction: each piece's cut segments cover exactly the nodes of every sample's segments
    that fall in it, by sample, each segment cut at the piece's edges."""
    from smi_core import polar
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 60))
    edges = np.unique(np.concatenate([[0, total], rng.integers(0, total, rng.integers(0, 6))])).astype(np.int64)
    sample, seg_start, seg_stop = [], [], []
    for i in range(int(rng.integers(1, 6))):           # each sample's segments: disjoint, ascending
        cuts = np.sort(rng.choice(total + 1, 2 * int(rng.integers(0, 4)), replace=False))
        for a, b in cuts.reshape(-1, 2):
            sample.append(i), seg_start.append(a), seg_stop.append(b)
    plan = SimpleNamespace(sample=np.array(sample, dtype=np.int64), seg_start=np.array(seg_start, dtype=np.int64),
                           seg_stop=np.array(seg_stop, dtype=np.int64))
    who, start, stop, ptr = polar._by_piece(plan, edges)
    assert ptr[0] == 0 and (np.diff(ptr) >= 0).all() and ptr[-1] == len(who)
    for p in range(len(edges) - 1):
        part = slice(ptr[p], ptr[p + 1])
        assert (np.diff(who[part]) >= 0).all()
        assert ((start[part] >= edges[p]) & (stop[part] <= edges[p + 1]) & (start[part] <= stop[part])).all()
        for i in range(5):
            mine = [(a, b) for a, b in zip(start[part][who[part] == i], stop[part][who[part] == i])]
            got = sorted(k for a, b in mine for k in range(a, b))
            want = sorted(k for j, a, b in zip(sample, seg_start, seg_stop) if j == i
                          for k in range(max(a, edges[p]), min(b, edges[p + 1])))
            assert got == want


@given(seed=seeds)
@settings(BASE, max_examples=30)
def test_polar_arc_plan_keeps_the_union_of_the_arcs(seed):
    """``polar._arc_plan`` (``_quadrature.polar_arcs``) against a node-by-node construction: the
    kept nodes are exactly those some sample's arc covers, and each sample's ranges, read through
    the kept nodes' numbering, cover exactly its own arcs (each node once)."""
    from smi_core import polar
    rng = np.random.default_rng(seed)
    n, rings = 4, 5
    N = rng.integers(1, 7, rings)                               # angles per ring of the last layer
    size = np.tile(N, 3) * (rng.random(3 * rings) < 0.8)        # 3 nodes of the first layer × rings
    start = np.concatenate([[0], np.cumsum(size)])
    lo = rng.integers(0, N, (n, rings))
    span = rng.integers(0, N + 1, (n, rings))
    window = np.stack([np.broadcast_to(N, (n, rings)), lo, np.minimum(lo + span, N), 0 * lo,
                       np.maximum(lo + span - N, 0)], axis=2).astype(np.int64)
    seg = [(i, j * rings + a, j * rings + b, a) for i in range(n) for j in range(3)
           for a, b in [sorted(rng.integers(0, rings + 1, 2))] if b > a and size[j * rings + a:j * rings + b].all()]
    arcs = [set() for _ in range(n)]                            # set-up node indices per sample
    for i, b0, b1, ring in seg:
        for b in range(b0, b1):
            w = window[i, ring + b - b0]
            arcs[i] |= {start[b] + k for k in [*range(w[1], w[2]), *range(w[3], w[4])]}
    cols = [np.ascontiguousarray(c) for c in np.array(seg, dtype=np.int64).reshape(-1, 4).T]
    plan = polar._arc_plan([], (), size, start, *cols, window)
    union = sorted(set().union(*arcs))
    set_up = np.concatenate([np.arange(start[b], start[b + 1]) for b in np.flatnonzero(plan.size)] or [[]])
    assert list(set_up[plan.used]) == union
    for i in range(n):
        mine = [k for s, a, b in zip(plan.sample, plan.seg_start, plan.seg_stop) if s == i for k in range(a, b)]
        assert sorted(mine) == [union.index(k) for k in sorted(arcs[i])]
    assert (np.diff(plan.sample) >= 0).all()


IDENTITY_CASES = {
    "L1": (1, np.array([[0.6]]), None, None),
    "L2-scalar": (2, 0.5 * np.eye(2), None, 1e-4),
    "L2-correlated": (2, np.array([[0.7, 0.25], [0.25, 0.4]]), None, 1e-4),
    "L2-small-V": (2, 0.95 * np.eye(2), None, 1e-4),
    "L2-T3": (2, 0.5 * np.eye(2), None, None, 3),
    "L3": (3, 0.5 * np.eye(3), None, None),
    "noisy-L1": (1, np.array([[0.5]]), 0.05, 1e-4),
}


@pytest.mark.parametrize("case", sorted(IDENTITY_CASES))
def test_mean_and_nishimori_identities(case):
    """With y drawn from the model itself at fixed q (ω = q^{1/2}ξ, V = I - q):
    E[g_out] = 0 and E[Σ_t g_out[:,t] g_out[:,t]ᵀ] = -E[Σ_t ∂g_out[(·,t),(·,t)]] (the token-
    diagonal blocks), each entry within 5 standard errors (n = 4000 draws; 5σ covers the ≤ 10
    entries tested per case)."""
    layers, q, noise, tol, T = (IDENTITY_CASES[case] + (2,))[:5]
    n, R = 4000, layers
    y, omega, V = se_batch(layers, n, q, np.random.default_rng(12345), noise, T)
    ch = model(layers, T).channel(noise=noise, tol=tol) if tol else model(layers, T).channel(noise=noise)
    mo = ch.moments(y, omega, V)
    g = mo.g_out
    blocks = mo.dg_out.reshape(n, R, T, R, T)
    diag = sum(blocks[:, :, t, :, t] for t in range(T))                       # (n, R, R)
    nishimori = np.einsum("nat,nbt->nab", g, g) + diag
    for name, x in (("E[g_out]", g.reshape(n, -1)), ("E[g gᵀ + ∂g]", nishimori.reshape(n, -1))):
        mean, se = x.mean(axis=0), x.std(axis=0, ddof=1) / math.sqrt(n)
        z = np.abs(mean) / se
        assert (z <= 5).all(), (case, name, mean, se, z)


def test_three_index_link_nishimori_identities():
    """The shell y = h_1² + h_2² + h_3²/2 + noise away from q = 0 (correlated q, where the
    characteristic-function reference does not apply): with y from the model, E[g_out] = 0 and
    E[g gᵀ] = -E[∂g] within 5 standard errors (256 draws, Δ = 0.1).  A consistency check, not
    an accuracy one: the Laplace rule alone passes it too here (1.4σ at 512 draws), while its
    q̂ = E[g gᵀ] at q = diag(0.05, 0.05, 0.01) is 44–316 % off (README "Adding a model")."""
    n, rng = 256, np.random.default_rng(7)
    q = np.array([[0.3, 0.1, 0.0], [0.1, 0.3, 0.0], [0.0, 0.0, 0.2]])
    omega = np.einsum("ab,nbt->nat", sqrt_psd(q), rng.standard_normal((n, 3, 1)))
    V = np.eye(3) - q
    Z = omega + np.einsum("ab,nbt->nat", sqrt_psd(V), rng.standard_normal((n, 3, 1)))
    model = LinkModel("chan_quadratic")
    y = model.forward(Z) + np.sqrt(0.1) * rng.standard_normal(n)
    mo = model.channel(noise=0.1).moments(y, omega, V)
    x = np.concatenate([mo.g_out.reshape(n, 3), (np.einsum("nat,nbt->nab", mo.g_out, mo.g_out)
                                                 + mo.dg_out).reshape(n, 9)], axis=1)
    z = np.abs(x.mean(axis=0)) / (x.std(axis=0, ddof=1) / np.sqrt(n))
    assert (z <= 5).all(), z


# -- symmetry h_ℓ → -h_ℓ ----------------------------------------------------------------------------

SYMMETRY_CASES = dict(argnames="layers,noise", argvalues=[(1, None), (2, None), (3, None), (1, 0.1)],
                      ids=["L1", "L2", "L3", "noisy-L1"])


def check_symmetry(layers, noise, d, y2, omega2, V2, P, s):
    """The moments at (y2, ω2, V2) are those at the draw d moved by the signed permutation
    (P, s) of the entries a·T + t: g_out → s·g_out[P], dg_out → (s sᵀ)·dg_out[P, P] (relative
    1e-6; 1e-4 for L = 3), and log Z_out is unchanged (noisy route: exact there)."""
    ch = channel(layers, noise=noise)
    a = ch.moments(d.y[None], d.omega[None], d.V)
    b = ch.moments(y2[None], omega2[None], V2)
    g = (s * a.g_out[0].ravel()[P]).reshape(layers, 2)
    err = ref.metric(b.g_out[0], b.dg_out[0], g, np.outer(s, s) * a.dg_out[0][P][:, P])
    tol = RTOL_L3 if layers == 3 else RTOL
    assert err <= tol, (err, fmt(d.y), fmt(d.omega), fmt(d.V), a.error, b.error)
    if noise is not None:
        assert abs(a.log_z[0] - b.log_z[0]) <= tol * max(1.0, abs(a.log_z[0]))


@pytest.mark.parametrize(**SYMMETRY_CASES)
@examples(6)
@given(data=st.data())
def test_layer_flip_symmetry(layers, noise, data):
    """Flipping layer ℓ (row ℓ of ω, and V → DVD with D = diag(±1)) leaves y's likelihood
    unchanged, so g_out → D g_out and dg_out → (D⊗I) dg_out (D⊗I)."""
    d = data.draw(se_draws(layers, correlated=layers > 1, noise=noise))
    D = np.ones(layers)
    D[data.draw(st.integers(0, layers - 1))] = -1
    check_symmetry(layers, noise, d, d.y, D[:, None] * d.omega, D[:, None] * d.V * D[None],
                   np.arange(2 * layers), np.repeat(D, 2))


@pytest.mark.parametrize(**SYMMETRY_CASES)
@examples(6)
@given(data=st.data())
def test_token_swap_symmetry(layers, noise, data):
    """Swapping the two tokens (the columns of ω, the rows and columns of y) swaps them in the
    posterior.  Unlike the flips, this is not a symmetry of the rules' nodes (a cliff a = 0 maps
    to b = 0, the Cholesky factors of the pieces change), so a rule that misses part of the
    posterior in one orientation shows here."""
    d = data.draw(se_draws(layers, correlated=layers > 1, noise=noise))
    check_symmetry(layers, noise, d, d.y[::-1, ::-1], d.omega[:, ::-1], d.V,
                   np.arange(2 * layers).reshape(layers, 2)[:, ::-1].ravel(), np.ones(2 * layers))


def test_reparam_l3_tail_beyond_the_laplace_box():
    """A three-layer draw at q = 0.96·I with y at the softmax edge, where the posterior of h_2
    has a tail (sd 0.21 against 0.15 at the mode) beyond 8 sd of the mode's piece: the adaptive
    rule over ±8 of the piece was 1.1e-3 off the reference while estimating 2.0e-5; it now spans
    ±ADAPTIVE_BOUND (12)."""
    y, omega, V = se_batch(3, 16, 0.96 * np.eye(3), np.random.default_rng(4))
    check_l3(Draw(y[4], omega[4], V, "tail", 0.96 * np.eye(3)), ch=laplace3(tol=CHANNEL_TOL))


def test_reparam_l3_laplace_rule_escalates_by_default():
    """Three layers with every layer narrow (q = 0.97·I) and the Laplace rule (``laplace3``; the
    default channel takes the polar rule there now, next test), default options: samples whose
    estimate is above ``escalate`` (LAPLACE3_ESCALATE) get the finer Gauss–Hermite round.  Draw
    60 was 2.6e-3 off without it (measured 3.9e-5 with it); draw 53, y at the softmax edge
    (smallest entry 9e-13), 1.1e-2 → 4.6e-4, still above 1e-4 but flagged."""
    y, omega, V = se_batch(3, 64, 0.97 * np.eye(3), np.random.default_rng(7))
    for i, tolerance in ((60, RTOL_L3), (53, None)):
        r = ref.reparam_l3(y[i], omega[i], V, n=5)
        assert r.error <= REF_TOL_L3
        got = {name: laplace3(**options).moments(y[i:i + 1], omega[i:i + 1], V)
               for name, options in (("default", {}), ("without", dict(escalate=1.0)))}
        err = {name: ref.metric(m.g_out[0], m.dg_out[0], r.g_out, r.dg_out) for name, m in got.items()}
        assert err["without"] > 1e-3 and err["default"] < err["without"] / 10, err
        assert err["default"] <= (tolerance or got["default"].error[0]) + r.error, (err, got["default"].error[0])


def test_reparam_l3_every_layer_narrow_takes_the_polar_rule():
    """Three layers at q = 0.97·I (conditional sd 0.17, every layer as narrow): the default
    channel takes the polar rule (POLAR3_MIN_SD), within RTOL_L3 of the reference on the two
    draws of the previous test, where the Laplace rule's default is 3.9e-5 and 4.6e-4 off; with
    the last layer pinned (q = diag(0.97, 0.97, 0.999)) the Laplace rule stays.  Where ρ ≥ 0.8
    the switch is hard (blend 0)."""
    y, omega, V = se_batch(3, 64, 0.97 * np.eye(3), np.random.default_rng(7))
    ch = model(3).channel()
    assert (ch._polar_weight(omega[:2], np.broadcast_to(V, (2, 3, 3))) == 1).all()
    pinned = np.diag([0.03, 0.03, 0.001])
    assert (ch._polar_weight(omega[:2], np.broadcast_to(pinned, (2, 3, 3))) == 0).all()
    lo, hi = ReparamChannel.POLAR3_MIN_SD["ratio"]
    for rho, sd, blend in ((lo, ReparamChannel.POLAR_MIN_SD, ch._polar_params()["blend"]),
                           (hi, ReparamChannel.POLAR3_MIN_SD["sd"], 0.0)):     # the ends
        s_min, b = ch._polar_threshold(np.array([[1.0, 1.0, 1.0 / rho ** 2]]))
        assert np.isclose(s_min[0], sd) and np.isclose(b[0], blend)
    for i in (60, 53):
        check_l3(Draw(y[i], omega[i], V, f"q = 0.97·I, draw {i}", 0.97 * np.eye(3)), ch=ch)


# q = 0.975·I, y at the softmax edge (the benchmark's first draw there)
EDGE_L3 = Draw(y=np.array([[9.9999995385230689e-01, 4.6147693173083495e-08],
                           [9.9995792874544520e-01, 4.2071254554810605e-05]]),
               omega=np.array([[-2.521152060526112, -0.07463095017224594],
                               [-3.2310313349693374, 0.7390276078470298],
                               [1.55267609532061, -0.1059918188791433]]),
               V=0.025 * np.eye(3), kind="q = 0.975·I, y at the softmax edge", q=0.975 * np.eye(3))


def test_reparam_l3_narrow_polar_rule_escalates_by_default():
    """Three layers with every layer about as narrow (the polar rule's narrow range and broad
    q·I): samples whose estimate is above POLAR3_ESCALATE get one round at 1.5× the counts by
    default (the last layer pinned: none; with ``tol``: its three rounds).  On a q =
    0.975·I draw with y at the softmax edge the rule without it was 7.9e-4 off (estimate
    3.2e-2), with it 6.5e-6 (measured against the reference at n = 6)."""
    ch = model(3).channel()
    prec = np.array([[40.0, 40.0, 40.0], [40.0, 40.0, 1000.0], [10.0, 10.0, 10.0]])   # narrow; pinned; q = 0.9·I
    error = np.full(3, 1.0)
    target, rounds = ch._polar_escalation(prec[:, :, None] * np.eye(3), error)
    assert rounds == 1 and (target[[0, 2]] == ch.POLAR3_ESCALATE).all() and target[1] == np.inf
    assert model(3).channel(tol=1e-3)._polar_escalation(prec[:, :, None] * np.eye(3), error) == (1e-3, 3)
    without = model(3).channel()
    without.POLAR3_ESCALATE = np.inf
    expected = ref.reparam_l3(EDGE_L3.y, EDGE_L3.omega, EDGE_L3.V, n=5)
    assert expected.error <= REF_TOL_L3
    m = without.moments(EDGE_L3.y[None], EDGE_L3.omega[None], EDGE_L3.V)
    assert ref.metric(m.g_out[0], m.dg_out[0], expected.g_out, expected.dg_out) > 1e-4
    compare("L=3", ch, EDGE_L3, expected, RTOL_L3, REF_TOL_L3)


# -- the noiseless limit of the noisy route ---------------------------------------------------------------

def test_noisy_route_approaches_reparam_route_one_layer():
    """DeepAttention(1, 2): on noiseless SE outputs (q = 0.5), channel(noise=Δ) → channel() (the
    exact two-point channel) as Δ → 0.  The noisy posterior shrinks onto the two pre-images ±u of
    y once √Δ resolves y; near the flat centre of the softmax (a row of y within ≈ √Δ of ½, where
    y − ½ ∝ u_t(u_t − u_s)) that takes a smaller Δ, so the approach is not uniform over draws
    (measured on these 24: the median distance 0.68, 0.28, 0.048, 0.0080 at Δ = 1e-1 … 1e-4, the
    draws with rows near ½ at 0.14–0.22 at Δ = 1e-4; the noisy route itself agrees with the
    mpmath reference to 2.5e-9 on such a draw).  Checked: the median falls ≥ 3× per decade from
    Δ = 1e-2 and is below 2e-2 at 1e-4, and every draw is closer at 1e-4 than at 1e-1."""
    rng = np.random.default_rng(7)
    y, omega, V = se_batch(1, 24, 0.5 * np.eye(1), rng)
    exact = channel(1).moments(y, omega, V)
    dist = []
    for noise in (1e-1, 1e-2, 1e-3, 1e-4):
        mo = channel(1, noise=noise).moments(y, omega, V)
        dist.append([ref.metric(mo.g_out[i], mo.dg_out[i], exact.g_out[i], exact.dg_out[i])
                     for i in range(len(y))])
    dist = np.array(dist)
    med = np.median(dist, axis=1)
    msg = f"distance to the reparam route per Δ (rows) and sample (columns):\n{dist}\nmedians {med}"
    assert med[1] < med[0] and med[2] < med[1] / 3 and med[3] < med[2] / 3 and med[3] < 2e-2, msg
    assert (dist[3] < dist[0]).all(), msg


@pytest.mark.slow
def test_noisy_route_approaches_reparam_route():
    """DeepAttention(2, 2): on noiseless SE outputs (q = 0.5), channel(noise=Δ) → channel() as
    Δ → 0: for Δ = 1e-2, 1e-3, 1e-4 the median metric distance to the reparametrised route over
    12 draws shrinks, by ≥ 3× from 1e-3 to 1e-4 (measured 0.22, 0.10, 5.7e-3).

    Only the medians: the exact noisy posterior approaches the noiseless one slowly and not
    monotonically on every draw.  Draw 9 sits at the fold (1 - p - r = 2e-4): 0.06, 0.09, 0.09
    at Δ = 1e-2, 1e-3, 1e-4, and the two-layer polar rule forced to Δ = 1e-4 (``nodes=21``) agrees
    with the chart rule there to 3.7e-8 (``test_noisy_l2_chart_rule_against_polar_rule``).  (4-D
    reference, draw 0: 0.53, 0.33, 0.19 for Δ = 1e-2, 1e-3, 1e-4; draw 1: 0.18, 0.08 for Δ =
    1e-2, 1e-3.)"""
    rng = np.random.default_rng(7)
    y, omega, V = se_batch(2, 12, 0.5 * np.eye(2), rng)
    exact = channel(2).moments(y, omega, V)
    dist = []
    for noise in (1e-2, 1e-3, 1e-4):
        mo = model(2).channel(noise=noise, tol=CHANNEL_TOL).moments(y, omega, V)
        dist.append([ref.metric(mo.g_out[i], mo.dg_out[i], exact.g_out[i], exact.dg_out[i])
                     for i in range(len(y))])
    dist = np.array(dist)
    med = np.median(dist, axis=1)
    msg = f"distance to the reparam route per Δ (rows) and sample (columns):\n{dist}\nmedians {med}"
    assert med[1] < med[0] and med[2] < med[1] / 3, msg


class ForcedPolar(NoisyChannel):
    """The two-layer noisy polar rule below its POLAR_MIN_NOISE (slow: ∝ Δ^-3/4 per ring)."""
    POLAR_MIN_NOISE = {1: 1e-9, 2: 1e-9}


def test_noisy_l2_chart_rule_against_polar_rule():
    """Δ = 1e-4, q = 0.5, the three draws of the test above that the chart rule takes (the fold
    at r ≈ 1/2, the softmax edge r → 0, near the fold): the chart rule at tol = 1e-7 against
    the two-layer polar rule forced below its POLAR_MIN_NOISE at ``nodes=21``, an independent
    rule (rings about u_2 = 0; its own difference to its default counts 1e-6 … 6.5e-6): within
    1e-6 (measured 3.7e-8, 6.7e-9, 9.4e-10; the polar rule takes ≈ 30 s)."""
    y, omega, V = se_batch(2, 12, 0.5 * np.eye(2), np.random.default_rng(7))
    sel = [9, 0, 11]
    m = model(2)
    assert not _preimage_samples(m.channel(noise=1e-4), y[sel], V).any()
    chart_rule = m.channel(noise=1e-4, tol=CHANNEL_TOL).moments(y[sel], omega[sel], V)
    polar = ForcedPolar(m, noise=1e-4, nodes=21, error_estimate=False).moments(y[sel], omega[sel], V)
    dist = [ref.metric(chart_rule.g_out[j], chart_rule.dg_out[j], polar.g_out[j], polar.dg_out[j]) for j in range(3)]
    assert max(dist) <= 1e-6, dist


def _preimage_samples(ch, y, V):
    return ch._preimage_applies(y.reshape(len(y), 4))


@pytest.mark.parametrize("layers, noise", [(1, 1e-14), (2, 1e-12)])
def test_noisy_preimage_rule_tends_to_reparam_route(layers, noise):
    """Below POLAR_MIN_NOISE: the preimage rule (Gauss–Hermite in the off-diagonal entries
    (p, r) of σ_β(u_L u_Lᵀ), where the likelihood is Gaussian; two layers on each node of the
    rings of h_1) on noiseless SE outputs (q = 0.5).  It takes ≥ 90 % of the samples and on each
    is within 1e-5 of the reparametrised route at tol = 1e-8, an independent rule (measured: one
    layer 48 of 48, max 1.0e-8; two layers 46 of 48, max 3.2e-7.  The distance falls ∝ Δ, for
    two layers median 7.3e-5, 9.5e-7, 1.4e-8 at Δ = 1e-6, 1e-8, 1e-10; near the fold p + r = 1
    it is large until Δ is tiny: 1.6e-2 at Δ = 1e-10 for one layer when 1 − p − r = 6e-5)."""
    y, omega, V = se_batch(layers, 48, 0.5 * np.eye(layers), np.random.default_rng(7))
    exact = model(layers).channel(tol=1e-8).moments(y, omega, V)
    ch = model(layers).channel(noise=noise)
    good = _preimage_samples(ch, y, V) & (ch._polar_weight(omega, np.broadcast_to(V, (len(y),) + V.shape)) > 0)
    m = ch.moments(y, omega, V)
    dist = np.array([ref.metric(m.g_out[i], m.dg_out[i], exact.g_out[i], exact.dg_out[i]) for i in range(len(y))])
    assert good.mean() >= 0.9
    assert dist[good].max() <= 1e-5, dist


# SE draws (64, seed 5, Δ = 1e-5) whose likelihood window reaches the triangle's edges, by kind:
# the fold p + r → 1 near r = 1/2 (0, 31, 3, 40) and away from it (26, 57 beyond it; 17), the
# softmax edge r → 0 (6, 20: the tokens are swapped) and p → 0 (23, 46), both (20 at q = 0, 60)
CHART_DRAWS = {0.0: (20, 23, 46), 0.5: (0, 6, 20, 26, 31, 57), 0.9: (3, 17, 40, 60)}


@pytest.mark.parametrize("q", sorted(CHART_DRAWS))
def test_noisy_l1_chart_rule(q):
    """One layer, Δ = 1e-5 < POLAR_MIN_NOISE[1], samples the preimage rule leaves (window within
    PREIMAGE["margin"] sd of the triangle's edges): the chart rule (smi_core.chart) against the
    mpmath reference to RTOL, log Z_out too.  On all 47 such draws at q = 0, 0.5, 0.9 the
    Laplace rule these samples took before was 1.6e-6 … 12 off (median 6.6e-2); the chart rule
    (default nodes) is within 9.4e-8 (median 3.3e-10)."""
    y, omega, V = se_batch(1, 64, q * np.eye(1), np.random.default_rng(5), noise=1e-5)
    ch = channel(1, noise=1e-5)
    for i in CHART_DRAWS[q]:
        assert not _preimage_samples(ch, y[i:i + 1], V)[0]
        d = Draw(y[i], omega[i], V, "chart", q, 1e-5)
        compare("noisy L=1 chart", ch, d, ref.noisy_l1(d.y, d.omega, d.V, 1.0, 1e-5, mp_pass=False),
                RTOL, REF_TOL, log_z=True)


@pytest.mark.parametrize("q", [0.0, 0.9])
def test_noisy_l2_preimage_rule_converges(q):
    """Δ = 1e-5 (the preimage rule where it applies, else the chart rule): on the preimage
    samples of 32 SE draws (measured 66 % / 69 %) the default is within 1e-5 of the rule at 1.5×
    the node counts per dimension (measured max 1.3e-7 / 1.6e-8 at q = 0 / 0.9)."""
    y, omega, V = se_batch(2, 32, q * np.eye(2), np.random.default_rng(11), noise=1e-5)
    ch = model(2).channel(noise=1e-5)
    good = _preimage_samples(ch, y, V)
    assert good.mean() >= 0.3
    m = ch.moments(y[good], omega[good], V)
    fine = model(2).channel(noise=1e-5, nodes=21).moments(y[good], omega[good], V)
    dist = [ref.metric(m.g_out[i], m.dg_out[i], fine.g_out[i], fine.dg_out[i]) for i in range(good.sum())]
    assert max(dist) <= 1e-5, dist


def test_noisy_l2_preimage_rule_without_skip():
    """skip c = 0: Φ⁽¹⁾ = σ_β(h_1 h_1ᵀ) is singular on a line of h_1, where the preimage rule's
    linearised prior is lost to rounding (it raised LinAlgError); those nodes weigh 0 and every
    moment is finite."""
    m2 = DeepAttention(layers=2, tokens=2, rank=1, skip=0.0, beta=1.0)
    rng = np.random.default_rng(1)
    omega = math.sqrt(0.5) * rng.standard_normal((16, 2, 2))
    y = m2.forward(omega + math.sqrt(0.5) * rng.standard_normal((16, 2, 2)))
    mo = m2.channel(noise=1e-12).moments(y, omega, 0.5 * np.eye(2))
    assert np.isfinite(mo.g_out).all() and np.isfinite(mo.dg_out).all()


def test_noisy_l2_tiny_noise_at_the_softmax_edge():
    """Δ = 1e-16 with y_21 = 3.2e-8 (the softmax edge): the chart rule's moments are finite, and
    so are the Laplace rule's (which this sample took before the chart rule, and which samples
    with a narrow prior of h_1 still take): the curvature along y_21 is ≈ 1e16 times the others
    and the rounded Laplace covariance was not positive definite (LinAlgError from numpy); its
    eigenvalues are floored."""
    rng = np.random.default_rng(1)
    omega = math.sqrt(0.5) * rng.standard_normal((48, 2, 2))
    y = model(2).forward(omega + math.sqrt(0.5) * rng.standard_normal((48, 2, 2)))[:1]
    assert 1e-8 < y[0, 1, 0] < 1e-7
    ch = model(2).channel(noise=1e-16)
    mo = ch.moments(y, omega[:1], 0.5 * np.eye(2))
    assert np.isfinite(mo.g_out).all() and np.isfinite(mo.dg_out).all()
    V = 0.5 * np.eye(2)[None]
    log_z, mean, cov, _ = ch._laplace(y.reshape(1, 4), omega[:1], V, np.linalg.inv(V), np.linalg.slogdet(V)[1])
    assert np.isfinite(mean).all() and np.isfinite(cov).all()


@pytest.mark.parametrize("q", [0.0, 0.9])
def test_noisy_l2_chart_rule_converges(q):
    """Δ = 1e-5, two layers, on 6 SE draws the preimage rule leaves (the chart rule: ±x_1 of
    h_1's rings × u_2 nodes in the chart): within 1e-6 of the rule at 1.5× the counts (measured
    on 16 such draws per q: max 3.5e-7 / 8.3e-8 / 1.4e-7 at q = 0 / 0.5 / 0.9)."""
    y, omega, V = se_batch(2, 64, q * np.eye(2), np.random.default_rng(11), noise=1e-5)
    ch = model(2).channel(noise=1e-5)
    sel = np.flatnonzero(~_preimage_samples(ch, y, V))[:6]
    assert len(sel) == 6
    m = ch.moments(y[sel], omega[sel], V)
    fine = model(2).channel(noise=1e-5, nodes=21).moments(y[sel], omega[sel], V)
    dist = [ref.metric(m.g_out[i], m.dg_out[i], fine.g_out[i], fine.dg_out[i]) for i in range(len(sel))]
    assert max(dist) <= 1e-6, dist


def test_noisy_l2_pinned_last_layer_escalates():
    """Two layers with the last layer pinned, q = diag(0.3, 0.99), Δ = 1e-12 (the preimage and
    chart rules): h_1's rings limit the rule, and by default the samples whose estimate is above
    ``escalate`` (1e-4) get the rings ×1.5 up to three times.  On noiseless SE draws whose
    likelihood window is ≥ 1e-3 inside the triangle (there the noisy posterior is within ≈ Δ/1e-6
    of the noiseless one; nearer the edges it genuinely differs) the default is within 1e-5 of the
    reparametrised route at tol = 1e-8, an independent rule, and without the estimate (no
    escalation) it is not (measured on the 14 of 16 draws inside: max 6.4e-6 with, 2.1e-2
    without)."""
    q = np.diag([0.3, 0.99])
    y, omega, V = se_batch(2, 16, q, np.random.default_rng(5))
    p, r, _ = chart.window(y.reshape(len(y), 4), 1e-12)
    inside = np.minimum(np.minimum(p, r), 1 - p - r) >= 1e-3
    assert inside.sum() >= 12
    y, omega = y[inside], omega[inside]
    exact = model(2).channel(tol=1e-8).moments(y, omega, V)
    ch = model(2).channel(noise=1e-12)
    assert ch.escalates and model(2).channel(noise=1e-2)._polar_target() is None    # rings: below 1e-3 only
    worst = {}
    for options in (dict(), dict(error_estimate=False)):
        m = model(2).channel(noise=1e-12, **options).moments(y, omega, V)
        worst[len(options)] = max(ref.metric(m.g_out[i], m.dg_out[i], exact.g_out[i], exact.dg_out[i])
                                  for i in range(len(y)))
    assert worst[0] <= 1e-5 and worst[1] > 1e-4, worst


def test_noisy_l2_conditional_rule_pinned_last_layer():
    """Two layers, Δ = 0.1, the last layer pinned (q = diag(0, 0.99)): the samples that the
    Laplace rule flags go to the conditional rule (h_1's rings × Gauss–Hermite in h_2 given h_1).
    Against an independent rule — the adaptive Genz–Malik cubature of the Laplace path in Z at
    tol = 1e-8 with 2·10⁵ boxes, which agrees with the conditional rule at 5× the rings' default
    counts and 20 nodes per dimension to ≤ 2.5e-7 on these draws — the default is within 1e-4 (its
    target; measured max 2.4e-5, median 6e-7) and its log Z_out within 1e-6, and without the
    estimate (the Laplace rule alone) it is more than 1e-3 off (measured 1.8e-3 … 7.2e-2)."""
    y, omega, V = se_batch(2, 6, np.diag([0.0, 0.99]), np.random.default_rng(3), noise=0.1)
    n = len(y)
    Vb = np.broadcast_to(V, (n, 2, 2)).copy()
    Vinv = np.linalg.inv(Vb)
    ch = model(2).channel(noise=0.1, tol=1e-8, max_regions=200000, conditional=dict(sd=0.0))
    assert ch.escalates             # sd = 0: no sample is the conditional rule's, the adaptive rule runs
    exact = ch._assemble(omega, Vb, Vinv, *Channel._laplace(ch, y.reshape(n, 4), omega, Vb, Vinv,
                                                            np.linalg.slogdet(Vb)[1]))
    worst = {}
    for options in (dict(), dict(error_estimate=False)):
        m = model(2).channel(noise=0.1, **options).moments(y, omega, V)
        worst[len(options)] = [ref.metric(m.g_out[i], m.dg_out[i], exact.g_out[i], exact.dg_out[i])
                               for i in range(n)]
        if not options:
            assert np.abs(m.log_z - exact.log_z).max() <= 1e-6
    assert max(worst[0]) <= 1e-4 and min(worst[1]) > 1e-3, worst


def test_noisy_l2_conditional_rings_favour_angles():
    """The conditional rule's rings of h_1 take √aspect × the angles and 1/√aspect × the radii
    (``conditional["aspect"]``, 2 by default): with h_2 pinned (q = diag(0, 0.999), Δ = 0.1) the
    posterior over h_1 is narrow across the rays.  On the three of these 24 draws where the
    rings at aspect 1 are furthest from the rule at 4× the counts and 16 nodes (rounds off;
    measured 5.5e-5, 3.2e-7, 3.8e-8), aspect 2 is at least 10× closer (4.1e-6, 7.1e-9, 4.2e-10)
    with about as many nodes."""
    y, omega, V = se_batch(2, 24, np.diag([0.0, 0.999]), np.random.default_rng(3), noise=0.1)
    pick = [6, 15, 18]
    y, omega, n = y[pick], omega[pick], len(pick)
    Vb = np.broadcast_to(V, (n, 2, 2)).copy()
    Vinv = np.linalg.inv(Vb)

    def rule(**conditional):
        ch = model(2).channel(noise=0.1, conditional=dict(rounds=0, **conditional))
        return ch._assemble(omega, Vb, Vinv, *ch._conditional(y.reshape(n, 4), omega, Vb, Vinv, 1.0))
    fine = rule(nodes=16, scale=8.0, aspect=1.0)
    err = {a: np.array([ref.metric(m.g_out[i], m.dg_out[i], fine.g_out[i], fine.dg_out[i]) for i in range(n)])
           for a, m in ((a, rule(aspect=a)) for a in (1.0, 2.0))}
    assert (err[2.0] * 10 <= err[1.0]).all() and err[2.0].max() <= 1e-5, err


def test_integrate_nodes_against_numpy():
    """``_quadrature.integrate_nodes`` (the conditional rule's product rule) against the weighted
    moments computed directly, with the integrand N(Z; ω, V) N(y; g(Z), Δ I) from the spec's
    forward model (tests/reference.py), over rows whose log weights spread over 600 e-folds (the
    running maximum), in tiles that end inside a row."""
    from smi_core import _quadrature
    rng = np.random.default_rng(1)
    delta, mm = 0.1, Model(2, 2)
    ch = model(2).channel(noise=delta)
    rows = np.column_stack([rng.standard_normal((10, 4)), rng.uniform(0.1, 0.5, 10), rng.uniform(-300, 300, 10)])
    xi, lw = rng.standard_normal((2, 37)), rng.uniform(-2.0, 0.0, 37)       # 37 nodes: tiles of 256 split rows
    omega, y = rng.standard_normal((2, 4)), rng.uniform(0.1, 0.9, (2, 4))
    V = np.array([[[1.0, 0.3], [0.3, 0.5]], [[0.7, -0.2], [-0.2, 0.4]]])
    Vinv, ptr = np.linalg.inv(V), np.array([0, 3, 10])
    out = np.empty(2), np.empty((2, 4)), np.empty((2, 4, 4))
    _quadrature.integrate_nodes(1, ch._node_kernel.capsule("columns"), ch.model.params, y, omega, Vinv,
                                np.linalg.slogdet(V)[1], rows, ptr, xi, lw, 2, 2, 4, delta, *out)
    for i in range(2):
        r = rows[ptr[i]:ptr[i + 1]]
        Z = np.concatenate([np.repeat(r[:, None, :2], xi.shape[1], axis=1),
                            r[:, None, 2:4] + r[:, None, 4:5] * xi.T[None]], axis=2).reshape(-1, 4)
        D = Z.reshape(-1, 2, 2) - omega[i].reshape(2, 2)
        g = mm.forward(Z.reshape(-1, 2, 2)).reshape(-1, 4)
        w = ((r[:, 5:6] + lw[None]).ravel() - 0.5 * np.einsum("kat,ab,kbt->k", D, Vinv[i], D)
             - np.log(2 * np.pi) * 2 - np.linalg.slogdet(V[i])[1]
             - 0.5 * ((g - y[i]) ** 2).sum(axis=1) / delta - 2 * np.log(2 * np.pi * delta))
        p, z = np.exp(w - w.max()), Z - omega[i]
        assert out[0][i] == pytest.approx(w.max() + np.log(p.sum()), rel=1e-12)
        np.testing.assert_allclose(out[1][i], p @ z / p.sum(), rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(out[2][i], (z * p[:, None]).T @ z / p.sum(), rtol=1e-10, atol=1e-13)


# A draw of the test above (draw 0, Δ = 1e-2) with its noisy-route moments from the 4-D reference
# (channel_reference.noisy_l2, n = 6: self-convergence 9e-4 in the metric), confirmed by
# importance sampling from the prior (2e7 draws, effective sample size 7.5e5): the two agree to
# 2.5e-3 in the metric and to 5e-4 in log Z_out.
NOISY_L2_DRAW = dict(
    y=np.array([[6.3391212800156183e-01, 3.6608787199843817e-01],
                [1.3625605678151606e-04, 9.9986374394321842e-01]]),
    omega=np.array([[0.0008698497809753275, 0.21124499542145916],
                    [-0.193844736506561, -0.629743528454665]]),
    V=np.array([[0.5, 0.0], [0.0, 0.5]]), noise=1e-2,
    g_out=np.array([[-0.07930668691174098, 0.07270491204952895],
                    [1.2185536788582445, -1.0642507471794587]]),
    dg_out=np.array([[0.21287028916507023, -0.3627650161688821, 0.08774103250080947, -0.0494098670718506],
                     [-0.3627650161688821, 0.32714740877321047, -0.027652633591200806, 0.11484972253686666],
                     [0.08774103250080947, -0.027652633591200806, -1.635200701409342, -0.6377222617421897],
                     [-0.0494098670718506, 0.11484972253686666, -0.6377222617421897, -0.09304085102255444]]),
    log_z=1.70263371345111)


def test_noisy_l2_known_draw():
    """The noisy route for L = 2 (4-D integral; the default polar rule in (h_1, u_2)) on
    NOISY_L2_DRAW, at the accuracy the 4-D reference supports (it agrees with importance
    sampling to 2.5e-3 in the metric and 5e-4 in log Z_out): metric ≤ 3e-3, |Δ log Z_out| ≤
    1e-3.  Measured: 3.3e-4 and 7.7e-6 (the Laplace rule was off by 0.26 and 0.11)."""
    k = NOISY_L2_DRAW
    d = Draw(k["y"], k["omega"], k["V"], "known", None, k["noise"])
    expected = ref.Reference(k["g_out"], k["dg_out"], k["log_z"], 9e-4, 0.0)
    mo = model(2).channel(noise=k["noise"]).moments(d.y[None], d.omega[None], d.V)
    err = ref.metric(mo.g_out[0], mo.dg_out[0], expected.g_out, expected.dg_out)
    msg = describe(d, "noisy L=2", expected, mo, err)
    assert err <= 3e-3, msg
    assert abs(mo.log_z[0] - expected.log_z) <= 1e-3, msg


@pytest.mark.slow
@settings(BASE, max_examples=6)
@given(data=st.data(), noise=st.floats(math.log(1e-2), 0.0).map(math.exp))
def test_noisy_l2_state_evolution_draws(data, noise):
    """The noisy route for L = 2 (default polar rule) against the 4-D reference (n = 5: ≈ 1e-3
    accurate, 1–3 minutes per draw), at 1e-2."""
    d = data.draw(se_draws(2, noise=noise))
    expected = ref.noisy_l2(d.y, d.omega, d.V, 1.0, 1.0, noise, n=5)
    compare("noisy L=2", model(2).channel(noise=noise), d, expected, 1e-2, 3e-3, log_z=False)


# -- bad input -------------------------------------------------------------------------------------------

def _good(layers=2):
    rng = np.random.default_rng(0)
    omega = 0.5 * rng.standard_normal((1, layers, 2))
    y = model(layers).forward(omega + 0.3)
    return y, omega, 0.5 * np.eye(layers)


BAD = {
    "y entry negative": (lambda y, o, V: (y * [[1, -1], [1, 1]], o, V), r"softmax range|\(0, 1\)"),
    "y entry zero": (lambda y, o, V: (np.where(y == y.min(), 0.0, y), o, V), r"softmax range|\(0, 1\)"),
    "y entry above one": (lambda y, o, V: (y + [[0.9, 0], [0, 0]], o, V), r"softmax range|\(0, 1\)"),
    "y rows off one": (lambda y, o, V: (0.9 * y, o, V), r"sum to 1|softmax range"),
    "y not finite": (lambda y, o, V: (np.full_like(y, np.nan), o, V), r"finite|softmax range"),
    "V not symmetric": (lambda y, o, V: (y, o, V + [[0, 0.1], [0, 0]]), r"symmetric positive definite"),
    "V indefinite": (lambda y, o, V: (y, o, np.array([[0.5, 0.0], [0.0, -0.1]])), r"symmetric positive definite"),
    "V singular": (lambda y, o, V: (y, o, np.array([[0.5, 0.5], [0.5, 0.5]])), r"symmetric positive definite"),
    "V not finite": (lambda y, o, V: (y, o, np.full((2, 2), np.inf)), r"V must be finite|finite"),
    "V wrong shape": (lambda y, o, V: (y, o, np.eye(3)), r"V must .*shape|shape"),
    "V per-sample count": (lambda y, o, V: (y, o, np.stack([V, V])), r"V must .*shape|shape"),
    "omega wrong R": (lambda y, o, V: (y, np.zeros((1, 3, 2)), V), r"omega must have shape"),
    "omega wrong T": (lambda y, o, V: (y, np.zeros((1, 2, 3)), V), r"omega must have shape"),
    "y wrong T": (lambda y, o, V: (np.full((1, 3, 3), 1 / 3), o, V), r"y must have shape"),
    "sample counts differ": (lambda y, o, V: (np.concatenate([y, y]), o, V), r"same number of samples"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("route", ["reparam", "noisy"])
def test_bad_input_is_a_value_error(case, route):
    y, omega, V = _good()
    bad_y, bad_omega, bad_V = BAD[case][0](y, omega, V)
    if route == "noisy" and case.startswith("y ") and "wrong" not in case and "finite" not in case:
        pytest.skip("the noisy route accepts any real y")
    ch = channel(2, noise=0.1 if route == "noisy" else None)
    with pytest.raises(ValueError, match=BAD[case][1]):
        ch.moments(bad_y, bad_omega, bad_V)


def test_bad_input_t3_inconsistent_output():
    """A T = 3 row-stochastic y with no pre-image σ_β(u uᵀ) (L = 1) is rejected by name."""
    y = np.array([[[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]])
    with pytest.raises(ValueError, match="pre-image"):
        channel(1, 3).moments(y, np.zeros((1, 1, 3)), np.eye(1))


@pytest.mark.parametrize("options,match", [
    (dict(noise=0.0), "noise"), (dict(noise=-1.0), "noise"), (dict(noise=float("nan")), "noise"),
    (dict(tol=0.0), "tol"), (dict(tol=-1e-7), "tol"), (dict(nodes=1), "nodes"),
    (dict(route="other"), "route"), (dict(route="noisy"), "noise"),
    (dict(escalate=0.0), "escalate"), (dict(escalate=float("nan")), "escalate"),
    (dict(noise=1e-5, escalate=-1.0), "escalate"), (dict(max_regions=0), "max_regions"),
    (dict(max_regions=2.5), "max_regions"),
    (dict(noise=0.1, conditional=dict(scale=0.0)), "conditional"),
    (dict(noise=0.1, conditional=dict(nodes=2)), "conditional"),
    (dict(noise=0.1, conditional=dict(nodes=8.5)), "conditional"),
    (dict(noise=0.1, conditional=dict(rounds=-1)), "conditional"),
    (dict(noise=0.1, conditional=dict(sd=float("nan"))), "conditional"),
    (dict(noise=0.1, conditional=dict(points=4)), "conditional"),
    (dict(noise=0.1, conditional=dict(escalate=0.0)), "conditional"),
    (dict(noise=0.1, conditional=dict(scale="2")), "conditional"),
    (dict(noise=0.1, conditional=dict(aspect=0.0)), "conditional"),
    (dict(escalation=dict(rounds=-1)), "escalation"), (dict(escalation=dict(rounds=2.5)), "escalation"),
    (dict(escalation=dict(refine=0.0)), "escalation"), (dict(escalation=dict(refine=2.0)), "escalation"),
    (dict(escalation=dict(refine=float("nan"))), "escalation"), (dict(escalation=dict(nodes=8)), "escalation"),
    (dict(escalation=dict(angular=0.0)), "escalation"), (dict(escalation=dict(angular=2.5)), "escalation"),
    (dict(escalation=False), "escalation must be a dict"), (dict(escalation=0), "escalation must be a dict"),
    (dict(noise=0.1, conditional=[("nodes", 8)]), "conditional must be a dict"),
])
def test_bad_channel_options(options, match):
    with pytest.raises(ValueError, match=match):
        model(2).channel(**options)


def test_max_regions_none_is_the_default():
    """``max_regions=None`` (as a caller forwarding its own default passes it) is the default
    budget, not a TypeError inside the adaptive rule."""
    assert model(2).channel(max_regions=None).max_regions == Channel.MAX_REGIONS
    assert model(3).channel(max_regions=None).max_regions == ReparamChannel.LAPLACE3_REGIONS
    assert model(2).channel(max_regions=123).max_regions == 123


# -- the reference against plain mp.quad (slow) -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", ["noisy_l1", "reparam_l2"])
def test_reference_matches_mpquad(case):
    """The 2-D reference (adaptive Gauss–Legendre, mpmath evaluation) against nested mp.quad
    (tanh-sinh at 15 digits, every moment separately): agreement to 1e-9 in the metric.
    Minutes per case."""
    rng = np.random.default_rng(3)
    if case == "noisy_l1":
        omega, V, noise = np.array([[-0.38, -0.22]]), np.array([[0.5]]), 0.1
        y = model(1).forward(omega + 0.5 * rng.standard_normal((1, 2))) + 0.3 * rng.standard_normal((2, 2))
        args = (y, omega, V, 1.0, noise)
        fast = ref.noisy_l1(*args)
    else:
        omega, V = np.array([[0.4, -0.3], [0.8, 0.2]]), np.array([[0.5, 0.1], [0.1, 0.4]])
        y = model(2).forward(omega + 0.6 * rng.standard_normal((2, 2)))
        args = (y, omega, V, 1.0, 1.0)
        fast = ref.reparam_l2(*args)
    slow = ref.mpquad_check(case, *args, dps=15)
    assert ref.metric(fast.g_out, fast.dg_out, slow.g_out, slow.dg_out) <= 1e-9
    if case == "noisy_l1":
        assert abs(fast.log_z - slow.log_z) <= 1e-9
