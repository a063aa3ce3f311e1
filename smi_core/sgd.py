"""The SGD baseline: a student of the same architecture trained by mini-batch SGD on the squared
loss, gradients chained by hand through the generated ∂y/∂Z kernel (no autograd).

For a batch B, with H_μ = W X_μ / √D, r_μ = g(H_μ) − y_μ and J_μ = ∂g/∂Z (H_μ):

    L_B(W)   = (1 / 2|B|) Σ_μ ‖r_μ‖²
    ∇_W L_B  = (1 / |B|) (1/√D) Σ_μ Σ_t G_μ[:, t] X_μ[:, t]ᵀ,   G_μ[a, t] = Σ_k r_μ[k] J_μ[k, (a, t)]
    W       ← W − lr (D ∇_W L_B + weight_decay · W)

(the factor D makes one step move the overlaps W Wᵀ/D by O(lr)).  Each epoch visits the
samples in a fresh random order, in batches of ``batch_size``; each batch is used for ``reuse``
consecutive steps.  The student starts from W iid N(0, init).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate
from .data import Monitor, Teacher, back, check_count, project
from .gamp import check_data, check_teacher, held_out


@dataclass
class SGDResult:
    """Per epoch (index 0 = the start): ``train_loss`` = mean ½‖g(W X/√D) − y‖² over the training
    set, ``self_overlap`` Q = W Wᵀ/D; with a teacher ``overlap`` M = W W*ᵀ/D and ``cosine`` per
    layer; with a test set ``plugin_error`` = mean ‖y − g(W X/√D)‖²_F.  Final ``W_hat``."""
    alpha: float
    train_loss: np.ndarray              # (epochs + 1,)
    self_overlap: np.ndarray            # (epochs + 1, R, R)
    W_hat: np.ndarray
    overlap: np.ndarray | None = None
    cosine: np.ndarray | None = None    # (epochs + 1, layers)
    plugin_error: np.ndarray | None = None

    def to_dict(self, weights: bool = False) -> dict:
        """JSON-ready (arrays as lists); W only with ``weights``."""
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(self).items()
                if weights or k != "W_hat"}


def _residual_gradient(model, W, X, y):
    """(½‖r‖² per sample, G (n, R, T)) at W on the samples X, y."""
    H = project(W, X)
    n = len(X)
    r = model.forward(H).reshape(n, -1) - y.reshape(n, -1)
    G = np.einsum("nk,nkj->nj", r, model.forward_jacobian(H)).reshape(H.shape)
    return 0.5 * (r ** 2).sum(axis=1), G


def sgd(model, X, y, *, teacher: Teacher | None = None, lr: float = 0.1, weight_decay: float = 0.0,
        batch_size: int = 100, reuse: int = 2, epochs: int = 40, init: float = 1e-2, rng=None,
        test=None, test_samples: int = 1000, progress: bool = False) -> SGDResult:
    """Train a student (module docstring) on X (n, D, T), y (n, *output_shape); ``rng`` a seed or
    Generator (start, order, test set); ``test`` = (X_test, y_test), else ``test_samples`` fresh
    samples of the teacher."""
    X, y = check_data(model, X, y)
    n, D, _ = X.shape
    validate.positive("lr", lr)
    validate.positive("weight_decay", weight_decay, allow_zero=True)
    validate.positive("init", init)
    for name, value in (("batch_size", batch_size), ("reuse", reuse), ("epochs", epochs)):
        check_count(name, value)
    W_star = check_teacher(model, teacher, D)
    rng = np.random.default_rng(rng)
    monitor = Monitor(model, W_star, held_out(model, teacher, test, test_samples, rng), rng=rng)
    W = np.sqrt(init) * rng.standard_normal((model.indices, D))
    monitor.record(W, train_loss=float(_residual_gradient(model, W, X, y)[0].mean()))
    from tqdm import tqdm
    for _ in tqdm(range(epochs), disable=not progress, unit="epoch", leave=False):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            idx = np.sort(order[start:start + batch_size])
            Xb, yb = X[idx], y[idx]
            for _ in range(reuse):
                G = _residual_gradient(model, W, Xb, yb)[1]
                W = W - lr * (D * back(G, Xb) / len(idx) + weight_decay * W)
        monitor.record(W, train_loss=float(_residual_gradient(model, W, X, y)[0].mean()))
    rows = monitor.arrays()
    return SGDResult(alpha=n / D, train_loss=rows["train_loss"], self_overlap=rows["self_overlap"],
                     W_hat=W, overlap=rows.get("overlap"), cosine=rows.get("cosine"),
                     plugin_error=rows.get("plugin_error"))
