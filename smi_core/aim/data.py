"""Data from the one-layer attention-indexed model (AIM.md §1): x_a ~ N(0, I_d),
S = WWᵀ/√(rd), h_ab = x_aᵀ S x_b/√d - δ_ab Tr S/√d, y = row-wise softmax_β(h) | hardmax(h) | h."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .channels import make_channel


@dataclass
class AIMData:
    X: np.ndarray        # (n, T, d)
    S: np.ndarray        # (d, d)
    h: np.ndarray        # (n, T, T)
    y: np.ndarray        # (n, T, T)
    channel: str
    rho: float
    beta: float


def rng_of(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def indices(X: np.ndarray, S: np.ndarray) -> np.ndarray:
    """h_ab = x_aᵀ S x_b/√d - δ_ab Tr S/√d for every sample."""
    d = X.shape[-1]
    h = np.einsum("nad,de,nbe->nab", X, S, X, optimize=True) / np.sqrt(d)
    return h - np.eye(X.shape[1]) * np.trace(S) / np.sqrt(d)


def link(h: np.ndarray, channel: str, beta: float = 1.0) -> np.ndarray:
    if channel == "softmax":
        e = np.exp(beta * (h - h.max(axis=-1, keepdims=True)))
        return e / e.sum(axis=-1, keepdims=True)
    if channel == "hardmax":
        return (h.argmax(axis=-1)[..., None] == np.arange(h.shape[-1])).astype(float)
    return h.copy()


def aim_data(d: int, alpha: float, rho: float, tokens: int = 2, channel: str = "softmax",
             beta: float = 1.0, seed=None) -> AIMData:
    """n = round(α d²) samples of the model with r = round(ρ d) ≥ 1."""
    make_channel(channel, tokens, beta)
    if int(d) != d or d < 2:
        raise ValueError(f"d must be an integer ≥ 2, got {d}")
    if not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be > 0, got {rho}")
    rng = rng_of(seed)
    d, r, n = int(d), max(1, round(rho * d)), max(1, round(alpha * d * d))
    W = rng.standard_normal((d, r))
    S = W @ W.T / np.sqrt(r * d)
    X = rng.standard_normal((n, tokens, d))
    h = indices(X, S)
    return AIMData(X, S, h, link(h, channel, beta), channel, r / d, float(beta))
