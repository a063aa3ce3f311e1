"""Closed forms of AIM.md §5.

- Perfect recovery of the noiseless linear channels (softmax, linear), counting d²(ρ - ρ²/2)
  degrees of freedom (d²/2 for ρ ≥ 1) against n·K measurements:
  α_PR = (2ρ - ρ²)/(2K) for ρ ≤ 1, 1/(2K) for ρ ≥ 1, with K = (T² + T - 2)/2 (softmax) or
  T(T + 1)/2 (linear) the rank derived in derive/aim.py.
- Small width, ρ → 0 with α = ᾱρ (units Q0 = 1): the denoising part becomes a rank-ρd spike of
  strength 1/√ρ in noise Δ = 1/q̂, so q = [max(1 - t, 0)]² with t = ρ/q̂ = 1/(ᾱ F(q)) and
  F(q) = 2·fisher(q, 1 - q) of the channel; weak recovery (q = 0 unstable) at ᾱ_c = 1/F(0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from .channels import make_channel
from .state_evolution import aim_state_evolution, check_alpha, check_rho


def aim_perfect_recovery(channel: str = "softmax", tokens: int = 2, rho: float = 0.5,
                         mmse_tol: float | None = None) -> float:
    """α_PR = (2ρ - ρ²)/(2K) (ρ ≤ 1), 1/(2K) (ρ ≥ 1), for the softmax and linear channels.

    Hardmax has no finite α_PR: fisher ≈ F₁/√V as V → 0 (hardmax_decay_constant), so V = 0 is never
    a fixed point and the MMSE only decays as ((2ρ - ρ²)/(2αF₁))² (ρ ≤ 1).  Given `mmse_tol`, the
    smallest α whose state-evolution MMSE is ≤ mmse_tol (Brent in log α, relative 1e-6)."""
    rho = check_rho(rho)
    ch = make_channel(channel, tokens)
    if ch.rank is not None:
        return (2 * rho - rho ** 2 if rho <= 1 else 1.0) / (2 * ch.rank)
    if mmse_tol is None or not 0 < mmse_tol < 1:
        raise ValueError(f"mmse_tol must be in (0, 1) for channel {channel!r} (no closed form: the "
                         f"state-evolution MMSE reaches 0 only as α → ∞), got {mmse_tol}")
    gap = lambda la: np.log(aim_state_evolution(channel, tokens, rho, np.exp(la)).mmse[0] / mmse_tol)
    hi = np.log((2 * rho - rho ** 2 if rho <= 1 else 1.0) / (2 * hardmax_decay_constant(tokens, rho) * np.sqrt(mmse_tol)))
    while gap(hi) > 0:
        hi += 1.0
    lo = hi - 1.0
    while gap(lo) <= 0:
        lo -= 1.0
    return float(np.exp(brentq(gap, lo, hi, xtol=1e-6)))


def hardmax_decay_constant(tokens: int = 2, rho: float = 0.5, V: float = 1e-8) -> float:
    """F₁ = lim_{V→0} √V·fisher(Q0 - V, V), Q0 = 1 + ρ, evaluated at V (the information comes from
    the ω within √V of the cone boundaries, so F₁ ∝ 1/√Q0)."""
    return float(np.sqrt(V) * make_channel("hardmax", tokens).fisher(1 + check_rho(rho) - V, V))


def small_width_constant(channel: str = "hardmax", tokens: int = 2, q: float = 0.0) -> float:
    """F(q) = 2·fisher(q, 1 - q) (Q0 = 1)."""
    return 2 * make_channel(channel, tokens).fisher(q, 1 - q)


def aim_weak_recovery(channel: str = "hardmax", tokens: int = 2) -> float:
    """ᾱ_c = 1/F(0) of the small-width limit."""
    return 1 / small_width_constant(channel, tokens, 0.0)


@dataclass
class SmallWidthResult:
    alpha_bar: np.ndarray
    q: np.ndarray
    mmse: np.ndarray
    iterations: np.ndarray

    def to_dict(self) -> dict:
        return {k: v.tolist() for k, v in self.__dict__.items()}


def aim_small_width(channel: str = "hardmax", tokens: int = 2, alpha_bar=1.0, tol: float = 1e-12,
                    max_iter: int = 10000) -> SmallWidthResult:
    """Fixed point of q ← [max(1 - 1/(ᾱ F(q)), 0)]² from q = 0, per ᾱ; mmse = 1 - q."""
    abar = check_alpha(alpha_bar)
    ch = make_channel(channel, tokens)
    qs, its = np.zeros(abar.size), np.zeros(abar.size, int)
    for i, a in enumerate(abar):
        q = 0.0
        for it in range(1, max_iter + 1):
            t = np.inf if a == 0 else 1 / (a * 2 * ch.fisher(q, 1 - q))
            new = max(1 - t, 0.0) ** 2
            if abs(new - q) <= tol:
                break
            q = min(new, 1 - 1e-12)
        qs[i], its[i] = new, it
    return SmallWidthResult(abar, qs, 1 - qs, its)
