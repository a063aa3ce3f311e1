"""Three layers, T = 2, the first two layers not learned — ω_1 = ω_2 = 0, V diagonal (state
evolution at q = diag(0, 0, q₃₃), the plateau where only the last layer is learned): nested
product integration in both layers' attention weights θ_1, θ_2 (smi_core.theta_rule), one rule of
n_1² n_2² nodes shared by every sample.

The likelihood depends on (h_1, h_2) only through Φ⁽²⁾ = Φ_2 Φ_1, Φ_ℓ = cI + A(θ_ℓ): per sign of
u_3 it is N(±Φ⁽²⁾⁻¹u_3; ω_3, V₃₃)/|det Φ⁽²⁾|, smooth in (θ_1, θ_2).  Outer: θ_1 on the θ rule's
n_1 × n_1 grid with its weights for h_1 ~ N(0, V₁₁ I).  Inner, per outer node: layer 2 sees g =
Φ_1 h_2 ~ N(0, V₂₂ Φ_1Φ_1ᵀ) and θ_2 = σ(βa(g)), so θ_2 goes on an n_2 × n_2 grid with the weights
of that pushforward (``theta_rule.weights_of``), whose Chebyshev moments (``theta_rule._moments``
with S = Φ_1Φ_1ᵀ, degree DEGREE) are interpolated in θ_1 from a K × K table (``table``, once per
(βV₂₂, c, β), ≈ 80 s, cached on disk).  E[h_1 | θ_1] = E[h_2 | θ_1, θ_2] = 0 (h_ℓ and −h_ℓ give the
same θ_ℓ); E[h_1h_1ᵀ | θ_1] = V₁₁ x xᵀ by the outer rule's weights of x xᵀ, E[h_2h_2ᵀ | ·] =
V₂₂ Φ_1⁻¹ x xᵀ Φ_1⁻ᵀ by the inner one's: both go into weights of their own (three rows each), so
one ``_quadrature.theta_product`` pass gives every moment.  The truncated set (the error
estimate) truncates both rules.

Measured against tests/theta3_reference.py's brute inner rule (a Gauss–Legendre product in g) on
two draws at q₃₃ = 0.99: 2.5e-8 and 4.9e-8 at (n_1, n_2) = (21, 33); tables at K = 9 and 13 gave
the same results (weights ≈ 6e-6 apart at K = 9 against moments computed directly).
"""
from __future__ import annotations

import numpy as np

from . import theta_rule

DEGREE = 33           # the inner moments' degree (the finest inner level)
NODES = 8             # Gauss–Legendre nodes per panel of the inner moments' rule (weights within 2e-10 of 16 at 33)
K = 9                 # the table's grid in θ_1 (K × K)


def table(b: float, phi1: np.ndarray) -> np.ndarray:
    """μ (K², 4, DEGREE, DEGREE): the moments of g ~ N(0, Φ_1Φ_1ᵀ) (``theta_rule._moments`` at b =
    βV₂₂) for Φ_1 (K², 2, 2) at the θ_1 grid; read from the cache where an earlier run left it."""
    phi1 = np.asarray(phi1, dtype=float)
    rule = (DEGREE, NODES, K, theta_rule.REACH, theta_rule.CLIFFS.tolist(), theta_rule.STEP, float(b),
            np.round(phi1, 12).tolist())
    return theta_rule.cached(theta_rule.cache_file("table3", rule), (K * K, 4, DEGREE, DEGREE),
                             lambda: np.stack([theta_rule._moments(b, P @ P.T, DEGREE, NODES) for P in phi1]),
                             f"the three-layer θ rule's weights for βV₂₂ = {b:g} (≈ 80 s)")


def interpolate(tab: np.ndarray, n: int) -> np.ndarray:
    """The table's Chebyshev interpolant in θ_1 = (p, v) at the n × n grid: (n², 4, D, D)."""
    C = theta_rule.points(K)[1]
    coef = np.einsum("ja,lb,ab...->jl...", C, C, tab.reshape(K, K, *tab.shape[1:]))
    x = theta_rule.points(n)[0]
    Tp, Tv = theta_rule._chebyshev(2 * np.repeat(x, n) - 1, K), theta_rule._chebyshev(2 * np.tile(x, n) - 1, K)
    return np.einsum("ji,li,jl...->i...", Tp, Tv, coef)


def weights(b1: float, inner: np.ndarray, phi1inv: np.ndarray, n1: int, n2: int) -> tuple[np.ndarray, np.ndarray]:
    """The nested rule's weights, separable per θ_1 node i (the block of nodes i·n_2² + j, j the
    θ_2 node): inner (8, n_1² n_2²), per set (full, truncated) [w_2ij, the three of
    (Φ_1i⁻¹ w_2ij^(xx) Φ_1i⁻ᵀ)_ab] (h_2h_2ᵀ/V₂₂), and outer (8, n_1²), per set [w_1i, the three of
    w_1i^(ab)] (h_1h_1ᵀ/V₁₁): the node's weight is w_1i w_2ij, h_1h_1ᵀ's w_1i^(ab) w_2ij and
    h_2h_2ᵀ's w_1i (Φ_1i⁻¹ w_2ij^(xx) Φ_1i⁻ᵀ)_ab (``_quadrature.theta_product`` with ``outer``).
    ``inner`` the inner moments at the θ_1 nodes (``interpolate``), ``phi1inv`` (n_1², 2, 2) Φ_1⁻¹
    there, b1 = βV₁₁."""
    W2 = theta_rule.weights_of(inner, n2)                                 # (n_1², 8, n_2²)
    out = np.empty((8, n1 * n1, n2 * n2))
    for s in (0, 1):
        X = W2[:, 4 * s + np.array([1, 2, 2, 3])].reshape(-1, 2, 2, n2 * n2)  # x xᵀ weights, 2 × 2 per node
        H = np.einsum("iab,ibcj,idc->adij", phi1inv, X, phi1inv, optimize=True)
        out[4 * s] = W2[:, 4 * s]
        out[4 * s + 1:4 * s + 4] = H.reshape(4, n1 * n1, -1)[[0, 1, 3]]
    return np.ascontiguousarray(out.reshape(8, -1)), np.ascontiguousarray(theta_rule.weights(b1, n1))
