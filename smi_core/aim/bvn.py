"""log Φ₂(h, k; r), the bivariate normal CDF P(X < h, Y < k) with correlation r, vectorised and
accurate in relative terms in the tails.

- min(h, k) ≥ -3: Φ₂ = Φ(h)Φ(k) + (1/2π) ∫₀^{asin r} exp(-(h² - 2hk sin θ + k²)/(2cos²θ)) dθ
  (Sheppard/Drezner), 24-point Gauss–Legendre in θ; Φ₂ ≥ ~1e-6 there, so no cancellation.
- otherwise, with h ≤ k: Φ₂ = ∫_{-∞}^h φ(x) Φ((k - rx)/√(1-r²)) dx; the log-integrand L is concave
  and increasing up to h, so with c = L'(h) > 0, Φ₂ = e^{L(h)}/c ∫₀^∞ e^{-s} e^{L(h - s/c) - L(h) + s} ds
  by 24-point Gauss–Laguerre, all in log space.
"""
from __future__ import annotations

import numpy as np
from scipy.special import log_ndtr, logsumexp, ndtr

_LEG = np.polynomial.legendre.leggauss(24)
_LAG = np.polynomial.laguerre.laggauss(24)
_LOG_SQRT_2PI = 0.5 * np.log(2 * np.pi)


def _log_phi(x):
    return -0.5 * x * x - _LOG_SQRT_2PI


def log_bvn(h, k, r) -> np.ndarray:
    """log Φ₂(h, k; r) elementwise (|r| < 1)."""
    h, k, r = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (h, k, r)))
    lo, hi = np.minimum(h, k), np.maximum(h, k)
    out = np.empty(h.shape)
    core = lo >= -3
    if core.any():
        out[core] = _log_core(lo[core], hi[core], r[core])
    if (~core).any():
        out[~core] = _log_tail(lo[~core], hi[~core], r[~core])
    return out


def _log_core(h, k, r):
    t, w = _LEG
    asr = np.arcsin(r)[:, None]
    s = np.sin(asr * (t + 1) / 2)
    expo = (h[:, None] * k[:, None] * s - (h[:, None] ** 2 + k[:, None] ** 2) / 2) / (1 - s * s)
    integral = (np.exp(expo) * w).sum(axis=1) * asr[:, 0] / 2 / (2 * np.pi)
    return np.log(ndtr(h) * ndtr(k) + integral)


def _log_tail(h, k, r):
    sig = np.sqrt(1 - r * r)
    L = lambda x: _log_phi(x) + log_ndtr((k[:, None] - r[:, None] * x) / sig[:, None])
    arg = (k - r * h) / sig
    c = -h - r / sig * np.exp(_log_phi(arg) - log_ndtr(arg))
    s, w = _LAG
    Lh = L(h[:, None])
    vals = L(h[:, None] - s / c[:, None]) - Lh + s
    return Lh[:, 0] - np.log(c) + logsumexp(vals, b=w, axis=1)


def log_bvn_partials(h, k, r) -> tuple[np.ndarray, np.ndarray]:
    """log ∂Φ₂/∂h = log φ(h) + log Φ((k - rh)/√(1-r²)), and the twin for k."""
    sig = np.sqrt(1 - np.asarray(r) ** 2)
    return (_log_phi(h) + log_ndtr((k - r * h) / sig), _log_phi(k) + log_ndtr((h - r * k) / sig))
