"""Output channels of the effective scalar problem (AIM.md §2, §4), over the upper-triangle
indices pairs(T) of the symmetric T×T h: ω_ab ~ N(0, (1+δ_ab) q), h_ab = ω_ab + √((1+δ_ab)V) ξ_ab.

Each channel gives `fisher(q, V)` = E_{ω,y}[Σ_{a≤b} (1+δ_ab) g_ab²] (so q̂ = 2α·fisher) and, for
data, `g_out(y, omega, V)` = ∂ log Z_out/∂ω (n, T(T+1)/2).

- softmax / linear: noiseless linear channels seeing all of h but the null directions derived in
  derive/aim.py (the common shift for softmax, nothing for linear): fisher = K/V.
- hardmax, T = 2: Z_out = Φ₂(κ₁, κ₂; s₁s₂/3); g from derive.aim.hardmax2 (chain rule through the
  ratios R_i = ∂_iΦ₂/Φ₂, evaluated in log space); fisher by a deterministic 2D quadrature.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import sympy as sp

from derive import aim as sym

from .bvn import log_bvn, log_bvn_partials

CHANNELS = ("softmax", "hardmax", "linear")
N_IN, N_OUT = 48, 24       # Gauss–Legendre nodes of the hardmax quadrature (inner / outer panels)


def check_tokens(tokens) -> int:
    if int(tokens) != tokens or tokens < 2:
        raise ValueError(f"tokens must be an integer ≥ 2, got {tokens}")
    return int(tokens)


def pair_weights(T: int) -> np.ndarray:
    """1 + δ_ab over pairs(T)."""
    return np.array([1.0 + (a == b) for a, b in sym.pairs(T)])


class LinearChannel:
    """y observes h up to the null directions N (rows over pairs(T)); K = T(T+1)/2 - rank N."""

    def __init__(self, name: str, tokens: int, beta: float = 1.0):
        self.name, self.tokens, self.beta = name, check_tokens(tokens), float(beta)
        if not (np.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {beta}")
        if name == "softmax":
            self.rank, null = sym.softmax_rank(self.tokens)
        else:
            self.rank, null = sym.linear_rank(self.tokens), ()
        self.null = np.array(null, dtype=float).reshape(-1, len(sym.pairs(self.tokens)))

    def fisher(self, q: float, V: float) -> float:
        """K/V."""
        return self.rank / V

    def preimage(self, y: np.ndarray) -> np.ndarray:
        """An h (over pairs) with g(h) = y: y itself (linear); for softmax
        h_ab = l_ab + l_Ta with l_ab = log(y_ab/y_aT)/β (h_TT = 0; h is defined up to the shift)."""
        T = self.tokens
        if self.name == "linear":
            return np.stack([y[:, a, b] for a, b in sym.pairs(T)], axis=1)
        if not np.all(y > 0):
            raise ValueError("y must be softmax outputs with every entry > 0 (an entry underflowed to 0)")
        l = (np.log(y) - np.log(y[:, :, T - 1:])) / self.beta
        return np.stack([l[:, a, b] + l[:, T - 1, a] for a, b in sym.pairs(T)], axis=1)

    def g_out(self, y: np.ndarray, omega: np.ndarray, V: float) -> np.ndarray:
        """C⁻¹(E[h|y] - ω) with C = V diag(1+δ) and E[h|y] = h_pre + N t*, t* minimising the
        Gaussian energy along the null directions."""
        C_inv = 1 / (V * pair_weights(self.tokens))
        r = self.preimage(y) - omega
        if self.null.size:
            N = self.null
            M = (N * C_inv) @ N.T
            t = -np.linalg.solve(M, (N * C_inv) @ r.T).T     # minimises (r + tN)ᵀC⁻¹(r + tN)
            r = r + t @ N
        return r * C_inv


@lru_cache(maxsize=None)
def _hardmax2_fns():
    h = sym.hardmax2()
    args = (*h["R"], *h["s"], h["V"])
    g = sp.lambdify(args, [h["g"][p] for p in sym.pairs(2)], "numpy")
    fisher = sp.lambdify(args, h["fisher"], "numpy")
    return g, fisher


def _hardmax2_ratios(u1, u2, s1, s2, V):
    """log Φ₂ and R_i = ∂_iΦ₂/Φ₂ at κ_i = s_i u_i/√(3V), r = s₁s₂/3."""
    k1, k2 = s1 * u1 / np.sqrt(3 * V), s2 * u2 / np.sqrt(3 * V)
    r = s1 * s2 / 3.0
    logz = log_bvn(k1, k2, r)
    l1, l2 = log_bvn_partials(k1, k2, r)
    return logz, np.exp(l1 - logz), np.exp(l2 - logz)


def _grid_1d(L: float, b: float, n_in: int = N_IN, n_out: int = N_OUT):
    """Nodes and weights on [-L, L] (Lebesgue measure), refined on [-b, b] where the integrand
    varies on the scale of the noise."""
    def gl(lo, hi, n):
        t, w = np.polynomial.legendre.leggauss(n)
        return (lo + hi) / 2 + (hi - lo) / 2 * t, (hi - lo) / 2 * w
    parts = [gl(-L, L, n_in)] if b >= L else [gl(-L, -b, n_out), gl(-b, b, n_in), gl(b, L, n_out)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class Hardmax2Channel:
    """Row-wise hardmax of a T = 2 attention index: y₀₀ = 1{h₀₀ > h₀₁}, y₁₁ = 1{h₁₁ > h₀₁}."""
    name, tokens, rank = "hardmax", 2, None

    def g_out(self, y: np.ndarray, omega: np.ndarray, V: float) -> np.ndarray:
        """g over pairs (00, 01, 11) for one-hot rows y (n, 2, 2)."""
        s1 = np.where(y[:, 0, 0] > 0.5, 1.0, -1.0)
        s2 = np.where(y[:, 1, 1] > 0.5, 1.0, -1.0)
        u1, u2 = omega[:, 0] - omega[:, 1], omega[:, 2] - omega[:, 1]
        _, R1, R2 = _hardmax2_ratios(u1, u2, s1, s2, V)
        g, _ = _hardmax2_fns()
        return np.stack(np.broadcast_arrays(*g(R1, R2, s1, s2, V)), axis=1)

    def log_z(self, y, omega, V):
        s1 = np.where(y[:, 0, 0] > 0.5, 1.0, -1.0)
        s2 = np.where(y[:, 1, 1] > 0.5, 1.0, -1.0)
        return _hardmax2_ratios(omega[:, 0] - omega[:, 1], omega[:, 2] - omega[:, 1], s1, s2, V)[0]

    def fisher(self, q: float, V: float) -> float:
        """Σ_y ∫ N(u; 0, qC) Φ₂ Σ(1+δ)g² du over u = (ω₀₀ - ω₀₁, ω₁₁ - ω₀₁), C = [[3, 1], [1, 3]];
        the outputs -s give the same integral as s (u ↦ -u), so s ∈ {(+,+), (+,-)} counted twice."""
        _, fisher = _hardmax2_fns()
        if q <= 0:
            u1 = u2 = np.zeros(1)
            w = np.ones(1)
        else:
            x, wx = _grid_1d(9 * np.sqrt(3 * q), 10 * np.sqrt(3 * V))
            u1, u2 = (a.ravel() for a in np.meshgrid(x, x, indexing="ij"))
            w = np.outer(wx, wx).ravel()
            quad = (3 * u1 ** 2 - 2 * u1 * u2 + 3 * u2 ** 2) / (16 * q)     # uᵀ(qC)⁻¹u/2
            w = w * np.exp(-quad) / (2 * np.pi * np.sqrt(8) * q)
        total = 0.0
        for s1, s2 in ((1.0, 1.0), (1.0, -1.0)):
            k = np.minimum(s1 * u1, s2 * u2) / np.sqrt(3 * V)
            keep = k > -12        # Φ₂ ≤ Φ(min κ) < e^-75 elsewhere: the terms vanish in double
            logz, R1, R2 = _hardmax2_ratios(u1[keep], u2[keep], s1, s2, V)
            total += 2 * np.sum(w[keep] * np.exp(logz) * fisher(R1, R2, s1, s2, V))
        return float(total)


def make_channel(channel: str, tokens: int, beta: float = 1.0):
    """The channel object for 'softmax' | 'linear' | 'hardmax' (hardmax: tokens = 2)."""
    tokens = check_tokens(tokens)
    if channel in ("softmax", "linear"):
        return LinearChannel(channel, tokens, beta)
    if channel == "hardmax":
        if tokens != 2:
            raise ValueError(f"channel 'hardmax' is implemented for tokens = 2 only, got {tokens}")
        return Hardmax2Channel()
    raise ValueError(f"channel must be one of {', '.join(CHANNELS)}, got {channel!r}")
