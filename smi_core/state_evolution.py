"""State evolution, free entropy and Bayes-optimal errors (spec §5).

For a model y = g(Z) (+ Gaussian noise Δ), Gaussian prior and side information λ ≥ 0:

    q̂ᵗ   = α E_{ξ,ζ} [ Σ_t g_out(y; ω, V)[:, t] g_out(y; ω, V)[:, t]ᵀ ],
           ω = (qᵗ)^{1/2} ξ,  V = I − qᵗ,  Z = ω + (I − qᵗ)^{1/2} ζ,  y ~ P(·|Z)
    qᵗ⁺¹ = (1 − d) (q̂ᵗ + λI)(I + q̂ᵗ + λI)⁻¹ + d qᵗ                  (damping d)

The expectation is an average over ``samples`` draws of (ξ, ζ, noise), split into
``BLOCKS`` independent blocks (Monte Carlo with a seeded generator, or independently scrambled
Sobol points); the standard error of every reported average is the spread of its block means
over √BLOCKS.  The same draws are used at every iteration (common random numbers), so the
iteration is a deterministic map (accelerated, see _Anderson); it stops when the distance to its
fixed point, estimated as |G(q) − q| / (1 − ρ̂) (ρ̂ the map's contraction over the last steps)
and confirmed by a Newton step with the map's Jacobian, is below ``tol``, or when the iterates
stagnate within a band narrower than ``tol`` without a monotone drift (the floor of the
channel's quadrature noise, see _stagnated).

Free entropy at (q, q̂):

    f = −½ Tr(q q̂) + ½ [Tr(q̂ + λI) − log det(I + q̂ + λI)] + α E_{ξ,ζ} log Z_out(y; ω, V)

(α E_ξ ∫dy Z_out log Z_out written as an average over y drawn from the model).  Dropped
constants, equal at every fixed point of one model: for the reparametrised attention route,
E_y log|∂u_L/∂y| (the channel's ``log_z`` omits the y-only Jacobian of u_L ↦ y), and for
noiseless links the (infinite) entropy of the output's point mass.  Compare f between fixed
points of the same model, α and sample set only.  A noiseless closed-form channel keeps the
y-only term −log|g'(r(y))| in log Z_out: its mean does not depend on q, but it is heavy-tailed
(log|z| near z = 0), so f is noisier there than for noisy or reparametrised channels.

Errors at a fixed point: per-index MSE 1 − q_aa; Bayes-optimal prediction error
E ‖y − E[y | ω, V]‖²_F = E_ω tr Cov_{Z~N(ω,V)} g(Z) + Δ·size(y) (the inner covariance from
``INNER`` Monte Carlo draws per sample, unbiased); plug-in error E ‖g(Z) − g(ω)‖²_F.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.stats import norm, qmc

from . import validate

BLOCKS = 8                    # independent blocks of draws: standard errors from their spread
INNER = 8                     # draws of Z ~ N(ω, V) per sample for the Bayes prediction error
UNINFORMED = 1e-3             # q at the uninformed start (λ → 0⁺: q = 0 is a fixed point)
INFORMED = 1 - 1e-3           # q at the informed start
V_MIN = 1e-6                  # q is kept in [0, (1 − V_MIN) I]: V ≥ V_MIN I
DISTINCT = 1e-2               # two fixed points differ when some |Δq| exceeds this
STARTS = ("uninformed", "informed", "both")
SAMPLERS = ("sobol", "mc")
MAX_SAMPLES = 1 << 18         # with stderr_tol: the draws grow up to this many
ESCALATE = 1e-3               # SE's two-layer channel: samples whose estimate is above this get finer
                              # rules, to this.  q̂ (the mean over draws) is then within 6e-7 (relative)
                              # of the tol = 1e-7 channel from q = diag(0, 0.92) to diag(0.95, 0.9995),
                              # against 1.1e-8 with the channel's default 1e-5, at 0.3–0.6 of its time
                              # (the adaptive rule then still ran to 1e-5; to 1e-3: the same q̂ to two
                              # digits, 1.3–3.3× faster at q₂₂ ≥ 0.99)
FLAG = (1e-2, 0.01)           # a warning where the channel estimates above 1e-2 on > 1 % of the samples
CONDITIONAL = dict(scale=2 / 3, nodes=8, rounds=2, escalate=FLAG[0], aspect=1.0)   # the noisy route's conditional
                              # rule in SE (two layers, Δ ≥ 1e-3, a pinned last layer): a third of the
                              # rings' counts and 8 nodes in h_2 of the channel's default, finer rounds
                              # only above FLAG[0].  At Δ = 0.1, 512 draws, q̂ is within 6.8e-5
                              # (relative) of the default rule's at q = diag(0.26, 0.98),
                              # diag(0.82, 0.99), diag(0.1, 0.97) (α = 8, 16, 6) at 1/12–1/22 of its
                              # time, estimates above FLAG[0] on ≤ 0.2 % of the samples (no rounds:
                              # 4.4e-4, up to 18 %); the Laplace rule alone puts q̂₁₁ 2–9 % off there
                              # (aspect 1: with a third of the counts the channel's aspect 2 leaves too
                              # few radii, 32 draws at Δ = 0.1, q = diag(0, 0.999): median 6.0e-5
                              # against 2.7e-5 off the rule at 4× the counts)
ESCALATION = {2: dict(rounds=8, refine=1.0)}   # SE's two-layer escalation by T (``ReparamChannel.ESCALATION``):
                              # T = 2: eight finer polar rounds (the channel: ten), then the adaptive
                              # rule, to ESCALATE itself (not a tenth of it).  Until 2026-11-29
                              # three rounds (on 2026-11-28 eight made the curve slower; now the
                              # adaptive rule is the dearer, the cause not isolated: the late
                              # rounds' Gauss–Legendre rules were cached since).  One thread,
                              # 1 024 draws, process time:
                              # 0.202 / 0.181 / 0.458 / 0.863 → 0.065 / 0.110 / 0.182 / 0.405 ms
                              # per sample at q = diag(0.2, 0.99) / diag(0.59, 0.994) /
                              # diag(0.81, 0.998) / diag(0.95, 0.9995); q̂ the same to 1e-6
                              # (relative, 512 draws, diag(0, 0.99) … diag(0.9, 0.9995), against
                              # the tol = 1e-7 channel: both within 1.0e-6); the two-layer curve
                              # (1 024 draws, 2 threads) the same table, 310 iterations.
                              # T = 3 keeps the channel's six spherical rounds: with three, q̂₂₂ at
                              # q = diag(0, 0.999) was 1446 ± 118 against 727 ± 41 (1 024 draws; 4
                              # and 5 rounds 1309, 869), 45 % of the samples flagged, at 4.8 against
                              # 38.9 s per step (one core); at diag(0, 0.99) and diag(0.3, 0.995)
                              # the same q̂ to 2.2e-7 at 2.7 → 5.2 and 3.6 → 5.7 s
RHO_CAP = 0.99                # the spectral radius of the map's Jacobian is capped here
NEWTON_REACH = 1e-2           # a failed convergence check takes its Newton step when it is this short


@dataclass
class SEResult:
    """A fixed point of state evolution at one α (arrays R×R unless noted)."""
    alpha: float
    q: np.ndarray
    q_hat: np.ndarray
    mse: np.ndarray                     # (R,) 1 − q_aa: per layer for r = 1 attention
    prediction_error: float             # Bayes-optimal, E‖y − E[y|ω,V]‖²_F
    plugin_error: float                 # E‖g(Z) − g(ω)‖²_F
    free_entropy: float
    trajectory: np.ndarray              # (iterations + 1, R, R): q at every step
    stderr: np.ndarray                  # standard error of q̂
    q_stderr: np.ndarray                # … of the fixed point q (delta method: _Problem.fixed_point_stderr)
    free_entropy_stderr: float
    prediction_error_stderr: float
    plugin_error_stderr: float
    iterations: int
    converged: bool
    start: str                          # the start it was reached from
    samples: int = 0                    # draws of (ξ, ζ) at the fixed point (see stderr_tol)
    channel_flagged: float = float("nan")   # share of those whose channel estimate is above FLAG[0] (NaN: none)
    alternative: "SEResult | None" = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """JSON-ready: arrays as nested lists, the alternative fixed point nested."""
        out = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(self).items()
               if k != "alternative"}
        out["alternative"] = None if self.alternative is None else self.alternative.to_dict()
        return out


class _Draws:
    """The fixed standard-normal draws of one state evolution: ξ, ζ (n, R, T), the output
    noise η (n, size(y)), in BLOCKS equal blocks of ``per`` draws.  Without ``xi`` (for q = 0
    only) ξ = 0 and ζ takes the first coordinates of the Sobol points.  With ``spread`` = σ(d) >
    1, a function of the number d of coordinates, all are drawn wider, σx, with importance
    weights σ^d e^{−(σ² − 1)|x|²/2}, so that the tails of polynomially growing integrands are
    sampled.  ``use(per)`` switches to the first ``per`` draws of every block, drawing more
    when needed: each block continues its own sequence (a scrambled Sobol sequence's first 2^k
    points are a scrambled Sobol set), so a larger set contains every smaller one."""

    skip = None     # (n,) mask of draws to leave out (the thresholds' ``_Rule``: negligible nodes)

    def __init__(self, samples: int, R: int, T: int, n_out: int, noisy: bool, sampler: str,
                 rng: np.random.Generator, xi: bool = True, spread=None):
        per = -(-samples // BLOCKS)
        self.R, self.T, self.k, self.noisy = R, T, R * T if xi else 0, noisy
        self.dims = self.k + R * T + (n_out if noisy else 0)
        self.sigma = None if spread is None else spread(self.dims)
        if sampler == "sobol":
            per = 1 << max(int(np.ceil(np.log2(per))), 1)
            self._engines = [qmc.Sobol(self.dims, scramble=True, seed=rng) for _ in range(BLOCKS)]
        self._rng, self._sobol = rng, sampler == "sobol"
        self._x = np.empty((BLOCKS, 0, self.dims))
        self.use(per)

    def _more(self, count: int) -> np.ndarray:
        """The next ``count`` standard-normal points of every block, (BLOCKS, count, dims)."""
        if self._sobol:
            u = np.stack([e.random(count) for e in self._engines])
            return norm.ppf(np.clip(u, 1e-300, 1 - 2 ** -53))
        return self._rng.standard_normal((BLOCKS, count, self.dims))

    def use(self, per: int) -> None:
        """Use the first ``per`` draws of every block (n = BLOCKS·per in all)."""
        if per > self._x.shape[1]:
            self._x = np.concatenate([self._x, self._more(per - self._x.shape[1])], axis=1)
        x = self._x[:, :per].reshape(BLOCKS * per, self.dims)
        n = len(x)
        self.n, self.per = n, per
        self.weight = None
        if self.sigma is not None:
            self.weight = self.sigma ** self.dims * np.exp(-0.5 * (self.sigma ** 2 - 1) * (x ** 2).sum(axis=1))
            x = self.sigma * x
        k, RT = self.k, self.R * self.T
        self.xi = x[:, :k].reshape(n, self.R, self.T) if k else np.zeros((n, self.R, self.T))
        self.zeta = x[:, k:k + RT].reshape(n, self.R, self.T)
        self.eta = x[:, k + RT:] if self.noisy else None

    def blocks(self, values: np.ndarray) -> np.ndarray:
        """The BLOCKS block means of per-sample ``values`` (n, ...), importance-weighted."""
        if self.weight is not None:
            values = values * self.weight.reshape(-1, *([1] * (values.ndim - 1)))
        return values.reshape(BLOCKS, self.per, *values.shape[1:]).mean(axis=1)

    def mean(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean over samples and its standard error from the block means."""
        return _summary(self.blocks(values))

    def controlled(self, values: np.ndarray, control: np.ndarray) -> np.ndarray:
        """values − c·control, entry by entry, for a ``control`` of mean zero: c = Cov(v, d)/Var(d)
        over all draws (v, d importance-weighted) minimises the variance of the mean; estimating
        c from the same draws biases the mean by O(1/n) only."""
        v, d = values, control
        if self.weight is not None:
            w = self.weight.reshape(-1, *([1] * (values.ndim - 1)))
            v, d = v * w, d * w
        dc = d - d.mean(axis=0)
        var = (dc ** 2).mean(axis=0)
        c = ((v - v.mean(axis=0)) * dc).mean(axis=0) / np.where(var > 0, var, 1.0)
        return values - c * control


def _summary(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean of BLOCKS block estimates and its standard error, their spread / √BLOCKS."""
    return blocks.mean(axis=0), blocks.std(axis=0, ddof=1) / np.sqrt(BLOCKS)


def _spectral(q: np.ndarray, f) -> np.ndarray:
    """f(q) for symmetric q: f applied to the eigenvalues."""
    w, U = np.linalg.eigh(q)
    return (U * f(w)) @ U.T


def _sqrtm(q: np.ndarray) -> np.ndarray:
    return _spectral(q, lambda w: np.sqrt(np.clip(w, 0, None)))


def _inward(q: np.ndarray, E: np.ndarray, h: float) -> float:
    """The step s = ±h along E with q + sE below (1 − V_MIN/2) I (+h first), h halved until
    one sign is: an off-diagonal E raises one eigenvalue whichever the sign, so at q near
    (1 − V_MIN) I both signs of a step ≥ V_MIN/2 would make V = I − q − sE singular."""
    for _ in range(64):
        for s in (h, -h):
            if np.linalg.eigvalsh(q + s * E)[-1] <= 1 - V_MIN / 2:
                return s
        h *= 0.5
    raise ValueError(f"q must have eigenvalues below 1 − {V_MIN / 2:g}")


def _project(q: np.ndarray) -> np.ndarray:
    """Symmetrise and clip the eigenvalues into [0, 1 − V_MIN]."""
    q = _spectral(0.5 * (q + q.T), lambda w: np.clip(w, 0.0, 1 - V_MIN))
    return 0.5 * (q + q.T)


class _Problem:
    """Model, channel, noise, side information and draws: evaluates the SE map at q."""

    def __init__(self, model, noise, side_info, samples, sampler, rng, channel_options, xi=True,
                 spread=None, control_variate=False):
        self.model, self.R, self.T = model, model.indices, model.tokens
        self.noise = None if noise is None else validate.positive("noise", noise)
        self.side_info = validate.positive("side_info", side_info, allow_zero=True)
        if not isinstance(samples, (int, np.integer)) or samples < 2 * BLOCKS:
            raise ValueError(f"samples must be an integer ≥ {2 * BLOCKS}, got {samples!r}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.channel = _channel(model, self.noise, channel_options)
        self._muted = not (_estimate_asked(channel_options) or getattr(self.channel, "error_estimate", True))
        self.n_out = int(np.prod(model.output_shape)) if model.output_shape else 1
        self.draws = _Draws(samples, self.R, self.T, self.n_out, self.noise is not None, sampler, rng, xi, spread)
        self.rng = rng
        self.restrict = None        # a projector P: q is kept on its range, q ← PqP (thresholds)
        self.control_variate = bool(control_variate)
        self.flagged, self._warned = float("nan"), False      # ``_flag``

    def outputs(self, Z: np.ndarray) -> np.ndarray:
        """y ~ P(·|Z): g(Z), plus √Δ η with noise."""
        y = self.model.forward(Z).reshape(len(Z), -1)
        if self.noise is not None:
            y = y + np.sqrt(self.noise) * self.draws.eta
        return y.reshape(len(Z), *self.model.output_shape)

    def fields(self, q: np.ndarray):
        """ω = q^{1/2} ξ, V = I − q, Z = ω + V^{1/2} ζ (column-wise).  q is symmetrised first:
        near q = I the entries of V are ≈ 1e-5, and a rounding-level asymmetry of q would make V
        fail the channel's symmetry check."""
        q = 0.5 * (q + q.T)
        V = np.eye(self.R) - q
        omega = np.einsum("ab,nbt->nat", _sqrtm(q), self.draws.xi)
        Z = omega + np.einsum("ab,nbt->nat", _sqrtm(V), self.draws.zeta)
        return omega, V, Z

    def moments(self, q: np.ndarray):
        """g_out (n, R, T), ∂_ω g_out (n, RT, RT) and log Z_out (n,) at the draws for overlap q.
        A drawn output the channel cannot take (``channel.representable``: a softmax entry that
        underflowed to 0, or a pre-image lost to rounding, e.g. u₁ ≈ u₂ to 1e-8 — seen once in
        ≈ 10⁸ two-layer draws) counts as 0: its probability is far below the sampling error."""
        omega, V, Z = self.fields(q)
        y = self.outputs(Z)
        keep = self.channel.representable(y)
        if self.draws.skip is not None:
            keep = keep & ~self.draws.skip
        if keep.all():
            m = self.channel.moments(y, omega, V)
            self._flag(m.error)
            return m.g_out, m.dg_out, m.log_z
        m = self.channel.moments(y[keep], omega[keep], V)
        g, dg, log_z, error = (np.zeros((len(y),) + a.shape[1:]) for a in (m.g_out, m.dg_out, m.log_z, m.error))
        g[keep], dg[keep], log_z[keep], error[keep] = m.g_out, m.dg_out, m.log_z, m.error
        self._flag(error)
        return g, dg, log_z

    def _flag(self, error: np.ndarray):
        """``flagged``: the share of samples (in the draws' weights) whose channel estimate is
        above FLAG[0] (NaN with the estimate off); above FLAG[1] a warning, once per problem."""
        if not np.isfinite(error).any():
            self.flagged = float("nan")
            return
        self.flagged = float(self.draws.blocks((error > FLAG[0]).astype(float)).mean())     # NaN: no estimate
        if self.flagged > FLAG[1] and not self._warned:
            self._warned = True
            warnings.warn(f"the channel's error estimate is above {FLAG[0]:g} on {self.flagged:.0%} of the "
                          f"samples (up to {np.nanmax(error):.2g}): its rule may not resolve these "
                          f"posteriors and the result may be biased; {self._remedy()} "
                          "See README, 'Adding a model'.", stacklevel=4)

    def audit(self, q: np.ndarray) -> float:
        """``flagged`` at q; where SE runs the channel without its estimate (``_channel``: three
        layers, one layer, links whose rule does not escalate), one evaluation at q with the
        estimate on, so that a fixed point still reports (and warns about) the samples its rule
        does not resolve — e.g. three layers with the last layer pinned, up to 84 % of the draws
        above FLAG[0] at q = diag(0.57, 0.42, 0.9993), at ≈ 1.2× the time of one evaluation."""
        if self._muted:                             # (``moments`` without the estimate left it NaN)
            self.channel.error_estimate = True
            try:
                self.moments(q)
            finally:
                self.channel.error_estimate = False
        return self.flagged

    def _remedy(self) -> str:
        if self.channel.unresolved:
            return "they are curved (R·T > 4), and channel={'tol': ...} runs the adaptive rule (slow)."
        if self.channel.ridges:
            return ("the adaptive rule stopped at its budget (its estimate is often far above its "
                    "error there); channel={'max_regions': ...} raises it (slower).")
        if getattr(self.channel, "route", None) == "reparam" and self.model.layers == 3:
            return ("three layers: where the last layer is pinned (q_LL → 1, the earlier layers broad) the rule's "
                    "per-sample errors largely average out between the transitions, but q̂ is biased by ≈ 10 % "
                    "on the last rise (README, 'Three layers: the default is not accurate'); channel={'tol': 1e-3} "
                    "is accurate, at 0.4–4 s per sample.")
        return "channel={'tol': ...} asks for finer rules (slower)."

    def step(self, q: np.ndarray, alpha: float):
        """q̂ (with its standard error) and E log Z_out (with its standard error) at q, and the
        BLOCKS block estimates of q̂.  With ``control_variate``, the Nishimori identity
        E[Σ_t g_t g_tᵀ] = −E[Σ_t ∂_{ω_t} g_t] (y drawn from the model) makes
        D = Σ_t (g_t g_tᵀ + ∂_{ω_t} g_t) a control variate of mean zero."""
        g, dg, log_z = self.moments(q)
        gg = np.einsum("nat,nbt->nab", g, g)
        if self.control_variate:
            J = dg.reshape(len(gg), self.R, self.T, self.R, self.T)
            gg = self.draws.controlled(gg, gg + np.einsum("natbt->nab", J))
        blocks = alpha * self.draws.blocks(gg)
        log_z, log_z_err = self.draws.mean(log_z)
        return *_summary(blocks), float(log_z), float(log_z_err), blocks

    def jacobian(self, q: np.ndarray, alpha: float) -> np.ndarray:
        """J = ∂(u∘q̂)/∂q at q (u = ``update``) on the upper-triangle entries, by one-sided
        differences along each symmetric direction E_ab, step 1 % of √(V_aa V_bb) (within
        [1e-6, 1e-3], inwards at the upper bound: ``_inward``), on the same draws (common random numbers) but
        only the first 1/8 of each block (at least 128: J needs ≈ 10 % accuracy, not q*'s); its
        spectral radius is capped at RHO_CAP.  R(R+1)/2 + 1 evaluations of the map on 1/8 of the
        draws."""
        R = self.R
        rows, cols = np.triu_indices(R)
        per = self.draws.per
        self.draws.use(min(per, max(per // BLOCKS, 128)))
        try:
            u0 = self.update(self.step(q, alpha)[0])
            V = np.diag(np.eye(R) - q)
            J = np.empty((len(rows), len(rows)))
            for k, (a, b) in enumerate(zip(rows, cols)):
                E = np.zeros((R, R))
                E[a, b] = E[b, a] = 1.0
                h = _inward(q, E, float(np.clip(0.01 * np.sqrt(V[a] * V[b]), 1e-6, 1e-3)))
                J[:, k] = (self.update(self.step(q + h * E, alpha)[0]) - u0)[rows, cols] / h
        finally:
            self.draws.use(per)
        rho = np.abs(np.linalg.eigvals(J)).max()
        return J * (RHO_CAP / rho) if rho > RHO_CAP else J

    def _resolvent(self, J: np.ndarray, r: np.ndarray) -> np.ndarray:
        """(I − J)⁻¹ r for symmetric R×R matrices r (…, R, R), on their upper-triangle entries:
        how far a change r of the map's value moves its fixed point.  Returns (…, R, R)."""
        rows, cols = np.triu_indices(self.R)
        flat = r[..., rows, cols]
        moved = np.linalg.solve(np.eye(len(rows)) - J, flat.reshape(-1, len(rows)).T).T.reshape(flat.shape)
        out = np.zeros(r.shape)
        out[..., rows, cols] = out[..., cols, rows] = moved
        return out

    def newton_step(self, q: np.ndarray, q_hat: np.ndarray, J: np.ndarray) -> np.ndarray:
        """The Newton step to the fixed point, q* − q ≈ (I − J)⁻¹ (u(q̂) − q), as an R×R matrix."""
        return self._resolvent(J, self.update(q_hat) - q)

    def fixed_point_stderr(self, q_hat: np.ndarray, blocks: np.ndarray, J: np.ndarray) -> np.ndarray:
        """Standard error of the fixed point q* = u(q̂(q*)) by the delta method: block b's
        estimate q̂_b moves it by δq*_b = (I − J)⁻¹ (u(q̂_b) − u(q̂)), J = ``jacobian`` at q*
        (near a transition an eigenvalue of J → 1: the fixed point is that much less
        determined; the cap RHO_CAP bounds the amplification at 1/(1 − RHO_CAP))."""
        dev = np.array([self.update(b) for b in blocks]) - self.update(q_hat)
        if not dev.any():
            return np.zeros((self.R, self.R))
        return self._resolvent(J, dev).std(axis=0, ddof=1) / np.sqrt(BLOCKS)

    def shifted(self, q_hat: np.ndarray) -> np.ndarray:
        """q̂ + λI: the prior's conjugate with side information."""
        return q_hat + self.side_info * np.eye(self.R)

    def update(self, q_hat: np.ndarray) -> np.ndarray:
        """q = (q̂ + λI)(I + q̂ + λI)⁻¹ (on the range of ``restrict`` when set)."""
        A = self.shifted(q_hat)
        q = A @ np.linalg.inv(np.eye(self.R) + A)
        return _project(q if self.restrict is None else self.restrict @ q @ self.restrict)

    def free_entropy(self, q, q_hat, alpha, log_z) -> float:
        A = self.shifted(q_hat)
        return float(-0.5 * np.trace(q @ q_hat) + 0.5 * (np.trace(A) - np.linalg.slogdet(np.eye(self.R) + A)[1])
                     + alpha * log_z)

    def errors(self, q: np.ndarray):
        """Bayes-optimal and plug-in prediction errors at q, with standard errors."""
        omega, V, Z = self.fields(q)
        n = self.draws.n
        g_omega = self.model.forward(omega).reshape(n, -1)
        plugin = ((self.model.forward(Z).reshape(n, -1) - g_omega) ** 2).sum(axis=1)
        inner = omega[:, None] + np.einsum("ab,nkbt->nkat", _sqrtm(V),
                                           self.rng.standard_normal((n, INNER, self.R, self.T)))
        g_inner = self.model.forward(inner.reshape(n * INNER, self.R, self.T)).reshape(n, INNER, -1)
        bayes = g_inner.var(axis=1, ddof=1).sum(axis=1) + (self.noise or 0.0) * self.n_out
        (b, b_err), (p, p_err) = self.draws.mean(bayes), self.draws.mean(plugin)
        return float(b), float(b_err), float(p), float(p_err)


def _channel(model, noise, options):
    """The channel SE calls: a one-index link's closed form when SymPy has one, else the
    model's default route (reparametrisation, or the noisy route when noise is given), with
    its default nodes.  The per-sample error estimate is computed only where it changes the
    moments (``channel.escalates``: two-layer attention, noiseless or noisy, whose pinned samples
    it sends to finer rules — without it, at q = diag(0.81, 0.998), 38 % of the noiseless
    samples are off by more than 1e-4 and q̂₂₂ by 0.4 %; at Δ ≥ 1e-3 the conditional rule, at
    SE's CONDITIONAL unless the options give ``tol`` or ``conditional``; links with R·T ≤ 4,
    ``channel.ridges``, whose curved
    posteriors it sends to the ridge-refined adaptive rule — without it, y = h_1 h_2 + noise at
    Δ = 0.01 has q̂₁₁ 0.0126 where 0.0035 after two iterations from the uninformed start), where
    it flags samples the rule does not resolve (``channel.unresolved``, R·T > 4:
    ``_Problem._flag`` warns), or when the options ask for it (``tol``, ``error_estimate``); SE
    escalates from ESCALATE, not from the channel's default, and noiseless two layers by
    ESCALATION (T = 2) unless the options give ``tol`` or ``escalation``.  A channel already built is
    used as it is."""
    if hasattr(options, "moments"):
        return options
    options = dict(options or {})
    if "route" not in options and not hasattr(model, "spec"):
        try:
            return model.channel(route="closed", noise=noise, threads=options.get("threads"))
        except ValueError:
            pass
    if noise is not None and options.get("route", "noisy") == "noisy" and not {"tol", "conditional"} & options.keys():
        options["conditional"] = CONDITIONAL
    channel = model.channel(noise=noise, **options)
    if not (_estimate_asked(options) or channel.escalates or channel.unresolved):
        channel.error_estimate = False      # it would only report, or escalate beyond what SE affords
    if channel.escalates and "escalate" not in options:
        channel.escalate = ESCALATE
    if hasattr(channel, "escalation") and channel.T in ESCALATION and not {"tol", "escalation"} & options.keys():
        channel.escalation = channel.escalation | ESCALATION[channel.T]
    return channel


def _estimate_asked(options) -> bool:
    """Whether the channel options settle the estimate themselves (``tol``, ``error_estimate``,
    or a channel already built), so that SE neither turns it off (``_channel``) nor audits it."""
    return hasattr(options, "moments") or bool({"tol", "error_estimate"} & dict(options or {}).keys())


def _start(start, R: int) -> tuple[np.ndarray, str]:
    if isinstance(start, str):
        if start == "uninformed":
            return UNINFORMED * np.eye(R), start
        if start == "informed":
            return INFORMED * np.eye(R), start
        raise ValueError(f"start must be one of {STARTS} or an (R, R) overlap matrix, got {start!r}")
    q0 = np.asarray(start, dtype=np.float64)
    if q0.shape != (R, R) or not np.isfinite(q0).all():
        raise ValueError(f"start must be one of {STARTS} or a finite ({R}, {R}) matrix, got shape {q0.shape}")
    return _project(q0), "warm"


def _iterate(problem: _Problem, alpha: float, q0: np.ndarray, label: str, damping: float,
             tol: float, max_iter: int, stderr_tol: float | None = None,
             max_samples: int | None = None) -> SEResult:
    """The fixed point from q0 at the problem's draws; with ``stderr_tol``, while the standard
    error of the fixed point q (``q_stderr``) is above it, the draws grow (each block continues
    its sequence) by the power of 2 ≥ q_stderr/stderr_tol, at least 2 (enough if the error
    falls as 1/n, as a scrambled Sobol average of a smooth integrand does; 1/√n takes more
    steps), up to ``max_samples`` draws, and the iteration continues from the fixed point
    reached.  The problem is left at the draws it started with."""
    base, trajectory, iterations = problem.draws.per, [], 0
    while True:
        r = _converge(problem, alpha, q0, label, damping, tol, max_iter)
        trajectory.append(r.trajectory)         # q of every evaluation of the map
        iterations += r.iterations
        if stderr_tol is None or r.q_stderr.max() <= stderr_tol:
            break
        per = problem.draws.per << max(1, int(np.ceil(np.log2(r.q_stderr.max() / stderr_tol))))
        while per * BLOCKS > max_samples:
            per //= 2
        if per <= problem.draws.per:
            break
        problem.draws.use(per)
        q0 = r.q
    problem.draws.use(base)
    r.trajectory, r.iterations = np.concatenate(trajectory), iterations
    return r


def _converge(problem: _Problem, alpha: float, q0: np.ndarray, label: str, damping: float,
              tol: float, max_iter: int, memory: int = 3) -> SEResult:
    q, trajectory, mix, newton = q0, [q0], _Anderson(memory), _Newton(problem, alpha)
    for it in range(1, max_iter + 1):
        q_hat, q_hat_err, log_z, log_z_err, blocks = problem.step(q, alpha)
        mix.push(q, damping * q + (1 - damping) * problem.update(q_hat))
        step, converged = None, _stagnated(trajectory, tol)
        if not converged and (newton.active or mix.distance() < tol):
            step, converged = newton.check(q, q_hat, tol)
        if converged or it == max_iter:
            break
        q = _project(q + step if step is not None else mix.next().reshape(q.shape))
        trajectory.append(q)
    flagged = problem.audit(q)                  # at q (before the Jacobian's steps)
    J = newton.J if newton.active else problem.jacobian(q, alpha)
    bayes, bayes_err, plugin, plugin_err = problem.errors(q)
    return SEResult(alpha=alpha, q=q, q_hat=q_hat, mse=1 - np.diag(q), prediction_error=bayes,
                    plugin_error=plugin, free_entropy=problem.free_entropy(q, q_hat, alpha, log_z),
                    trajectory=np.array(trajectory), stderr=q_hat_err,
                    q_stderr=problem.fixed_point_stderr(q_hat, blocks, J),
                    free_entropy_stderr=alpha * log_z_err, prediction_error_stderr=bayes_err,
                    plugin_error_stderr=plugin_err, iterations=it, converged=bool(converged), start=label,
                    samples=problem.draws.n, channel_flagged=flagged)


class _Newton:
    """Newton steps to the fixed point once Anderson's estimate of the distance is below tol
    (near a transition the map contracts slowly, ρ ≈ 0.95, and Anderson's secants through a
    map with quadrature noise overshoot): q ← q + (I − J)⁻¹ (u(q̂) − q), J = ``jacobian``,
    kept while each step at least halves the distance (a chord method), recomputed otherwise.
    The length of that step is the distance to the fixed point: below tol the iteration has
    converged, and so it has when with a fresh J it no longer falls (the map's noise floor).
    A step longer than NEWTON_REACH hands back to Anderson."""

    def __init__(self, problem: _Problem, alpha: float):
        self.problem, self.alpha, self.J, self.distance, self.stale = problem, alpha, None, np.inf, False

    @property
    def active(self) -> bool:
        return self.J is not None

    def check(self, q: np.ndarray, q_hat: np.ndarray, tol: float):
        """(step, converged) at the evaluation (q, q̂); step None: take Anderson's."""
        last, fresh = self.distance, self.J is None or self.stale
        if fresh:
            self.J = self.problem.jacobian(q, self.alpha)
        step = self.problem.newton_step(q, q_hat, self.J)
        self.distance = float(np.abs(step).max())
        if self.distance < tol or (fresh and self.distance >= last):
            return step, True
        if self.distance > NEWTON_REACH:
            self.J, self.distance, self.stale = None, np.inf, False
            return None, False
        self.stale = self.distance > 0.5 * last
        return step, False


def _stagnated(trajectory, tol: float, window: int = 6) -> bool:
    """The iterates have stopped moving: over the last ``window`` steps every entry of q stays in
    a band narrower than ``tol`` without a monotone drift.  The map is then at the floor of its
    own quadrature noise (a channel accurate to ε moves G(q) by ≈ ε between nearby q, so
    |G(q) − q| cannot fall below it), and a non-monotone sequence brackets its fixed point to
    within the band."""
    if len(trajectory) < window:
        return False
    last = np.array(trajectory[-window:]).reshape(window, -1)
    step = np.diff(last, axis=0)
    monotone = (step >= 0).all(axis=0) | (step <= 0).all(axis=0)
    band = last.max(axis=0) - last.min(axis=0)
    return bool((band < tol).all() and not (monotone & (band > 0)).any())


class _Anderson:
    """Guarded Anderson acceleration of the fixed-point map q ↦ G(q) (memory m): the next
    iterate is G(q_k) − ΔG γ with γ = argmin ‖F_k − ΔF γ‖, F = G(q) − q.  It takes plain steps,
    as AMP does, until the map contracts over the whole history (ρ̂ < 1) and while an entry of
    F grows with a steady sign (an iterate escaping an unstable fixed point, q ≈ 0 above a
    weak-recovery threshold); it extrapolates only within a trust region: along F and no
    further than the predicted distance |F|/(1 − ρ̂), at most 4|F| from a two-point history
    (a longer step is shortened).  The history restarts whenever the residual grows."""

    def __init__(self, memory: int):
        self.memory, self.X, self.G = memory, [], []

    def push(self, x: np.ndarray, g: np.ndarray) -> None:
        self.X, self.G = self.X[-self.memory:] + [x.ravel()], self.G[-self.memory:] + [g.ravel()]

    def contraction(self) -> float:
        """ρ̂ = max_i |ΔG_i| / |ΔX_i| (max norm) over the history: the map's contraction."""
        dX, dG = np.abs(np.diff(self.X, axis=0)).max(axis=1), np.abs(np.diff(self.G, axis=0)).max(axis=1)
        return float(np.max(np.where(dX > 0, dG / np.where(dX > 0, dX, 1), 0.0)))

    def distance(self) -> float:
        """Distance to the fixed point, |F_k| / (1 − ρ̂) (infinite before two evaluations or
        while ρ̂ ≥ 1)."""
        f = np.abs(self.G[-1] - self.X[-1]).max()
        if f == 0:
            return 0.0
        rho = self.contraction() if len(self.X) > 1 else np.inf
        return f / (1 - rho) if rho < 1 else np.inf

    def next(self) -> np.ndarray:
        F = np.array(self.G) - np.array(self.X)
        if len(F) < 2 or self.contraction() >= 1:        # not (yet) contracting: plain step
            return self.G[-1]
        f, before = F[-1], F[-2]
        steady = (np.sign(f) == np.sign(before)) & (np.abs(f) > 1e-12)   # not jitter
        if (steady & (np.abs(f) > np.abs(before))).any():                 # an entry escapes
            if np.abs(f).max() > np.abs(before).max():
                self.X, self.G = self.X[-1:], self.G[-1:]
            return self.G[-1]
        dF, dG = np.diff(F, axis=0), np.diff(self.G, axis=0)
        gamma = np.linalg.lstsq(dF.T, f, rcond=None)[0]
        x = self.G[-1] - dG.T @ gamma
        # trust region: along the residual where it is steady (else it is a jump towards another,
        # possibly unstable, fixed point), and no further than the predicted distance — from a
        # two-point history at most 4 residuals: a secant through the first steps of a nonlinear
        # map (two-layer attention, α = 0.5, from q = diag(0, 0.21): ρ̂ = 0.95) once threw q₂₂
        # from 0.31 to 1, into the basin of the fixed point with both layers learned.  An entry
        # whose residual is 0 (an unlearned layer at q = 0) stays put; a longer step is shortened.
        step = x - self.X[-1]
        gap = 1 - self.contraction()
        reach = np.where(np.abs(f) > 1e-12, np.maximum(np.abs(f), 0.01 * np.abs(f).max()), 1e-12)
        reach = reach / (max(gap, 0.25) if len(F) < 3 else gap)
        along = (np.sign(step) == np.sign(f)) | ~steady
        if not along.all():
            return self.G[-1]
        return self.X[-1] + step * min(1.0, float(np.min(reach / np.maximum(np.abs(step), 1e-300))))


def _best(a: SEResult, b: SEResult) -> SEResult:
    """The fixed point of larger free entropy; the other one attached when they differ."""
    best, other = (a, b) if a.free_entropy >= b.free_entropy else (b, a)
    if np.abs(a.q - b.q).max() > DISTINCT:
        best.alternative = other
    return best


def _check(alpha, damping, tol, max_iter, stderr_tol=None, max_samples=None, samples=0):
    alpha = validate.positive("alpha", alpha, allow_zero=True)
    if stderr_tol is not None:
        validate.positive("stderr_tol", stderr_tol)
        if not isinstance(max_samples, (int, np.integer)) or max_samples < samples:
            raise ValueError(f"max_samples must be an integer ≥ samples ({samples}), got {max_samples!r}")
    if not 0 <= damping < 1:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    validate.positive("tol", tol)
    if not isinstance(max_iter, (int, np.integer)) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    return alpha


def state_evolution(model, alpha: float, *, side_info: float = 0.0, start="uninformed",
                    damping: float = 0.0, samples: int = 4096, seed=0, tol: float = 1e-4,
                    max_iter: int = 200, noise: float | None = None, sampler: str = "sobol",
                    channel: dict | None = None, control_variate: bool = False,
                    stderr_tol: float | None = None, max_samples: int = MAX_SAMPLES) -> SEResult:
    """Iterate state evolution at sample ratio ``alpha`` from ``start`` until the estimated
    distance to the fixed point is below ``tol``.  ``start``: "uninformed" (q = 1e-3·I),
    "informed" (q = (1 − 1e-3)·I), "both" (both; the larger free
    entropy wins and the other is ``result.alternative`` when they differ), or an R×R matrix.
    ``samples`` draws of (ξ, ζ, noise) by ``sampler`` ("sobol": scrambled Sobol, "mc"),
    ``seed`` an int or numpy Generator; ``noise`` = Δ for P(y|Z) = N(y; g(Z), Δ);
    ``channel``: options for ``model.channel`` (e.g. ``{"nodes": 10, "threads": 2}``);
    ``control_variate``: estimate q̂ with the Nishimori control variate (see ``_Problem.step``;
    it needs an accurate channel Jacobian: where the last layer is pinned, the two-layer polar
    rule's ∂g_out errors bias it); ``stderr_tol``: grow the draws (up to ``max_samples``)
    until the standard error of the fixed point q, ``q_stderr``, is below it (see _iterate)."""
    alpha = _check(alpha, damping, tol, max_iter, stderr_tol, max_samples, samples)
    problem = _Problem(model, noise, side_info, samples, sampler, np.random.default_rng(seed), channel,
                       control_variate=control_variate)
    if isinstance(start, str) and start == "both":
        runs = [_iterate(problem, alpha, *_start(s, problem.R), damping, tol, max_iter, stderr_tol, max_samples)
                for s in ("uninformed", "informed")]
        return _best(*runs)
    return _iterate(problem, alpha, *_start(start, problem.R), damping, tol, max_iter, stderr_tol, max_samples)


def free_entropy(model, alpha: float, q, q_hat, *, side_info: float = 0.0, samples: int = 4096,
                 seed=0, noise: float | None = None, sampler: str = "sobol",
                 channel: dict | None = None) -> tuple[float, float]:
    """f(q, q̂) of the module docstring at any (q, q̂), and its standard error; the draws are
    those state_evolution uses with the same ``samples``, ``seed`` and ``sampler``."""
    alpha = validate.positive("alpha", alpha, allow_zero=True)
    problem = _Problem(model, noise, side_info, samples, sampler, np.random.default_rng(seed), channel)
    q, q_hat = (np.asarray(a, dtype=np.float64) for a in (q, q_hat))
    for name, a in (("q", q), ("q_hat", q_hat)):
        if a.shape != (problem.R, problem.R) or not np.isfinite(a).all():
            raise ValueError(f"{name} must be a finite ({problem.R}, {problem.R}) matrix, got shape {a.shape}")
    if np.abs(_project(q) - q).max() > 1e-12:
        raise ValueError(f"q must be symmetric with eigenvalues in [0, 1 − {V_MIN:g}]")
    _, _, log_z, log_z_err, _ = problem.step(q, alpha)
    return problem.free_entropy(q, q_hat, alpha, log_z), alpha * log_z_err


def learning_curve(model, alphas, *, start: str = "uninformed", progress: bool = True,
                   side_info: float = 0.0, samples: int = 4096, seed=0, noise: float | None = None,
                   sampler: str = "sobol", channel: dict | None = None, damping: float = 0.0,
                   tol: float = 1e-4, max_iter: int = 200, control_variate: bool = False,
                   stderr_tol: float | None = None, max_samples: int = MAX_SAMPLES) -> list[SEResult]:
    """State evolution over a grid of α with continuation: the uninformed branch is swept up in
    α, each point started from the previous fixed point (its eigenvalues floored at the
    uninformed start); the informed branch is swept down.  ``start="both"`` sweeps both and
    keeps, per α, the fixed point of larger free entropy (the other in ``.alternative``).  The
    same draws serve every α (with ``stderr_tol``, each α starts from ``samples`` and grows
    them only as far as it needs).  Options as for state_evolution.  Returns one SEResult per α, in
    the order given."""
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    if alphas.size == 0 or not np.isfinite(alphas).all() or (alphas < 0).any():
        raise ValueError("alphas must be a non-empty list of finite values ≥ 0")
    if not isinstance(start, str) or start not in STARTS:
        raise ValueError(f"start must be one of {STARTS} for a learning curve (an explicit q: "
                         f"state_evolution), got {start!r}")
    _check(0.0, damping, tol, max_iter, stderr_tol, max_samples, samples)
    problem = _Problem(model, noise, side_info, samples, sampler, np.random.default_rng(seed), channel,
                       control_variate=control_variate)
    branches = {}
    bar = _progress(progress, len(alphas) * (2 if start == "both" else 1))
    for branch in (("uninformed", "informed") if start == "both" else (start,)):
        order = np.argsort(alphas) if branch == "uninformed" else np.argsort(-alphas)
        q0, results = _start(branch, problem.R)[0], {}
        for i in order:
            results[i] = res = _iterate(problem, float(alphas[i]), q0, branch, damping, tol, max_iter,
                                        stderr_tol, max_samples)
            q0 = res.q
            if branch == "uninformed":      # off the q = 0 fixed point again
                q0 = _spectral(res.q, lambda w: np.maximum(w, UNINFORMED))
            bar.set_postfix(alpha=f"{alphas[i]:.3g}", q=np.round(np.diag(res.q), 3).tolist(),
                            **({"samples": res.samples} if stderr_tol else {}))
            bar.update(1)
        branches[branch] = results
    bar.close()
    if start == "both":
        return [_best(branches["uninformed"][i], branches["informed"][i]) for i in range(len(alphas))]
    return [branches[start][i] for i in range(len(alphas))]


def _progress(enabled: bool, total: int):
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, unit="α", leave=False)
