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

from .channels import make_channel
from .state_evolution import check_alpha, check_rho


def aim_perfect_recovery(channel: str = "softmax", tokens: int = 2, rho: float = 0.5) -> float:
    """α_PR = (2ρ - ρ²)/(2K) (ρ ≤ 1), 1/(2K) (ρ ≥ 1), for the softmax and linear channels."""
    rho = check_rho(rho)
    ch = make_channel(channel, tokens)
    if ch.rank is None:
        raise ValueError(f"channel {channel!r} has no perfect-recovery closed form "
                         "(only the noiseless linear channels: softmax, linear)")
    return (2 * rho - rho ** 2 if rho <= 1 else 1.0) / (2 * ch.rank)


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
