"""State evolution of the attention-indexed model (AIM.md §2-§3, §5), in V = Q0 - q:

    q̂ = 2α·fisher(q, V),    V ← mmse(1/q̂)    (Q0 = 1 + ρ; no data: q = ρ, V = 1),

damped as V ← (1 - damping)·new + damping·V, until a step changes V by at most tol·V.  The map is increasing in V, so from the uninformed
start the iterates decrease to its largest fixed point; every three steps an Aitken extrapolation
is tried and kept when the map does not rise above it (still above the fixed point), or else the
fixed point is bracketed and solved by Brent's method.  V below `floor` counts as 0 (perfect
recovery).  Over a grid of α (sorted internally), each α starts from the previous fixed point.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import brentq

from .channels import make_channel
from .free_convolution import mmse as denoising_mmse


@dataclass
class AIMSEResult:
    """Fixed points per α: `mmse` = Q0 - q, `q`, `q_hat`, `iterations`, `converged`, and the
    trajectory of q per α."""
    channel: str
    tokens: int
    rho: float
    alpha: np.ndarray
    q: np.ndarray
    mmse: np.ndarray
    q_hat: np.ndarray
    iterations: np.ndarray
    converged: np.ndarray
    trajectory: list = field(repr=False)

    def to_dict(self) -> dict:
        return {"channel": self.channel, "tokens": self.tokens, "rho": self.rho,
                "alpha": self.alpha.tolist(), "q": self.q.tolist(), "mmse": self.mmse.tolist(),
                "q_hat": [None if np.isinf(v) else float(v) for v in self.q_hat],   # inf: perfect recovery
                "iterations": self.iterations.tolist(),
                "converged": self.converged.tolist(), "trajectory": [t.tolist() for t in self.trajectory]}


def check_rho(rho) -> float:
    rho = float(rho)
    if not (np.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a finite number > 0, got {rho}")
    return rho


def check_alpha(alpha) -> np.ndarray:
    alpha = np.atleast_1d(np.asarray(alpha, dtype=float))
    if alpha.ndim != 1 or alpha.size == 0 or not np.all(np.isfinite(alpha)) or np.any(alpha < 0):
        raise ValueError(f"alpha must be finite numbers ≥ 0, got {alpha}")
    return alpha


class _Map:
    """V ↦ mmse(1/q̂(V)) at one α, remembering the last q̂."""

    def __init__(self, channel, rho: float, alpha: float):
        self.ch, self.rho, self.alpha, self.Q0 = channel, rho, alpha, 1 + rho
        self.q_hat = 0.0

    def __call__(self, V: float) -> float:
        if V <= 0:
            self.q_hat = np.inf
            return 0.0
        self.q_hat = 2 * self.alpha * self.ch.fisher(self.Q0 - V, V)
        return 1.0 if self.q_hat == 0 else denoising_mmse(self.rho, 1 / self.q_hat)


def _solve(f: _Map, V: float, damping: float, tol: float, max_iter: int, floor: float):
    """Iterate from V; returns (V*, trajectory, iterations, converged)."""
    traj = [V]
    for it in range(1, max_iter + 1):
        new = (1 - damping) * f(V) + damping * V
        traj.append(new)
        if new <= floor:
            traj.append(0.0)
            return 0.0, traj, it, True
        if abs(new - V) <= tol * V:
            return new, traj, it, True
        V = new
        if it % 3 == 0:
            V = _aitken(f, traj, floor)
            if V != traj[-1]:
                traj.append(V)
    return V, traj, max_iter, False


def _aitken(f: _Map, traj: list, floor: float) -> float:
    v0, v1, v2 = traj[-3:]
    d1, d2 = v1 - v0, v2 - v1
    if not (d1 < 0 and d2 < 0 and d2 - d1 > 0):
        return v2
    guess = max(v2 - d2 * d2 / (d2 - d1), floor / 2)
    if f(guess) <= guess:                       # still above the largest fixed point
        return guess
    return brentq(lambda v: f(v) - v, guess, v2, xtol=1e-15, rtol=1e-13)


def aim_state_evolution(channel: str = "softmax", tokens: int = 2, rho: float = 0.5, alpha=0.1,
                        beta: float = 1.0, damping: float = 0.0, tol: float = 1e-10,
                        max_iter: int = 2000, floor: float = 1e-13, progress=None) -> AIMSEResult:
    """Fixed points of AIM state evolution from the uninformed start, for one α or a grid."""
    rho = check_rho(rho)
    alphas = check_alpha(alpha)
    if not 0 <= damping < 1:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    ch = make_channel(channel, tokens, beta)
    order = np.argsort(alphas)
    out = {k: np.zeros(alphas.size) for k in ("V", "q_hat", "iterations")}
    converged = np.zeros(alphas.size, bool)
    traj = [None] * alphas.size
    V = 1.0
    for i in order:
        f = _Map(ch, rho, alphas[i])
        V, t, its, conv = _solve(f, V, damping, tol, max_iter, floor)
        f(V)
        out["V"][i], out["q_hat"][i], out["iterations"][i], converged[i] = V, f.q_hat, its, conv
        traj[i] = 1 + rho - np.array(t)
        if progress is not None:
            progress.update(1)
    return AIMSEResult(channel, ch.tokens, rho, alphas, 1 + rho - out["V"], out["V"], out["q_hat"],
                       out["iterations"].astype(int), converged, traj)
