"""Generalised approximate message passing on data (spec §7).

State: Ŵ (R, D), Ĉ (R, R), the previous denoiser outputs g_μ (R, T) (zero at the start).  One
iteration:

    V   = Ĉ
    ω_μ = Ŵ X_μ / √D − V g_μ                                 (Onsager correction, token-wise)
    g_μ, ∂g_μ = g_out(y_μ; ω_μ, V), ∂_ω g_out(y_μ; ω_μ, V)   (the model's channel, as in SE)
    A   = −(1/D) Σ_μ Σ_t ∂g_μ[(·, t), (·, t)]
    B   = (1/√D) Σ_μ Σ_t g_μ[:, t] X_μ[:, t]ᵀ + A Ŵ
    Ŵ   = (A + (1 + λ) I)⁻¹ (B + √λ S),   Ĉ = (A + (1 + λ) I)⁻¹

then (Ŵ, Ĉ) ← d (Ŵ, Ĉ)_old + (1 − d) (Ŵ, Ĉ)_new (damping d).  A is symmetrised and its
eigenvalues are kept in [0, 1/V_MIN] (Ĉ between V_MIN·I and the prior's I/(1 + λ)), as state
evolution keeps q in [0, (1 − V_MIN) I].  Side information S = √λ W + ξ (ξ iid N(0, 1)) needs
the teacher; the start is then the posterior given S alone, Ŵ = √λ S/(1 + λ), Ĉ = I/(1 + λ).
Without it the start is random, Ŵ iid N(0, q₀), Ĉ = (1 − q₀) I: the even models have the
uninformative fixed point Ŵ = 0, and the O(1/√D) chance overlap of a random start breaks it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate
from .data import Monitor, Teacher, back, check_count, project, sample
from .state_evolution import V_MIN, _channel


@dataclass
class GAMPResult:
    """Per iteration (index 0 = the start): ``overlap`` M = Ŵ Wᵀ/D and ``cosine`` per layer (with
    a teacher), ``self_overlap`` Q = Ŵ Ŵᵀ/D, ``test_error`` (Bayes: the posterior mean of y) and
    ``plugin_error`` (g at the posterior mean Ŵ) on the test set, ``change`` = RMS change of
    Ŵ's entries (NaN at 0).  Final ``W_hat``, ``C_hat``."""
    alpha: float
    self_overlap: np.ndarray            # (iterations + 1, R, R)
    change: np.ndarray                  # (iterations + 1,)
    W_hat: np.ndarray                   # (R, D)
    C_hat: np.ndarray                   # (R, R)
    iterations: int
    converged: bool
    overlap: np.ndarray | None = None   # (iterations + 1, R, R)
    cosine: np.ndarray | None = None    # (iterations + 1, layers)
    test_error: np.ndarray | None = None
    plugin_error: np.ndarray | None = None

    def to_dict(self, weights: bool = False) -> dict:
        """JSON-ready (arrays as lists); Ŵ only with ``weights``."""
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(self).items()
                if weights or k != "W_hat"}


def check_data(model, X, y) -> tuple[np.ndarray, np.ndarray]:
    """X (n, D, T) finite, y (n, *output_shape) (scalar outputs: (n,)) finite, same n."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 3 or X.shape[2] != model.tokens or min(X.shape) < 1:
        raise ValueError(f"X must have shape (n, D, {model.tokens}) with n, D ≥ 1, got {X.shape}")
    X = np.ascontiguousarray(X)
    for start in range(0, len(X), 1024):            # no full-size temporary for a large X
        bad = ~np.isfinite(X[start:start + 1024]).all(axis=(1, 2))
        if bad.any():
            raise ValueError(f"X must be finite (sample {start + int(np.argmax(bad))} is not)")
    shape = tuple(model.output_shape)
    y = np.asarray(y, dtype=np.float64)
    y = validate.batch("y", y, shape)[0] if shape or y.ndim != 1 else validate.batch("y", y[:, None], (1,))[0][:, 0]
    if len(y) != len(X):
        raise ValueError(f"X and y must have the same number of samples, got {len(X)} and {len(y)}")
    return X, y


def held_out(model, teacher: Teacher | None, test, samples: int, rng) -> tuple | None:
    """The test set: ``test`` = (X, y) if given, else ``samples`` fresh samples of the teacher."""
    if test is not None:
        return check_data(model, *test)
    if teacher is None or samples == 0:
        return None
    return sample(teacher, samples, rng)


def check_teacher(model, teacher: Teacher | None, D: int) -> np.ndarray | None:
    if teacher is None:
        return None
    if teacher.W.shape != (model.indices, D):
        raise ValueError(f"teacher.W must have shape ({model.indices}, {D}) to match the model and X, "
                         f"got {teacher.W.shape}")
    return teacher.W


def _clip(A: np.ndarray) -> np.ndarray:
    """Symmetrise and keep the eigenvalues in [0, 1/V_MIN]."""
    w, U = np.linalg.eigh(0.5 * (A + A.T))
    return (U * np.clip(w, 0.0, 1.0 / V_MIN)) @ U.T


def gamp(model, X, y, *, teacher: Teacher | None = None, noise: float | None = None,
         side_info: float = 0.0, damping: float = 0.0, max_iter: int = 100, tol: float = 1e-5,
         init: float = 1e-3, rng=None, test=None, test_samples: int = 1000,
         channel=None, progress: bool = False) -> GAMPResult:
    """Run GAMP (module docstring) on X (n, D, T), y (n, *output_shape) until the RMS change of
    Ŵ's entries is below ``tol`` or ``max_iter`` iterations.  ``noise`` = Δ selects the noisy
    channel P(y|Z) = N(y; g(Z), Δ I) (default: the model's noiseless channel); ``side_info`` = λ
    needs ``teacher``; ``init`` = q₀ of the random start; ``rng`` a seed or Generator (start,
    side information, test draws); ``test`` = (X_test, y_test), else ``test_samples`` fresh
    samples of the teacher; ``channel``: options for the channel (``nodes``, ``threads``, ``tol``)
    or a channel built by ``model.channel(...)`` (reused, e.g. over seeds; it then fixes the noise)."""
    X, y = check_data(model, X, y)
    n, D, T = X.shape
    R = model.indices
    side_info = validate.positive("side_info", side_info, allow_zero=True)
    if not 0 <= damping < 1:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    validate.positive("tol", tol)
    if not 0 < init < 1:
        raise ValueError(f"init must be in (0, 1), got {init}")
    check_count("max_iter", max_iter)
    W = check_teacher(model, teacher, D)
    if side_info > 0 and W is None:
        raise ValueError("side_info > 0 needs the teacher (S = √λ W + noise)")
    rng = np.random.default_rng(rng)
    if hasattr(channel, "moments") and noise is not None:
        raise ValueError("noise must be None with a built channel (the channel fixes the noise)")
    chan = _channel(model, None if noise is None else validate.positive("noise", noise), channel)
    if side_info > 0:
        field = np.sqrt(side_info) * (np.sqrt(side_info) * W + rng.standard_normal(W.shape))
        W_hat, C_hat = field / (1 + side_info), np.eye(R) / (1 + side_info)
    else:
        field = 0.0
        W_hat, C_hat = np.sqrt(init) * rng.standard_normal((R, D)), (1 - init) * np.eye(R)
    monitor = Monitor(model, W, held_out(model, teacher, test, test_samples, rng), rng=rng)   # after the start
    g = np.zeros((n, R, T))
    monitor.record(W_hat, C_hat, change=np.nan)
    from tqdm import tqdm
    bar = tqdm(range(1, max_iter + 1), disable=not progress, unit="it", leave=False)
    converged = False
    for it in bar:
        V = C_hat
        omega = project(W_hat, X) - np.einsum("ab,nbt->nat", V, g)
        try:
            m = chan.moments(y, omega, V)
        except ValueError as err:
            raise ValueError(f"y does not fit the {chan.route} channel of {model!r} "
                             f"(noise={noise}): {err}") from None
        g = m.g_out
        A = _clip(-np.einsum("natbt->ab", m.dg_out.reshape(n, R, T, R, T)) / D)
        C_new = np.linalg.inv(A + (1 + side_info) * np.eye(R))
        C_new = 0.5 * (C_new + C_new.T)
        W_new = C_new @ (back(g, X) + A @ W_hat + field)
        W_new = damping * W_hat + (1 - damping) * W_new
        change = float(np.sqrt(np.mean((W_new - W_hat) ** 2)))
        W_hat, C_hat = W_new, damping * C_hat + (1 - damping) * C_new
        monitor.record(W_hat, C_hat, change=change)
        bar.set_postfix(change=f"{change:.2e}")
        if change < tol:
            converged = True
            break
    bar.close()
    rows = monitor.arrays()
    return GAMPResult(alpha=n / D, self_overlap=rows["self_overlap"], change=rows["change"], W_hat=W_hat,
                      C_hat=C_hat, iterations=it, converged=converged, overlap=rows.get("overlap"),
                      cosine=rows.get("cosine"), test_error=rows.get("test_error"),
                      plugin_error=rows.get("plugin_error"))
