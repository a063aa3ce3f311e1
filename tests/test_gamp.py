"""GAMP on data (spec §7) against state evolution: the noisy linear channel in closed form, and
two-layer attention (T = 2, r = 1, c = 1, β = 1), whose layers are learned one after the other.

The attention model is even in each layer (h_ℓ → −h_ℓ), so without side information GAMP
finds W up to a sign per layer: overlaps are compared in absolute value.  At Bayes-optimality
Q = M = q and |W_ℓ|²/D → 1, so the per-layer cosine similarity tends to √q_ℓℓ."""
import json

import numpy as np
import pytest

from smi_core import DeepAttention, LinkModel, index_symbols, register_link, state_evolution
from smi_core.cli import main
from smi_core.data import cosine, make_teacher, sample
from smi_core.gamp import gamp

register_link("gamp_linear", index_symbols(1, 1)[0, 0])
LINEAR = LinkModel("gamp_linear", threads=1)
ATTENTION = DeepAttention(layers=2, tokens=2, threads=1)
NOISE = 0.5


@pytest.fixture(scope="module")
def linear_channel():
    """The closed-form noisy linear channel (built once: SymPy takes seconds)."""
    return LINEAR.channel(route="closed", noise=NOISE)


def linear_fixed_point(alpha, side_info):
    """y = z + √Δ η: g_out = (y − ω)/(V + Δ), q̂ = α/(1 − q + Δ), q = (q̂ + λ)/(1 + q̂ + λ)."""
    q = 0.5
    for _ in range(10_000):
        q_hat = alpha / (1 - q + NOISE)
        q = (q_hat + side_info) / (1 + q_hat + side_info)
    return q


def linear_data(D, alpha, seed):
    rng = np.random.default_rng(seed)
    teacher = make_teacher(LINEAR, D, rng, noise=NOISE)
    return (teacher, *sample(teacher, int(alpha * D), rng))


@pytest.mark.parametrize("alpha, side_info", [(1.0, 0.0), (0.6, 0.3)])
def test_noisy_linear_channel_matches_state_evolution(linear_channel, alpha, side_info):
    """D = 2000, averaged over 8 seeds (one seed's M spreads by ≈ 0.025, mostly |W|²/D): the
    overlap M, the self-overlap Q and 1 − Ĉ within 0.02 of the closed-form fixed point q; the
    Bayes test error within 5 standard errors of 1 − q + Δ."""
    q = linear_fixed_point(alpha, side_info)
    M, Q, C, err = [], [], [], []
    for seed in range(8):
        teacher, X, y = linear_data(2000, alpha, seed=100 + seed)
        r = gamp(LINEAR, X, y, teacher=teacher, side_info=side_info, channel=linear_channel, rng=seed)
        assert r.converged and r.iterations < 100
        M.append(r.overlap[-1, 0, 0]), Q.append(r.self_overlap[-1, 0, 0]), C.append(r.C_hat[0, 0])
        err.append(r.test_error[-1])
        P = teacher.W @ teacher.W.T / 2000
        np.testing.assert_allclose(r.cosine[:, 0], np.abs(r.overlap[:, 0, 0]) / np.sqrt(r.self_overlap[:, 0, 0] * P[0, 0]))
    M, Q, C = np.mean(M), np.mean(Q), np.mean(C)
    print(f"α = {alpha}, λ = {side_info}: M = {M:.4f}, Q = {Q:.4f}, 1 − Ĉ = {1 - C:.4f}, q = {q:.4f}")
    assert abs(M - q) <= 0.02 and abs(Q - q) <= 0.02 and abs(1 - C - q) <= 0.02
    expected = 1 - q + NOISE                 # the test error's sd per sample is √2 (1 − q + Δ)
    assert abs(np.mean(err) - expected) <= 5 * np.sqrt(2) * expected / np.sqrt(8 * 1000), (np.mean(err), expected)


def test_without_teacher(linear_channel):
    """Only X, y: no overlaps, cosine or test error, an estimate with cosine √q, identical to the
    run with the teacher or a test set given (they only measure), and reproducible."""
    teacher, X, y = linear_data(1000, 1.0, seed=3)
    alone = gamp(LINEAR, X, y, channel=linear_channel, rng=4, max_iter=30)
    assert alone.overlap is None and alone.cosine is None and alone.test_error is None
    assert alone.self_overlap.shape == (alone.iterations + 1, 1, 1)
    q = linear_fixed_point(1.0, 0.0)
    assert abs(cosine(LINEAR, alone.W_hat, teacher.W)[0] - np.sqrt(q)) <= 0.02
    Xt, yt = sample(teacher, 500, np.random.default_rng(5))
    tested = gamp(LINEAR, X, y, channel=linear_channel, rng=4, max_iter=30, test=(Xt, yt))
    np.testing.assert_array_equal(tested.W_hat, alone.W_hat)
    taught = gamp(LINEAR, X, y, teacher=teacher, channel=linear_channel, rng=4, max_iter=30)
    np.testing.assert_array_equal(taught.W_hat, alone.W_hat)
    assert tested.test_error.shape == (tested.iterations + 1,)
    json.dumps(tested.to_dict())
    again = gamp(LINEAR, X, y, channel=linear_channel, rng=4, max_iter=30)
    np.testing.assert_array_equal(again.W_hat, alone.W_hat)


# -- two-layer attention ----------------------------------------------------------------------------

def attention_runs(D, alpha, seeds, max_iter):
    runs = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        teacher = make_teacher(ATTENTION, D, rng)
        X, y = sample(teacher, int(round(alpha * D)), rng)
        runs.append(gamp(ATTENTION, X, y, teacher=teacher, rng=rng, max_iter=max_iter, test_samples=300))
    return runs


def mean_cosine(runs):
    steps = min(len(r.cosine) for r in runs)
    return np.mean([r.cosine[:steps] for r in runs], axis=0)


def first_above(curve, level):
    above = np.flatnonzero(curve >= level)
    return int(above[0]) if above.size else None


def assert_last_layer_first(cos):
    """The last layer's mean cosine reaches 0.5 while the first layer's is still below 0.3, and
    the first layer reaches 0.5 only later."""
    last, first = first_above(cos[:, 1], 0.5), first_above(cos[:, 0], 0.5)
    print("mean cosine per iteration:", np.round(cos, 3).tolist())
    assert last is not None and first is not None and last < first, (last, first)
    assert cos[last, 0] < 0.3, cos[last]


@pytest.fixture(scope="module")
def se_half():
    return state_evolution(ATTENTION, 0.5, samples=2048, channel={"nodes": 10})


def test_two_layer_attention_small_dim(se_half):
    """D = 200, 3 seeds: at α = 1.2 the last layer is learned first, then the first, both fully
    (state evolution: q = I); at α = 0.5 only the last, its mean cosine within 0.05 of √q₂₂ of
    state evolution (0.77), and the first layer's overlap stays 0."""
    high = attention_runs(200, 1.2, 3, 40)
    cos = mean_cosine(high)
    assert_last_layer_first(cos)
    assert (cos[-1] >= 0.98).all(), cos[-1]
    low = attention_runs(200, 0.5, 3, 40)
    cos = mean_cosine(low)
    M = np.mean([np.abs(np.diag(r.overlap[-1])) for r in low], axis=0)
    print(f"α = 0.5: mean cosine {cos[-1]}, |M| {M}, SE q {np.diag(se_half.q)}")
    assert abs(cos[-1, 1] - np.sqrt(se_half.q[1, 1])) <= 0.05
    assert M[0] <= 0.02 and se_half.q[0, 0] < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.5, 1.2])
def test_two_layer_attention_matches_state_evolution(alpha):
    """D = 1000, 8 seeds: mean |M_ℓℓ| at the last of 50 iterations within 0.05 of state
    evolution's q_ℓℓ, and (α = 1.2) the last layer learned first."""
    se = state_evolution(ATTENTION, alpha, samples=8192)
    runs = attention_runs(1000, alpha, 8, 50)
    M = np.mean([np.abs(np.diag(r.overlap[-1])) for r in runs], axis=0)
    print(f"α = {alpha}: mean |M_ℓℓ| {M}, SE q {np.diag(se.q)} ± {np.diag(se.q_stderr)}")
    assert np.abs(M - np.diag(se.q)).max() <= 0.05
    if alpha > 1:
        assert_last_layer_first(mean_cosine(runs))


# -- bad input ----------------------------------------------------------------------------------------

def _small():
    rng = np.random.default_rng(0)
    teacher = make_teacher(ATTENTION, 20, rng)
    return (teacher, *sample(teacher, 30, rng))


@pytest.mark.parametrize("change, match", [
    (lambda t, X, y: dict(X=X[:-1]), "X and y must have the same number of samples"),
    (lambda t, X, y: dict(X=X[:, :, :1]), r"X must have shape \(n, D, 2\)"),
    (lambda t, X, y: dict(X=np.where(np.arange(30)[:, None, None] == 7, np.nan, X)), r"X must be finite \(sample 7"),
    (lambda t, X, y: dict(y=np.where(np.arange(30)[:, None, None] == 4, np.inf, y)), r"y must be finite \(sample 4"),
    (lambda t, X, y: dict(y=y[:, :1]), "y must have shape"),
    (lambda t, X, y: dict(y=y + 0.1), "y does not fit the reparam channel"),
    (lambda t, X, y: dict(side_info=0.5), "side_info > 0 needs the teacher"),
    (lambda t, X, y: dict(side_info=-1.0, teacher=t), "side_info must be ≥ 0"),
    (lambda t, X, y: dict(teacher=make_teacher(ATTENTION, 21, np.random.default_rng())), r"teacher.W must have shape \(2, 20\)"),
    (lambda t, X, y: dict(damping=1.0), r"damping must be in \[0, 1\)"),
    (lambda t, X, y: dict(max_iter=0), "max_iter must be an integer ≥ 1"),
    (lambda t, X, y: dict(noise=0.0), "noise must be > 0"),
])
def test_bad_input(change, match):
    teacher, X, y = _small()
    args = dict(X=X, y=y, max_iter=2) | change(teacher, X, y)
    with pytest.raises(ValueError, match=match):
        gamp(ATTENTION, args.pop("X"), args.pop("y"), **args)


# -- command line ---------------------------------------------------------------------------------------

def test_cli_gamp_and_sgd(tmp_path, capsys):
    """``smi gamp`` / ``smi sgd``: JSON with per-run fields and the averaged table, CSV, figure."""
    for command, steps in (("gamp", ["--iterations", "3", "--tol", "1e-12"]),
                           ("sgd", ["--epochs", "3", "--batch-size", "20"])):
        csv, png = tmp_path / f"{command}.csv", tmp_path / f"{command}.png"
        code = main([command, "--dim", "30", "--alpha", "2", "--seeds", "2", "--test-samples", "50", *steps,
                     "--csv", str(csv), "--plot", str(png), "--json", "--quiet"])
        assert code == 0
        out = json.loads(capsys.readouterr().out)
        assert len(out["runs"]) == 2 and out["n"] == 60
        assert len(out["table"]) == len(out["runs"][0]["cosine"]) == 4     # the start + 3 steps
        assert {"cos_1", "cos_2", "cos_1_sd", "M_11", "M_22"} <= set(out["table"][0])
        assert csv.read_text().count("\n") == len(out["table"]) + 1 and png.stat().st_size > 0


@pytest.mark.parametrize("args, match", [
    (["--alpha", "0"], "alpha must be > 0"),
    (["--alpha", "-1"], "alpha must be > 0"),
    (["--dim", "0"], "dim must be an integer ≥ 1"),
    (["--seeds", "0"], "seeds must be an integer ≥ 1"),
    (["--alpha", "0.001", "--dim", "10"], "at least one sample"),
])
def test_cli_bad_input(args, match, capsys):
    assert main(["gamp", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and match in err, err
