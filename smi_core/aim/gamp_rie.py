"""GAMP-RIE on data (AIM.md §6).  Rescaled indices h'_k = Tr(S Z'_k) over pairs(T), with
Z'_aa = (x_a x_aᵀ - I)/√d and Z'_ab = (x_a x_bᵀ + x_b x_aᵀ)/√(2d), so h' = D h with D = 1 on the
diagonal and √2 off it, and every h'_k has variance 2Q0.  Per iteration:

    ω'_k = Tr(Z'_k Ŝ) - V' g'_k(previous),     g'_k = g_out(y, ω'/D, V'/2)_k / D_k,
    A = 2α ⟨-Σ_k ∂g'_k/∂ω'_k⟩ = 2αK/V' for the noiseless linear channels (softmax, linear), and its
        Nishimori twin A = (2/d²) Σ_μ Σ_k g'_k² for hardmax,      R = Ŝ + (1/(A d)) Σ_μ Σ_k g'_k Z'_k,    Δ = 1/(2A),
    Ŝ ← RIE_Δ(R) (eigenvalues through ξ of the free convolution),   V' = 2 mmse(Δ).

Start: Ŝ = √ρ I (the prior mean), V' = 2(Q0 - ρ) = 2, g' = 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from derive.aim import pairs

from .channels import make_channel
from .data import AIMData, indices
from .free_convolution import aim_free_convolution


@dataclass
class AIMGampResult:
    """`mmse` per iteration (‖S - Ŝ‖²_F/d), `delta` per iteration, the final `S_hat`, and the
    state-evolution prediction `mmse_se` = mmse(Δ) at each iteration."""
    mmse: np.ndarray
    mmse_se: np.ndarray
    delta: np.ndarray
    S_hat: np.ndarray
    iterations: int

    def to_dict(self) -> dict:
        return {"mmse": self.mmse.tolist(), "mmse_se": self.mmse_se.tolist(),
                "delta": self.delta.tolist(), "iterations": self.iterations}


def _scales(T: int) -> np.ndarray:
    return np.array([1.0 if a == b else np.sqrt(2) for a, b in pairs(T)])


def _sensing_sum(X: np.ndarray, gp: np.ndarray) -> np.ndarray:
    """Σ_μ Σ_k g'_k Z'_k = Σ_μ (X_μᵀ M_μ X_μ - Tr M_μ I)/√d, M_aa = g'_aa, M_ab = g'_ab/√2."""
    n, T, d = X.shape
    M = np.zeros((n, T, T))
    for k, (a, b) in enumerate(pairs(T)):
        M[:, a, b] = M[:, b, a] = gp[:, k] if a == b else gp[:, k] / np.sqrt(2)
    Xf = X.reshape(n * T, d)
    MX = np.einsum("nab,nbd->nad", M, X).reshape(n * T, d)
    out = Xf.T @ MX
    return (out + out.T) / 2 / np.sqrt(d) - np.trace(M, axis1=1, axis2=2).sum() * np.eye(d) / np.sqrt(d)


def aim_gamp(data: AIMData, max_iter: int = 60, tol: float = 1e-6, damping: float = 0.3,
             progress=None) -> AIMGampResult:
    """GAMP-RIE from the prior mean, Ŝ damped as Ŝ ← damping·Ŝ + (1 - damping)·RIE (the undamped
    noiseless softmax iteration oscillates at d = 100); stops when Δ changes by less than tol·Δ."""
    if not 0 <= damping < 1:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    n, T, d = data.X.shape
    ch = make_channel(data.channel, T, data.beta)
    D = _scales(T)
    rho = data.rho
    S_hat, Vp, g_old = np.sqrt(rho) * np.eye(d), 2.0, np.zeros((n, D.size))
    errs, ses, deltas = [], [], []
    for it in range(1, max_iter + 1):
        h = indices(data.X, S_hat)
        omega_p = np.stack([h[:, a, b] for a, b in pairs(T)], axis=1) * D - Vp * g_old
        gp = ch.g_out(data.y, omega_p / D, Vp / 2) / D
        if not np.all(np.isfinite(gp)):
            bad = int(np.argwhere(~np.isfinite(gp))[0, 0])
            raise FloatingPointError(f"g_out is not finite at sample {bad} (iteration {it})")
        A = 2 * n * ch.rank / (Vp * d * d) if ch.rank is not None else 2 * np.sum(gp ** 2) / d ** 2
        R = S_hat + _sensing_sum(data.X, gp) / (A * d)
        delta = 1 / (2 * A)
        fc = aim_free_convolution(rho, delta)
        lam, U = np.linalg.eigh(R)
        new = (U * fc.rie(lam)) @ U.T
        S_hat = damping * S_hat + (1 - damping) * new
        Vp, g_old = 2 * fc.mmse, gp
        errs.append(np.sum((data.S - S_hat) ** 2) / d)
        ses.append(fc.mmse)
        deltas.append(delta)
        if progress is not None:
            progress.update(1)
        if it > 1 and abs(deltas[-1] - deltas[-2]) <= tol * deltas[-1]:
            break
    return AIMGampResult(np.array(errs), np.array(ses), np.array(deltas), S_hat, it)
