"""Matrix denoising for the prior part of state evolution (AIM.md §3).

S = √ρ · MP(1/ρ) (atom 1 - ρ at 0 when ρ < 1), Y = S + √Δ Z with Z a GOE of semicircle variance 1.
The Stieltjes transform G(z) = ∫ μ(t)/(z - t) dt of the law of Y solves

    Δ G³ - (z + √ρ Δ) G² + (√ρ z + 1 - ρ) G - √ρ = 0,

equivalently z = ΔG + 1/G - ρ/(G - √ρ) (R-transforms add).  The density is μ(x) = Im G(x - i0⁺)/π
(the root with positive imaginary part).  The band edges are the values z(G*) at the real critical
points of that inverse, ΔG⁴ - 2√ρΔG³ + (ρΔ + ρ - 1)G² + 2√ρ G - ρ = 0, which are the real zeros of
the cubic's discriminant in z (one band or two).

On the support the posterior mean of an eigenvalue of S is the RIE
ξ(λ) = λ - 2Δ Re G(λ) = ρ^{3/2}/|G - √ρ|², and its posterior variance is ρΔ|G|²/|G - √ρ|², so

    mmse(Δ) = Δ - (4π²/3) Δ² ∫ μ³ = ρΔ ∫ μ(x) |G(x)|² / |G(x) - √ρ|² dx.

The second form (a sum of positive terms, derived from the first with the curve equation
Im z(G) = 0) is what is integrated: no cancellation for Δ → 0 or Δ → ∞.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

_GL = {n: np.polynomial.legendre.leggauss(n) for n in (10, 20)}


def _check(rho: float, delta: float) -> tuple[float, float]:
    rho, delta = float(rho), float(delta)
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a finite number > 0, got {rho}")
    if not (np.isfinite(delta) and delta > 0):
        raise ValueError(f"delta must be a finite number > 0, got {delta}")
    return rho, delta


def _cubic_roots(x: np.ndarray, rho: float, delta: float) -> np.ndarray:
    """The three roots G of the cubic at real z = x, shape (n, 3), Newton-polished."""
    a = np.sqrt(rho)
    x = np.asarray(x, dtype=float).ravel()
    c2 = -(x / delta + a)                      # monic: G³ + c2 G² + c1 G + c0
    c1 = (a * x + 1 - rho) / delta
    c0 = np.full_like(x, -a / delta)
    comp = np.zeros((x.size, 3, 3))
    comp[:, 0, :] = -np.stack([c2, c1, c0], axis=1)
    comp[:, 1, 0] = comp[:, 2, 1] = 1.0
    G = np.linalg.eigvals(comp)
    for _ in range(2):
        p = ((G + c2[:, None]) * G + c1[:, None]) * G + c0[:, None]
        dp = (3 * G + 2 * c2[:, None]) * G + c1[:, None]
        step = np.where(dp != 0, p / np.where(dp != 0, dp, 1), 0)
        G = G - step
    return G


def _physical(x: np.ndarray, rho: float, delta: float) -> np.ndarray:
    """G(x - i0⁺) on the support: the root with the largest imaginary part (real outside)."""
    G = _cubic_roots(x, rho, delta)
    return G[np.arange(G.shape[0]), np.argmax(G.imag, axis=1)]


def _inverse(G, rho: float, delta: float):
    """z(G) = ΔG + 1/G - ρ/(G - √ρ)."""
    return delta * G + 1 / G - rho / (G - np.sqrt(rho))


def _critical_points(rho: float, delta: float) -> np.ndarray:
    """Real G* with z'(G*) = 0, sorted by z(G*), Newton-polished."""
    a = np.sqrt(rho)
    coef = np.array([delta, -2 * a * delta, rho * delta + rho - 1, 2 * a, -rho])
    roots = np.roots(coef)
    G = roots[np.abs(roots.imag) <= 1e-7 * np.maximum(1, np.abs(roots))].real
    dcoef = np.polyder(coef)
    for _ in range(3):
        d = np.polyval(dcoef, G)
        G = G - np.where(d != 0, np.polyval(coef, G) / np.where(d != 0, d, 1), 0)
    G = G[(G != 0) & (G != a)]
    return G[np.argsort(_inverse(G, rho, delta))]


def _adaptive(f, lo: float, hi: float, tol: float, max_levels: int = 40) -> np.ndarray:
    """∫_lo^hi f, f vector-valued (f(x) has shape (m, len(x))): Gauss–Legendre panels, a panel is
    halved while its 10- and 20-point rules differ by more than tol × total × max(its share of the
    interval, 1e-3) (the floor keeps round-off in tiny panels from forcing endless halving)."""
    panels = np.array([[lo, hi]])
    total = None
    done = 0.0
    for _ in range(max_levels):
        c = panels.mean(axis=1)[:, None]
        h = (panels[:, 1] - panels[:, 0])[:, None] / 2
        est = {}
        for n, (t, w) in _GL.items():
            vals = f((c + h * t).ravel()).reshape(-1, *c.shape[:1], n)
            est[n] = (vals * w).sum(axis=-1) * h[:, 0]
        err = np.abs(est[20] - est[10]).max(axis=0)
        if total is None:
            total = est[20].sum(axis=1)
        scale = np.maximum(np.abs(total).max(), 1e-300)
        ok = err <= tol * scale * np.maximum(2 * h[:, 0] / (hi - lo), 1e-3)
        done = done + est[20][:, ok].sum(axis=1)
        total = done + est[20][:, ~ok].sum(axis=1)
        if ok.all():
            return done
        bad = panels[~ok]
        mid = bad.mean(axis=1)
        panels = np.concatenate([np.stack([bad[:, 0], mid], 1), np.stack([mid, bad[:, 1]], 1)])
    raise RuntimeError(f"free convolution quadrature did not reach tol={tol} in {max_levels} levels")


@dataclass
class FreeConvolution:
    """The law of S + √Δ Z: `bands` (k, 2) with k = 1 or 2, `density(x)`, `rie(λ)`, `mmse`."""
    rho: float
    delta: float
    tol: float = 1e-12
    bands: np.ndarray = field(init=False)
    _edge_G: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.rho, self.delta = _check(self.rho, self.delta)
        G = _critical_points(self.rho, self.delta)
        z = _inverse(G, self.rho, self.delta)
        mids = (z[:-1] + z[1:]) / 2
        inside = (_physical(mids, self.rho, self.delta).imag > 0) if mids.size else np.zeros(0, bool)
        bands, edge_G, start = [], [], None
        for i, inn in enumerate(inside):          # merge consecutive in-support intervals
            if inn and start is None:
                start = i
            if start is not None and (not inn or i == len(inside) - 1):
                end = i + 1 if inn else i
                bands.append((z[start], z[end]))
                edge_G.append((G[start], G[end]))
                start = None
        if not bands:
            raise RuntimeError(f"no band found for rho={self.rho}, delta={self.delta}")
        self.bands, self._edge_G = np.array(bands), np.array(edge_G)

    def stieltjes(self, x) -> np.ndarray:
        """G(x - i0⁺) (root of the cubic with the largest imaginary part)."""
        x = np.asarray(x, dtype=float)
        return _physical(x, self.rho, self.delta).reshape(x.shape)

    def density(self, x) -> np.ndarray:
        """μ(x) = Im G(x - i0⁺)/π, zero outside the bands."""
        x = np.asarray(x, dtype=float)
        return np.maximum(self.stieltjes(x).imag, 0) / np.pi * self._in_support(x)

    def _in_support(self, x):
        return ((x[..., None] >= self.bands[:, 0]) & (x[..., None] <= self.bands[:, 1])).any(-1)

    def rie(self, eigenvalues) -> np.ndarray:
        """ξ(λ) = ρ^{3/2}/|G(λ) - √ρ|² (= λ - 2Δ Re G(λ)); λ outside the support is moved to the
        nearest band edge, where G is the critical point G* itself."""
        lam = np.asarray(eigenvalues, dtype=float)
        a = np.sqrt(self.rho)
        G = self.stieltjes(lam)
        edges, edge_G = self.bands.ravel(), self._edge_G.ravel()
        nearest = np.abs(lam[..., None] - edges).argmin(-1)
        G = np.where(self._in_support(lam), G, edge_G[nearest])
        return self.rho * a / np.abs(G - a) ** 2

    def _integrals(self, x):
        """Rows: μ, μ|G|²/|G-√ρ|², μ³ at the points x."""
        G = self.stieltjes(x)
        mu = np.maximum(G.imag, 0) / np.pi
        return np.stack([mu, mu * np.abs(G) ** 2 / np.abs(G - np.sqrt(self.rho)) ** 2, mu ** 3])

    @cached_property
    def _moments(self) -> np.ndarray:
        total = np.zeros(3)
        for lo, hi in self.bands:                 # x = mid - half·cos θ: the √ edges become smooth
            mid, half = (lo + hi) / 2, (hi - lo) / 2
            f = lambda th: self._integrals(mid - half * np.cos(th)) * (half * np.sin(th))
            total += _adaptive(f, 0.0, np.pi, self.tol)
        return total

    @property
    def mass(self) -> float:
        """∫ μ (= 1 up to the quadrature tolerance)."""
        return float(self._moments[0])

    @property
    def cube_integral(self) -> float:
        """∫ μ³."""
        return float(self._moments[2])

    @property
    def mmse(self) -> float:
        """ρΔ ∫ μ |G|²/|G - √ρ|² (= Δ - (4π²/3)Δ²∫μ³)."""
        if abs(self.mass - 1) > 1e-6:
            raise RuntimeError(f"free convolution density integrates to {self.mass} (rho={self.rho}, "
                               f"delta={self.delta}): band detection failed")
        return float(self.rho * self.delta * self._moments[1])

    def to_dict(self) -> dict:
        return {"rho": self.rho, "delta": self.delta, "bands": self.bands.tolist(),
                "mass": self.mass, "mmse": self.mmse}


def aim_free_convolution(rho: float, delta: float, tol: float = 1e-12) -> FreeConvolution:
    """The spectral law of S + √Δ Z (AIM.md §3): bands, density, RIE and mmse(Δ)."""
    return FreeConvolution(rho, delta, tol)


def mmse(rho: float, delta: float, tol: float = 1e-12) -> float:
    """mmse(Δ) of denoising S from S + √Δ Z, per d (E‖S - Ŝ‖²_F/d)."""
    return FreeConvolution(rho, delta, tol).mmse
