"""The SGD baseline: the hand-chained gradient against finite differences of the loss, and the
order in which a student learns the layers of two-layer attention (the last one first)."""
import json

import numpy as np
import pytest

from smi_core import DeepAttention
from smi_core.data import make_teacher, sample
from smi_core.sgd import _residual_gradient, sgd

MODEL = DeepAttention(layers=2, tokens=2, threads=1)


def test_gradient_matches_finite_differences_of_the_loss():
    """D ∇_W L_B as used by the step (module docstring) against central differences of
    L_B(W) = (1/2|B|) Σ ‖g(W X/√D) − y‖², computed here with einsum and the forward map only."""
    rng = np.random.default_rng(0)
    teacher = make_teacher(MODEL, 15, rng)
    X, y = sample(teacher, 12, rng)
    W = rng.standard_normal((2, 15))

    def loss(W):
        H = np.einsum("ad,ndt->nat", W, X) / np.sqrt(15)
        return 0.5 * ((MODEL.forward(H) - y) ** 2).sum() / len(X)

    from smi_core.data import back
    grad = back(_residual_gradient(MODEL, W, X, y)[1], X) / len(X)
    h, numeric = 1e-6, np.zeros_like(W)
    for idx in np.ndindex(W.shape):
        e = np.zeros_like(W)
        e[idx] = h
        numeric[idx] = (loss(W + e) - loss(W - e)) / (2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    assert np.isclose(_residual_gradient(MODEL, W, X, y)[0].mean(), loss(W), rtol=1e-12)


def test_sgd_learns_the_last_layer_first():
    """D = 100, α = 10, 4 seeds: the mean cosine of the last layer reaches 0.9 while the first
    layer's is below 0.5, and the first reaches 0.5 only later; the training loss falls."""
    runs = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        teacher = make_teacher(MODEL, 100, rng)
        X, y = sample(teacher, 1000, rng)
        runs.append(sgd(MODEL, X, y, teacher=teacher, lr=0.2, batch_size=100, reuse=2, epochs=40, rng=rng,
                        test_samples=200))
    cos = np.mean([r.cosine for r in runs], axis=0)
    print("mean cosine per epoch:", np.round(cos, 3).tolist())
    last = int(np.argmax(cos[:, 1] >= 0.9))
    first = np.flatnonzero(cos[:, 0] >= 0.5)
    assert cos[last, 1] >= 0.9 and cos[last, 0] < 0.5, cos[last]
    assert first.size and first[0] > last, (first, last)
    for r in runs:
        assert r.train_loss[-1] < 0.2 * r.train_loss[0] and r.plugin_error.shape == (41,)
    json.dumps(runs[0].to_dict())


def test_weight_decay_shrinks_the_student():
    """Without data signal (y independent of X), weight decay shrinks W: Q falls."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((50, 20, 2))
    y = MODEL.forward(rng.standard_normal((50, 2, 2)))
    free = sgd(MODEL, X, y, lr=0.05, epochs=5, batch_size=25, init=1.0, rng=2)
    decayed = sgd(MODEL, X, y, lr=0.05, epochs=5, batch_size=25, init=1.0, rng=2, weight_decay=1.0)
    assert free.cosine is None and free.overlap is None
    assert np.trace(decayed.self_overlap[-1]) < 0.7 * np.trace(free.self_overlap[-1])


@pytest.mark.parametrize("option, match", [
    (dict(lr=0.0), "lr must be > 0"),
    (dict(weight_decay=-0.1), "weight_decay must be ≥ 0"),
    (dict(batch_size=0), "batch_size must be an integer ≥ 1"),
    (dict(reuse=1.5), "reuse must be an integer ≥ 1"),
    (dict(epochs=0), "epochs must be an integer ≥ 1"),
    (dict(X=np.zeros((3, 20, 2))), "X and y must have the same number of samples"),
    (dict(X=np.full((50, 20, 2), np.nan)), r"X must be finite \(sample 0"),
])
def test_bad_input(option, match):
    rng = np.random.default_rng(0)
    teacher = make_teacher(MODEL, 20, rng)
    X, y = sample(teacher, 50, rng)
    with pytest.raises(ValueError, match=match):
        sgd(MODEL, option.pop("X", X), y, epochs=option.pop("epochs", 1), **option)
