"""Gaussian probabilities of a polyhedral cone and the truncated mean, for the hardmax channel at
any T (AIM.md §4): with h = ω + √V diag(√w) ξ, ξ ~ N(0, I),

    Z = P(C h > 0),    E[ξ | C h > 0],

by Genz's separation of variables with randomised QMC.  C diag(√w) = L Qᵀ (pivoted QR; L is m×r
lower trapezoidal, Q has r = rank orthonormal columns), z = Qᵀξ ~ N(0, I_r) and the constraints
read L z > -Cω/√V.  Variable j is drawn from N(0, 1) truncated to the interval cut by the rows
whose last non-zero column is j, given z_<j; the product of the interval masses is the weight w_s:

    Z ≈ mean_s w_s,    E[z | cone] ≈ Σ_s w_s z_s / Σ_s w_s,    E[ξ | cone] = Q E[z | cone].

The rows of a hardmax cone are redundant (T(T-1) rows, rank T(T+1)/2 - 1), which the intervals
absorb.  Same points u for every ω: the estimates are smooth functions of (ω, V).
"""
from __future__ import annotations

import numpy as np
from scipy.linalg import qr
from scipy.special import logsumexp, ndtr, ndtri
from scipy.stats import qmc


def sobol(dim: int, n: int, seed: int, shifts: int = 0) -> np.ndarray:
    """n scrambled Sobol points in (0, 1)^dim; with shifts > 0, that many Cranley–Patterson
    rotations of them (shifts, n, dim), the shifts themselves Sobol points."""
    u = qmc.Sobol(dim, scramble=True, seed=seed).random(n)
    if shifts:
        u = (u + qmc.Sobol(dim, scramble=True, seed=seed + 1).random(shifts)[:, None]) % 1
    return u.clip(1e-15, 1 - 1e-15)


class Cone:
    """{h : C h > 0} under N(ω, V diag(w)); `rank` = r, the dimension of the SOV points."""

    def __init__(self, C: np.ndarray, w: np.ndarray):
        A = np.asarray(C, float) * np.sqrt(w)
        Q, R, piv = qr(A.T, pivoting=True, mode="economic")
        d = np.abs(np.diag(R))
        self.rank = int(np.sum(d > 1e-10 * d[0]))
        self.C, self.Q, self.L = np.asarray(C, float)[piv], Q[:, :self.rank], R[:self.rank].T
        big = np.abs(self.L) > 1e-12 * np.abs(self.L).max(axis=1, keepdims=True)
        last = self.L.shape[1] - 1 - np.argmax(big[:, ::-1], axis=1)
        self.rows = [np.flatnonzero(last == j) for j in range(self.rank)]

    def sample(self, omega: np.ndarray, V: float, u: np.ndarray):
        """(log w_s, z_s) for each ω (n, P) and points u (N, r) or (n, N, r): shapes (n, N), (n, N, r)."""
        beta = -(omega @ self.C.T) / np.sqrt(V)                      # (n, m)
        n, N = omega.shape[0], u.shape[-2]
        z = np.zeros((n, N, self.rank))
        logw = np.zeros((n, N))
        for j, rows in enumerate(self.rows):
            lo, hi = np.full((n, N), -np.inf), np.full((n, N), np.inf)
            for i in rows:
                t = (beta[:, i, None] - z[:, :, :j] @ self.L[i, :j]) / self.L[i, j]
                if self.L[i, j] > 0:
                    lo = np.maximum(lo, t)
                else:
                    hi = np.minimum(hi, t)
            flip = lo > 0                                  # work in the lower tail: x = ±z
            a, b = np.where(flip, -hi, lo), np.where(flip, -lo, hi)
            pa, pb = ndtr(a), ndtr(np.maximum(a, b))       # relative accuracy in the tail
            with np.errstate(divide="ignore"):
                logw += np.log(pb - pa)
            v = np.where(flip, 1 - u[..., j], u[..., j])   # z = Φ⁻¹(Φ(lo) + u(Φ(hi) - Φ(lo))) either way
            x = np.clip(ndtri(pa + v * (pb - pa)), a, b)
            x = np.where(np.isfinite(x), x, b)             # Φ(b) underflowed: a null weight
            z[:, :, j] = np.where(flip, -x, x)
        return logw, z

    def moments(self, omega: np.ndarray, V: float, u: np.ndarray):
        """log Z (n,) and E[ξ | cone] (n, P); E = 0 where Z = 0."""
        logw, z = self.sample(omega, V, u)
        logz = logsumexp(logw, axis=1) - np.log(u.shape[-2])
        with np.errstate(invalid="ignore"):
            p = np.exp(logw - logz[:, None] - np.log(u.shape[-2]))
        ez = np.einsum("ns,nsr->nr", np.nan_to_num(p), z)
        return logz, ez @ self.Q.T
