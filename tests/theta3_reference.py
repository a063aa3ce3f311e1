"""A reference for three layers, T = 2, the first two layers not learned (ω_1 = ω_2 = 0, V
diagonal: state evolution at q = diag(0, 0, q₃₃)), by nested product integration in the
attention weights (smi_core.theta_rule), in numpy.

The likelihood depends on (h_1, h_2) only through Φ⁽²⁾ = (cI + A(θ_2)) Φ_1, Φ_1 = cI + A(θ_1), and
per sign of u_3 it is N(±Φ⁽²⁾⁻¹u_3; ω_3, V₃₃)/|det Φ⁽²⁾|.  Outer: θ_1 by the two-layer θ rule's
weights for h_1 ~ N(0, V₁₁ I).  Inner, per outer node: g = Φ_1 h_2 ~ N(0, V₂₂ Φ_1Φ_1ᵀ), θ_2 = σ(β
a(g)), by product integration with the weights of that pushforward (``theta_rule._moments`` with
S = Φ_1Φ_1ᵀ, b = βV₂₂), their Chebyshev moments interpolated in θ_1 from a K × K table
(``smi_core.theta3_rule.table`` and ``interpolate``, shared with the channel's rule: what is
independent here is Φ (written out below, not the generated kernels), the nested loop and the
sums' algebra).  E[h_1 |
θ_1] = 0 and E[h_2 | θ_1, θ_2] = 0 (h_ℓ and −h_ℓ give the same θ_ℓ), E[h_2h_2ᵀ | ·] = Φ_1⁻¹ g gᵀ
Φ_1⁻ᵀ from the weights of g gᵀ.

Measured 2026-12-03 (c = β = 1, q₃₃ = 0.99, seed-0 draws of tests/test_theta_rule.py): with the
inner integral done instead by a plain Gauss–Legendre product in (d, m) of g (0.8 M nodes per
outer node, panels at the softmax's cliffs) at n_1 = 21, two draws agreed with this rule at
(21, 33) to 2.5e-8 and 4.9e-8; tables at k = 9 and 13 gave the same results to the digits shown
(weights ≈ 6e-6 apart at k = 9 against the moments computed directly)."""
from __future__ import annotations

import numpy as np

from smi_core import theta3_rule, theta_rule


def _theta(n):
    """(p, r) at the θ rule's n × n grid (node i·n + j at (p_i, v_j), r = 1 − p + p v)."""
    x = theta_rule.points(n)[0]
    p, v = np.repeat(x, n), np.tile(x, n)
    return p, 1 - p + p * v


def _phi(c, p, r):
    """cI + A(θ), A = [[p, 1 − p], [1 − r, r]] (the softmax of two tokens), (..., 2, 2)."""
    A = np.stack([np.stack([p, 1 - p], -1), np.stack([1 - r, r], -1)], -2)
    return c * np.eye(2) + A


def moments(u, omega, V, c, beta, n1, n2):
    """For each weight set (full, truncated): (log Z + const, E[Z] (n, 6), Cov[Z] (n, 6, 6)),
    index a·T + t; u (n, 2) the last layer's u_3 for one sign, omega (n, 3, 2), V (3, 3) diagonal."""
    ns, (v1, v2, v3) = len(u), np.diag(V)
    W1 = theta_rule.weights(beta * v1, n1)
    mus = theta3_rule.interpolate(theta3_rule.table(beta * v2, _phi(c, *_theta(theta3_rule.K))), n1)
    A2 = _phi(c, *_theta(n2))
    sums = [dict(M=np.full(ns, -np.inf), Z=np.zeros(ns), H3=np.zeros((ns, 2)), H33=np.zeros((ns, 2, 2)),
                 H11=np.zeros((ns, 3)), H22=np.zeros((ns, 2, 2))) for _ in range(2)]
    for i, P1 in enumerate(_phi(c, *_theta(n1))):
        W2 = theta_rule.weights_of(mus[i], n2)
        P2 = A2 @ P1
        inv, logdet, P1inv = np.linalg.inv(P2), np.log(np.abs(np.linalg.det(P2))), np.linalg.inv(P1)
        for sign in (1.0, -1.0):
            h3 = np.einsum("jab,nb->nja", inv, sign * u)
            lw = -((h3 - omega[:, 2, None, :]) ** 2).sum(-1) / (2 * v3) - logdet
            for s, R in enumerate(sums):
                top = np.maximum(R["M"], lw.max(axis=1))
                scale = np.exp(R["M"] - top)
                for key in ("Z", "H3", "H33", "H11", "H22"):
                    R[key] *= scale.reshape(-1, *[1] * (R[key].ndim - 1))
                R["M"] = top
                e = np.exp(lw - top[:, None])
                ew, w1 = e * W2[4 * s], W1[4 * s, i]
                R["Z"] += w1 * ew.sum(1)
                R["H3"] += w1 * np.einsum("nj,nja->na", ew, h3)
                R["H33"] += w1 * np.einsum("nj,nja,njb->nab", ew, h3, h3)
                R["H11"] += v1 * np.outer(ew.sum(1), W1[4 * s + 1:4 * s + 4, i])
                G = e @ W2[4 * s + 1:4 * s + 4].T
                G = np.stack([G[:, :2], G[:, 1:]], axis=1)
                R["H22"] += w1 * v2 * np.einsum("ab,nbc,dc->nad", P1inv, G, P1inv)
    out = []
    for R in sums:
        Z = R["Z"]
        mean, cov = np.zeros((ns, 6)), np.zeros((ns, 6, 6))
        mean[:, 4:] = R["H3"] / Z[:, None]
        cov[:, :2, :2] = (R["H11"] / Z[:, None])[:, [[0, 1], [1, 2]]]
        cov[:, 2:4, 2:4] = R["H22"] / Z[:, None, None]
        cov[:, 4:, 4:] = R["H33"] / Z[:, None, None] - mean[:, 4:, None] * mean[:, None, 4:]
        out.append((np.log(Z) + R["M"], mean, cov))
    return out


def denoiser(omega, V, mean, cov):
    """g_out (n, 3, 2) and dg_out (n, 6, 6) for V diagonal (spec §4): g = (E[Z] − ω)/V_aa,
    ∂g = Cov/(V_aa V_bb) − δ/V_aa."""
    d = np.repeat(np.diag(V), 2)
    g = (mean - omega.reshape(len(omega), 6)) / d
    return g.reshape(-1, 3, 2), cov / np.outer(d, d) - np.diag(1 / d)


def reference(u, omega, V, c=1.0, beta=1.0, levels=((21, 21), (33, 33))):
    """g_out, dg_out at the finer level and the error: the metric of its difference to the coarser
    level and to its own truncated weights (whichever is larger)."""
    runs = [moments(u, omega, V, c, beta, *n) for n in levels]
    (g, dg), *others = [denoiser(omega, V, *r[1:]) for r in (runs[-1][0], runs[0][0], runs[-1][1])]
    scale = np.maximum(np.abs(g).reshape(len(g), -1).max(1), np.abs(dg).reshape(len(g), -1).max(1))
    error = np.max([np.maximum(np.abs(g - a).reshape(len(g), -1).max(1), np.abs(dg - b).reshape(len(g), -1).max(1))
                    for a, b in others], axis=0) / scale
    return g, dg, error
