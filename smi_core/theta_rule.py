"""Two layers, T = 2, the first layer not learned — ω_1 = 0, V₁₁ = v_1, V₁₂ = 0 (state evolution
at q₁₁ = 0, the plateau before layer 1 is learned): one product rule in layer 1's attention
weights θ = (p, r) shared by every sample.

The likelihood depends on h_1 only through θ = σ(βa), a = (h_11(h_11 − h_12), h_12(h_12 − h_11))
(spec §2), and per sign of u_2 it is N(±u_2; Φω_2, V₂₂ΦΦᵀ) with Φ = cI + A(θ): Φω_2 is affine in
θ, so the likelihood is a smooth function of θ, close to a Gaussian of sd ≈ √V₂₂‖Φ‖/|ω_21 − ω_22|.
With ω_1 = 0 the prior's pushforward ρ(θ) (the law of θ under h_1 ~ N(0, v_1 I)) is the same for
every sample, and singular: ∝ 1/|a| at θ = (½, ½) (the image of the whole fold h_11 = h_12),
a 1/√(a_1 + a_2) layer along the wedge's edge p + r = 1, power laws at θ_t → 0, 1.  A product
rule for ρ absorbs all of that into its weights (product integration):

    ∫ρ(θ) f(θ) dθ ≈ Σ_i w_i f(θ_i),    w_i = ∫ρ ℓ_i,

exact for f a polynomial in (p, v) of degree < n per axis, v = (p + r − 1)/p ∈ [0, 1] (the
wedge p + r ≥ 1 as a square: a polynomial in θ of total degree < n is one in (p, v) of degree
< n per axis); θ_i the n × n Chebyshev points (first kind) in (p, v), ℓ_i their Lagrange
polynomials.  Layer 1's posterior moments come the same way: E[h_1 | θ] = 0 (h_1 and −h_1 have
the same θ) and E[h_1 h_1ᵀ | θ] = h hᵀ with h = (a_1, −a_2)/√(a_1 + a_2), a singular function of θ
that goes into weights of its own, w_i^(ab) = ∫ρ x_a x_b ℓ_i.  All the weights follow from the
Chebyshev moments μ_jk = E[T_j(2p − 1) T_k(2v − 1) (1, x_1², x_1x_2, x_2²)] (``moments``, once per
βv_1: x ~ N(0, I), h_1 = √v_1 x), computed in (d, m) = (x_1 − x_2, (x_1 + x_2)/2), where the
prior is Gaussian and a = (d²/2 + md, d²/2 − md) smooth: Gauss–Legendre in d on panels graded ×2
towards 0 and per d node in m on panels cut at the softmax's cliffs m = ∓d/2 (graded ×2 in units
of 1/(βd)) and at the prior's walls.

Error estimate: the same nodes with the truncated weights, exact only below degree n − DROP per
axis (the interpolant's top coefficients dropped); the difference measures the top of the
likelihood's Chebyshev series, which falls off like a Gaussian's once n·sd is large.
"""
from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from .quadrature import gauss_legendre

DROP = 2                        # the truncated rule: degree < n − DROP per axis
DEGREES = (81, 121)             # the moments' tables, each up to its degree: a level n reads the first ≥ n
                                # (121 only once a sample reaches that level: ≈ 21 s per b, 7 s at 81)
REACH = 40.0                    # the prior (∝ e^(−d²/4 − m²)) where it is above e^−REACH
CLIFFS = 0.125 * 2.0 ** (np.arange(37) / 4)   # m panels from the cliffs, in units of 1/(βd)
STEP = 0.125                    # d panels beyond the graded ones
NODES = 16                      # Gauss–Legendre nodes per panel of the moments' rule


def _panels(ends, n):
    """Gauss–Legendre with n nodes on every panel between consecutive ends: (nodes, weights)."""
    t, w = gauss_legendre(n)
    half, mid = np.diff(ends)[:, None] / 2, (ends[1:] + ends[:-1])[:, None] / 2
    return (mid + half * t).ravel(), (half * w).ravel()


def _chebyshev(x, n):
    """T_0 … T_{n−1} at x, by rows (n, len(x))."""
    T = np.empty((n, len(x)))
    T[0] = 1.0
    if n > 1:
        T[1] = x
    for k in range(2, n):
        np.multiply(2 * x, T[k - 1], out=T[k])
        T[k] -= T[k - 2]
    return T


def _attention(d, m, b):
    """p = σ(a_1) and v = (p + r − 1)/p at (d, m), for a = b·(d²/2 + md, d²/2 − md).  With
    σ(x) − σ(−y) = sinh((x + y)/2)/(2 cosh(x/2) cosh(y/2)) and a_1 + a_2 = b d²,
    v = sinh(b d²/2) e^(−a_1/2)/cosh(a_2/2): no cancellation where p is small."""
    a1, a2 = b * d * (m + d / 2), b * d * (d / 2 - m)
    return 0.5 * (1 + np.tanh(a1 / 2)), np.sinh(b * d * d / 2) * np.exp(-a1 / 2) / np.cosh(a2 / 2)


def cache_path(b: float, degree: int | None = None) -> Path:
    """Where ``moments(b, degree)`` is kept between runs (``cache_file``), named by a digest of b
    and the moments' rule."""
    degree = degree or DEGREES[0]
    return cache_file("moments", (degree, REACH, CLIFFS.tolist(), STEP, NODES, float(b)))


def cache_file(kind: str, rule) -> Path:
    """$SMI_CACHE (default ~/.cache/smi, as the kernels compiled on demand) /theta/kind-digest.npy,
    the digest of repr(rule)."""
    root = Path(os.environ.get("SMI_CACHE") or Path.home() / ".cache" / "smi")
    return root / "theta" / f"{kind}-{hashlib.sha256(repr(rule).encode()).hexdigest()[:16]}.npy"


def cached(path: Path, shape, compute, what: str) -> np.ndarray:
    """The array at ``path`` if it has ``shape``; else compute() (announcing ``what`` on stderr),
    written there atomically when the folder can be made."""
    try:
        mu = np.load(path)
        if mu.shape == tuple(shape):
            return mu
    except (OSError, ValueError):
        pass
    print(f"smi: {what} (once: cached in {path.parent})", file=sys.stderr)
    mu = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, mu)
        os.replace(tmp, path)
    except OSError:
        pass
    return mu


@lru_cache(maxsize=8)
def moments(b: float, degree: int | None = None) -> np.ndarray:
    """μ (4, D, D), D = degree (default DEGREES[0]): E[T_j(2p − 1) T_k(2v − 1) f(x)], f = 1, x_1²,
    x_1x_2, x_2², for x ~ N(0, I) and θ = σ(b·a(x)) (b = βv_1).  ≈ 7 s per b at 81; read from
    ``cache_path(b, degree)`` where an earlier run left it."""
    degree = degree or DEGREES[0]
    return cached(cache_path(b, degree), (4, degree, degree), lambda: _moments(b, degree=degree),
                  f"the θ rule's weights for βV₁₁ = {b:g} to degree {degree}")


def _moments(b, S=None, degree=None, nodes=NODES):
    """``moments`` computed, for x ~ N(0, S) (default I): in (d, m), d ~ N(0, s_d²) and m | d ~
    N(κd, τ²), panels from 0 in d graded ×2 then STEP in units of s_d/√2, and per d node in m cut
    at the softmax's cliffs and at every sd τ of m | d (the walls), where the prior is above
    e^−REACH.  Degree: DEGREES[0] unless given."""
    S = np.eye(2) if S is None else np.asarray(S, dtype=float)
    degree = degree or DEGREES[0]
    vd, vm, cdm = S[0, 0] + S[1, 1] - 2 * S[0, 1], (S[0, 0] + S[1, 1] + 2 * S[0, 1]) / 4, (S[0, 0] - S[1, 1]) / 2
    kappa, tau, unit = cdm / vd, np.sqrt(vm - cdm * cdm / vd), np.sqrt(vd / 2)
    dmax = unit * np.sqrt(4 * REACH)
    ends = unit * np.concatenate([[0.0], 1e-4 * 2.0 ** np.arange(14), np.arange(STEP, dmax / unit, STEP)])
    D, WD = _panels(np.unique(np.append(ends[ends <= dmax], dmax)), nodes)
    cliffs = np.concatenate([-CLIFFS[::-1], [0.0], CLIFFS])
    mu = np.zeros((4, degree, degree))
    for d, wd in zip(D, WD):
        centre, half = kappa * d, tau * np.sqrt(max(2 * REACH - d * d / vd, 0.0))
        cuts = np.concatenate([-d / 2 + cliffs / (b * d), d / 2 + cliffs / (b * d), centre + tau * np.arange(-9, 10)])
        ends_m = np.concatenate([[centre - half, centre + half], cuts[np.abs(cuts - centre) < half]])
        M, WM = _panels(np.unique(ends_m), nodes)
        prior = 2 * wd * WM * np.exp(-d * d / (2 * vd) - (M - centre) ** 2 / (2 * tau * tau)) / (2 * np.pi * np.sqrt(vd) * tau)
        p, v = _attention(d, M, b)
        Tp, Tv = _chebyshev(2 * p - 1, degree), _chebyshev(2 * v - 1, degree)
        x1, x2 = M + d / 2, M - d / 2
        f = prior * np.stack([np.ones_like(M), x1 * x1, x1 * x2, x2 * x2])          # (4, m nodes); d < 0 by x → −x
        mu += (f[:, None, :] * Tp) @ Tv.T
    return mu


def points(n):
    """The Chebyshev points of the first kind on (0, 1), ascending, and C (n × n): the
    interpolant's Chebyshev coefficients (in 2x − 1) from its values there."""
    t = np.pi * (np.arange(n)[::-1] + 0.5) / n
    C = 2.0 / n * np.cos(np.outer(np.arange(n), t))
    C[0] /= 2
    return (1 + np.cos(t)) / 2, C


@lru_cache(maxsize=32)
def weights(b: float, n: int) -> np.ndarray:
    """(8, n²) weights on the n × n grid (node i·n + j at (p_i, v_j)): [w, w_11, w_12, w_22] of the
    full rule, then of the truncated one (degree < n − DROP per axis)."""
    degree = next((d for d in DEGREES if d >= n), None)
    if degree is None:
        raise ValueError(f"n must be at most DEGREES[-1] = {DEGREES[-1]}, got {n}")
    return weights_of(moments(b, degree), n)


def weights_of(mu, n):
    """``weights`` from Chebyshev moments mu (…, 4, ≥ n, ≥ n) of any prior's pushforward (any
    leading axes: one set of weights (…, 8, n²) per prior)."""
    C = points(n)[1]
    mu = mu[..., :n, :n]
    keep = (np.arange(n) < n - DROP).astype(float)
    full = C.T @ mu @ C                                     # Σ_jl μ_jl C_ja C_lb
    cut = C.T @ (mu * np.outer(keep, keep)) @ C
    return np.ascontiguousarray(np.concatenate([full, cut], axis=-3).reshape(*mu.shape[:-3], 8, n * n))


def grid(n, beta):
    """h_1 (2, n²) at the grid's nodes: a pre-image of θ = (p, r), r = 1 − p + p v, by the
    one-layer pre-image h = (a_1, −a_2)/√(a_1 + a_2), a = logit(θ)/β (spec §4), with
    1 − r = p(1 − v) and a_1 + a_2 = log(1 + v/((1 − p)(1 − v)))/β (no cancellation)."""
    x = points(n)[0]
    p, v = np.repeat(x, n), np.tile(x, n)
    a1 = np.log(p / (1 - p)) / beta
    a2 = np.log((1 - p + p * v) / (p * (1 - v))) / beta
    s = np.sqrt(np.log1p(v / ((1 - p) * (1 - v))) / beta)
    return np.stack([a1 / s, -a2 / s])


def sums(out, s, omega, priors, v):
    """(log Z, E[Z − ω], E[(Z − ω)(Z − ω)ᵀ]) of weight set s (0: full, 1: truncated) from
    ``_quadrature.theta_product``'s rows ``out`` (ω_ℓ = 0 before the last layer; Z = [h_1; …; h_L],
    index a*T + t; ``omega`` ω_L, ``v`` V_LL, ``priors`` V_ℓℓ of the earlier layers, whose
    h_ℓ h_ℓᵀ weights are three rows each): the larger sign's deviation y = ±h_L − ω_L weighs e,
    the other's −y − 2ω_L e·q, so E[h_L − ω_L] = (Σ e y − Σ e q y − 2ω_L Σ e q)/Z and the second
    moment adds 2(Σ e q y)ω_Lᵀ + 2ω_L(Σ e q y)ᵀ + 4ω_Lω_Lᵀ Σ e q to Σ e(1 + q) y yᵀ;
    E[h_ℓ h_ℓᵀ] = V_ℓℓ Σ w_ab e(1 + q)/Z; log Z adds the running maximum and N(·; ω_L, v I)'s
    −log(2π v)."""
    n, L = len(out), len(priors) + 1
    width = 9 + 3 * (L - 1)
    cols = out[:, 1 + width * s:1 + width * (s + 1)].T
    z, zq, m0, m1, q0, q1, s00, s01, s11 = cols[:9]
    q = np.stack([q0, q1], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean, second = np.zeros((n, 2 * L)), np.zeros((n, 2 * L, 2 * L))
        mean[:, -2:] = (np.stack([m0, m1], axis=1) - q - 2 * omega * zq[:, None]) / z[:, None]
        S = np.stack([np.stack([s00, s01], axis=1), np.stack([s01, s11], axis=1)], axis=1)
        S += 2 * (q[:, :, None] * omega[:, None, :] + omega[:, :, None] * q[:, None, :])
        S += 4 * zq[:, None, None] * omega[:, :, None] * omega[:, None, :]
        second[:, -2:, -2:] = S / z[:, None, None]
        for l, vl in enumerate(priors):
            a, b, c = cols[9 + 3 * l:12 + 3 * l]
            second[:, 2 * l:2 * l + 2, 2 * l:2 * l + 2] = vl * np.stack([np.stack([a, b], 1), np.stack([b, c], 1)], 1) / z[:, None, None]
        log_z = np.log(z) + out[:, 0] - np.log(2 * np.pi * v)
    return log_z, mean, second
