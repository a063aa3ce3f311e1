"""A second reference for two-layer T = 2 attention with V diagonal: a nested product rule in
(d, m) = (h_11 − h_12, (h_11 + h_12)/2) in numpy (u_L from ``channel_reference.u_from_y``;
independent of derive/, codegen/ and smi_core/ like that module, and ≈ 100× faster than its
mpmath rule).

Written from spec §2 and §4: the posterior over h_1 is ∝ Σ_± N(h_1; ω_1, v_1 I) N(±h_2; ω_2, v_2 I)
/ |det Φ(h_1)| with h_2 = Φ⁻¹u, Φ = cI + σ_β(h_1 h_1ᵀ), and Φ is even in h_1, so d > 0 with the
reflection −h_1 (d, m → −d, −m) covers R².  In (d, m) the softmax's logits are a_1 = d(m + d/2),
a_2 = d(d/2 − m), and the fold of h_1 ↦ a (the whole line d = 0 goes to a = 0, θ = (½, ½)) is
flat: the integrand is smooth, so this rule is the one for the samples whose posterior holds
θ = (½, ½), which the channel's logit rule leaves to its polar rounds.

Nodes: Gauss–Legendre in d on panels graded ×2 towards d = 0, cut at √(a_1 + a_2) of the
likelihood's walls and at the prior's walls |d_0| + j·√(2 v_1) (d_0 = ω_11 − ω_12); per d node,
Gauss–Legendre in m on panels cut at the walls of both logits (θ*_t + j·w as logits, θ* where
Φ(θ*)ω_2 = ±u, w = √v_2 (c + √2)/|ω_21 − ω_22|; beyond them panels growing ×4) and at the
prior's walls ±m_0 + j·√(v_1/2) (h_1 and its reflection), over the prior's whole reach (so a
misplaced wall costs accuracy, not mass: ``error`` is the difference of two node counts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from channel_reference import u_from_y

WALLS = np.array([-9.0, -6.0, -4.0, -2.5, -1.25, 0.0, 1.25, 2.5, 4.0, 6.0, 9.0])   # units of w
PRIOR = np.array([-9.5, -7.0, -5.0, -3.5, -2.0, -1.0, 0.0, 1.0, 2.0, 3.5, 5.0, 7.0, 9.5])   # units of the prior's sd
REACH = 45.0        # the prior is cut at e^-REACH


@dataclass
class Nested:
    g_out: np.ndarray       # (2, 2)
    dg_out: np.ndarray      # (4, 4), index a*T + t
    error: float            # the metric between the two node counts
    nodes: int


def _logit(t, beta):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.log(t) - np.log1p(-t)) / beta


def _axis_ends(centre, w, beta, reach):
    """Panel ends of one logit: the walls inside (0, 1), and where the window passes θ = 0 or 1,
    panels growing ×4 from 0.5 out to ±reach."""
    theta = centre + w * WALLS
    ends = list(_logit(theta[(theta > 0) & (theta < 1)], beta))
    grow = 0.5 * (4.0 ** np.arange(1, 40) - 1) / 3
    if theta[0] <= 0:
        start = ends[0] if ends else 0.0
        ends = list(start - grow[start - grow > -reach][::-1]) + ends
    if theta[-1] >= 1:
        start = ends[-1] if ends else 0.0
        ends = ends + list(start + grow[start + grow < reach])
    return np.array(ends)


def _gl(ends, n):
    x, w = np.polynomial.legendre.leggauss(n)
    half, mid = np.diff(ends)[:, None] / 2, (ends[1:] + ends[:-1])[:, None] / 2
    return (mid + half * x).ravel(), (half * w).ravel()


def nodes(u, omega, V, skip, beta, n, nd):
    """(d, m, weight) of the rule: nd nodes per d panel, n per m panel."""
    c, v1, v2 = skip, V[0, 0], V[1, 1]
    dw = omega[1, 0] - omega[1, 1]
    centres, k = [], WALLS[-1]
    if dw != 0:
        w = np.sqrt(v2) * (c + np.sqrt(2.0)) / abs(dw)
        for s in (1.0, -1.0):       # θ* = (A_11, A_22) with (cI + A) ω_2 = s·u
            theta = (s * u - c * omega[1] - omega[1, ::-1]) / np.array([dw, -dw])
            if (theta + k * w > 0).all() and (theta - k * w < 1).all():
                centres.append(theta)
    d0, m0 = omega[0, 0] - omega[0, 1], (omega[0, 0] + omega[0, 1]) / 2
    dmax = abs(d0) + np.sqrt(4 * REACH * v1)
    mlo, mhi = -abs(m0) - np.sqrt(REACH * v1), abs(m0) + np.sqrt(REACH * v1)     # h_1 and −h_1: m about ±m_0
    reach = 1.21 * (np.linalg.norm(omega[0]) + np.sqrt(2 * REACH * v1)) ** 2
    ends = [np.concatenate([_axis_ends(t[k], w, beta, reach) for t in centres] + [[]]) for k in range(2)]
    dends = [0.0, dmax] + list(1e-3 * dmax * 2.0 ** np.arange(10)) + list(abs(d0) + np.sqrt(2 * v1) * PRIOR)
    for t in centres:
        s = _logit(t[0] + w * WALLS, beta) + _logit(t[1] + w * WALLS, beta)
        dends += list(np.sqrt(s[np.isfinite(s) & (s > 0)]))
    dends = np.unique(np.clip(dends, 0.0, dmax))
    D, WD = _gl(dends, nd)
    prior = np.concatenate([m0 + np.sqrt(v1 / 2) * PRIOR, -m0 + np.sqrt(v1 / 2) * PRIOR])
    out = []
    for d, wd in zip(D, WD):
        cuts = np.concatenate([(ends[0] - d * d / 2) / d, (d * d / 2 - ends[1]) / d, prior])
        M, WM = _gl(np.unique(np.concatenate([[mlo, mhi], cuts[(cuts > mlo) & (cuts < mhi)]])), n)
        out.append(np.stack([np.full_like(M, d), M, wd * WM]))
    return np.concatenate(out, axis=1)


def _moments(u, omega, V, skip, beta, n, nd):
    """(g_out, dg_out, node count) of the rule."""
    d, m, wt = nodes(u, omega, V, skip, beta, n, nd)
    h = np.stack([m + d / 2, m - d / 2])
    p = 1 / (1 + np.exp(-beta * h[0] * (h[0] - h[1])))          # row 1: σ_β(h_11 h_1·)
    r = 1 / (1 + np.exp(-beta * h[1] * (h[1] - h[0])))          # row 2
    det = (skip + p) * (skip + r) - (1 - p) * (1 - r)
    h2 = np.stack([(skip + r) * u[0] - (1 - p) * u[1], (skip + p) * u[1] - (1 - r) * u[0]]) / det
    Z, logw = [], []
    for a in (1.0, -1.0):
        for b in (1.0, -1.0):
            z = np.concatenate([a * h, b * h2]) - omega.reshape(4, 1)
            Z.append(z)
            logw.append(np.log(wt) - 0.5 * (z[:2] ** 2).sum(0) / V[0, 0] - 0.5 * (z[2:] ** 2).sum(0) / V[1, 1]
                        - np.log(np.abs(det)))
    Z, logw = np.concatenate(Z, axis=1), np.concatenate(logw)
    w = np.exp(logw - logw.max())
    w /= w.sum()
    mean = Z @ w
    cov = (Z * w) @ Z.T - np.outer(mean, mean)
    Vinv = np.linalg.inv(V)
    g = Vinv @ mean.reshape(2, 2)
    P = np.kron(Vinv, np.eye(2))                 # index a*T + t
    dg = P @ cov @ P - P
    return g, dg, len(wt)


def reparam_l2_nested(y, omega, V, skip=1.0, beta=1.0, n=24, nd=18) -> Nested:
    """g_out, dg_out at n / nd nodes per panel, the error their difference to 2/3 the counts."""
    y, omega, V = (np.asarray(a, dtype=np.float64) for a in (y, omega, V))
    if V[0, 1] != 0 or V[1, 0] != 0:
        raise ValueError("the nested rule needs V diagonal")
    u = np.array([float(x) for x in u_from_y(y, beta)])
    g, dg, count = _moments(u, omega, V, skip, beta, n, nd)
    g0, dg0, _ = _moments(u, omega, V, skip, beta, (2 * n) // 3, (2 * nd) // 3)
    scale = max(np.abs(g).max(), np.abs(dg).max())
    error = max(np.abs(g - g0).max(), np.abs(dg - dg0).max()) / scale
    return Nested(g, dg, float(error), count)
