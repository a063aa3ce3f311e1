"""Output channels: log Z_out, g_out and ∂_ω g_out from one pass over quadrature nodes (spec §4).

For Z with independent columns Z[:, t] ~ N(ω[:, t], V) and the posterior ∝ N(Z; ω, V) P(y|Z):

    g_out = V⁻¹ (E[Z|y] - ω),   ∂g_out[(a,t),(b,s)] = (V⁻¹ Cov(Z_t, Z_s|y) V⁻¹)_ab - V⁻¹_ab δ_ts

This module holds what the routes share (``Channel``: the Laplace rule, the adaptive rule, the
error estimate) and ``make_channel``; each route is a module of its own.

Routes:
- ``"reparam"`` (smi_core.reparam_channel; noiseless softmax deep attention, tied, r = 1): the
  integral over the earlier layers x = h_{<L} of Σ_± N([x; ±h_L(x)]; ω, V) / |det Φ⁽ᴸ⁻¹⁾(x)|;
  L = 1 has no integral (two points ±u_L).  ``log_z`` omits the factor of u_L ↦ y, which depends on y only.
- ``"noisy"`` (smi_core.noisy_channel; any differentiable link, P(y|Z) = N(y; g(Z), Δ I)): the
  integral over all R·T indices; ``log_z`` is exact.
- ``"closed"`` (smi_core.closed_channel): a closed form derived by SymPy.

Nodes sit on the posterior: every mode (one per sign of u_L and reflection of an earlier layer,
or per symmetry of the link) is found by Gauss–Newton, the integral is split by a partition of
unity over the modes' Laplace Gaussians, and each piece is integrated by a Gauss–Hermite tensor
rule centred and scaled on its mode (d ≤ 4), or by randomised QMC (d > 4).  The error estimate
is the difference to a coarser rule; with ``tol`` (and for two- and three-layer attention above
``escalate`` by default) the node count grows (×1.5, while n^d ≤ GH_BUDGET, each rule checked
against the previous one), and with ``tol`` samples still above it go to adaptive Genz–Malik
cubature.  The fixed rules run by tiles of nodes (``_quadrature.integrate``).

T = 2 and L = 2 or 3 with broad posteriors over the earlier layers: the softmax of layer 1
switches across the lines a = 0, b = 0 and a = b of h_1 = (a, b), on a scale ≈ 1/(β|h_1|) —
near-cliffs and plateaus on which Gauss–Hermite converges only algebraically.  All three lines
meet at h_1 = 0, so in polar coordinates about the origin they only make the angular integrand
vary fast, and the periodic trapezoid rule in θ converges geometrically whatever their width;
the count per ring grows with β r².  Layer 2's cliffs are lines through u_2 = Φ⁽¹⁾h_2 = 0, hence
through h_2 = 0 for every h_1, so L = 3 takes the product of such rules in h_1 and in h_2.  The
nodes depend on the sample only through V and the |ω_ℓ|, so samples with the same V and close
|ω_ℓ| (state evolution, GAMP: V is shared) share them: Φ⁽ᴸ⁻¹⁾⁻¹ and log|det Φ⁽ᴸ⁻¹⁾| are computed
once per node, and each sample adds only h_L = Φ⁻¹u_L and the 2^L terms (each earlier layer
reflected or not — Φ is even in each — and the sign of u_L; the nodes of each layer cover a half
plane).  Samples whose posterior over an earlier layer is narrow (``ReparamChannel.POLAR_MIN_SD``)
keep the Laplace rule, on which the cliffs are smooth; for three layers, just above that width
both rules run and their posteriors are blended (``_blend``), so the moments are continuous in
V.  Neither rule resolves a pinned last layer (V_LL small) with broad earlier layers: the
posterior then collapses onto the pre-image of a small ball in h_L (see the README).  The prior component of the partition sits e^-40 below the highest mode: its rule is
on the prior's scale and cannot resolve a narrow posterior, and with a near-singular V the
moments must be right to ≈ 1e-12 of the mass for dg_out = V⁻¹(Cov - V)V⁻¹ to be right to 1e-6.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _quadrature, validate
from .kernels import first_bad_row
from .polar import _about, refine
from .quadrature import gauss_hermite, partition, sobol_normal

ROUTES = ("reparam", "noisy", "closed")
DEFAULT_NODES = {1: 40, 2: 14, 3: 9, 4: 7}
GH_BUDGET = 16384       # with tol: Gauss–Hermite grows ×1.5 per dimension while n^d stays below this
QMC_SCRAMBLES = 4
# with tol: the adaptive rule integrates each partition piece over ±ADAPTIVE_BOUND of its own
# whitened coordinates.  A mode's piece keeps the partition weight out to where its Gaussian
# falls e^-40 (partition's floor) plus the prior's own decay below the prior piece's, so 8 left
# a tail out: a three-layer draw at q = 0.96·I with y at the softmax edge (h_2's posterior sd
# 0.21 against 0.15 at the mode) was 1.1e-3 off the reference while estimating 2.0e-5; with
# 12, 3.4e-5 (the reference's own bound 1.1e-5)
ADAPTIVE_BOUND = 12.0
# it starts from ADAPTIVE_SPLIT^d equal boxes per piece: a feature narrower than a starting box
# that none of its 17 (2-D) points sees is never refined.  On 226 two-layer draws with a
# near-singular V (λ_min 1e-4 … 3e-3, at random angles; the rule alone at tol = 1e-6, against the
# channel at tol = 1e-9) the error exceeded 3× the estimate and 1e-7 on 10 draws with 2 (the
# orthant boxes; worst 0.26, confirmed against mpmath), 5 with 3, 2 with 4 (worst 3.2e-3); at
# q = 0.96·I, three layers, tol = 1e-4, the cost did not change (0.57 / 0.55 s per sample).
ADAPTIVE_SPLIT = 4
# and the prior's piece (``partition``'s last) from PRIOR_SPLIT^d: it integrates whatever the
# modes' pieces do not cover, on the prior's scale, including any mode Gauss–Newton did not find
# from its starts at ±ω.  On the 226 draws two such modes (3 % and 0.3 % of the mass, the second
# ≈ 0.04 wide against the prior's sd 0.5) were 8.1e-4 and 3.2e-3 off while estimating ≤ 1e-6,
# with 4 as with ADAPTIVE_SPLIT, at every budget tried (up to 3·10⁵ and 10⁶ regions); with 8
# none is above 3× its estimate (max error 4.2e-7), at the same cost (6.7 against 6.3 ms per
# sample)
PRIOR_SPLIT = 8


@dataclass
class Moments:
    """Per sample: ``log_z`` (n,), ``g_out`` (n, R, T), ``dg_out`` (n, RT, RT) flattened a*T + t,
    ``error`` (n,): estimated max abs error of (g_out, dg_out) relative to their largest entry."""
    log_z: np.ndarray
    g_out: np.ndarray
    dg_out: np.ndarray
    error: np.ndarray


class Channel:
    """``channel.moments(y, omega, V)``; build it with ``model.channel(**options)``."""

    route: str
    MAX_REGIONS = 4000      # the adaptive rule's default budget per sample

    def __init__(self, model, nodes: int | None = None, tol: float | None = None,
                 error_estimate: bool = True, qmc_points: int = 4096, seed: int = 0,
                 inflate: float = 1.0, max_regions: int | None = None, threads: int | None = None):
        """``max_regions``: the adaptive rule's budget per sample (None: MAX_REGIONS)."""
        self.model = model
        self.R, self.T = model.indices, model.tokens
        self.nodes, self.tol, self.error_estimate = nodes, tol, error_estimate or tol is not None
        self.qmc_points, self.seed, self.inflate = qmc_points, seed, inflate
        if max_regions is not None and (not isinstance(max_regions, (int, np.integer)) or max_regions < 1):
            raise ValueError(f"max_regions must be a positive integer, got {max_regions!r}")
        self.max_regions = self.MAX_REGIONS if max_regions is None else int(max_regions)
        self.threads = threads or 0
        if nodes is not None and (not isinstance(nodes, (int, np.integer)) or nodes < 2):
            raise ValueError(f"nodes must be an integer ≥ 2, got {nodes!r}")
        if tol is not None:
            validate.positive("tol", tol)

    # -- checks ----------------------------------------------------------------------------
    def _inputs(self, y, omega, V):
        omega, _ = validate.batch("omega", omega, (self.R, self.T))
        n = len(omega)
        V = np.asarray(V, dtype=np.float64)
        if V.ndim == 0 and self.R == 1:
            V = V.reshape(1, 1)
        if V.shape == (self.R, self.R):
            V = np.broadcast_to(V, (n, self.R, self.R))
        if V.shape != (n, self.R, self.R) or not np.isfinite(V).all():
            raise ValueError(f"V must be a finite ({self.R}, {self.R}) matrix or ({n}, {self.R}, {self.R}) "
                             f"array, got shape {V.shape}")
        asym = np.abs(V - np.swapaxes(V, 1, 2)).max(axis=(1, 2)) > 1e-12 * np.abs(V).max(axis=(1, 2))
        eig = np.linalg.eigvalsh(V)
        bad = asym | (eig[:, 0] <= 0)
        if bad.any():
            raise ValueError(f"V must be symmetric positive definite (sample {int(np.argmax(bad))} is not)")
        y = self._check_y(y, n)
        return y, omega, np.ascontiguousarray(V)

    # -- the pass over nodes ---------------------------------------------------------------
    def moments(self, y, omega, V) -> Moments:
        y, omega, V = self._inputs(y, omega, V)
        Vinv = np.linalg.inv(V)
        Vinv = 0.5 * (Vinv + np.swapaxes(Vinv, 1, 2))
        logdetV = np.linalg.slogdet(V)[1]
        n, RT = len(omega), self.R * self.T
        if self.model_is_points:
            u = self._prepare(y, omega, V)[0]
            log_z, mean, cov = self._points(u, omega, Vinv, logdetV)
            return self._assemble(omega, V, Vinv, log_z, mean, cov, np.zeros(n))
        weight = self._polar_weight(omega, V)
        runs = []
        for idx, method in ((np.flatnonzero(weight < 1), self._laplace), (np.flatnonzero(weight > 0), self._polar)):
            out = np.zeros(n), np.zeros((n, RT)), np.zeros((n, RT, RT)), np.zeros(n)
            if idx.size:
                for a, b in zip(out, method(y[idx], omega[idx], V[idx], Vinv[idx], logdetV[idx])):
                    a[idx] = b
            runs.append(out)
        return self._assemble(omega, V, Vinv, *_blend(weight, *runs))

    model_is_points = False
    escalates = False       # whether the error estimate changes the moments (not only reports)
    ridges = False          # whether curved posteriors escalate to the adaptive rule on the ridge
    unresolved = False      # whether curved posteriors stay with the Laplace rule (flagged by the estimate)

    def representable(self, y) -> np.ndarray:
        """(n,) mask of the outputs this route accepts (here: finite)."""
        y = np.asarray(y, dtype=np.float64)
        return np.isfinite(y.reshape(len(y), -1)).all(axis=1)

    def _polar_weight(self, omega, V):
        """Per sample, the weight of the polar rule (see ReparamChannel); 0 (the Laplace rule)
        by default."""
        return np.zeros(len(omega))

    def _laplace(self, y, omega, V, Vinv, logdetV):
        """Laplace modes, partition of unity, Gauss–Hermite (d ≤ 4) or randomised QMC per piece;
        samples whose estimate is above ``_laplace_target`` get finer Gauss–Hermite rules, and
        with ``tol`` then adaptive cubature.  Returns (log_z, E[Z], Cov[Z], error)."""
        data, x0, signs = self._prepare(y, omega, V)
        n, RT = len(omega), self.R * self.T
        K, d = x0.shape[1], x0.shape[2]
        centers = np.ascontiguousarray(x0, dtype=np.float64)
        logf, hess = np.empty((n, K)), np.empty((n, K, d, d))
        const0 = -0.5 * self.T * (self.R * np.log(2 * np.pi) + logdetV) - 0.5 * self._n_data_noise * np.log(2 * np.pi * max(self._delta, 1e-300))
        _quadrature.modes(self._route_id, self._jac_kernel.capsule(), self.model.params,
                          np.ascontiguousarray(data), omega.reshape(n, RT), Vinv, const0, centers,
                          np.ascontiguousarray(signs, dtype=np.float64), logf, hess, self.R, self.T,
                          self._n_node, self._delta, threads=self.threads)
        logf = np.where(np.isfinite(logf), logf, -np.inf)
        best = np.argmax(logf, axis=1)
        centers, hess, A, logh = partition(centers, hess, logf, self._prior(omega, V), self.inflate)
        ref = self._point(data, centers[np.arange(n), best], signs.reshape(n, K)[np.arange(n), best])
        args = (data, omega, Vinv, logdetV, centers, A, hess, logh, ref)
        nodes = self.nodes or DEFAULT_NODES.get(d, 0)
        if d <= 4:      # tensor Gauss–Hermite; error: the difference to a coarser rule
            fine = self._run(args, gauss_hermite(nodes, d))
            error = np.full(n, np.nan)
            if self.error_estimate:
                coarse = self._run(args, gauss_hermite(max(1, nodes - max(2, nodes // 3)), d))
                error = self._spread([fine, coarse], omega, V, Vinv, ref)
        else:           # randomised QMC: independent scramblings; error: their standard error
            rng = np.random.default_rng(self.seed)
            runs = [self._run(args, sobol_normal(self.qmc_points // QMC_SCRAMBLES, d, rng))
                    for _ in range(QMC_SCRAMBLES)]
            fine = _combine(runs)
            error = self._spread(runs, omega, V, Vinv, ref) / np.sqrt(QMC_SCRAMBLES)
        target = self._laplace_target()
        if target is not None and d <= 4:       # first more Gauss–Hermite nodes (×1.5, ≤ 3 times)
            counts = [nodes]
            while len(counts) <= 3 and int(np.ceil(1.5 * counts[-1])) ** d <= GH_BUDGET:
                counts.append(int(np.ceil(1.5 * counts[-1])))
            counts = counts[1:]
            refine(fine, error, target, len(counts),
                   lambda i, k: self._run(tuple(a[i] for a in args), gauss_hermite(counts[k], d)),
                   lambda i, runs: self._spread(runs, omega[i], V[i], Vinv[i], ref[i]))
        adaptive = self._adaptive_target()
        if adaptive is not None:                # then adaptive cubature
            redo = np.flatnonzero(~(error <= adaptive) & ~self._escalated_elsewhere(V))
            if redo.size:       # kept where finite (not so on 4 of 60 pinned T = 3 samples, nor where
                                # a box too coarse for the degree-7 rule's negative weights left a
                                # negative mass: R·T = 3 with max_regions=1)
                better, achieved = self._adaptive(tuple(a[redo] for a in args), const0[redo], V[redo], adaptive)
                ok = (np.isfinite(achieved) & np.isfinite(better[0]) & np.isfinite(better[1]).all(axis=1)
                      & np.isfinite(better[2]).all(axis=(1, 2)))
                error[redo[ok]] = achieved[ok]
                for a, b in zip(fine, better):
                    a[redo[ok]] = b[ok]
        return (*_about(ref, *fine), error)

    def _laplace_target(self):
        """The estimate above which the Laplace rule grows its nodes (None: never)."""
        return self.tol

    def _adaptive_target(self):
        """The estimate above which the Laplace path's samples go to adaptive cubature, and its
        tolerance (None: never)."""
        return self.tol

    def _escalated_elsewhere(self, V):
        """(n,) mask of the Laplace path's samples that another rule escalates instead of the
        adaptive rule (none here; see NoisyChannel's conditional rule)."""
        return np.zeros(len(V), dtype=bool)

    def _target(self, escalating):
        """``tol`` when given, else the channel's ``escalate`` where the rule escalates by default
        and the estimate is on (None: no finer rules)."""
        return self.tol if self.tol is not None else (
            self.escalate if escalating and self.error_estimate else None)

    def _run(self, args, rule):
        """One pass of the rule (ξ, lw) over every partition piece."""
        data, omega, Vinv, logdetV, centers, A, hess, logh, ref = args
        xi, lw = rule
        n, RT = len(omega), self.R * self.T
        log_z, mean, second = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        _quadrature.integrate(self._route_id, self._node_kernel.capsule("columns"), self.model.params,
                              np.ascontiguousarray(data), omega.reshape(n, RT), Vinv, logdetV,
                              np.ascontiguousarray(centers), np.ascontiguousarray(A),
                              np.ascontiguousarray(hess), np.ascontiguousarray(logh), xi, lw,
                              np.ascontiguousarray(ref), self.R, self.T, self._n_node, self._delta,
                              log_z, mean, second, self.threads)
        return log_z, mean, second

    def _adaptive(self, args, const0, V, tol):
        """Adaptive Genz–Malik cubature of the same partition pieces, to ``tol`` in
        κ Σ|I7 - I5| / mass (``_quadrature._adaptive_regions``; κ from ``_amp``, as ``_pinned``);
        with ``_ridge_rule`` the prior's piece alone (weight 1), from boxes refined onto the ridge."""
        data, omega, Vinv, logdetV, centers, A, hess, logh, ref = args
        n, RT = len(omega), self.R * self.T
        log_z, mean, second = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        used, achieved = np.empty(n, dtype=np.int32), np.empty(n)
        M, d = centers.shape[1:]
        split = np.full(M, ADAPTIVE_SPLIT, dtype=np.int32)
        split[-1] = PRIOR_SPLIT                         # the prior's piece (``partition``)
        while split.max() > 1 and (split ** d).sum() > self.max_regions // 4:
            split[np.argmax(split)] -= 1                # the start within a quarter of the budget
        ridge, on_ridge = self._ridge_rule(), {}
        if ridge is not None:       # λ_min(A_mᵀ P A_m) of the prior's piece m (``_ridge_boxes``)
            P = _per_token(Vinv, self.T)
            lam = np.ascontiguousarray(np.linalg.eigvalsh(np.swapaxes(A[:, -1], 1, 2) @ P @ A[:, -1])[:, 0])
            logh = np.where(np.arange(M) == M - 1, logh, -np.inf)
            on_ridge = dict(jacobian=self._jac_kernel.capsule(), lam=lam, ridge=ridge)
        _quadrature.integrate_adaptive(self._route_id, self._node_kernel.capsule("columns"), self.model.params,
                                       np.ascontiguousarray(data), omega.reshape(n, RT), Vinv, const0,
                                       np.ascontiguousarray(centers), np.ascontiguousarray(A),
                                       np.ascontiguousarray(hess), np.ascontiguousarray(logh),
                                       np.ascontiguousarray(ref), _whitening(V, self.T),
                                       self.R, self.T, self._n_node, self._delta, tol,
                                       self.max_regions, ADAPTIVE_BOUND, split, log_z, mean, second, used, achieved,
                                       self.threads, V=np.ascontiguousarray(V), amp=_amp(V), **on_ridge)
        return (log_z, mean, second), achieved

    def _ridge_rule(self):
        """The refinement of the adaptive rule's starting boxes onto the likelihood's ridge, as
        ``_quadrature.integrate_adaptive``'s ``ridge`` = [reach, width (in units of y), cap, floor]
        (None: equal boxes on every piece)."""
        return None

    def _spread(self, runs, omega, V, Vinv, ref):
        """``_differ`` of runs (log Z, E[Z] - ref, E[(Z - ref)(Z - ref)ᵀ])."""
        return self._differ(omega, V, Vinv, *[_about(ref, *run) for run in runs])

    def _differ(self, omega, V, Vinv, *results):
        """``_spread_of`` the moments of results (log Z, E[Z], Cov[Z], ...) of the same samples."""
        return _spread_of([self._assemble(omega, V, Vinv, *r[:3], None, check=False) for r in results])

    def _assemble(self, omega, V, Vinv, log_z, mean, cov, error, check=True) -> Moments:
        n, R, T = len(omega), self.R, self.T
        EZ = mean.reshape(n, R, T)
        g_out = np.einsum("nab,nbt->nat", Vinv, EZ - omega)
        P, VI = _per_token(Vinv, T), _per_token(V, T)
        dg_out = P @ (cov - VI) @ P
        dg_out = 0.5 * (dg_out + np.swapaxes(dg_out, 1, 2))
        if check:
            bad = first_bad_row(np.concatenate([log_z[:, None], g_out.reshape(n, -1),
                                                dg_out.reshape(n, -1)], axis=1))
            if bad is not None:
                raise FloatingPointError(f"non-finite channel moment at sample {bad} "
                                         f"({self.route} route)")
        return Moments(log_z=log_z, g_out=g_out, dg_out=dg_out, error=error)


def _spread_of(moments):
    """max over (g_out, dg_out) entries of the spread between the moments (two rules: their
    difference; several scramblings: their standard deviation), over the largest entry."""
    parts = np.array([_entries(m) for m in moments])
    spread = np.abs(parts[0] - parts[1]) if len(parts) == 2 else parts.std(axis=0, ddof=1)
    scale = np.abs(parts).max(axis=(0, 2))
    return spread.max(axis=1) / np.where(scale > 0, scale, 1.0)


def _amp(V):
    """max(λ_min(V)^-½, λ_min(V)⁻¹) per sample, the numerator of κ = max(1, amp / M): an error
    ε·mass in the moments whitened by V's Cholesky factor moves g_out by ≤ ε/√λ_min(V) and
    dg_out by ≤ ε/λ_min(V), i.e. the metric (relative to the largest entry M of g_out, dg_out)
    by ≤ ε κ (the adaptive rule's stopping test, ``_quadrature._kappa``).  κ is large where V is
    near-singular and y barely informative along its thin direction (M ≪ ‖V⁻¹‖: dg_out is a
    difference of nearly equal terms)."""
    lam = np.linalg.eigvalsh(V)[:, 0]
    return np.maximum(lam ** -0.5, 1.0 / lam)


def _whitening(V, T):
    """W = L⁻¹ ⊗ I_T (n, RT, RT), index a*T + t, for V = LLᵀ: the adaptive rules' error is in
    W·(moments)·Wᵀ (``_quadrature._region``)."""
    return np.ascontiguousarray(_per_token(np.linalg.inv(np.linalg.cholesky(V)), T))


def _per_token(M, T):
    """M ⊗ I_T per sample: (n, R, R) → (n, RT, RT), index a*T + t."""
    n, R = M.shape[:2]
    return np.einsum("nab,ts->natbs", M, np.eye(T)).reshape(n, R * T, R * T)


def _entries(m):
    """The entries of (g_out, dg_out) per sample, (n, RT + (RT)²)."""
    n = len(m.g_out)
    return np.concatenate([m.g_out.reshape(n, -1), m.dg_out.reshape(n, -1)], 1)


def _shallow(model, threads, layers):
    """``model`` cut to its first ``layers`` layers (same T, skip, β, backend), on the channel's
    threads: with one layer, u ↦ σ_β(u uᵀ), the last softmax (its reparametrisation gives u_L
    from y); with two, its node kernel gives Φ⁽¹⁾⁻¹u_2."""
    from .models import DeepAttention
    return DeepAttention(layers, model.tokens, 1, skip=model.skip, beta=model.beta, backend=model.backend,
                         threads=threads or model._threads or None)


def _given_h1(x1, omega, V):
    """h_2 | h_1 = x_1 ~ N(m, s² I) per row (ω, V of its sample): m = ω_2 + V₂₁/V₁₁ (x_1 − ω_1),
    s² (``_h2_var``)."""
    return omega[:, 1] + (V[:, 1, 0] / V[:, 0, 0])[:, None] * (x1 - omega[:, 0]), _h2_var(V)


def _h2_var(V):
    """The variance of h_2 given h_1, s² = V₂₂ − V₂₁²/V₁₁ (per V)."""
    return V[:, 1, 1] - V[:, 1, 0] ** 2 / V[:, 0, 0]


def _settings(option, defaults, changes):
    """``defaults`` with ``changes`` (the channel option ``option``: NoisyChannel's
    ``conditional``, ReparamChannel's ``escalation``): scale > 0 (× the rings' default counts),
    nodes ≥ 3 and rounds ≥ 0 integers, sd ≥ 0, escalate > 0 or None, 0 < refine ≤ 1, 0 <
    angular ≤ 2, aspect > 0, logit, cusp and gauss True or False."""
    if changes is not None and not isinstance(changes, dict):
        raise ValueError(f"{option} must be a dict of settings to change (keys {sorted(defaults)}), got {changes!r}")
    out = dict(defaults)
    for key, value in (changes or {}).items():
        if key not in defaults:
            raise ValueError(f"{option} takes {sorted(defaults)}, got {key!r}")
        if key == "escalate" and value is None:
            out[key] = None
            continue
        if key in ("logit", "cusp", "gauss", "theta"):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{option}[{key!r}] must be True or False, got {value!r}")
            out[key] = bool(value)
            continue
        integer = key in ("nodes", "rounds")
        low = {"nodes": 3, "rounds": 0, "sd": 0}.get(key)
        high = {"refine": 1.0, "angular": 2.0}.get(key, np.inf)
        if (not isinstance(value, (int, np.integer) if integer else (int, float, np.integer, np.floating))
                or not np.isfinite(value) or (value < low if low is not None else value <= 0) or value > high):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{option}[{key!r}] must be {kind} " + (f"≥ {low}" if low is not None else "> 0")
                             + (f" and ≤ {high:g}" if high < np.inf else "") + f", got {value!r}")
        out[key] = value
    return out


def _keep_lower(out, redo, better):
    """Where another rule's estimate is lower, its result (log Z, E[Z], Cov[Z], error) of the
    samples redo replaces theirs in ``out``, in place."""
    keep = better[3] < out[3][redo]
    for a, b in zip(out, better):
        a[redo[keep]] = b[keep]


def _blend(w, laplace, polar):
    """The moments (log Z, E[Z], Cov[Z], error) of the mixture w·(polar posterior) +
    (1 − w)·(Laplace posterior), per sample: log Z and the error averaged with weights w, 1 − w,
    Cov the mixture's, Σ_k w_k (Cov_k + d_k d_kᵀ) with d_k = E_k[Z] − E[Z] (exactly the polar or
    the Laplace moments at w = 1 or 0; a rule a sample did not run holds zeros)."""
    def mix(a, b):
        wk = w.reshape((-1,) + (1,) * (a.ndim - 1))
        return (1 - wk) * a + wk * b
    mean = mix(laplace[1], polar[1])
    d_l, d_p = laplace[1] - mean, polar[1] - mean
    cov = mix(laplace[2] + d_l[:, :, None] * d_l[:, None, :], polar[2] + d_p[:, :, None] * d_p[:, None, :])
    return mix(laplace[0], polar[0]), mean, cov, mix(laplace[3], polar[3])


def _combine(runs):
    """Moments from several independent estimates: mass-weighted average."""
    log_z = np.array([r[0] for r in runs])
    top = log_z.max(axis=0)
    w = np.exp(log_z - top)
    total = w.sum(axis=0)
    mean = sum(wk[:, None] * r[1] for wk, r in zip(w, runs)) / total[:, None]
    second = sum(wk[:, None, None] * r[2] for wk, r in zip(w, runs)) / total[:, None, None]
    return top + np.log(total / len(runs)), mean, second


def make_channel(model, route: str | None = None, noise: float | None = None, **options):
    """The channel of ``model``: ``noise`` > 0 selects the noisy route; otherwise the
    reparametrisation for tied softmax deep attention with r = 1, or the SymPy closed form for
    a one-index link (``route="closed"`` also with noise)."""
    from .closed_channel import ClosedChannel       # the routes' modules build on this one
    from .noisy_channel import NoisyChannel
    from .reparam_channel import ReparamChannel
    if route is None:
        route = "noisy" if noise is not None else ("reparam" if hasattr(model, "spec") else "closed")
    if route == "closed":
        if hasattr(model, "spec"):
            raise ValueError("route='closed' is for registered one-index links (LinkModel)")
        return ClosedChannel(model, noise, threads=options.get("threads"))
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if route == "noisy":
        if noise is None:
            raise ValueError("noise (Δ > 0) is required for route='noisy'")
        if "jacobian" not in model._specs:
            raise ValueError(f"route='noisy' needs a differentiable link; {model!r} has none")
        return NoisyChannel(model, noise, **options)
    if noise is not None:
        raise ValueError("noise is only used by route='noisy'")
    if not hasattr(model, "spec"):
        raise ValueError(f"{model!r} has no noiseless channel; give noise=Δ > 0")
    return ReparamChannel(model, **options)
