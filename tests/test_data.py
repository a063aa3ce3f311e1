"""Teacher data (spec §1), the sample-token contractions GAMP and SGD share, and the per-layer
cosine similarity."""
import numpy as np
import pytest

from smi_core import DeepAttention
from smi_core.data import Monitor, back, cosine, make_teacher, project, sample

MODEL = DeepAttention(layers=2, tokens=2, threads=1)


def test_teacher_and_samples_follow_the_model():
    """W and X have iid N(0, 1) entries; y = g(W X/√D) computed here by einsum; reproducible."""
    rng = np.random.default_rng(5)
    teacher = make_teacher(MODEL, 300, rng)
    X, y = sample(teacher, 400, rng)
    assert teacher.W.shape == (2, 300) and X.shape == (400, 300, 2) and y.shape == (400, 2, 2)
    for a in (teacher.W, X):               # mean and variance within 5 standard errors
        assert abs(a.mean()) < 5 / np.sqrt(a.size) and abs(a.var() - 1) < 5 * np.sqrt(2 / a.size)
    H = np.einsum("ad,ndt->nat", teacher.W, X) / np.sqrt(300)
    np.testing.assert_allclose(y, MODEL.forward(H), rtol=1e-12, atol=1e-14)
    rng = np.random.default_rng(5)
    again = make_teacher(MODEL, 300, rng)
    X2, y2 = sample(again, 400, rng)
    assert np.array_equal(again.W, teacher.W) and np.array_equal(X2, X) and np.array_equal(y2, y)


def test_noisy_teacher_adds_gaussian_noise_of_variance_delta():
    rng = np.random.default_rng(1)
    teacher = make_teacher(MODEL, 50, rng, noise=0.3)
    X, y = sample(teacher, 20_000, rng)
    eps = (y - MODEL.forward(project(teacher.W, X))).ravel()
    assert abs(eps.mean()) < 5 * np.sqrt(0.3 / eps.size)
    assert abs(eps.var() - 0.3) < 5 * 0.3 * np.sqrt(2 / eps.size)


def test_project_and_back_are_the_token_wise_products_and_adjoint():
    rng = np.random.default_rng(2)
    X, W, G = rng.standard_normal((7, 11, 3)), rng.standard_normal((4, 11)), rng.standard_normal((7, 4, 3))
    np.testing.assert_allclose(project(W, X), np.einsum("ad,ndt->nat", W, X) / np.sqrt(11), rtol=1e-12)
    np.testing.assert_allclose(back(G, X), np.einsum("nat,ndt->ad", G, X) / np.sqrt(11), rtol=1e-12)
    # ⟨back(G, X), W⟩ = ⟨G, project(W, X)⟩
    assert np.isclose((back(G, X) * W).sum(), (G * project(W, X)).sum(), rtol=1e-12)


def test_cosine_per_layer_and_its_invariances():
    rng = np.random.default_rng(3)
    W, W_hat = rng.standard_normal((2, 40)), rng.standard_normal((2, 40))
    c = cosine(MODEL, W_hat, W)
    expected = [abs(W_hat[l] @ W[l]) / np.linalg.norm(W_hat[l]) / np.linalg.norm(W[l]) for l in range(2)]
    np.testing.assert_allclose(c, expected, rtol=1e-12)
    np.testing.assert_allclose(cosine(MODEL, W_hat * [[-1.0], [3.0]], W), c, rtol=1e-12)
    np.testing.assert_allclose(cosine(MODEL, 2 * W, W), [1.0, 1.0], rtol=1e-12)
    assert cosine(MODEL, np.zeros((2, 40)), W).tolist() == [0.0, 0.0]
    # rank 2: one value per layer, invariant under a rotation of the layer's rows, 1 at Ŵ = O W
    rank2 = DeepAttention(layers=2, tokens=2, rank=2)
    W4 = rng.standard_normal((4, 40))
    theta = 0.7
    O = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    rotated = np.vstack([O @ W4[:2], W4[2:]])
    np.testing.assert_allclose(cosine(rank2, rotated, W4), [1.0, 1.0], rtol=1e-12)
    noisy = W4 + rng.standard_normal(W4.shape)
    np.testing.assert_allclose(cosine(rank2, np.vstack([O @ noisy[:2], noisy[2:]]), W4),
                               cosine(rank2, noisy, W4), rtol=1e-12)


def test_monitor_bayes_error_is_unbiased():
    """Given y, the Bayes test error with Ŵ X/√D = H and Ĉ = V estimates mean ‖y − E g(Z)‖²,
    Z ~ N(H, V), without the tr Cov/K bias of a K-draw mean: 40 monitors with K = 2 draws
    against E g(Z) from 4000 independent draws per sample."""
    rng = np.random.default_rng(4)
    teacher = make_teacher(MODEL, 100, rng)
    Xt, _ = sample(teacher, 200, rng)
    H = project(teacher.W, Xt)
    V = np.array([[0.3, 0.05], [0.05, 0.2]])
    chol = np.linalg.cholesky(V)
    draw = lambda k: MODEL.forward((H[:, None] + np.einsum("ab,nkbt->nkat", chol, rng.standard_normal(
        (200, k, 2, 2)))).reshape(-1, 2, 2)).reshape(200, k, 4)
    g = draw(4000)
    yt = draw(1)[:, 0]
    target = ((yt - g.mean(axis=1)) ** 2).sum(axis=1).mean()
    trace_cov = g.var(axis=1).sum(axis=1).mean()
    estimates = []
    for seed in range(40):
        monitor = Monitor(MODEL, teacher.W, (Xt, yt.reshape(200, 2, 2)), draws=2, rng=seed)
        monitor.record(teacher.W, V)
        estimates.append(monitor.arrays()["test_error"][0])
    tol = 5 * np.std(estimates) / np.sqrt(40) + trace_cov / 4000
    assert tol < trace_cov / 2 / 3            # the uncorrected estimate would be off by tr Cov/2
    assert abs(np.mean(estimates) - target) < tol, (np.mean(estimates), target, tol)
    rows = monitor.arrays()
    assert np.allclose(rows["cosine"][0], 1.0) and np.allclose(rows["overlap"][0], rows["self_overlap"][0])


@pytest.mark.parametrize("call, match", [
    (lambda: make_teacher(MODEL, 0, np.random.default_rng()), "dim must be an integer ≥ 1"),
    (lambda: make_teacher(MODEL, 2.5, np.random.default_rng()), "dim must be an integer ≥ 1"),
    (lambda: make_teacher(MODEL, 10, np.random.default_rng(), noise=-1.0), "noise must be > 0"),
    (lambda: sample(make_teacher(MODEL, 10, np.random.default_rng()), 0, np.random.default_rng()),
     "n must be an integer ≥ 1"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
