"""Two layers, T = 2, the last layer pinned and V diagonal, the likelihood's window about
θ = (½, ½): a product rule in (d, m) = (h_11 − h_12, (h_11 + h_12)/2).

The logit rule (``logit_rule``) leaves these samples out: the fold h_11 = h_12 of h_1 ↦ a
(a = (h_11(h_11 − h_12), h_12(h_12 − h_11)), the logits of θ = σ(βa)) goes to a = 0, where the
prior's density over a is ∝ 1/|a|.  In (d, m) the prior is the Gaussian
N(d; d_0, 2V_11) N(m; m_0, V_11/2) (dh_1 = dd dm) and a = (d²/2 + md, d²/2 − md), smooth.  Near
θ = (½, ½) the softmax is near-linear, so per sign of u_2 the likelihood is close to a Gaussian
in a about a* = logit(θ*)/β (θ* from ``logit_rule.attention_targets``) with precision
P = J D (ΦΦᵀ)⁻¹ D J / V_22, D = diag(δ, −δ) (δ = ω_21 − ω_22, Φ ω_2 = const + Dθ), J =
diag(βθ*(1 − θ*)), Φ = cI + A(θ*).  Along the line of constant d, that Gaussian times the prior
of m is the Gaussian in m of precision λ(d) = d² eᵀPe + 2/V_11 and mean
μ(d) = (2m_0/V_11 − d eᵀP r(d))/λ(d) (e = (1, −1), r(d) = (d²/2)(1, 1) − a*): Gauss–Hermite in m
about it.  Its mass over d, ∝ N(d) λ(d)^-½ exp(…), turns from flat to ∝ 1/|d| at
ε = (2/(V_11 eᵀPe))^½ and lives where s = d² is within a few σ_s of s* = a*_1 + a*_2 (σ_s² =
1ᵀP⁻¹1): Gauss–Legendre in d on panels graded ×2 towards 0 from ε/4, cut at ±√(s* + jσ_s) and
at the prior's walls, out to √(s* + 9σ_s).  With ω_1 = 0 the integrand is even in h_1 and the
rule covers d > 0 (``integrate_polar`` adds the reflection −h_1 of every node); otherwise it
covers the plane and each node's weight carries its share N(h_1)/(N(h_1) + N(−h_1)) =
σ(2 ω_1·h_1/V_11) of that sum.

It applies where one sign's window (``logit_rule.windows``) holds θ = (½, ½), the other's does
not meet the range, max_t |θ*_t − ½| + 3w < NEAR and s* + SPAN σ_s > 0: further out the
Gaussian in a misplaces the nodes (on the windows about (½, ½) at q = diag(0, 0.9999), the
rule at (8, 14) against (6, 10) nodes accepted, at 1e-6, a result 0.17 off: the posterior in a
is skewed towards θ → 1 and both counts miss the same mass).  With the first layer narrower
(V_11 < BROAD) the prior pulls the posterior into the likelihood's tails, where the Gaussian in a
is off: the rule stays accurate (its estimate held on the samples it kept at q = diag(0.7,
0.9995) and diag(0.95, 0.9995)) but leaves a sixth to a fifth of them to the rounds, and the channel was
slower with it (1 024 draws, one core: q₁₁ = 0.7 / 0.81 / 0.95 5–20 % by default, 20–45 % in
state evolution's channel; q₁₁ = 0.5 15–23 % faster, 0.59 the same).
"""
from __future__ import annotations

import numpy as np

from .logit_rule import WALLS
from .quadrature import gauss_legendre

NEAR = 0.25                     # max_t |θ*_t − ½| + 3w below this
BROAD = 0.4                     # V_11 at least this
SPAN = 9.0                      # d² out to s* + SPAN σ_s
S_WALLS = np.array([-6.0, -4.0, -2.5, -1.25, 0.0, 1.25, 2.5, 4.0, 6.0])                     # units of σ_s
PRIOR = np.array([-9.5, -7.0, -5.0, -3.5, -2.0, -1.0, 0.0, 1.0, 2.0, 3.5, 5.0, 7.0, 9.5])    # units of √(2V_11)


def gaussian(theta, omega2, v2, skip, beta):
    """The likelihood's Gaussian in a, per sample (θ* (n, 2), ω_2 (n, 2), V_22 (n,)): mean
    a* (n, 2), precision P (n, 2, 2), s* and σ_s (n,) each."""
    delta = omega2[:, 0] - omega2[:, 1]
    phi = np.stack([np.stack([skip + theta[:, 0], 1 - theta[:, 0]], axis=1),
                    np.stack([1 - theta[:, 1], skip + theta[:, 1]], axis=1)], axis=1)
    dj = np.stack([delta, -delta], axis=1) * beta * theta * (1 - theta)       # the diagonal of D J
    P = dj[:, :, None] * np.linalg.inv(phi @ phi.transpose(0, 2, 1)) * dj[:, None, :] / v2[:, None, None]
    astar = np.log(theta / (1 - theta)) / beta
    return astar, P, astar.sum(axis=1), np.sqrt(np.linalg.inv(P).sum(axis=(1, 2)))


def applies(centre, w, meets, omega, V, skip, beta):
    """Per sample (from ``logit_rule.windows``): V₁₂ = 0, V₁₁ ≥ BROAD, exactly one sign's window
    meets the range, it holds θ = (½, ½), max_t |θ*_t − ½| + 3w < NEAR and s* + SPAN σ_s > 0;
    and that sign's θ* (n, 2)."""
    sign = np.argmax(meets, axis=1)
    near = np.take_along_axis(centre, sign[:, None, None], axis=1)[:, 0]
    off = np.abs(near - 0.5).max(axis=1)
    with np.errstate(invalid="ignore"):
        ok = ((V[:, 0, 1] == 0) & (V[:, 0, 0] >= BROAD) & (meets.sum(axis=1) == 1) & (off < WALLS[-1] * w)
              & (off + 3 * w < NEAR))
    if ok.any():
        _, _, s_star, sigma_s = gaussian(near[ok], omega[ok, 1], V[ok, 1, 1], skip, beta)
        ok[ok] = s_star + SPAN * sigma_s > 0
    return ok, near


class Layout:
    """Per sample, what every node count shares: the d panels and the likelihood's Gaussian."""

    def __init__(self, centre, omega, V, skip, beta):
        """``centre``: θ* of the sign the rule is for (n, 2); ``omega`` (n, 2, 2), ``V`` (n, 2, 2)."""
        self.omega, self.v1 = omega, V[:, 0, 0]
        self.astar, self.P, self.s_star, self.sigma_s = gaussian(centre, omega[:, 1], V[:, 1, 1], skip, beta)
        self.half = (omega[:, 0] == 0).all(axis=1)
        ends = [self._ends(i) for i in range(len(centre))]
        self.lo = np.concatenate([e[:-1] for e in ends])
        self.hi = np.concatenate([e[1:] for e in ends])
        self.owner = np.repeat(np.arange(len(ends)), [len(e) - 1 for e in ends])

    def _ends(self, i):
        """Panel ends in d of sample i (over d ≥ 0 where ``half``)."""
        v1, P, e = self.v1[i], self.P[i], np.array([1.0, -1.0])
        s_star, sigma_s = self.s_star[i], self.sigma_s[i]
        d0 = self.omega[i, 0, 0] - self.omega[i, 0, 1]
        top = min(np.sqrt(s_star + SPAN * sigma_s), abs(d0) + np.sqrt(2 * v1) * PRIOR[-1])
        eps = np.sqrt(2 / (v1 * (e @ P @ e)))
        grade = eps / 4 * 2.0 ** np.arange(64)
        s = s_star + sigma_s * S_WALLS
        walls = np.concatenate([[0.0, top], grade[grade < top], np.sqrt(s[s > 0]), d0 + np.sqrt(2 * v1) * PRIOR])
        walls = np.concatenate([walls, -walls])
        return np.unique(np.clip(walls, 0.0 if self.half[i] else -top, top))

    def nodes(self, todo, nd, nm):
        """The rule's nodes for the samples ``todo`` (ascending), nd Gauss–Legendre nodes per d
        panel and nm Gauss–Hermite nodes in m: rows [h_1 (2), log weight, 5 rows for Φ⁻¹ and
        log|det Φ| (left to the caller's inverse kernel)] by columns, and per sample of ``todo``
        its range start:stop of columns."""
        x, wx = gauss_legendre(nd)
        t, wt = np.polynomial.hermite.hermgauss(nm)
        sel = np.isin(self.owner, todo)
        lo, hi, owner = self.lo[sel], self.hi[sel], self.owner[sel]
        half, mid = (hi - lo)[:, None] / 2, (hi + lo)[:, None] / 2
        d, wd = (mid + half * x).ravel(), (half * wx).ravel()
        own = np.repeat(owner, nd)
        P, astar, v1 = self.P[own], self.astar[own], self.v1[own]
        Pe = P[:, :, 0] - P[:, :, 1]                              # P e
        ePe = Pe[:, 0] - Pe[:, 1]
        r = d[:, None] ** 2 / 2 - astar
        lam = d * d * ePe + 2 / v1
        m0 = self.omega[own, 0].sum(axis=1) / 2
        mu = (2 * m0 / v1 - d * (Pe * r).sum(axis=1)) / lam
        scale = np.sqrt(2 / lam)
        m = mu[:, None] + scale[:, None] * t
        cols = np.empty((8, m.size))
        cols[0] = (m + d[:, None] / 2).ravel()
        cols[1] = (m - d[:, None] / 2).ravel()
        cols[2] = (np.log(wd * scale)[:, None] + np.log(wt) + t * t).ravel()
        each = np.repeat(own, nm)                                 # the sample of every node
        omega1 = self.omega[each, 0]
        full = ~self.half[each]
        share = 2 * (omega1[:, 0] * cols[0] + omega1[:, 1] * cols[1]) / self.v1[each]
        cols[2, full] -= np.logaddexp(0.0, -share[full])
        stop = np.cumsum(np.bincount(np.searchsorted(todo, own), minlength=len(todo)) * nm)
        return cols, np.concatenate([[0], stop[:-1]]), stop
