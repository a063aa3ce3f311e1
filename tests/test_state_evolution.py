"""State evolution (spec §5) against closed forms, an independent quadrature of phase retrieval,
the free entropy's stationarity, the layer-wise learning of deep attention, and α = 0 limits."""
import json

import numpy as np
import pytest
from scipy.special import roots_hermitenorm

from smi_core import DeepAttention, LinkModel, index_symbols, register_link
from smi_core.state_evolution import free_entropy, learning_curve, state_evolution

H = index_symbols(1, 1)
register_link("test_phase_retrieval", H[0, 0] ** 2)
register_link("se_linear", H[0, 0])
register_link("se_quadratic", H[0, 0] ** 2 / 2 + H[0, 0])
PR = LinkModel("test_phase_retrieval")


# -- phase retrieval: the weak-recovery threshold α_c = 1/2 and the curve -------------------------

@pytest.mark.parametrize("alpha", [0.4, 0.45, 0.55, 0.6])
def test_phase_retrieval_q0_stable_below_one_half(alpha):
    """Noiseless phase retrieval: near q = 0 one SE step multiplies q by 2α (linear stability),
    so q = 0 is stable for α < 1/2 and unstable for α > 1/2."""
    q0 = 1e-5
    r = state_evolution(PR, alpha, start=[[q0]], max_iter=1, samples=2 ** 14)
    growth = r.q_hat[0, 0] / q0
    assert abs(growth - 2 * alpha) <= 0.02 + 4 * r.stderr[0, 0] / q0, (growth, r.stderr)
    assert (growth < 1) == (alpha < 0.5)


def test_phase_retrieval_uninformed_fixed_points_around_threshold():
    below = state_evolution(PR, 0.4, samples=2 ** 12)
    above = state_evolution(PR, 0.6, samples=2 ** 12, max_iter=500)
    assert below.converged and above.converged
    assert below.q[0, 0] < 1e-4 < 0.02 < above.q[0, 0], (below.q, above.q)


def _pr_fixed_point(alpha, q=0.3, nodes=120):
    """Independent computation: the scalar SE of noiseless phase retrieval by a 2-D
    Gauss–Hermite rule over (ξ, ζ), with g_out = (|Z| tanh(|Z| ω/V) − ω)/V written out here."""
    x, w = roots_hermitenorm(nodes)
    xi, zeta = np.meshgrid(x, x, indexing="ij")
    W = np.outer(w, w) / w.sum() ** 2
    for _ in range(10_000):
        V, om = 1 - q, np.sqrt(q) * xi
        r = np.abs(om + np.sqrt(V) * zeta)
        g = (r * np.tanh(r * om / V) - om) / V
        q_hat = alpha * (W * g * g).sum()
        q, old = q_hat / (1 + q_hat), q
        if abs(q - old) < 1e-13:
            return q
    raise AssertionError("reference SE did not converge")


def test_phase_retrieval_curve_matches_independent_quadrature():
    alphas = [0.7, 0.8, 1.0]
    curve = learning_curve(PR, alphas, samples=2 ** 16, tol=1e-6, max_iter=1000, progress=False)
    for r in curve:
        expected = _pr_fixed_point(r.alpha)
        assert r.converged
        assert abs(r.q[0, 0] - expected) <= 4 * r.q_stderr[0, 0] + 1e-4, (r.alpha, r.q, expected, r.q_stderr)


def test_stderr_tol_grows_the_draws_until_q_is_that_precise():
    """With ``stderr_tol`` the draws grow (each block continuing its Sobol sequence) until
    the standard error of the fixed point q is below it: noiseless phase retrieval at α = 0.7
    (q ≈ 0.12, a slowly contracting fixed point) from 256 draws, against the independent quadrature."""
    plain = state_evolution(PR, 0.7, samples=256, tol=1e-6, max_iter=1000)
    r = state_evolution(PR, 0.7, samples=256, tol=1e-6, max_iter=1000, stderr_tol=2e-3)
    assert plain.q_stderr[0, 0] > 2e-3 and plain.samples == 256
    assert r.converged and r.q_stderr[0, 0] <= 2e-3 and r.samples > 256
    assert r.iterations == len(r.trajectory) > plain.iterations
    expected = _pr_fixed_point(0.7)
    assert abs(r.q[0, 0] - expected) <= 4 * r.q_stderr[0, 0], (r.q, expected, r.q_stderr)
    capped = state_evolution(PR, 0.7, samples=256, tol=1e-6, max_iter=1000, stderr_tol=1e-6,
                             max_samples=2048)
    assert capped.samples == 2048 and capped.q_stderr[0, 0] > 1e-6     # the ceiling, reported


def test_q_stderr_matches_the_spread_of_fixed_points_over_seeds():
    """The standard error of the fixed point (delta method, _Problem.fixed_point_stderr) against
    the spread of q* over 24 independent scrambled Sobol sets of 1024 draws: phase retrieval at
    α = 0.7, a slowly contracting fixed point (q ≈ 0.12), where (1 − J)⁻¹ amplifies the spread
    of q̂ several times.  Measured: spread 0.0263, mean stderr 0.0248.  Within a factor 1.5
    (a standard deviation from 24 values is itself uncertain by ≈ 15 %)."""
    runs = [state_evolution(PR, 0.7, samples=1024, seed=s, tol=1e-7, max_iter=2000) for s in range(24)]
    spread = np.std([r.q[0, 0] for r in runs], ddof=1)
    stderr = np.mean([r.q_stderr[0, 0] for r in runs])
    assert spread / 1.5 < stderr < 1.5 * spread, (spread, stderr)


def test_q_stderr_does_not_depend_on_the_path_to_the_fixed_point():
    """Two-layer attention at α = 0.85 (q ≈ (0.38, 0.99): the first layer rising, J's largest
    eigenvalue ≈ 0.9): the standard error of q* reached from a start 0.1 away and from q*
    itself agree within 10 %.  (Measured from the contraction seen along the iterations, which
    the channel's quadrature noise dominates once the steps are small, it came out 3× apart.)"""
    model = DeepAttention(layers=2, tokens=2)
    a = state_evolution(model, 0.85, start=np.diag([0.28, 0.98]), samples=4096)
    b = state_evolution(model, 0.85, start=a.q, samples=4096)
    assert a.converged and b.converged and np.abs(a.q - b.q).max() < 1e-3
    assert abs(a.q_stderr[0, 0] - b.q_stderr[0, 0]) <= 0.1 * a.q_stderr[0, 0], (a.q_stderr, b.q_stderr)


def test_draws_grow_by_continuing_each_block():
    """A larger set of draws contains the smaller one block by block (Sobol and MC), and going
    back to fewer draws gives the same draws again."""
    from smi_core.state_evolution import BLOCKS, _Draws
    for sampler in ("sobol", "mc"):
        d = _Draws(512, 2, 2, 4, True, sampler, np.random.default_rng(5))
        small = [a.reshape(BLOCKS, 64, -1).copy() for a in (d.xi, d.zeta, d.eta)]
        d.use(256)
        assert d.n == 2048
        for a, b in zip(small, (d.xi, d.zeta, d.eta)):
            b = b.reshape(BLOCKS, 256, -1)
            assert np.array_equal(a, b[:, :64]) and not np.array_equal(b[:, :64], b[:, 64:128])
        d.use(64)
        assert all(np.array_equal(a, b.reshape(BLOCKS, 64, -1)) for a, b in zip(small, (d.xi, d.zeta, d.eta)))


# -- linear channel with noise: closed form ---------------------------------------------------------

@pytest.mark.parametrize("noise, alpha, side_info", [(0.5, 1.0, 0.0), (0.1, 2.5, 0.0), (0.3, 0.7, 0.2)])
def test_linear_noisy_channel_closed_form(noise, alpha, side_info):
    """y = z + √Δ η: g_out = (y − ω)/(V + Δ), so q̂ = α/(1 − q + Δ) and
    q = (q̂ + λ)/(1 + q̂ + λ); prediction errors 1 − q + Δ (Bayes) and 1 − q (plug-in)."""
    q = 0.5
    for _ in range(10_000):
        q_hat = alpha / (1 - q + noise)
        q = (q_hat + side_info) / (1 + q_hat + side_info)
    r = state_evolution(LinkModel("se_linear"), alpha, noise=noise, side_info=side_info,
                        samples=2 ** 15, tol=1e-9, max_iter=1000)
    assert abs(r.q[0, 0] - q) <= 1e-4, (r.q, q)
    assert abs(r.q_hat[0, 0] - q_hat) <= 4 * r.stderr[0, 0], (r.q_hat, q_hat, r.stderr)
    assert abs(r.prediction_error - (1 - q + noise)) <= 1e-3 + 4 * r.prediction_error_stderr
    assert abs(r.plugin_error - (1 - q)) <= 1e-3 + 4 * r.plugin_error_stderr
    # f = −½ q q̂ + ½ [q̂ + λ − log(1 + q̂ + λ)] + α E log N(y; ω, V + Δ)
    f = (-0.5 * q * q_hat + 0.5 * (q_hat + side_info - np.log(1 + q_hat + side_info))
         - 0.5 * alpha * (np.log(2 * np.pi * (1 - q + noise)) + 1))
    assert abs(r.free_entropy - f) <= 1e-4 + 4 * r.free_entropy_stderr, (r.free_entropy, f)


# -- stationarity of the free entropy -----------------------------------------------------------------

@pytest.mark.parametrize("model, noise, alpha", [
    (LinkModel("se_linear"), 0.3, 1.2),
    (PR, 0.2, 1.5),
    (LinkModel("se_quadratic"), 0.1, 0.8),
], ids=["noisy-linear", "noisy-phase-retrieval", "noisy-quadratic"])
def test_fixed_point_is_stationary_point_of_free_entropy(model, noise, alpha):
    """∂f/∂q and ∂f/∂q̂ vanish at the SE fixed point (central differences, same draws)."""
    opts = dict(noise=noise, samples=2 ** 13, seed=3)
    r = state_evolution(model, alpha, tol=1e-7, max_iter=2000, **opts)
    q, q_hat, h = r.q[0, 0], r.q_hat[0, 0], 1e-4
    f = lambda a, b: free_entropy(model, alpha, [[a]], [[b]], **opts)[0]
    df_dq = (f(q + h, q_hat) - f(q - h, q_hat)) / (2 * h)
    df_dqhat = (f(q, q_hat + h) - f(q, q_hat - h)) / (2 * h)
    scale = 0.5 * q_hat      # the size of each of the two terms that cancel in ∂f/∂q
    print(f"∂f/∂q = {df_dq:.2e}, ∂f/∂q̂ = {df_dqhat:.2e}, q̂/2 = {scale:.3f}")
    assert abs(df_dq) <= 0.02 * scale, (df_dq, scale)
    assert abs(df_dqhat) <= 1e-6, df_dqhat


# -- deep attention: the staircase ----------------------------------------------------------------

FAST = dict(samples=2048, channel=dict(nodes=10, error_estimate=False))


def test_two_layer_attention_layers_learned_one_after_the_other():
    """T = 2, r = 1, c = 1, β = 1: at α = 0.5 the last layer is learned (q_22 > 0.5) and the first
    is not (q_11 < 0.05); at α = 1.3 both are (> 0.5)."""
    model = DeepAttention(layers=2, tokens=2)
    low = state_evolution(model, 0.5, **FAST)
    high = state_evolution(model, 1.3, **FAST)
    assert low.converged and high.converged
    assert low.q[1, 1] > 0.5 and low.q[0, 0] < 0.05, low.q
    # the uninformed start stays on the AMP branch (an accelerated step once jumped to q = I)
    mid = state_evolution(model, 0.7, **FAST)
    assert mid.q[0, 0] < 0.05 < 0.9 < mid.q[1, 1] < 0.99, mid.q
    assert high.q[0, 0] > 0.5 and high.q[1, 1] > 0.5, high.q
    assert (low.mse == 1 - np.diag(low.q)).all()


@pytest.mark.slow
def test_three_layer_attention_last_layer_first_then_earlier_two_together():
    """L = 3: at α = 0.5 only the last layer is learned; at α = 1.6 the two earlier layers have
    risen together (their overlaps within 0.1 of each other along the way and at the end)."""
    model = DeepAttention(layers=3, tokens=2)
    opts = dict(samples=512, channel=dict(nodes=5, error_estimate=False))
    low = state_evolution(model, 0.5, **opts)
    high = state_evolution(model, 1.6, max_iter=40, **opts)
    assert low.q[2, 2] > 0.5 and np.diag(low.q)[:2].max() < 0.05, low.q
    assert min(high.q[0, 0], high.q[1, 1]) > 0.5 and high.q[2, 2] > 0.99, high.q
    gap = np.abs(high.trajectory[:, 0, 0] - high.trajectory[:, 1, 1])
    assert gap.max() < 0.15 and gap[-1] < 0.1, gap


def test_nishimori_control_variate_lowers_the_standard_error_of_q_hat():
    """q̂ with the control variate D = Σ_t (g gᵀ + ∂g)_tt (mean zero under the model) agrees with
    the plain average within their standard errors, and its standard error is several times
    smaller on the rising branch (two-layer attention, α = 0.5: q₂₂ ≈ 0.77; measured 4.3×)."""
    model, q = DeepAttention(layers=2, tokens=2), np.diag([0.0, 0.77])
    from smi_core.state_evolution import _Problem
    runs = [_Problem(model, None, 0.0, 4096, "sobol", np.random.default_rng(0), {},
                     control_variate=cv).step(q, 0.5) for cv in (False, True)]
    (plain, plain_err, *_), (cv, cv_err, *_) = runs
    assert abs(cv[1, 1] - plain[1, 1]) < 4 * np.hypot(cv_err[1, 1], plain_err[1, 1])
    assert cv_err[1, 1] < plain_err[1, 1] / 2
    from smi_core.state_evolution import _Draws
    draws = _Draws(4096, 1, 1, 1, False, "mc", np.random.default_rng(1))
    x = draws.zeta[:, 0, 0]                        # a synthetic check: E[x² + x] = 1 with x as control
    mean, err = draws.mean(draws.controlled(x ** 2 + x, x))
    assert abs(mean - 1) < 4 * err and err < draws.mean(x ** 2 + x)[1]


# -- α = 0: the errors of the prior predictive --------------------------------------------------------

@pytest.mark.parametrize("model, noise", [(DeepAttention(layers=2, tokens=2), None), (PR, 0.3)],
                         ids=["attention", "noisy-phase-retrieval"])
def test_prediction_errors_at_alpha_zero(model, noise):
    """At α = 0 (q = 0): the Bayes-optimal error is the variance of y, the plug-in error the mean
    squared distance of y's noiseless part to g(0), by independent Monte Carlo."""
    r = state_evolution(model, 0.0, noise=noise, samples=2 ** 14, channel=FAST["channel"] if noise is None else None)
    assert np.allclose(r.q, 0)
    Z = np.random.default_rng(11).standard_normal((400_000, model.indices, model.tokens))
    g = model.forward(Z).reshape(len(Z), -1)
    variance = g.var(axis=0).sum() + (noise or 0.0) * g.shape[1]
    g0 = model.forward(np.zeros((1, model.indices, model.tokens))).reshape(1, -1)
    plugin = ((g - g0) ** 2).sum(axis=1).mean()
    mc = lambda x: 4 * x.std() / np.sqrt(len(x))
    assert abs(r.prediction_error - variance) <= 4 * r.prediction_error_stderr + 0.01 * variance
    assert abs(r.plugin_error - plugin) <= 4 * r.plugin_error_stderr + mc(((g - g0) ** 2).sum(axis=1))


# -- the curve and bad input ----------------------------------------------------------------------------

def test_learning_curve_both_starts_report_a_gap():
    """Phase retrieval just above α = 1: the informed start reaches q ≈ 1, the uninformed one
    stays lower; both fixed points are reported."""
    curve = learning_curve(PR, [0.3, 1.05], start="both", samples=2 ** 12, max_iter=500, progress=False)
    assert curve[0].alternative is None
    gap = curve[1]
    assert gap.alternative is not None
    qs = sorted([gap.q[0, 0], gap.alternative.q[0, 0]])
    assert qs[0] < 0.9 < 0.999 < qs[1]
    assert {gap.start, gap.alternative.start} == {"uninformed", "informed"}


def test_trajectory_and_result_fields():
    r = state_evolution(PR, 0.8, samples=2 ** 12)
    assert r.trajectory.shape == (r.iterations, 1, 1)
    assert r.trajectory[0, 0, 0] == pytest.approx(1e-3)
    d = r.to_dict()
    for key in ("q", "q_hat", "mse", "prediction_error", "plugin_error", "free_entropy",
                "trajectory", "stderr", "iterations"):
        assert key in d


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=-1.0), "alpha"),
    (dict(alpha=1.0, damping=1.0), "damping"),
    (dict(alpha=1.0, samples=3), "samples"),
    (dict(alpha=1.0, start="warm"), "start"),
    (dict(alpha=1.0, start=np.eye(2)), "start"),
    (dict(alpha=1.0, sampler="grid"), "sampler"),
    (dict(alpha=1.0, side_info=-0.1), "side_info"),
    (dict(alpha=1.0, noise=0.0), "noise"),
    (dict(alpha=1.0, tol=0.0), "tol"),
    (dict(alpha=1.0, stderr_tol=-1e-3), "stderr_tol"),
    (dict(alpha=1.0, stderr_tol=1e-3, samples=4096, max_samples=1024), "max_samples"),
])
def test_bad_input_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        state_evolution(PR, **kwargs)


@pytest.mark.parametrize("start", ["warm", np.eye(1)])
def test_learning_curve_bad_start_is_a_value_error(start):
    with pytest.raises(ValueError, match="start"):        # a matrix had raised numpy's own error
        learning_curve(PR, [0.3], start=start, progress=False)


def test_cli_se_json_csv_and_figure(tmp_path, capsys):
    from smi_core.cli import main
    csv, png = tmp_path / "se.csv", tmp_path / "figures" / "se.png"     # the folder is made
    code = main(["se", "--alphas", "0.3,0.6", "--samples", "256", "--nodes", "6", "--quiet",
                 "--csv", str(csv), "--plot", str(png), "--json", "--stderr-tol", "1.0"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["alpha"] for p in out["points"]] == [0.3, 0.6]
    for key in ("q", "q_hat", "mse", "prediction_error", "plugin_error", "free_entropy", "stderr",
                "q_stderr", "samples"):
        assert key in out["points"][0]
    assert csv.read_text().splitlines()[0].startswith("alpha,q_1,q_2,")
    assert png.stat().st_size > 10_000


def test_cli_se_bad_alphas_is_a_clear_error(capsys):
    from smi_core.cli import main
    assert main(["se", "--alphas", "0:1", "--quiet"]) == 2
    assert "--alphas" in capsys.readouterr().err


def test_stagnation_needs_a_narrow_band_without_drift():
    """SE stops at the channel's noise floor: iterates jittering within tol (no monotone entry)
    count as converged; a slow monotone drift within tol or a jitter wider than tol do not."""
    from smi_core.state_evolution import _stagnated
    rng = np.random.default_rng(0)
    base = np.diag([0.3, 0.6])
    jitter = [base + 2e-5 * rng.standard_normal((2, 2)) for _ in range(6)]
    assert _stagnated(jitter, 1e-4)
    assert not _stagnated(jitter, 1e-5)
    drift = [base + 1e-5 * k * np.eye(2) + 1e-6 * rng.standard_normal((2, 2)) * np.array([[0, 1], [1, 0]])
             for k in range(6)]
    assert not _stagnated(drift, 1e-4)
    assert not _stagnated(jitter[:5], 1e-4)


def test_se_step_near_q_equal_identity_with_rounding_asymmetry():
    """The three-layer curve stopped at α ≈ 1.6 with 'V must be symmetric positive definite':
    its q ≈ I carried a rounding-level asymmetry (7.6e-17), which in V = I − q (entries ≈ 3e-5)
    is 2e-12 relative — over the channel's 1e-12 check.  That q (from the failing run) must
    give an exactly symmetric V and a finite SE step."""
    from smi_core.state_evolution import _Problem
    V = np.array([[3.4888597141180533e-05, -1.4018965803717140e-06, 1.0715783486338315e-07],
                  [-1.4018965802957491e-06, 3.9285352735562995e-05, -1.8305276108287905e-09],
                  [1.0715783486355426e-07, -1.8305276107985000e-09, 1.0003390168433768e-06]])
    q = np.eye(3) - V
    assert np.abs(q - q.T).max() > 0                      # the asymmetry of the failing run
    problem = _Problem(DeepAttention(3, 2), None, 0.0, 64, "sobol", np.random.default_rng(0),
                       {"nodes": 3, "error_estimate": False})
    _, V_used, _ = problem.fields(q)
    assert (V_used == V_used.T).all()
    q_hat, *_ = problem.step(q, 1.6)
    assert np.isfinite(q_hat).all()


def test_fixed_point_reports_what_the_muted_channel_does_not_resolve():
    """SE runs three layers without the channel's estimate; the fixed point still measures it
    once (``_Problem.audit``): between the transitions, with the last layer pinned (q =
    diag(0.31, 0.10, 0.99), where on 256 draws 54 % estimate above FLAG[0]), a share of the
    draws is flagged and a warning names the regime, and the channel goes back to running
    without it.  Where the options ask for no estimate, nothing is measured."""
    from smi_core.state_evolution import _Problem
    q = np.diag([0.31, 0.10, 0.99])
    problem = _Problem(DeepAttention(3, 2), None, 0.0, 64, "sobol", np.random.default_rng(0), None)
    assert problem.channel.error_estimate is False
    problem.moments(q)
    assert np.isnan(problem.flagged)
    with pytest.warns(UserWarning, match="last layer is pinned"):
        share = problem.audit(q)
    assert 0.2 < share < 1.0 and share == problem.flagged
    assert problem.channel.error_estimate is False
    asked = _Problem(DeepAttention(3, 2), None, 0.0, 64, "sobol", np.random.default_rng(0), {"error_estimate": False})
    asked.moments(q)
    assert np.isnan(asked.audit(q))


def test_jacobian_steps_stay_inside_near_perfect_recovery():
    """A two-layer T = 3 curve (α on np.arange(0.05, 0.75, 0.05), 1024 draws) stopped with 'V
    must be symmetric positive definite' in the Newton check's Jacobian: at q ≈ (1 − V_MIN) I
    the off-diagonal direction's step (at least 1e-6) makes V = I − q ∓ hE singular for either
    sign, and indefinite where q's eigenvalues exceed 1 − V_MIN by rounding (as those
    ``_project`` returns can, here by 1e-15).  There the step now shrinks to keep V positive
    definite, and J is finite."""
    from smi_core.state_evolution import V_MIN, _Problem
    problem = _Problem(DeepAttention(layers=2, tokens=2), None, 0.0, 1024, "sobol", np.random.default_rng(0),
                       {"error_estimate": False})
    J = problem.jacobian((1 - V_MIN + 1e-15) * np.eye(2), 1.0)
    assert J.shape == (3, 3) and np.isfinite(J).all()


def test_an_output_without_a_float64_preimage_counts_as_zero(monkeypatch):
    """A draw of a long two-layer run (2¹⁸ draws, α = 0.95) gave both rows of y within 1.1e-8
    of ½ ± the same amount: u₁ ≈ u₂, whose pre-image u = ±(a, −b)/√(a + b) rounding has lost
    (a + b = (u₁ − u₂)² ≈ 1e-15 cancels to ≤ 0).  The channel rejects it (ValueError), the
    channel's ``representable`` says so, and state evolution counts that draw as 0."""
    from smi_core.state_evolution import _Problem
    y_bad = np.array([[0.5000000108078761, 0.49999998919212385],
                      [0.5000000108078761, 0.49999998919212385]])
    model = DeepAttention(layers=2, tokens=2)
    channel = model.channel(error_estimate=False)
    assert not channel.representable(y_bad[None])[0]
    with pytest.raises(ValueError, match="pre-image"):
        channel.moments(y_bad[None], np.zeros((1, 2, 2)), np.eye(2))
    problem = _Problem(model, None, 0.0, 64, "sobol", np.random.default_rng(0), channel)
    q = np.diag([0.3, 0.5])
    g, dg, log_z = problem.moments(q)
    clean = problem.outputs
    monkeypatch.setattr(problem, "outputs", lambda Z: np.concatenate([y_bad[None], clean(Z)[1:]]))
    g2, dg2, log_z2 = problem.moments(q)
    assert (g2[0] == 0).all() and (dg2[0] == 0).all() and log_z2[0] == 0
    # the others as before (to the rule's accuracy: the dropped draw no longer shapes the rings)
    assert np.allclose(g2[1:], g[1:], rtol=1e-6, atol=1e-9) and np.allclose(dg2[1:], dg[1:], rtol=1e-6, atol=1e-9)


def test_uninformed_start_stays_on_the_branch_amp_reaches():
    """Two-layer attention at α = 0.5 warm-started from the α = 0.3 fixed point (q = diag(1e-3,
    0.21), what a two-point curve 0.3, 0.5 does): the fixed point is q = (0, 0.77).  An
    accelerated step along a secant through the first iterates (ρ̂ = 0.95) used to throw q₂₂
    to 1, and the iteration ended near (0.96, 1), the fixed point with both layers learned,
    without converging in 200 iterations."""
    r = state_evolution(DeepAttention(layers=2, tokens=2), 0.5, start=np.diag([1e-3, 0.2089]))
    assert r.converged and r.q[0, 0] < 1e-3 and abs(r.q[1, 1] - 0.77) < 0.01, r.q
    assert r.trajectory[:, 1, 1].max() < 0.78


def test_converged_means_within_tol_of_the_fixed_point():
    """Just above α₂ ≈ 0.185 q₂₂ leaves q ≈ 0 slowly (the map barely expands there): from the
    α = 0.15 fixed point (floored at the uninformed start) the residual is ≈ 6e-5 after one step
    and the contraction seen along two steps said converged at q₂₂ = 0.001, where the fixed
    point of the same draws is ≈ 0.02.  Convergence is now confirmed by a Newton step with the
    map's Jacobian: the reported q is within tol of where a tight iteration ends."""
    model = DeepAttention(layers=2, tokens=2)
    low, high = learning_curve(model, [0.15, 0.2], progress=False, samples=4096)
    tight = state_evolution(model, 0.2, start=high.q, samples=4096, tol=1e-7, max_iter=400)
    assert high.converged and tight.converged
    assert np.abs(tight.q - high.q).max() < 1e-4, (high.q, tight.q)
    assert high.q[1, 1] > 0.01, high.q


@pytest.mark.parametrize("q, polar_off", [((0.59, 0.995), 0), ((0.95, 0.998), 1)])
def test_se_channel_resolves_the_pinned_regime(q, polar_off):
    """Two layers with the last layer nearly learned, q = diag(0.59, 0.995) (α ≈ 0.9) and
    diag(0.95, 0.998) (layer 1's conditional sd 0.22, just above the polar rule's threshold): the
    polar rule alone is off on pinned samples (on these 256 draws q̂₁₁ by 0.18 % at the first q,
    q̂₂₂ by 0.12 % at the second; entry ``polar_off`` is checked at 0.1 %), so SE's channel keeps
    the estimate that sends them to finer rules: each entry of q̂ agrees with the tol = 1e-7
    channel to 1e-6 (measured ≤ 3.6e-7; mixing in the Laplace rule above the threshold, as three
    layers do, put q̂₁₁ 5.2e-5 off)."""
    from smi_core.state_evolution import _Problem
    model, q = DeepAttention(layers=2, tokens=2), np.diag(q)

    def q_hat(channel):
        return np.diag(_Problem(model, None, 0.0, 256, "sobol", np.random.default_rng(0), channel).step(q, 1.0)[0])

    reference = q_hat({"tol": 1e-7})
    assert (np.abs(q_hat(None) - reference) <= 1e-6 * reference).all()
    assert np.abs(q_hat({"error_estimate": False}) - reference)[polar_off] > 1e-3 * reference[polar_off]


@pytest.mark.parametrize("noise", [None, 1e-5, 1e-2])
def test_se_channel_keeps_the_estimate_where_it_escalates(noise):
    """SE's channel computes the per-sample estimate where it changes the moments: two layers,
    noiseless (the adaptive rule for pinned samples), noisy below the noisy route's
    POLAR_MIN_NOISE (finer rings of h_1) and at Δ ≥ 1e-3 (the conditional rule, at SE's cheaper
    CONDITIONAL unless the options give ``tol`` or ``conditional``); it escalates from SE's
    ESCALATE, not from the channel's default, and noiseless by SE's ESCALATION (T = 2: eight
    rounds to ESCALATE itself, the channel's ten to a tenth of it; T = 3 the channel's six)
    unless the options give ``tol``."""
    from smi_core.noisy_channel import NoisyChannel
    from smi_core.reparam_channel import ReparamChannel
    from smi_core.state_evolution import CONDITIONAL, ESCALATE, ESCALATION, _channel
    model = DeepAttention(layers=2, tokens=2)
    channel = _channel(model, noise, None)
    assert channel.escalates and channel.error_estimate and channel.escalate == ESCALATE
    if noise is None:
        assert channel.escalation == {**ReparamChannel.ESCALATION[2], **ESCALATION[2]}
        assert _channel(model, noise, {"tol": 1e-6}).escalation == ReparamChannel.ESCALATION[2]
        assert _channel(DeepAttention(layers=2, tokens=3), noise, None).escalation == ReparamChannel.ESCALATION[3]
    else:
        assert channel.conditional == {**NoisyChannel.CONDITIONAL, **CONDITIONAL}
        assert _channel(model, noise, {"tol": 1e-6}).conditional == NoisyChannel.CONDITIONAL


def test_se_conditional_rule_with_the_last_layer_pinned():
    """Noisy two layers (Δ = 0.1) at q = diag(0.26, 0.98), α = 8 (near the fixed point at
    α = 8): SE's q̂ with its cheaper conditional rule within 1e-3 (relative) of q̂ with the
    channel's default conditional rule (measured 2.2e-4 / 1.6e-4 for q̂₁₁ / q̂₂₂ on these 128
    draws), and the Laplace rule alone (SE's channel until 2026-11-28) more than 1e-2 off on
    q̂₁₁ (measured 7.7 %)."""
    from smi_core.noisy_channel import NoisyChannel
    from smi_core.state_evolution import _Problem
    model, q = DeepAttention(layers=2, tokens=2), np.diag([0.26, 0.98])

    def q_hat(channel):
        return np.diag(_Problem(model, 0.1, 0.0, 128, "sobol", np.random.default_rng(0), channel).step(q, 8.0)[0])

    reference = q_hat({"conditional": NoisyChannel.CONDITIONAL})
    assert (np.abs(q_hat(None) - reference) <= 1e-3 * reference).all()
    assert abs(q_hat({"error_estimate": False})[0] - reference[0]) > 1e-2 * reference[0]


def test_se_channel_keeps_the_estimate_for_two_index_links():
    """R·T = 2 (and 3, 4) links: curved posteriors escalate to the ridge-refined adaptive rule
    (``channel.ridges``), from SE's ESCALATE; one-index links do not need it."""
    from smi_core.state_evolution import ESCALATE, _channel
    H = index_symbols(2, 1)
    register_link("se_product", H[0, 0] * H[1, 0])
    channel = _channel(LinkModel("se_product"), 0.01, None)
    assert channel.ridges and channel.escalates and channel.error_estimate and channel.escalate == ESCALATE
    channel = _channel(LinkModel("se_product"), 0.01, {"error_estimate": False})
    assert not channel.error_estimate
    assert not _channel(DeepAttention(layers=1, tokens=2), 0.01, None).ridges
    H = index_symbols(3, 1)
    register_link("se_three", H[0, 0] ** 2 + H[1, 0] ** 2 + H[2, 0] ** 2 / 2)
    channel = _channel(LinkModel("se_three"), 0.1, None)       # R·T = 3: a shell, also escalated
    assert channel.ridges and channel.escalates and channel.escalate == ESCALATE


def test_se_flags_samples_the_channel_does_not_resolve():
    """R·T = 5 (``channel.unresolved``): the Laplace rule (randomised QMC) keeps curved
    posteriors, which its estimate flags; SE keeps the estimate on, warns, and reports the share
    at the fixed point.  A one-index link's closed form (exact, error 0) has nothing to flag."""
    H = index_symbols(5, 1)
    register_link("se_five", sum(H[a, 0] ** 2 for a in range(5)))
    with pytest.warns(UserWarning, match="error estimate is above.*R·T > 4"):
        r = state_evolution(LinkModel("se_five"), 1.0, noise=0.1, samples=256, max_iter=1)
    assert r.channel_flagged > 0.5
    r = state_evolution(LinkModel("se_linear"), 1.0, noise=0.1, samples=256, max_iter=1)
    assert r.channel_flagged == 0
