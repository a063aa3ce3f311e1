"""Synthetic data from a teacher (spec §1) and the contractions GAMP and SGD share.

A teacher is W ∈ R^{R×D} with iid N(0, 1) entries; a sample is X_μ ∈ R^{D×T} with iid N(0, 1)
entries and y_μ = g(W X_μ / √D) (+ √Δ ε, ε iid N(0, 1), when the teacher has noise Δ).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate


@dataclass
class Teacher:
    """The model, its weights W (R, D) and the output noise Δ (None: noiseless)."""
    model: object
    W: np.ndarray
    noise: float | None = None

    @property
    def dim(self) -> int:
        return self.W.shape[1]


def check_count(name: str, value) -> int:
    """``value`` as an int ≥ 1, else ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    return int(value)


def make_teacher(model, dim: int, rng: np.random.Generator, noise: float | None = None) -> Teacher:
    """A teacher of ``model`` in dimension D = ``dim``: W with iid N(0, 1) entries."""
    dim = check_count("dim", dim)
    noise = None if noise is None else validate.positive("noise", noise)
    return Teacher(model, rng.standard_normal((model.indices, dim)), noise)


def sample(teacher: Teacher, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n samples: X (n, D, T) iid N(0, 1) and y = g(W X / √D) (+ √Δ ε), shape (n, *output_shape)."""
    n = check_count("n", n)
    model = teacher.model
    X = rng.standard_normal((n, teacher.dim, model.tokens))
    y = model.forward(project(teacher.W, X))
    if teacher.noise is not None:
        y = y + np.sqrt(teacher.noise) * rng.standard_normal(y.shape)
    return X, y


def project(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """H_μ = W X_μ / √D for every sample: (n, R, T), one matrix product over the flat X (n, D·T)."""
    n, D, T = X.shape
    R = len(W)
    K = np.zeros((D, T, R, T))               # K[d, t, a, s] = W[a, d] δ_ts
    for t in range(T):
        K[:, t, :, t] = W.T
    return (X.reshape(n, D * T) @ K.reshape(D * T, R * T)).reshape(n, R, T) / np.sqrt(D)


def back(G: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Σ_μ Σ_t G_μ[:, t] X_μ[:, t]ᵀ / √D: (R, D), from one product G (RT, n) · X (n, D·T)."""
    n, D, T = X.shape
    R = G.shape[1]
    GT = np.ascontiguousarray(G.reshape(n, R * T).T)          # a contiguous left factor: 3× faster
    full = (GT @ X.reshape(n, D * T)).reshape(R, T, D, T)
    return np.einsum("atdt->ad", full) / np.sqrt(D)


def layer_rows(model) -> list[slice]:
    """The rows of W per layer (DeepAttention) or one row per index (any other model)."""
    spec = getattr(model, "spec", None)
    width = spec.rows_per_layer if spec is not None else 1
    return [slice(i, i + width) for i in range(0, model.indices, width)]


def cosine(model, W_hat: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Per layer: ‖Ŵ_ℓ W_ℓᵀ‖_F / (‖Ŵ_ℓ Ŵ_ℓᵀ‖_F ‖W_ℓ W_ℓᵀ‖_F)^{1/2} ∈ [0, 1] (for r = 1 the
    absolute cosine similarity |⟨ŵ_ℓ, w_ℓ⟩| / (|ŵ_ℓ| |w_ℓ|); invariant under the model's sign
    and rotation symmetries within a layer).  0 where Ŵ_ℓ = 0."""
    out = []
    for rows in layer_rows(model):
        a, b = W_hat[rows], W[rows]
        norm = np.sqrt(np.linalg.norm(a @ a.T) * np.linalg.norm(b @ b.T))
        out.append(np.linalg.norm(a @ b.T) / norm if norm > 0 else 0.0)
    return np.array(out)


class Monitor:
    """Per-step measurements of an estimate Ŵ (R, D): Q = Ŵ Ŵᵀ/D and, with a teacher, M = Ŵ Wᵀ/D
    and the per-layer cosine; with a test set (X, y), the plug-in test error
    mean ‖y − g(Ŵ X/√D)‖²_F and, given a posterior covariance Ĉ, the Bayes test error
    mean ‖y − E[g(Z)]‖²_F, Z[:, t] ~ N(Ŵ X[:, t]/√D, Ĉ), estimated from ``draws`` fixed draws
    per sample minus the sample variance over ``draws`` (unbiased)."""

    def __init__(self, model, W=None, test=None, draws: int = 8, rng=None):
        self.model, self.W, self.test = model, W, test
        if test is not None:
            n = len(test[0])
            self.zeta = np.random.default_rng(rng).standard_normal((n, draws, model.indices, model.tokens))
            self.y_test = np.asarray(test[1], dtype=np.float64).reshape(n, -1)
        self.rows: dict[str, list] = {}

    def record(self, W_hat: np.ndarray, C_hat: np.ndarray | None = None, **extra) -> None:
        D = W_hat.shape[1]
        values = dict(self_overlap=W_hat @ W_hat.T / D, **extra)
        if self.W is not None:
            values |= dict(overlap=W_hat @ self.W.T / D, cosine=cosine(self.model, W_hat, self.W))
        if self.test is not None:
            values |= self._errors(W_hat, C_hat)
        for key, value in values.items():
            self.rows.setdefault(key, []).append(value)

    def _errors(self, W_hat, C_hat) -> dict:
        omega = project(W_hat, self.test[0])
        n = len(omega)
        plugin = self.model.forward(omega).reshape(n, -1) - self.y_test
        out = {"plugin_error": float((plugin ** 2).sum(axis=1).mean())}
        if C_hat is not None:
            K = self.zeta.shape[1]
            Z = omega[:, None] + np.einsum("ab,nkbt->nkat", np.linalg.cholesky(C_hat), self.zeta)
            g = self.model.forward(Z.reshape(n * K, *omega.shape[1:])).reshape(n, K, -1)
            bias = g.var(axis=1, ddof=1).sum(axis=1) / K
            out["test_error"] = float((((g.mean(axis=1) - self.y_test) ** 2).sum(axis=1) - bias).mean())
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {key: np.array(value) for key, value in self.rows.items()}
