"""Quadrature rules and Laplace centring for the channel integrals (model-independent).

A rule integrates against the standard normal weight: ∫ φ_d(ξ) h(ξ) dξ ≈ Σ_k w_k h(ξ_k).  The
driver (``_quadrature.integrate``) takes ``lw_k = log(w_k / φ_d(ξ_k))``, so that
∫ f(c + Aξ) |det A| dξ ≈ |det A| Σ_k exp(lw_k) f(c + Aξ_k).
"""
from __future__ import annotations

from functools import lru_cache
from itertools import product

import numpy as np
from numpy.polynomial.hermite_e import hermegauss


def _log_phi(xi: np.ndarray) -> np.ndarray:
    d = xi.shape[1]
    return -0.5 * (xi ** 2).sum(axis=1) - 0.5 * d * np.log(2 * np.pi)


@lru_cache(maxsize=64)
def gauss_hermite(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensor-product Gauss–Hermite rule with n nodes per dimension: (ξ (n^d, d), lw (n^d,))."""
    x, w = hermegauss(n)
    w = w / np.sqrt(2 * np.pi)
    xi = np.array(list(product(x, repeat=d)), dtype=np.float64).reshape(-1, d)
    logw = np.array([np.log(w[list(i)]).sum() for i in product(range(n), repeat=d)]).reshape(-1)
    return np.ascontiguousarray(xi), logw - _log_phi(xi)


@lru_cache(maxsize=256)
def gauss_legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Legendre nodes and weights on [-1, 1] (cached, read-only: the polar rules' radii ask
    for the same n again and again, and numpy's ``leggauss`` takes ≈ 12 ms at n = 430)."""
    t, w = np.polynomial.legendre.leggauss(n)
    t.flags.writeable = w.flags.writeable = False
    return t, w


def sobol_normal(n: int, d: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Randomised QMC: n scrambled Sobol points mapped to N(0, I_d), weights 1/n."""
    from scipy.stats import norm, qmc
    u = qmc.Sobol(d, scramble=True, seed=rng).random(n)
    xi = norm.ppf(np.clip(u, 1e-300, 1 - 1e-16))
    return np.ascontiguousarray(xi), np.full(n, -np.log(n)) - _log_phi(xi)


def partition(centers, hess, logf, prior=None, inflate: float = 1.0, prune: float = 40.0,
              same: float = 0.05, floor: float = 40.0):
    """Components of the partition of unity.  Laplace modes (``centers`` (n, K, d), GN ``hess``,
    ``logf`` at the centre): duplicates (closer than ``same`` standard deviations to a heavier
    mode) and modes whose Laplace mass is below e^-prune of the largest are dropped (logh = -inf).
    ``prior`` = (centre (n, d), precision (n, d, d)) adds a last component shaped like the prior
    of x, e^-floor below the highest mode: it takes the tails where the likelihood saturates and
    f decays only like the prior.  (At floor = 20 the leftover of a narrow mode in the prior
    piece, ≈ e^-20 of the mass on a ring the prior-scaled rule does not resolve, cost 1e-4 in
    dg_out for a near-singular V; 40 puts it below rounding.)  Rules are scaled by ``inflate`` × the Laplace standard
    deviations.  Returns (centers, precisions H, A (lower-triangular scales), logh)."""
    n, M, d = centers.shape
    cov = np.linalg.inv(hess)
    mass = logf + 0.5 * np.linalg.slogdet(cov)[1]
    logh = logf.copy()
    order = np.argsort(-mass, axis=1)
    rows = np.arange(n)
    for i in range(M):
        m = order[:, i]
        for j in range(i):
            k = order[:, j]
            diff = centers[rows, m] - centers[rows, k]
            dist2 = np.einsum("ij,ijk,ik->i", diff, hess[rows, k], diff)
            dup = (dist2 < same ** 2) & np.isfinite(logh[rows, k])
            logh[rows[dup], m[dup]] = -np.inf
    logh[mass < mass.max(axis=1, keepdims=True) - prune] = -np.inf
    if prior is not None:
        centers = np.concatenate([centers, prior[0][:, None]], axis=1)
        hess = np.concatenate([hess, prior[1][:, None]], axis=1)
        logh = np.concatenate([logh, logh.max(axis=1, keepdims=True) - floor], axis=1)
    cov = np.linalg.inv(hess) * inflate ** 2
    cov = 0.5 * (cov + np.swapaxes(cov, -1, -2))
    w = np.linalg.eigvalsh(cov)
    stiff = w[..., 0] <= 1e-15 * w[..., -1]         # a curvature ≳ 1e15× the others (e.g. Δ → 0 at the
    if stiff.any():                                 # softmax edge): its rounding leaves cov not PD
        w, U = np.linalg.eigh(cov[stiff])
        w = np.maximum(w, 1e-15 * w[..., -1:])
        cov[stiff] = np.einsum("...ij,...j,...kj->...ik", U, w, U)
    A = np.linalg.cholesky(cov)
    return centers, hess, A, logh
