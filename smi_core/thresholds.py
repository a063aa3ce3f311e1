"""Weak-recovery thresholds, the grand staircase and phase diagrams (spec §6).

At an overlap q (ω = q^{1/2}ξ, V = I − q, y from Z = ω + V^{1/2}ζ) let J = ∂_ω g_out(y; ω, V)
and define the linear map on symmetric R×R matrices

    F(M)_ab = E [ Σ_{t,s} Σ_{c,d} J_{(a,t),(c,s)} M_cd J_{(b,t),(d,s)} ]

(per sample Σ_t A_t (M ⊗ I_T) A_tᵀ with A_t = J_{(·,t),(·,·)}: it maps the PSD cone into itself,
and it is self-adjoint for ⟨M, N⟩ = Tr MN since J is symmetric).  At q = 0 the state evolution
is q̂ = α F(q) to first order, so the weak-recovery threshold is α_c = 1/ρ(F), with ρ the
spectral radius, found by power iteration on the PSD cone; its eigen-direction M* names the
first subspace learned (the range of M*).

Staircase.  Once a one-dimensional subspace U = span(u) is learned, the fixed-point branch on U
is q* = s uuᵀ, and it is parametrised by s instead of α: q̂* = s/(1 − s) uuᵀ must equal
α uᵀE[Σ_t g_t g_tᵀ]u uuᵀ, so α(s) = s / ((1 − s) uᵀE[Σ_t g_t g_tᵀ]u), one pass of the channel
per s and no iteration.  The prior's derivative dq = (I + q̂*)⁻¹ dq̂ (I + q̂*)⁻¹ is the identity
on U⊥ (q̂* ∝ uuᵀ), so the linearised map on U⊥ is α P F_{q*}(P · P) P with P = I − uuᵀ, and
the next threshold is the first α along the branch (α(s) increasing, an AMP branch) where
h(s) = α(s) ρ(P F_{q*} P) − 1 crosses zero.  s is scanned on a geometric grid of
x = −log₁₀(1 − s), the
crossing refined by regula falsi (the Illinois variant) in x; every evaluation uses the same
draws, so h is a smooth function of x.  A learned subspace of higher dimension has its branch
q*(α) from state evolution kept on U, and the map on U⊥ includes K = (I + q̂*)⁻¹ on both sides.

Expectations: at q = 0 with one noisy output and a channel that escalates curved posteriors, a
1-D rule in y (F = ∫ p(y) J ⊗ J dy, p(y) = Z_out(y; 0, I); ``_output_F``); with (Z, noise) of
dimension ≤ 3, a rotated tensor Gauss–Hermite rule (error: the difference to a coarser rule);
otherwise BLOCKS independent blocks of draws
(independently scrambled Sobol sets or Monte Carlo), widened with importance weights.  Error
bars: per block, the Rayleigh quotient ⟨M*, F_b(M*)⟩ (first order in F_b − F, F being
self-adjoint) and, at a later step, the block's own α_b(s) and h_b(s) interpolated to its root
— so the error of the branch q*(α) is included.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from . import validate
from .quadrature import _log_phi, gauss_hermite
from .state_evolution import BLOCKS, SAMPLERS, UNINFORMED, V_MIN, _channel, _iterate, _Problem, _project

GH_NODES = {1: 200, 2: 80, 3: 28}   # Gauss–Hermite nodes per dimension at q = 0 (dimension of (Z, noise))
NEGLIGIBLE = 1e-14    # the rule's nodes below this fraction of its largest weight are skipped (``_Rule``)
SUBSPACE = 0.1        # the learned subspace: eigenvectors of M* above this fraction of its largest
X_MAX = -np.log10(V_MIN)   # the branch is followed up to s = 1 − V_MIN
OUTPUT_RULE = dict(step=0.25, min_step=1 / 128, tail=1e-14, pilot=4096, grow=30)   # ``_output_F``


@dataclass
class Threshold:
    """One step of the staircase: at ``alpha`` the directions ``subspace`` start to be learned."""
    alpha: float
    stderr: float
    direction: np.ndarray       # (R, R) PSD, unit Frobenius norm: the leading eigen-direction M*
    subspace: np.ndarray        # (R, R) orthogonal projector onto the range of M*
    indices: list[int]          # rows a (0-based) of the weights in the subspace (layers for r = 1)
    overlap: np.ndarray         # (R, R) q* on the branch where the step happens (0 at the first)
    samples: int

    def to_dict(self) -> dict:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(self).items()}


@dataclass
class Staircase:
    """The steps in the order they happen; ``complete`` when every direction is learned (else
    ``reason`` says where the search stopped)."""
    steps: list[Threshold]
    complete: bool
    reason: str = ""

    def __iter__(self):
        return iter(self.steps)

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]

    def to_dict(self) -> dict:
        return {"steps": [s.to_dict() for s in self.steps], "complete": self.complete, "reason": self.reason}


@dataclass
class _Evaluation:
    """Block means at one overlap: E[Σ_t g_t g_tᵀ] (BLOCKS, R, R) and F's tensor
    F_abcd = E[Σ_{t,s} J_{(a,t),(c,s)} J_{(b,t),(d,s)}] (BLOCKS, R, R, R, R)."""
    gg: np.ndarray
    F: np.ndarray


def _evaluate(problem: _Problem, q: np.ndarray) -> _Evaluation:
    """A drawn output the channel cannot take (a softmax entry underflowed to 0, only far out
    in the widened tails) counts as 0 (``_Problem.moments``)."""
    g, dg, _ = problem.moments(q)
    return _Evaluation(gg=problem.draws.blocks(np.einsum("nat,nbt->nab", g, g)),
                       F=problem.draws.blocks(_terms(dg, problem.R, problem.T)))


def _terms(dg: np.ndarray, R: int, T: int) -> np.ndarray:
    """Per sample, F's tensor Σ_{t,s} J_{(a,t),(c,s)} J_{(b,t),(d,s)} from J = ∂_ω g_out (n, RT, RT)."""
    J = dg.reshape(-1, R, T, R, T)
    return np.einsum("natcs,nbtds->nabcd", J, J)


def apply(F: np.ndarray, M: np.ndarray) -> np.ndarray:
    """F(M)_ab = Σ_cd F_abcd M_cd."""
    return np.einsum("abcd,cd->ab", F, M)


def perron(F: np.ndarray, P: np.ndarray | None = None, tol: float = 1e-13,
           max_iter: int = 100_000) -> tuple[float, np.ndarray]:
    """Spectral radius and PSD eigen-direction of M ↦ P F(PMP) P by power iteration on the PSD
    cone (generalised Perron–Frobenius), from M = P/‖P‖."""
    R = F.shape[0]
    P = np.eye(R) if P is None else P
    M = P / np.linalg.norm(P)
    rho = 0.0
    for _ in range(max_iter):
        N = P @ apply(F, M) @ P
        N = 0.5 * (N + N.T)
        rho = float(np.linalg.norm(N))
        if rho == 0:
            return 0.0, M
        N /= rho
        if np.abs(N - M).max() < tol:
            break
        M = N
    return rho, N


def _rayleigh(F_blocks: np.ndarray, M: np.ndarray) -> np.ndarray:
    """⟨M, F_b(M)⟩ per block (M of unit norm): ρ to first order in F_b − F."""
    return np.einsum("ab,kab->k", M, np.einsum("kabcd,cd->kab", F_blocks, M))


def _subspace(M: np.ndarray) -> np.ndarray:
    w, U = np.linalg.eigh(M)
    keep = U[:, w > SUBSPACE * w.max()]
    return keep @ keep.T


def _indices(P: np.ndarray) -> list[int]:
    return [int(a) for a in np.flatnonzero(np.diag(P) > 0.5)]


def _spread(d: int) -> float:
    """σ = (1 + 1.2/√d)^{1/2} for d coordinates: draws widened with importance weights (see
    _Draws).  J J grows like |Z|⁴, and plain draws leave its tail to rare samples — biased low
    per set, and error bars too small (measured on two-layer attention at 8192 draws: block
    error of α₂ 1.4e-3 → 3.1e-4)."""
    return np.sqrt(1 + 1.2 / np.sqrt(d))


def _problem(model, noise, samples, rng, sampler, channel, xi=True) -> _Problem:
    """Draws of (ξ, ζ, η), or of (ζ, η) at q = 0, widened by _spread; ``channel`` options or
    a channel already built (it is then shared).  Unlike state evolution, the thresholds skip
    the channel's error estimate unless the options ask for it, so two-layer pinned samples
    keep the polar rule: α₁ (c = 1, 2¹⁵ draws) is 0.72098 ± 0.0016 that way and 0.72101 ± 0.0022 with
    the escalation, which takes the staircase from 6 s to 113 s and the 16-skip phase diagram
    from 47 s to 945 s (``channel={"error_estimate": True}`` escalates).  Links whose curved
    posteriors need the escalation (``channel.ridges``) keep it: without it α_c of y = h_1 h_2 +
    noise at Δ = 0.01 is 0.256, against 0.6021 (README "Adding a model"); so do those whose
    estimate flags unresolved samples (``channel.unresolved``: a warning)."""
    if not hasattr(channel, "moments"):
        options = dict(channel or {})
        channel = _channel(model, noise, options)
        if not (channel.ridges or channel.unresolved or "error_estimate" in options or "tol" in options):
            channel.error_estimate = False
    return _Problem(model, noise, 0.0, samples, sampler, rng, channel, xi, _spread)


class _Rule:
    """A tensor Gauss–Hermite rule over (ζ, η) at q = 0 in the interface of the state
    evolution's draws (ξ = 0; one "block": the weighted sum).  The grid is turned by a fixed
    generic rotation — still exact for polynomials of total degree < 2n — so that no node sits
    on a null set where y has no unique pre-image (e.g. two equal tokens).  Nodes whose weight
    is below NEGLIGIBLE of the largest are skipped (``skip``: counted as 0, as outputs the
    channel cannot take): 60 % of the 28³ rule's nodes, 4.5e-14 of its weight (64 % of the
    200-node rule, 4.8e-16), and its outermost ones, where the posterior is farthest out."""

    def __init__(self, nodes: int, R: int, T: int, n_out: int, noisy: bool):
        d = R * T + (n_out if noisy else 0)
        x, lw = gauss_hermite(nodes, d)
        self.w = np.exp(lw + _log_phi(x))
        self.skip = self.w < NEGLIGIBLE * self.w.max()
        rotation = np.linalg.qr(np.random.default_rng(12345).standard_normal((d, d)))[0]
        x = x @ rotation.T
        self.n = len(x)
        self.xi = np.zeros((self.n, R, T))
        self.zeta = np.ascontiguousarray(x[:, :R * T]).reshape(self.n, R, T)
        self.eta = x[:, R * T:] if noisy else None

    def blocks(self, values: np.ndarray) -> np.ndarray:
        return np.tensordot(self.w, values, axes=1)[None]


def _rule_dims(problem: _Problem) -> int:
    return problem.R * problem.T + (problem.n_out if problem.noise is not None else 0)


def _deterministic_F(problem: _Problem) -> tuple[float, float, np.ndarray]:
    """ρ(F) and M* from the Gauss–Hermite rule; the standard error of α_c = 1/ρ is the
    difference to the rule with ≈ 3/4 of the nodes."""
    nodes, values = GH_NODES[_rule_dims(problem)], []
    for n in (nodes, 2 * (3 * nodes // 8)):       # even counts: no node at the origin
        problem.draws = _Rule(n, problem.R, problem.T, problem.n_out, problem.noise is not None)
        values.append(_evaluate(problem, np.zeros((problem.R, problem.R))).F[0])
    rho, M = perron(values[0])
    return rho, abs(1 / rho - 1 / _rayleigh(values[1][None], M)[0]), M


def _output_rule_applies(problem: _Problem) -> bool:
    """One noisy output (or one per token of a token-wise link, ``channel.per_token``), and a
    channel that escalates curved posteriors (``channel.ridges``): there every draw costs
    milliseconds, and a 1-D rule in y needs far fewer (``_output_F``)."""
    one = problem.n_out == 1 or getattr(problem.channel, "per_token", None) is not None
    return problem.noise is not None and one and bool(getattr(problem.channel, "ridges", False))


def _output_F(problem: _Problem, rtol: float, bar) -> tuple[float, float, np.ndarray, int]:
    """ρ(F), the error of α_c and M* at q = 0 with one noisy output, where J depends on y alone
    and F = ∫ p(y) J(y) ⊗ J(y) dy with p(y) = Z_out(y; 0, I), the channel's own log Z.  y = c +
    √Δ sinh u (c the median of g(Z) over OUTPUT_RULE["pilot"] draws: nodes √Δ-dense about c,
    geometric in the tails), the trapezoid rule in u (spectrally accurate for a smooth, fast
    decaying integrand), its range grown (by 1 in u, at most OUTPUT_RULE["grow"] times) until
    both ends fall below OUTPUT_RULE["tail"] of the largest value and its step halved until α
    from steps h and 2h differ by less than rtol·α/10 (or the step reaches
    OUTPUT_RULE["min_step"]); the error is that difference.
    Also returns the number of channel evaluations.  A token-wise link: F = T F₁ with F₁ its
    one-token link's (the tokens are independent and J is diagonal in them)."""
    token = getattr(problem.channel, "per_token", None)
    if token is not None:
        one = _problem(token.model, problem.noise, 2 * BLOCKS, problem.rng, "sobol", token, xi=False)
        rho, error, M, used = _output_F(one, rtol, bar)
        return problem.T * rho, error / problem.T, M, used
    R, T, sd = problem.R, problem.T, np.sqrt(problem.noise)
    Z = np.random.default_rng(0).standard_normal((OUTPUT_RULE["pilot"], R, T))
    g = problem.model.forward(Z).reshape(-1)
    c = np.median(g)
    span = [np.arcsinh((g.min() - c) / sd - 10), np.arcsinh((g.max() - c) / sd + 10)]
    values: dict[float, tuple[float, np.ndarray]] = {}

    def evaluate(u):
        u = np.array([x for x in u if x not in values])
        if u.size:
            m = problem.channel.moments(c + sd * np.sinh(u), np.zeros((len(u), R, T)), np.eye(R))
            w = np.exp(m.log_z) * sd * np.cosh(u)
            values.update((x, (wi, Fi)) for x, wi, Fi in zip(u, w, _terms(m.dg_out, R, T)))

    def total(h):
        u = np.arange(np.floor(span[0] / h), np.ceil(span[1] / h) + 1) * h
        evaluate(u)
        return h * sum(values[x][0] * values[x][1] for x in u), u

    def size(x):                                    # the integrand's largest entry at node x
        return values[x][0] * np.abs(values[x][1]).max()

    h = OUTPUT_RULE["step"]
    for _ in range(OUTPUT_RULE["grow"]):            # the range: grown until both ends are negligible
        F, u = total(h)
        top = max(size(x) for x in values)
        low, high = size(u[0]) > OUTPUT_RULE["tail"] * top, size(u[-1]) > OUTPUT_RULE["tail"] * top
        if not (low or high):
            break
        span = [span[0] - low, span[1] + high]
    while True:                                     # the step: halved until h and 2h agree
        fine, _ = total(h / 2)
        rho, M = perron(fine)
        error = abs(1 / rho - 1 / _rayleigh(F[None], M)[0])
        bar.set_postfix(alpha=f"{1 / rho:.6g}", nodes=len(values), error=f"{error:.2g}")
        bar.update(1)
        h /= 2
        if error <= 0.1 * rtol / rho or h <= OUTPUT_RULE["min_step"]:
            return rho, error, M, len(values)
        F = fine


def _sampled_F(samples, rtol, max_samples, progress, make):
    """ρ(F), the standard error of α_c, M* and the problem from ``samples`` draws (problem =
    make(samples)), doubled (fresh draws: a Sobol set gains from being large) until the
    standard error is below rtol·α_c or would pass ``max_samples``."""
    with _progress(progress, "step 1") as bar:
        while True:
            problem = make(samples)
            F_blocks = _evaluate(problem, np.zeros((problem.R, problem.R))).F
            rho, M = perron(F_blocks.mean(axis=0))
            stderr = _rayleigh(F_blocks, M).std(ddof=1) / np.sqrt(BLOCKS) / rho ** 2
            bar.set_postfix(alpha=f"{1 / rho:.5g}", stderr=f"{stderr:.2g}", samples=problem.draws.n)
            bar.update(1)
            if stderr <= rtol / rho or 2 * samples > max_samples:
                return rho, stderr, M, problem
            samples *= 2


def _first_step(model, noise, samples, rng, sampler, channel, rtol, max_samples, progress=False):
    """α_c = 1/ρ(F) at q = 0: by the Gauss–Hermite rule when (Z, noise) has at most 3
    dimensions and ``sampler`` is "auto", else by sampling (_sampled_F).  Returns the Threshold
    and the channel, built once."""
    kind = "sobol" if sampler == "auto" else sampler
    problem = _problem(model, noise, 2 * BLOCKS, rng, kind, channel, xi=False)
    make = lambda n: _problem(model, noise, n, rng, kind, problem.channel, xi=False)
    if sampler == "auto" and _output_rule_applies(problem):
        with _progress(progress, "step 1") as bar:
            rho, stderr, M, used = _output_F(problem, rtol, bar)
    elif sampler == "auto" and _rule_dims(problem) in GH_NODES:
        rho, stderr, M = _deterministic_F(problem)
        used = problem.draws.n
    else:
        rho, stderr, M, problem = _sampled_F(samples, rtol, max_samples, progress, make)
        used = problem.draws.n
    P = _subspace(M)
    return Threshold(alpha=1 / rho, stderr=float(stderr), direction=M, subspace=P, indices=_indices(P),
                     overlap=np.zeros_like(M), samples=used), problem.channel


def _check(samples, rtol, max_samples, sampler):
    if not isinstance(samples, (int, np.integer)) or samples < 2 * BLOCKS:
        raise ValueError(f"samples must be an integer ≥ {2 * BLOCKS}, got {samples!r}")
    validate.positive("rtol", rtol)
    if not isinstance(max_samples, (int, np.integer)) or max_samples < samples:
        raise ValueError(f"max_samples must be an integer ≥ samples ({samples}), got {max_samples!r}")
    if sampler not in SAMPLERS + ("auto",):
        raise ValueError(f"sampler must be one of {SAMPLERS + ('auto',)}, got {sampler!r}")


def weak_recovery_threshold(model, *, noise: float | None = None, samples: int = 1 << 15,
                            rtol: float = 1e-3, max_samples: int = 1 << 18, seed=0,
                            sampler: str = "auto", channel: dict | None = None,
                            progress: bool = False) -> Threshold:
    """α_c = 1/ρ(F) at q = 0 (module docstring), with its standard error and the leading PSD
    direction.  The expectation over Z (and the output noise, ``noise`` = Δ) is a 1-D rule in
    y for one noisy output of a channel with ``ridges`` (``_output_F``; ``samples`` is then the
    number of channel calls), else a rotated Gauss–Hermite rule when their dimension is at most
    3 (``sampler="auto"``, the default;
    ``stderr`` is then the difference to a rule with 3/4 of the nodes), otherwise ``samples``
    draws, doubled until the standard error is below ``rtol``·α_c or would pass
    ``max_samples``, by ``sampler`` "sobol" (scrambled) or "mc"; ``channel``: options for
    ``model.channel``;
    ``progress`` shows a bar."""
    _check(samples, rtol, max_samples, sampler)
    return _first_step(model, noise, samples, np.random.default_rng(seed), sampler, channel, rtol,
                       max_samples, progress)[0]


@dataclass
class _Point:
    """One evaluation along a branch: α, h = α ρ − 1, the direction M, per-block α_b and h_b,
    and the overlap q* there."""
    alpha: float
    h: float
    M: np.ndarray
    alpha_b: np.ndarray
    h_b: np.ndarray
    q: np.ndarray


class _Branch:
    """The fixed-point branch q* = s uuᵀ on a learned direction u, parametrised by
    x = −log₁₀(1 − s), and the map on P = I − uuᵀ."""

    def __init__(self, problem: _Problem, u: np.ndarray, bar):
        self.problem, self.u, self.bar = problem, u, bar
        self.P = np.eye(len(u)) - np.outer(u, u)
        self.cache: dict[float, _Point] = {}

    def __call__(self, x: float) -> _Point:
        if x not in self.cache:
            s = 1 - 10.0 ** -x
            q = s * np.outer(self.u, self.u)
            ev = _evaluate(self.problem, q)
            alpha_b = s / (1 - s) / np.einsum("a,kab,b->k", self.u, ev.gg, self.u)
            alpha = s / (1 - s) / (self.u @ ev.gg.mean(axis=0) @ self.u)
            rho, M = perron(ev.F.mean(axis=0), self.P)
            self.cache[x] = _Point(alpha, alpha * rho - 1, M, alpha_b, alpha_b * _rayleigh(ev.F, M) - 1, q)
            _report(self.bar, self.cache[x])
        return self.cache[x]


class _SubspaceBranch:
    """The branch q*(α) on a learned subspace U of any dimension, by state evolution kept on U
    (q ← P_U q P_U, continued from the previous α, off q = 0 by the uninformed floor), and the
    linearised map on U⊥: M ↦ α P K F_{q*}(PMP) K P with K = (I + q̂*)⁻¹ (the prior's
    derivative).  Parametrised by α itself; the error bars leave out the branch's own error."""

    def __init__(self, problem: _Problem, Pu: np.ndarray, bar):
        self.problem, self.Pu, self.bar = problem, Pu, bar
        self.P = np.eye(len(Pu)) - Pu
        self.q = UNINFORMED * Pu
        self.cache: dict[float, _Point] = {}

    def __call__(self, alpha: float) -> _Point:
        if alpha not in self.cache:
            self.problem.restrict = self.Pu
            r = _iterate(self.problem, alpha, _project(self.q + UNINFORMED * self.Pu), "branch", 0.0, 1e-6, 300)
            self.problem.restrict, self.q = None, r.q
            ev = _evaluate(self.problem, r.q)
            K = np.linalg.inv(np.eye(len(self.P)) + alpha * ev.gg.mean(axis=0))
            F = np.einsum("ai,bj,kijcd->kabcd", K, K, ev.F)
            rho, M = perron(F.mean(axis=0), self.P)
            self.cache[alpha] = _Point(alpha, alpha * rho - 1, M, np.full(BLOCKS, alpha),
                                       alpha * _rayleigh(F, M) - 1, r.q)
            _report(self.bar, self.cache[alpha])
        return self.cache[alpha]


def _report(bar, p: _Point) -> None:
    bar.set_postfix(alpha=f"{p.alpha:.4g}", q=np.round(np.diag(p.q), 4).tolist(), h=f"{p.h:+.3f}")
    bar.update(1)


def _next_step(problem, u, prev, alpha_max, rtol, grid, bar) -> Threshold | str:
    """The next threshold along the branch on span(u), or the reason there is none."""
    branch = _Branch(problem, u, bar)
    xs = np.geomspace(X_MAX / 2 ** (grid - 1), X_MAX, grid)        # s from ≈ 0.03 (grid = 10) to 1 − V_MIN
    top, lo = 0.0, None
    for x in xs:
        p = branch(x)
        if p.alpha < top:                # past a fold: this part of the branch is unstable
            continue
        top = p.alpha
        if p.h >= 0:
            return _threshold_at(branch, (x, x) if lo is None else _illinois(branch, lo, x, rtol), prev)
        if p.alpha > alpha_max:
            return f"no further direction is learned up to alpha_max = {alpha_max:g}"
        lo = x
    return f"no further direction is learned along the branch up to q = 1 − {V_MIN:g} (α = {top:.4g})"


def _next_step_subspace(problem, Pu, prev, alpha_max, rtol, bar) -> Threshold | str:
    """The next threshold along the branch on the subspace of Pu, scanning α upwards by 20 %."""
    branch = _SubspaceBranch(problem, Pu, bar)
    lo, alpha = None, 1.02 * prev.alpha
    while alpha <= alpha_max:
        if branch(alpha).h >= 0:
            return _threshold_at(branch, (alpha, alpha) if lo is None else _illinois(branch, lo, alpha, rtol), prev)
        lo, alpha = alpha, 1.2 * alpha
    return f"no further direction is learned up to alpha_max = {alpha_max:g}"


def _illinois(branch, a: float, b: float, rtol: float) -> tuple[float, float]:
    """Shrink [a, b] (h(a) < 0 ≤ h(b)) by the Illinois false position until α(b) − α(a) is
    below rtol·α(b)/4."""
    ha, hb = branch(a).h, branch(b).h
    side = 0
    for _ in range(40):
        if branch(b).alpha - branch(a).alpha <= 0.25 * rtol * branch(b).alpha:
            break
        c = b - hb * (b - a) / (hb - ha)
        hc = branch(c).h
        if hc >= 0:
            b, hb = c, hc
            ha = ha / 2 if side == 1 else ha
            side = 1
        else:
            a, ha = c, hc
            hb = hb / 2 if side == -1 else hb
            side = -1
    return a, b


def _threshold_at(branch, pair: tuple[float, float], prev: Threshold) -> Threshold:
    """α where h = 0, linear in α between the bracket's ends, per block too for the error.  A
    bracket of one point: U⊥ is unstable as soon as the branch starts, so the step is at the
    previous one, within that one's error."""
    lo, hi = branch(pair[0]), branch(pair[1])
    if pair[0] == pair[1]:
        alpha, stderr = prev.alpha, prev.stderr
    else:
        root = lambda al, hl, ah, hh: al + (ah - al) * (-hl) / (hh - hl)
        alpha, per = root(lo.alpha, lo.h, hi.alpha, hi.h), root(lo.alpha_b, lo.h_b, hi.alpha_b, hi.h_b)
        stderr = per.std(ddof=1) / np.sqrt(len(per))
    P = _subspace(hi.M)
    return Threshold(alpha=float(alpha), stderr=float(stderr), direction=hi.M, subspace=P, indices=_indices(P),
                     overlap=hi.q, samples=branch.problem.draws.n)


def staircase(model, *, noise: float | None = None, alpha_max: float = 10.0, samples: int = 1 << 15,
              rtol: float = 1e-3, max_samples: int = 1 << 18, grid: int = 10, seed=0,
              sampler: str = "auto", channel: dict | None = None, progress: bool = False) -> Staircase:
    """The thresholds at which the subspaces of the weights start to be learned, in order
    (module docstring): the first at q = 0 as in weak_recovery_threshold, then along the
    fixed-point branch on what is learned: one direction by its overlap s (``grid`` values
    of s scan the branch before the crossing is refined to ``rtol``), a subspace of higher
    dimension by state evolution kept on it, α scanned up by 20 % steps (_SubspaceBranch).
    Later steps use ``samples`` draws; ``progress`` shows a bar per step.  ``reason`` says why
    a staircase that is not ``complete`` stopped."""
    _check(samples, rtol, max_samples, sampler)
    validate.positive("alpha_max", alpha_max)
    if not isinstance(grid, (int, np.integer)) or grid < 2:
        raise ValueError(f"grid must be an integer ≥ 2, got {grid!r}")
    rng = np.random.default_rng(seed)
    first, channel = _first_step(model, noise, samples, rng, sampler, channel, rtol, max_samples, progress)
    steps, learned = [first], first.subspace
    R = len(learned)
    problem = None
    while np.trace(learned) < R - 0.5:
        problem = problem or _problem(model, noise, samples, rng, "sobol" if sampler == "auto" else sampler, channel)
        with _progress(progress, f"step {len(steps) + 1}") as bar:
            if round(np.trace(learned)) == 1:
                u = np.linalg.eigh(learned)[1][:, -1]
                step = _next_step(problem, u, steps[-1], alpha_max, rtol, grid, bar)
            else:
                step = _next_step_subspace(problem, learned, steps[-1], alpha_max, rtol, bar)
        if isinstance(step, str):
            return Staircase(steps, False, step)
        steps.append(step)
        learned = _subspace(learned + step.subspace)
    return Staircase(steps, True)


def _progress(enabled: bool, what: str):
    from tqdm import tqdm
    return tqdm(disable=not enabled, desc=what, unit="eval", leave=False)


@dataclass
class PhaseDiagram:
    """Staircase thresholds against the skip strength: ``alpha[i, k]`` is step k at skips[i]
    (NaN where that staircase stopped earlier)."""
    skips: np.ndarray
    alpha: np.ndarray
    stderr: np.ndarray
    indices: list[list[list[int]]]      # per skip, per step: the rows learned
    staircases: list[Staircase]

    def to_dict(self) -> dict:
        return {"skips": self.skips.tolist(), "alpha": self.alpha.tolist(), "stderr": self.stderr.tolist(),
                "indices": self.indices, "staircases": [s.to_dict() for s in self.staircases]}


def phase_diagram(model_family, skips, *, progress: bool = True, **options) -> PhaseDiagram:
    """The staircase for every skip strength c in ``skips``: ``model_family`` is a model with a
    ``replace(skip=c)`` method (DeepAttention) or a function c ↦ model; ``options`` as for
    staircase."""
    skips = np.asarray(skips, dtype=np.float64).reshape(-1)
    if skips.size == 0 or not np.isfinite(skips).all() or (skips < 0).any():
        raise ValueError("skips must be a non-empty list of finite values ≥ 0")
    if hasattr(model_family, "replace"):
        make = lambda c: model_family.replace(skip=c)
    elif callable(model_family):
        make = model_family
    else:
        raise ValueError("model_family must be a DeepAttention model or a function skip -> model")
    from tqdm import tqdm
    stairs = [staircase(make(float(c)), **options, progress=False)
              for c in tqdm(skips, disable=not progress, unit="skip", leave=False)]
    width = max(len(s) for s in stairs)
    alpha, stderr = np.full((len(skips), width), np.nan), np.full((len(skips), width), np.nan)
    for i, s in enumerate(stairs):
        alpha[i, :len(s)] = [t.alpha for t in s]
        stderr[i, :len(s)] = [t.stderr for t in s]
    return PhaseDiagram(skips=skips, alpha=alpha, stderr=stderr,
                        indices=[[t.indices for t in s] for s in stairs], staircases=stairs)
