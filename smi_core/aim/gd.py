"""Gradient-descent baseline (AIM.md §6): students S_s = W_s W_sᵀ/√(r d) of the same form (tied,
same diagonal centring), full-batch Adam on L = (1/n) Σ_μ ‖y_μ - σ_β(ĥ_μ)‖²_F, with the softmax
Jacobian dσ_ab = β σ_ab (dĥ_ab - Σ_c σ_ac dĥ_ac) (derive/links.py); the error of the average of
the students' S approaches the Bayes-optimal error."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import AIMData, indices, link, rng_of


@dataclass
class AIMGDResult:
    errors: np.ndarray        # ‖S - S_s‖²_F/d per student
    average_error: float      # ‖S - mean_s S_s‖²_F/d
    train_loss: np.ndarray    # final loss per student

    def to_dict(self) -> dict:
        return {"errors": self.errors.tolist(), "average_error": self.average_error,
                "train_loss": self.train_loss.tolist()}


def _loss_grad(W, data: AIMData):
    n, T, d = data.X.shape
    r = W.shape[1]
    S = W @ W.T / np.sqrt(r * d)
    out = link(indices(data.X, S), data.channel, data.beta)
    e = 2 * (out - data.y) / n
    if data.channel == "softmax":
        e = data.beta * out * (e - (e * out).sum(axis=-1, keepdims=True))
    GS = np.einsum("nad,nab,nbe->de", data.X, e, data.X, optimize=True) / np.sqrt(d)
    GS -= np.trace(e, axis1=1, axis2=2).sum() * np.eye(d) / np.sqrt(d)
    return np.sum((out - data.y) ** 2) / n, (GS + GS.T) @ W / np.sqrt(r * d), S


def aim_gd(data: AIMData, students: int = 4, steps: int = 2000, lr: float = 0.01, seed=None,
           progress=None) -> AIMGDResult:
    """Adam (β₁ = 0.9, β₂ = 0.999) from W ~ N(0, 1) for each student, r = ρ d."""
    if data.channel == "hardmax":
        raise ValueError("channel 'hardmax' has no gradient: gradient descent needs softmax or linear")
    if students < 1 or steps < 1 or not lr > 0:
        raise ValueError(f"students ≥ 1, steps ≥ 1 and lr > 0 required, got {students}, {steps}, {lr}")
    rng = rng_of(seed)
    d = data.S.shape[0]
    r = max(1, round(data.rho * d))
    Ss, errs, losses = [], [], []
    for _ in range(students):
        W = rng.standard_normal((d, r))
        m, v = np.zeros_like(W), np.zeros_like(W)
        for t in range(1, steps + 1):
            loss, grad, S = _loss_grad(W, data)
            m = 0.9 * m + 0.1 * grad
            v = 0.999 * v + 0.001 * grad ** 2
            W -= lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
            if progress is not None:
                progress.update(1)
        loss, _, S = _loss_grad(W, data)
        Ss.append(S)
        errs.append(np.sum((data.S - S) ** 2) / d)
        losses.append(loss)
    avg = np.mean(Ss, axis=0)
    return AIMGDResult(np.array(errs), float(np.sum((data.S - avg) ** 2) / d), np.array(losses))
