"""Weak-recovery thresholds and the staircase (spec §6) against closed forms, an independent
quadrature and state evolution itself."""
import json

import numpy as np
import pytest
from numpy.polynomial.hermite_e import hermegauss

import channel_reference as ref
from smi_core import DeepAttention, LinkModel, index_symbols, register_link, state_evolution
from smi_core.cli import main
from smi_core.thresholds import _Rule, apply, perron, phase_diagram, staircase, weak_recovery_threshold

for T in (2, 3):
    H = index_symbols(1, T)
    register_link(f"th_phase_retrieval_T{T}", [H[0, t] ** 2 for t in range(T)])
register_link("test_phase_retrieval", index_symbols(1, 1)[0, 0] ** 2)     # as in test_state_evolution
PHASE_RETRIEVAL = LinkModel("test_phase_retrieval")
H2 = index_symbols(2, 1)
register_link("th_product", H2[0, 0] * H2[1, 0])
QUADRATIC = (1.0, 1.0, 0.5)       # y = h_1² + h_2² + h_3²/2 + noise (R·T = 3)
register_link("th_quadratic", sum(c * h ** 2 for c, h in zip(QUADRATIC, index_symbols(3, 1)[:, 0])))
CLOSED = {"route": "closed"}
TWO_LAYER = DeepAttention(layers=2, tokens=2)


def test_perron_matches_a_dense_eigensolver():
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((2, 3, 3))
    F = np.einsum("ac,bd->abcd", A, A) + np.einsum("ac,bd->abcd", B, B)    # M ↦ AMAᵀ + BMBᵀ
    dense = F.reshape(9, 9)
    rho, M = perron(F)
    assert rho == pytest.approx(np.abs(np.linalg.eigvals(dense)).max(), rel=1e-10)
    assert np.linalg.eigvalsh(M).min() > -1e-12
    assert np.allclose(apply(F, M), rho * M, atol=1e-10)


@pytest.mark.parametrize("sampler", ["auto", "sobol", "mc"])
def test_noiseless_phase_retrieval_threshold_is_one_half(sampler):
    """"auto": a Gauss–Hermite rule (one dimension); "sobol", "mc": sampled, with error bars."""
    th = weak_recovery_threshold(PHASE_RETRIEVAL, channel=CLOSED, sampler=sampler)
    if sampler == "auto":
        assert abs(th.alpha - 0.5) < 1e-3
    assert th.stderr < (1e-3 if sampler != "mc" else 3e-3)      # Monte Carlo: 2^18 draws at most
    assert abs(th.alpha - 0.5) < 4 * th.stderr + 1e-12
    assert th.direction.shape == (1, 1) and th.indices == [0]


@pytest.mark.parametrize("T, sampler", [(2, "auto"), (3, "auto"), (2, "sobol")])
def test_tokens_add_information_threshold_is_one_over_2T(T, sampler):
    th = weak_recovery_threshold(LinkModel(f"th_phase_retrieval_T{T}"), channel=CLOSED, sampler=sampler)
    assert abs(th.alpha - 1 / (2 * T)) < 4 * th.stderr + 1e-12
    assert th.stderr < 1e-3 / T


def test_token_wise_closed_channel_is_the_product_of_one_token_channels():
    rng = np.random.default_rng(2)
    n = 50
    y, omega, V = rng.uniform(0.05, 4, (n, 3)), rng.standard_normal((n, 1, 3)), 0.3
    three = LinkModel("th_phase_retrieval_T3").channel(route="closed").moments(y, omega, V)
    one = PHASE_RETRIEVAL.channel(route="closed").moments(y.reshape(-1), omega.reshape(-1, 1, 1), V)
    assert np.allclose(three.log_z, one.log_z.reshape(n, 3).sum(axis=1), rtol=1e-13)
    assert np.allclose(three.g_out.reshape(n, 3), one.g_out.reshape(n, 3), rtol=1e-13)
    assert np.allclose(np.diagonal(three.dg_out, axis1=1, axis2=2), one.dg_out.reshape(n, 3), rtol=1e-13)
    assert np.count_nonzero(three.dg_out - np.einsum("nt,ts->nts", np.diagonal(three.dg_out, axis1=1, axis2=2),
                                                      np.eye(3))) == 0


def _product_link_reference(noise: float, n: int = 32) -> float:
    """α_c of y = z₁z₂ + √Δ η by tensor Gauss–Hermite sums written out here: the posterior
    moments of z given y on an n×n grid, the outer average over (z, η) on an n×n×16 grid."""
    x, w = hermegauss(n)
    w = w / w.sum()
    z1, z2 = np.meshgrid(x, x, indexing="ij")
    zz, wz = np.stack([z1.ravel(), z2.ravel()], axis=1), np.outer(w, w).ravel()
    e, we = hermegauss(16)
    we = we / we.sum()
    y = (zz[:, 0] * zz[:, 1])[:, None] + np.sqrt(noise) * e[None, :]          # outer nodes
    y, wy = y.ravel(), (wz[:, None] * we[None, :]).ravel()
    lik = np.exp(-(y[:, None] - zz[:, 0] * zz[:, 1]) ** 2 / (2 * noise)) * wz      # (outer, inner)
    post = lik / lik.sum(axis=1, keepdims=True)
    mean = post @ zz
    second = np.einsum("ok,ka,kb->oab", post, zz, zz)
    J = second - np.einsum("oa,ob->oab", mean, mean) - np.eye(2)
    F = np.einsum("o,oac,obd->abcd", wy, J, J).reshape(4, 4)
    return 1 / np.abs(np.linalg.eigvals(F)).max()


def _product_link_semi_analytic(noise: float) -> float:
    """α_c of y = z₁z₂ + √Δ η with z₂ integrated in closed form: given z₁, z₂ | y is
    N(z₁y/(Δ + z₁²), Δ/(Δ + z₁²)) and y ~ N(0, Δ + z₁²), so the posterior moments are 1-D
    integrals in z₁ (trapezoid on ±14, 20 001 points) and F = ∫ p(y) J(y) ⊗ J(y) dy one more
    (y = 2 sinh u, u on ±5, 4 001 points).  Halving both steps moves α_c by 4e-13; halving
    again and widening both ranges (±16, ±6), by 2e-12."""
    t = np.linspace(-14, 14, 20001)
    u = np.linspace(-5, 5, 4001)
    y, dy = 2 * np.sinh(u), 2 * np.cosh(u) * (u[1] - u[0])
    v = noise + t ** 2
    F = np.zeros((2, 2, 2, 2))
    for k in range(0, len(y), 500):
        yy = y[k:k + 500, None]
        dens = np.exp(-0.5 * t ** 2 - 0.5 * yy ** 2 / v) / (2 * np.pi * np.sqrt(v))     # (y, z₁)
        p_y = dens.sum(axis=1) * (t[1] - t[0])
        post = dens / dens.sum(axis=1, keepdims=True)
        m = t * yy / v                                                                  # E[z₂ | z₁, y]
        e11, e12, e22 = post @ t ** 2, (post * t * m).sum(axis=1), (post * (noise / v + m ** 2)).sum(axis=1)
        J = np.stack([np.stack([e11 - 1, e12], -1), np.stack([e12, e22 - 1], -1)], -2)
        F += np.einsum("o,oac,obd->abcd", p_y * dy[k:k + 500], J, J)
    return 1 / np.abs(np.linalg.eigvals(F.reshape(4, 4))).max()


def test_rule_skips_only_negligible_nodes():
    """The q = 0 rule skips the nodes of negligible weight (most of the 28³ rule, the outermost)
    and nothing that matters."""
    rule = _Rule(28, 2, 1, 1, True)
    assert rule.skip.mean() > 0.5 and rule.w[rule.skip].sum() < 1e-13
    assert rule.skip[np.argmax(np.abs(rule.zeta).max(axis=(1, 2)))]
    assert not rule.skip[np.argmax(rule.w)]


def test_product_link_semi_analytic_reference_agrees_with_the_gauss_hermite_one():
    """Two independent references at Δ = 0.5 (the 32-node Gauss–Hermite one is within 7e-6;
    with 48 nodes, 1e-6)."""
    assert _product_link_semi_analytic(0.5) == pytest.approx(_product_link_reference(0.5), rel=1e-5)


def test_two_index_product_link_at_small_noise_escalates():
    """Δ = 0.01: the posterior of (z₁, z₂) is a thin hyperbola, which the Laplace rule alone
    misses (α_c 0.27 against 0.602); by default the channel escalates such samples
    (``channel.ridges``), also for the thresholds (4096 Sobol draws, ≈ 11 s on two cores)."""
    reference = _product_link_semi_analytic(0.01)
    options = dict(noise=0.01, sampler="sobol", samples=4096, max_samples=4096, rtol=1.0)
    th = weak_recovery_threshold(LinkModel("th_product"), **options)
    assert abs(th.alpha - reference) < 4 * th.stderr and th.stderr < 1e-2 * reference
    alone = weak_recovery_threshold(LinkModel("th_product"), channel={"error_estimate": False}, **options)
    assert abs(alone.alpha - reference) > 0.3 * reference


@pytest.mark.parametrize("noise", [0.5, 0.01])
def test_two_index_product_link_by_the_output_rule(noise):
    """By default (one noisy output, an escalating channel) F is a 1-D integral over y with
    p(y) = Z_out(y; 0, I) (``_output_F``): ≈ 100 channel evaluations instead of the 28³-node
    rule's 8 800, within 1e-6 of the semi-analytic value (measured 1.2e-7 / 1.8e-7 at
    Δ = 0.5 / 0.01)."""
    reference = _product_link_semi_analytic(noise)
    th = weak_recovery_threshold(LinkModel("th_product"), noise=noise)
    assert th.samples < 500 and th.indices == [0, 1]
    assert abs(th.alpha - reference) < 1e-6 * reference and th.stderr < 1e-6 * reference


@pytest.mark.slow
def test_two_index_product_link_at_small_noise_by_the_gauss_hermite_rule():
    """The 28³-node Gauss–Hermite rule (``sampler="auto"`` before the output rule; ≈ 90 s on two
    cores), through ``_deterministic_F`` directly."""
    from smi_core.thresholds import _deterministic_F, _problem
    reference = _product_link_semi_analytic(0.01)
    problem = _problem(LinkModel("th_product"), 0.01, 16, np.random.default_rng(0), "sobol", None, xi=False)
    rho, stderr, _ = _deterministic_F(problem)
    assert abs(1 / rho - reference) < 4 * stderr + 2e-4 * reference


def test_three_index_quadratic_link_by_the_output_rule():
    """The shell by the output rule: within 1e-4 of the characteristic-function α_c (measured
    6.5e-5, the channel's own accuracy; 85 evaluations, ≈ 4 s)."""
    th = weak_recovery_threshold(LinkModel("th_quadratic"), noise=0.1)
    assert th.samples < 500 and th.indices == [0, 1]
    assert th.alpha == pytest.approx(_quadratic_link_reference(QUADRATIC, 0.1), rel=1e-4)


@pytest.mark.parametrize("noise", [0.1, 0.01])
def test_noisy_phase_retrieval_by_the_output_rule(noise):
    """y = z² + √Δ η has no elementary noisy closed form; its noisy-route channel escalates the
    samples the Laplace rule misses at ω = 0 (``channel.ridges``), and the output rule gives α_c
    within 2e-4 of the characteristic-function value (measured 6e-5 / 2.5e-9 at Δ = 0.1 /
    0.01; before, the Gauss–Hermite rule on the Laplace rule alone gave 0.5238 ± 0.0083 /
    0.4988 ± 0.0065 against 0.518066 / 0.502095)."""
    th = weak_recovery_threshold(PHASE_RETRIEVAL, noise=noise)
    assert th.alpha == pytest.approx(_quadratic_link_reference((1.0,), noise), rel=2e-4)


@pytest.mark.parametrize("T", [2, 3])
def test_token_wise_noisy_phase_retrieval_by_the_output_rule(T):
    """y_t = z_t² + √Δ η_t on T tokens: the channel factorises over the tokens
    (``channel.per_token``), F = T F₁, and α_c = α_c(one token)/T from the one-token output
    rule, within 1e-6 of the characteristic-function value over T (measured 2.7e-9 at T = 3)."""
    th = weak_recovery_threshold(LinkModel(f"th_phase_retrieval_T{T}"), noise=0.01)
    assert th.samples < 500
    assert th.alpha == pytest.approx(_quadratic_link_reference((1.0,), 0.01) / T, rel=1e-6)


def test_output_rule_applies_to_one_noisy_output_of_an_escalating_channel():
    from smi_core.thresholds import _output_rule_applies, _problem
    make = lambda model, noise: _problem(model, noise, 16, np.random.default_rng(0), "sobol", None, xi=False)
    assert _output_rule_applies(make(LinkModel("th_product"), 0.1))
    register_link("th_linear", index_symbols(1, 1)[0, 0])
    assert not _output_rule_applies(make(LinkModel("th_linear"), 0.1))        # closed form: exact, cheap
    assert not _output_rule_applies(make(DeepAttention(layers=1, tokens=2), 0.1))   # four outputs


def _quadratic_link_reference(coefficients, noise: float, step: float = 0.02, top: float = 60.0) -> float:
    """α_c of y = Σ_k d_k z_k² + √Δ η from the characteristic-function channel
    (``channel_reference.quadratic_link``: J(y) = diag(E[z_k²|y] - 1)), F = ∫ p(y) J ⊗ J dy by
    the trapezoid rule in y (p below 1e-12 left out, where the reference's sums are rounding).
    For d = (1, 1, 1/2), Δ = 0.1: 1.14127799; halving the step and extending y to 80 moves it by
    5e-12.  Phase retrieval (d = 1): 0.50209 at Δ = 0.01, towards 1/2 as Δ → 0."""
    R, y = len(coefficients), np.arange(-12 * np.sqrt(noise) - 1, top, step)
    F = np.zeros((R,) * 4)
    for k in range(0, len(y), 1000):
        with np.errstate(invalid="ignore"):
            log_p, c = ref.quadratic_link(coefficients, noise, y[k:k + 1000])
        keep = log_p > np.log(1e-12)
        J = np.einsum("na,ab->nab", c[keep], np.eye(R))
        F += np.einsum("n,nac,nbd->abcd", np.exp(log_p[keep]) * step, J, J)
    return 1 / np.abs(np.linalg.eigvals(F.reshape(R * R, R * R))).max()


def test_quadratic_link_reference_at_small_noise_is_phase_retrieval():
    assert _quadratic_link_reference((1.0,), 1e-3) == pytest.approx(0.5, abs=2e-3)


def test_three_index_quadratic_link_first_step():
    """y = h_1² + h_2² + h_3²/2 + √0.1 η: the first step learns the pair (h_1, h_2), at the
    characteristic-function α_c; the shell-shaped posteriors escalate (``channel.ridges``), and
    the Laplace rule alone is far off (0.79, and h_3 first).  512 Sobol draws (≈ 15 s on two
    cores); the widened draws' large outputs stop the adaptive rule at its budget, which warns."""
    reference = _quadratic_link_reference(QUADRATIC, 0.1)
    options = dict(noise=0.1, sampler="sobol", samples=512, max_samples=512, rtol=1.0)
    with pytest.warns(UserWarning, match="budget"):
        th = weak_recovery_threshold(LinkModel("th_quadratic"), **options)
    assert abs(th.alpha - reference) < 4 * th.stderr and th.stderr < 3e-2 * reference
    assert th.indices == [0, 1]
    with pytest.warns(UserWarning, match="error estimate"):
        alone = weak_recovery_threshold(LinkModel("th_quadratic"), channel={"escalate": 1e3}, **options)
    assert abs(alone.alpha - reference) > 0.2 * reference


@pytest.mark.parametrize("factor, grows", [(0.85, False), (1.15, True)])
def test_phase_retrieval_state_evolution_decays_below_and_grows_above(factor, grows):
    model = PHASE_RETRIEVAL
    alpha_c = weak_recovery_threshold(model, channel=CLOSED).alpha
    q0 = 1e-3
    r = state_evolution(model, factor * alpha_c, start=[[q0]], max_iter=8, samples=1 << 14)
    q = r.trajectory[:, 0, 0]
    assert (q[-1] > 2 * q0) if grows else (q[-1] < q0 / 2)


@pytest.fixture(scope="module")
def two_layer_staircase():
    return staircase(TWO_LAYER, samples=8192, rtol=1e-2)


def test_two_layer_attention_learns_the_last_layer_first(two_layer_staircase):
    first, second = two_layer_staircase
    assert two_layer_staircase.complete
    assert first.indices == [1] and second.indices == [0]
    assert first.direction[1, 1] > 0.999 and second.direction[0, 0] > 0.999
    assert first.alpha < second.alpha
    assert second.overlap[1, 1] > 0.5 and second.overlap[0, 0] == 0


def test_two_layer_operator_is_block_diagonal_in_the_layers():
    """The speed-up the spec allows (evenness per layer): F maps diag to diag and the layer
    blocks do not mix; checked, not assumed, by the code."""
    from smi_core.state_evolution import _Problem
    from smi_core.thresholds import _evaluate
    problem = _Problem(TWO_LAYER, None, 0.0, 4096, "sobol", np.random.default_rng(0), None, xi=False)
    F = _evaluate(problem, np.zeros((2, 2))).F
    mean, err = F.mean(axis=0), F.std(axis=0, ddof=1) / np.sqrt(len(F))
    cross = [(0, 0, 1, 1), (1, 1, 0, 0), (0, 0, 0, 1), (1, 1, 0, 1), (0, 1, 0, 0), (0, 1, 1, 1)]
    for idx in cross:
        assert abs(mean[idx]) < 4 * err[idx] + 1e-12 * mean[1, 1, 1, 1]
    assert mean[1, 1, 1, 1] > 10 * err[1, 1, 1, 1] and mean[0, 0, 0, 0] > 10 * err[0, 0, 0, 0]


@pytest.mark.parametrize("factor, grows", [(0.8, False), (1.2, True)])
def test_first_layer_threshold_is_where_state_evolution_gains_it(two_layer_staircase, factor, grows):
    """From the branch point q* = diag(0, s*) plus a small first-layer overlap, state evolution
    below α₁ loses the first layer again, above it gains it."""
    second = two_layer_staircase[1]
    q0 = second.overlap + np.diag([1e-3, 0])
    r = state_evolution(TWO_LAYER, factor * second.alpha, start=q0, max_iter=10, samples=4096, tol=1e-9)
    q11 = r.trajectory[:, 0, 0]
    assert (q11[-1] > 2e-3) if grows else (q11[-1] < 5e-4)


def test_phase_diagram_last_layer_first_for_every_skip():
    diagram = phase_diagram(TWO_LAYER, [0.3, 2.0], samples=4096, rtol=2e-2, progress=False)
    assert diagram.alpha.shape == (2, 2)
    assert (diagram.alpha[:, 0] < diagram.alpha[:, 1]).all()
    assert all(ix == [[1], [0]] for ix in diagram.indices)
    assert json.dumps(diagram.to_dict())


@pytest.mark.slow
def test_phase_diagram_full_grid():
    diagram = phase_diagram(TWO_LAYER, np.geomspace(0.01, 4, 16), samples=8192, rtol=1e-2, progress=False)
    assert (diagram.alpha[:, 0] < diagram.alpha[:, 1]).all()


def test_staircase_follows_a_branch_on_a_two_dimensional_learned_subspace():
    """The staircase's machinery on a fast surrogate: y = h₁² + h₂² + h₃²/2 + √Δ η through the
    Laplace rule alone (``error_estimate=False``), which is off for this link's shell-shaped
    posteriors (its first step is h₃ at α ≈ 0.79, where the escalating channel learns the pair
    (h₁, h₂) at 1.141: test_three_index_quadratic_link_first_step) but is a fixed, cheap map.
    On it: a first direction, then one of the remaining pair, and the last step on the branch of
    the two learned directions (state evolution kept on them), with q* zero outside them."""
    surrogate = {"error_estimate": False}        # and Sobol draws at q = 0 (not the 1-D rule in y)
    stairs = staircase(LinkModel("th_quadratic"), noise=0.1, samples=2048, rtol=1e-2, channel=surrogate,
                       sampler="sobol")
    assert stairs.complete and len(stairs) == 3
    assert stairs[0].indices == [2] and sorted(stairs[1].indices + stairs[2].indices) == [0, 1]
    alphas = [s.alpha for s in stairs]
    assert alphas == sorted(alphas)
    last = stairs[2]
    outside = last.indices[0]
    assert abs(last.overlap[outside, outside]) < 1e-12
    assert min(last.overlap[a, a] for a in range(3) if a != outside) > 0.01


@pytest.mark.parametrize("kwargs, match", [
    ({"samples": 3}, "samples"), ({"rtol": 0}, "rtol"), ({"max_samples": 100}, "max_samples"),
    ({"sampler": "grid"}, "sampler"), ({"noise": -1.0}, "noise"), ({"noise": 0.0}, "noise")])
def test_bad_input_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        weak_recovery_threshold(PHASE_RETRIEVAL, **kwargs)


@pytest.mark.parametrize("kwargs, match", [({"alpha_max": 0}, "alpha_max"), ({"grid": 1}, "grid")])
def test_bad_staircase_input_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        staircase(TWO_LAYER, **kwargs)


@pytest.mark.parametrize("family, skips, match", [(TWO_LAYER, [], "skips"), (TWO_LAYER, [-1.0], "skips"),
                                                  (3.0, [1.0], "model_family")])
def test_bad_phase_diagram_input_is_a_value_error(family, skips, match):
    with pytest.raises(ValueError, match=match):
        phase_diagram(family, skips)


def test_cli_thresholds_json_csv_and_figure(tmp_path, capsys):
    args = ["thresholds", "--samples", "4096", "--rtol", "2e-2", "--quiet", "--csv", str(tmp_path / "t.csv"),
            "--plot", str(tmp_path / "t.png"), "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["indices"] for s in out["steps"]] == [[1], [0]] and out["complete"]
    assert out["steps"][0]["alpha"] < out["steps"][1]["alpha"]
    assert (tmp_path / "t.png").stat().st_size > 0
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == "step,alpha,stderr,layers,samples"


def test_cli_phase_diagram_table_and_figure(tmp_path, capsys):
    args = ["phase-diagram", "--skips", "0.5,1.5", "--samples", "2048", "--rtol", "5e-2", "--quiet",
            "--csv", str(tmp_path / "p.csv"), "--plot", str(tmp_path / "p.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "alpha_1" in out and "alpha_2" in out
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("args, match", [(["phase-diagram", "--spacing", "cubic"], "spacing"),
                                         (["phase-diagram", "--skips", "0:1:3"], "skips"),
                                         (["thresholds", "--rtol", "-1"], "rtol")])
def test_cli_bad_input_is_one_line(args, match, capsys):
    assert main(args + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
