"""Output channels of the effective scalar problem (AIM.md §2, §4), over the upper-triangle
indices pairs(T) of the symmetric T×T h: ω_ab ~ N(0, (1+δ_ab) q), h_ab = ω_ab + √((1+δ_ab)V) ξ_ab.

Each channel gives `fisher(q, V)` = E_{ω,y}[Σ_{a≤b} (1+δ_ab) g_ab²] (so q̂ = 2α·fisher) and, for
data, `g_out(y, omega, V)` = ∂ log Z_out/∂ω (n, T(T+1)/2).

- softmax / linear: noiseless linear channels seeing all of h but the null directions derived in
  derive/aim.py (the common shift for softmax, nothing for linear): fisher = K/V.
- hardmax, T = 2: Z_out = Φ₂(κ₁, κ₂; s₁s₂/3); g from derive.aim.hardmax2 (chain rule through the
  ratios R_i = ∂_iΦ₂/Φ₂, evaluated in log space); fisher by a deterministic 2D quadrature.
- hardmax, any T: Z_out = P(C_y h > 0), the Gaussian probability of the cone of output y
  (derive.aim.hardmax_cone), and g = (E[h | y, ω] - ω)/(V(1+δ)) = E[ξ | cone]/√((1+δ)V)
  (Stein), both by randomised QMC (orthant.py); fisher = (1/V) Σ_y E_ω[Z_y |E[ξ | cone_y]|²] with
  the sum over outputs up to relabelling of the tokens, and QMC over ω.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import permutations, product

import numpy as np
from scipy.special import ndtri

from codegen import expressions_twin
from derive import aim as sym

from ..quadrature import gauss_legendre
from .bvn import log_bvn, log_bvn_partials
from .orthant import Cone, sobol

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
    """derive.aim.hardmax2's g_ab (over ``pairs(2)``) and Σ (1+δ_ab) g_ab² as NumPy functions of
    (R1, R2, s1, s2, V)."""
    h = sym.hardmax2()
    args = (*h["R"], *h["s"], h["V"])
    return (expressions_twin(args, [h["g"][p] for p in sym.pairs(2)]), expressions_twin(args, h["fisher"]))


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
        t, w = gauss_legendre(n)
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


def output_classes(T: int) -> list[tuple[tuple[int, ...], int]]:
    """Hardmax outputs (winner of each row) up to a relabelling π of the tokens
    (winners'[π(a)] = π(winners[a])), with the size of each class."""
    classes = {}
    for win in product(range(T), repeat=T):
        rep = min(tuple(p[win[p.index(a)]] for a in range(T)) for p in permutations(range(T)))
        classes[rep] = classes.get(rep, 0) + 1
    return sorted(classes.items())


class HardmaxChannel:
    """Row-wise hardmax for any T, by QMC: `n_inner` points per (ω, y) for Z_out and E[ξ | cone];
    in fisher, `n_outer` points over ω, each with its own rotation of `n_fisher` inner points;
    `seed` fixes the scrambling (a deterministic map)."""
    name, rank = "hardmax", None

    def __init__(self, tokens: int, n_inner: int = 256, n_outer: int = 2048, n_fisher: int = 64,
                 seed: int = 0):
        self.tokens, self.seed = check_tokens(tokens), seed
        self.n_inner, self.n_outer, self.n_fisher = n_inner, n_outer, n_fisher
        self.w = pair_weights(self.tokens)

    @lru_cache(maxsize=None)
    def cone(self, winners: tuple[int, ...]) -> Cone:
        return Cone(np.array(sym.hardmax_cone(self.tokens, winners), float), self.w)

    @lru_cache(maxsize=None)
    def points(self, dim: int, n: int, shifts: int = 0) -> np.ndarray:
        return sobol(dim, n, self.seed + 1000 * (shifts > 0), shifts)

    def _moments(self, y, omega, V, chunk: int = 2048):
        """log Z_out (n,) and E[ξ | cone] (n, P), grouped by output."""
        winners = y.argmax(axis=-1)
        logz, exi = np.empty(len(y)), np.empty(omega.shape)
        for win in np.unique(winners, axis=0):
            cone = self.cone(tuple(int(v) for v in win))
            u = self.points(cone.rank, self.n_inner)
            idx = np.flatnonzero((winners == win).all(axis=1))
            for k in range(0, idx.size, chunk):
                part = idx[k:k + chunk]
                logz[part], exi[part] = cone.moments(omega[part], V, u)
        return logz, exi

    def log_z(self, y, omega, V):
        return self._moments(y, omega, V)[0]

    def g_out(self, y: np.ndarray, omega: np.ndarray, V: float) -> np.ndarray:
        """E[ξ | cone_y]/√((1+δ)V) over pairs(T), for one-hot rows y (n, T, T)."""
        return self._moments(y, omega, V)[1] / np.sqrt(self.w * V)

    def fisher(self, q: float, V: float) -> float:
        """(1/V) Σ_classes size · E_ω[Z_y |E[ξ | cone_y]|²], ω = √((1+δ)q) Φ⁻¹(u) over QMC u."""
        if q <= 0:
            omega = np.zeros((1, self.w.size))
        else:
            omega = ndtri(self.points(self.w.size, self.n_outer, 1)[0]) * np.sqrt(self.w * q)
        total = 0.0
        for win, size in output_classes(self.tokens):
            cone = self.cone(win)
            logz, exi = cone.moments(omega, V, self.points(cone.rank, self.n_fisher, len(omega)))
            total += size * np.mean(np.exp(logz) * np.sum(exi ** 2, axis=1))
        return float(total / V)


def make_channel(channel: str, tokens: int, beta: float = 1.0):
    """The channel object for 'softmax' | 'linear' | 'hardmax' (hardmax T = 2: closed form)."""
    tokens = check_tokens(tokens)
    if channel in ("softmax", "linear"):
        return LinearChannel(channel, tokens, beta)
    if channel == "hardmax":
        return Hardmax2Channel() if tokens == 2 else HardmaxChannel(tokens)
    raise ValueError(f"channel must be one of {', '.join(CHANNELS)}, got {channel!r}")
