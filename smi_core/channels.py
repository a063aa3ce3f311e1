"""Output channels: log Z_out, g_out and ∂_ω g_out from one pass over quadrature nodes (spec §4).

For Z with independent columns Z[:, t] ~ N(ω[:, t], V) and the posterior ∝ N(Z; ω, V) P(y|Z):

    g_out = V⁻¹ (E[Z|y] - ω),   ∂g_out[(a,t),(b,s)] = (V⁻¹ Cov(Z_t, Z_s|y) V⁻¹)_ab - V⁻¹_ab δ_ts

Routes:
- ``"reparam"`` (noiseless softmax deep attention, tied, r = 1): the integral over the earlier
  layers x = h_{<L} of Σ_± N([x; ±h_L(x)]; ω, V) / |det Φ⁽ᴸ⁻¹⁾(x)|; L = 1 has no integral (two
  points ±u_L).  ``log_z`` omits the factor of u_L ↦ y, which depends on y only.
- ``"noisy"`` (any differentiable link, P(y|Z) = N(y; g(Z), Δ I)): the integral over all R·T
  indices; ``log_z`` is exact.

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
from functools import partial
from itertools import product

import numpy as np

from . import _quadrature, chart, validate
from .kernels import first_bad_row
from .polar import PolarRule, _growing, _merge, refine
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
        log_z, mean, second = fine
        cov = second - mean[:, :, None] * mean[:, None, :]
        return log_z, ref + mean, cov, error

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
        return self._differ(omega, V, Vinv, *[(log_z, ref + mean, second - mean[:, :, None] * mean[:, None, :])
                                              for log_z, mean, second in runs])

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


def _token_channel(model, noise, escalate, options):
    """For a one-index link applied to each token alone (T > 1), the noisy channel of its
    one-token link (registered as "<name>·token"), else None."""
    from derive.closed import token_wise
    from .models import LinkModel, register_link
    link = getattr(model, "link", None)
    if link is None or link.indices != 1 or link.tokens == 1:
        return None
    g = token_wise(link.expr, link.tokens)
    if g is None:
        return None
    name = f"{link.name}·token"
    register_link(name, g, params=link.params)
    one = LinkModel(name, backend=model.backend, threads=options.get("threads"),
                    **{str(p): v for p, v in zip(link.params, model.params)})
    return NoisyChannel(one, noise, escalate, **options)


def _inverse_logdet(mix):
    """Node rows [Φ⁻¹ (T×T, row-major), log|det Φ|] (T² + 1, n) from mixing-kernel rows [Φ,
    log|det Φ|], T = 2 or 3, by the adjugate (inf where Φ is singular: integrate_polar skips
    those nodes)."""
    phi = mix.T
    if len(phi) == 5:
        adj = np.stack([phi[3], -phi[1], -phi[2], phi[0]])
        det = phi[0] * phi[3] - phi[1] * phi[2]
    else:
        M = phi[:9].reshape(3, 3, -1)
        C = np.stack([np.cross(M[(j + 1) % 3], M[(j + 2) % 3], axis=0) for j in range(3)])  # cofactors
        adj = C.swapaxes(0, 1).reshape(9, -1)                           # adj_ij = C_ji
        det = np.einsum("in,in->n", M[0], C[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.concatenate([adj / det, phi[-1:]])


def _no_mixing(k):
    """k node rows [Φ⁻¹, log|det Φ|] of Φ = I (one layer: no earlier layer mixes the tokens)."""
    return np.tile([[1.0], [0.0], [0.0], [1.0], [0.0]], (1, k))


def _given_h1(x1, omega, V):
    """h_2 | h_1 = x_1 ~ N(m, s² I) per row (ω, V of its sample): m = ω_2 + V₂₁/V₁₁ (x_1 − ω_1),
    s² (``_h2_var``)."""
    return omega[:, 1] + (V[:, 1, 0] / V[:, 0, 0])[:, None] * (x1 - omega[:, 0]), _h2_var(V)


def _h2_var(V):
    """The variance of h_2 given h_1, s² = V₂₂ − V₂₁²/V₁₁ (per V)."""
    return V[:, 1, 1] - V[:, 1, 0] ** 2 / V[:, 0, 0]


def _cliff_grid(nr, nth, beta_tmax, max_grade=12):
    """Boxes [t, θ, half-width in t, in θ] over t ∈ [0, 1] (in units of tmax), θ ∈ [0, π): nr
    intervals uniform in √t, and per interval nth uniform in θ plus cuts graded towards the softmax
    cliffs θ = 0, π/4, π/2 down to ≈ 1/(β t), the cliffs' width at the interval's outer end."""
    rays = np.array([0.0, 0.25, 0.5, 0.75, 1.0]) * np.pi      # the cliffs a = 0, b = 0, a = b
    t_cuts = (np.arange(nr + 1) / nr) ** 2
    base = []
    for k in range(nr):
        grade = int(np.clip(np.ceil(np.log2(np.pi / 8 * beta_tmax * t_cuts[k + 1])), 0, max_grade))
        near = (np.pi / 8) * 2.0 ** -np.arange(grade + 1)
        cuts = np.unique(np.clip(np.concatenate([np.linspace(0, np.pi, nth + 1), (rays[:, None] + near).ravel(),
                                                 (rays[:, None] - near).ravel()]), 0, np.pi))
        base.append(np.stack([np.full(len(cuts) - 1, t_cuts[k] + t_cuts[k + 1]) / 2,
                              (cuts[1:] + cuts[:-1]) / 2, np.full(len(cuts) - 1, t_cuts[k + 1] - t_cuts[k]) / 2,
                              np.diff(cuts) / 2], axis=1))
    return np.concatenate(base)


def _settings(option, defaults, changes):
    """``defaults`` with ``changes`` (the channel option ``option``: NoisyChannel's
    ``conditional``, ReparamChannel's ``escalation``): scale > 0 (× the rings' default counts),
    nodes ≥ 3 and rounds ≥ 0 integers, sd ≥ 0, escalate > 0 or None, 0 < refine ≤ 1."""
    out = dict(defaults)
    for key, value in (changes or {}).items():
        if key not in defaults:
            raise ValueError(f"{option} takes {sorted(defaults)}, got {key!r}")
        if key == "escalate" and value is None:
            out[key] = None
            continue
        integer = key in ("nodes", "rounds")
        low = {"nodes": 3, "rounds": 0, "sd": 0}.get(key)
        high = {"refine": 1.0}.get(key, np.inf)
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


class ReparamChannel(PolarRule, Channel):
    """Route 1: noiseless softmax deep attention, tied, r = 1 (spec §4 reparametrisation)."""

    route, _route_id, _delta, _n_data_noise = "reparam", 0, 0.0, 0

    def __init__(self, model, escalate: float | None = None, escalation: dict | None = None, **options):
        """``escalate``: the estimate above which a sample gets finer rules (``tol`` when given;
        default PINNED["escalate"] for L = 2, LAPLACE3_ESCALATE for L = 3, where only the
        Laplace rule escalates).  ``escalation``: entries of ESCALATION[T] to change (two
        layers; e.g. state evolution's, ``state_evolution.ESCALATION[2]``)."""
        spec = model.spec
        if not (spec.architecture == "tied" and spec.link == "softmax" and spec.rank == 1):
            raise ValueError("route='reparam' needs a tied softmax DeepAttention with rank=1; "
                             "use noise=Δ > 0 for the noisy route")
        super().__init__(model, **options)
        default = self.LAPLACE3_ESCALATE if model.layers == 3 else self.PINNED["escalate"]
        self.escalate = default if escalate is None else validate.positive("escalate", escalate)
        self.escalation = _settings("escalation", self.ESCALATION.get(model.tokens, self.ESCALATION[2]), escalation)
        self._u_model = _shallow(model, self.threads, 1)
        if model.layers >= 2:
            self._node_kernel = model.kernel("node")
            self._jac_kernel = model.kernel("node_jacobian")
            self._inverse_kernel = model.kernel("inverse")
            self._n_node = model.tokens + 1
        if model.layers == 3:
            # Φ⁽¹⁾⁻¹u_2 for the adaptive rule (``_pinned3``)
            self._phi1_kernel = _shallow(model, self.threads, 2).kernel("node")
            if options.get("max_regions") is None:      # the Laplace path's adaptive budget
                self.max_regions = self.LAPLACE3_REGIONS
        self.model_is_points = model.layers == 1

    # L = 3 on the Laplace path with ``tol``: the adaptive rule's default budget (``max_regions``;
    # two layers cross-check there with PINNED["cross_regions"]).  A near-singular V (h_1, h_2
    # correlated 0.98, conditional sd 0.011 / 0.029) at tol = 1e-7: estimate 2.1e-2 with 4 000
    # regions, 7.2e-5 with 200 000 (11 s), 6.4e-6 with 1 000 000 (46 s), the last two 2.3e-5 apart.
    LAPLACE3_REGIONS = 200000
    # L = 3 on the Laplace path by default (with the estimate): samples above it get the finer
    # Gauss–Hermite round (7 → 11 nodes per dimension; 17 would exceed GH_BUDGET).  On 64
    # state-evolution draws per q, against the rule at 16 nodes: max error 1.1e-2 / 6.0e-3 /
    # 1.6e-3 → 4.6e-4 / 1.7e-4 / 2.0e-5 at q = 0.97 / 0.98 / 0.99·I, 0.57 / 0.54 / 0.53 →
    # 1.69 / 1.36 / 1.06 ms per sample (see the README)
    LAPLACE3_ESCALATE = 1e-4

    # -- L = 2, 3 and T = 2: the polar rule about the cliffs' meeting point (smi_core.polar) ----
    POLAR_SCALE = {2: 1.0, 3: 4 / 7}    # node counts at the default ``nodes``
    # three layers: one group per V (bin = inf: each sample runs over its own ball and arcs, so
    # the node set-up is shared by the whole batch), 3 radii per √V_ℓℓ of the range (at least
    # 20.6), 6.9 to 57 angles per ring (c0·scale, cap·scale; more where the prior concentrates,
    # capk below), the prior cut at e^-15.  Max
    # error on 64 draws per q (1024-draw batches) against the previous rule at nodes = 20:
    # 6.9e-5 / 6.4e-5 / 3.6e-5 at q = 0 / 0.3 / 0.9 (the previous defaults: 1.3e-4 / 2.9e-4 /
    # 9.5e-4; its groups of |ω_ℓ| cells 2√V_ℓℓ wide set up 4.5 M nodes for 1024 draws at q = 0.9,
    # against 1.3 M).  c2 = 1.5: the prior's concentration needs ≈ 2.6√k angles for 1e-6 (k the
    # von Mises concentration), c2 = 3 gave 2× the node pairs at q = 0.9 for the same error;
    # c0 and radial set the q = 0 and q = 0.3 tails (c0 = 10: 1.3e-4 at q = 0; 32 radii:
    # 1.4e-4 at q = 0.3); capk = 0.5: the cap grows ∝ (k/k0)^¼ where the prior concentrates (a
    # sample runs over ∝ 1/√k of such a ring), for a q = 0.9 draw whose h_2 rings at
    # r ≈ |ω_2| = 2.4 needed ≈ 70 angles (1.6e-3 → 6.2e-5; a flat cap of 180 did the same but
    # took q = 0.3 to 2.4 ms)
    # blend: the polar and Laplace rules are mixed for conditional sd in [0.2, 0.25] (see
    # _polar_weight): with the last layer pinned they disagree (up to 13× on 32 draws at
    # q = diag(0.96, 0.945, 0.9995)), and a hard switch made three-layer state evolution cycle
    # about it (α = 1.5, amplitude 1.5e-3 in q₁₁).  Two layers keep the hard switch: both rules
    # are accurate there and the mixture would take in the Laplace rule's unescalated error
    # (q̂₁₁ off the tol = 1e-7 channel by 3.5e-5 at q = diag(0.95, 0.998), 1024 draws, against
    # 4.6e-8 with the switch)
    POLAR_BY_LAYERS = {3: dict(radial=36, density=3.0, c0=12.0, c2=1.5, cap=100, capk=0.5, reach=5.5,
                               bin=np.inf, blend=0.25)}

    # T = 3 (the spherical rule, two layers): groups of |ω_1| cells 2√V_11 wide (each sample runs
    # over its own shells; a shell holds ≈ 0.64 N² nodes against N for a ring, so the T = 2 cells,
    # 0.25√V_11, spent most of the time in node set-up: 1.76 against 0.51 ms per sample at q = 0.9,
    # 1024 draws, without the estimate; one group per V, 0.52 ms, left a draw 9.8e-6 off)
    POLAR_T3 = dict(bin=2.0)

    def _polar_params(self):
        return super()._polar_params() | (self.POLAR_T3 if self.T == 3 else {})

    # three layers, every layer about as narrow (the last layer's conditional sd over the narrowest
    # earlier layer's, ρ, at least ratio[1]): the polar rule down to conditional sd 0.13 instead of
    # POLAR_MIN_SD, by a hard switch (both rules accurate there, and the blend ran both: at q =
    # 0.975 / 0.98·I 5.2 / 6.1 ms per sample where either alone took ≈ 1.5–3); threshold and blend
    # width move linearly between ρ = ratio[0] and ratio[1].  Against the channel at tol = 1e-6
    # (24 draws per q, 256-draw batches): at q = 0.95·I the polar rule 1.2e-5 max in 1.4 ms per
    # sample where the blend of both rules took 4.2 ms at 8.4e-4; at 0.97·I 2.5e-5 where the
    # Laplace rule was up to 1.5e-4 off (5.3e-3 on another draw, y at the softmax edge); at 0.98
    # both within 2e-5.  With the last layer pinned the polar rule is the worse one (q = diag(0.97,
    # 0.97, 0.999), ρ = 0.18: up to 0.51 off where the Laplace rule is 6.3e-3), so there threshold
    # and blend stay.
    POLAR3_MIN_SD = dict(sd=0.13, ratio=(0.5, 0.8))

    def _polar_threshold(self, prec):
        """POLAR_MIN_SD and the blend; three layers: towards POLAR3_MIN_SD["sd"] and a hard switch
        as ρ = √(max_ℓ<L (V⁻¹)_ℓℓ / (V⁻¹)_LL) grows through POLAR3_MIN_SD["ratio"]."""
        s_min, blend = super()._polar_threshold(prec)
        if self.model.layers != 3:
            return s_min, blend
        lo, hi = self.POLAR3_MIN_SD["ratio"]
        t = np.clip((np.sqrt(self._ring_prec(prec) / prec[:, 2]) - lo) / (hi - lo), 0.0, 1.0)
        return s_min + t * (self.POLAR3_MIN_SD["sd"] - s_min), blend * (1 - t)

    # three layers where the polar rule took over from the Laplace rule (the threshold lowered, ρ >
    # POLAR3_MIN_SD["ratio"][0], and conditional sd below (1 + blend) POLAR_MIN_SD), by default
    # with the estimate: samples whose estimate is above it get one round of the polar rule at
    # 1.5× the counts.  The estimate is pessimistic there (median 4.5e-4 at errors ≈ 1e-6, q =
    # 0.975·I), but a draw with y at the softmax edge, 2.1e-4 off, estimated 1.6e-2 (3rd of 256);
    # with the round 1.5e-5.  Not where the last layer is pinned (the rounds do not converge), nor
    # at broader q (q = 0.9·I: +30 % time for an error already within 1e-4).
    POLAR3_ESCALATE = 1e-2

    # two layers, T = 2: the samples whose estimate is above the target (``tol``, else
    # ``escalate``) get the polar rule at 1.5× the counts for up to ``rounds`` rounds, then the
    # adaptive rule (``_pinned``), until their estimate is below ``refine`` × the target.  With
    # three rounds to the target itself (before 2026-11-28), 256 draws at q = diag(0, 0.99) /
    # diag(0, 0.999) / diag(0.3, 0.995) took 0.84 / 5.1 / 1.2 ms per sample, max error 5.8e-7 /
    # 2.9e-7 / 2.4e-7 (against tol = 1e-8); now 0.30 / 1.1 / 0.54 ms, 5.8e-7 / 2.2e-7 / 1.1e-7:
    # the finer polar rules converge for most pinned samples, and cost less than the adaptive
    # rule.  Eight rounds to the target itself (256 other draws): 0.20 / 0.96 / 0.29 ms, but up
    # to 2.4e-6 off.  T = 3 (the spherical rule, then the Laplace rule): six rounds to the target
    # itself.  With the last layer pinned three rounds left 37 of 64 draws at q = diag(0, 0.999)
    # estimating above 1e-3, up to 9.9 off the 3-D reference; six rounds leave 2 (max 4.6e-3) at
    # 14× the time, and on the six draws checked against the reference at n = 20 are within its
    # bound plus 1.6e-5 (three rounds: 5.7e-4 … 9.9 off).  Seven rounds: 2.6× more again.
    ESCALATION = {2: dict(rounds=8, refine=0.1), 3: dict(rounds=6, refine=1.0)}

    def _polar_escalation(self, Vinv, error):
        """``tol`` (two layers: ``escalate`` by default), three rounds; two layers: the samples
        above it, ``escalation``'s rounds to its ``refine`` × it; three layers without ``tol``:
        POLAR3_ESCALATE where the polar rule took over from the Laplace rule, one round."""
        target, rounds = super()._polar_escalation(Vinv, error)
        if self.model.layers == 2:
            if target is not None:
                target = np.where(error > target, target * self.escalation["refine"], np.inf)
            return target, self.escalation["rounds"]
        if target is None and self.model.layers == 3 and self.error_estimate:
            prec = np.diagonal(Vinv, axis1=1, axis2=2)
            took_over = (self._polar_threshold(prec)[0] < self.POLAR_MIN_SD) & (
                1.0 / np.sqrt(self._ring_prec(prec)) < (1 + self._polar_params()["blend"]) * self.POLAR_MIN_SD)
            return np.where(took_over, self.POLAR3_ESCALATE, np.inf), 1
        return target, rounds

    @property
    def _ring_layers(self):
        return self.model.layers - 1

    @property
    def _polar_stall(self):
        """L = 3: a sample whose estimate fell by less than half when the counts grew by 1.5 is
        left to the adaptive rule (``_pinned3``): with the last layer pinned the rings converge
        too slowly to be worth growing (on a q₃₃ = 0.99 draw the three rounds took 7.8 of the
        13.7 s of the sample with tol = 1e-3)."""
        return 0.5 if self.model.layers == 3 else None

    @property
    def escalates(self) -> bool:
        """L = 2: samples whose estimate is above ``escalate`` get finer rules (``_polar``,
        ``_laplace``); without the estimate the result stands, off by up to 1e3 (relative) in
        the pinned regime.  L = 3 escalates only its Laplace rule (``_laplace_target``) and
        counts as not escalating: state evolution and GAMP keep turning its estimate off (one
        finer round there cost 2–4× per sample at q = 0.97 … 0.99·I)."""
        return self.model.layers == 2

    @property
    def _polar_applies(self):
        """T = 2 and L ∈ {2, 3}, or T = 3 and L = 2 (shells: the spherical rule); the rings are
        on the earlier layers (the likelihood pins h_L on a plateau of Φ)."""
        return self.model.layers in self.POLAR_SCALE and (self.T == 2 or (self.T == 3 and self.model.layers == 2))

    def _polar_layers(self, group, mu, V, scale):
        """The rings of every earlier layer h_ℓ about the origin (amp = (1 + c)^{2(ℓ-1)})."""
        return [self._polar_rings(group, mu[:, l], V[:, l, l], scale, (1 + self.model.skip) ** (2 * l))
                for l in range(self.model.layers - 1)]

    @property
    def _polar_data_rows(self):
        return self.T * self.T + 1

    def _polar_fill(self, nodes, m):
        """Rows [Φ⁻¹ (row-major), log|det Φ|] of Φ = Φ⁽ᴸ⁻¹⁾(x) (x: rows 0…m-1), by the generated
        inverse kernel, in place."""
        self._inverse_kernel.columns(nodes[:m], self.model.params, nodes[m + 1:])

    def _polar_input(self, y):
        return self._u_model.reparametrise(y).u

    def _polar_scale(self):
        d = 2 * (self.model.layers - 1)
        return (self.nodes or DEFAULT_NODES[d]) / DEFAULT_NODES[d] * self.POLAR_SCALE[self.model.layers]

    def _polar_target(self):
        return self._target(self.escalates)

    def _laplace_target(self):
        """As the polar rule's (two layers: ``escalate`` by default), and for three layers
        ``escalate`` by default too (LAPLACE3_ESCALATE), while their polar rule escalates only
        with ``tol``.  Without it, at q = 0.965·I nine of 1024 two-layer state-evolution draws
        (T = 2, 14 nodes per dimension) were 1.4e-5 … 3.2e-5 off, and with T = 3 (9 nodes) up
        to 1.1e-5 of 8, estimating 24–180× their errors; at 14 nodes (T = 3) within 9.1e-9."""
        return self._target(self.escalates or self.model.layers == 3)

    def _polar(self, y, omega, V, Vinv, logdetV):
        """Each earlier layer h_ℓ in polar coordinates about the origin (``PolarRule._polar``);
        ``nodes`` scales every count (by nodes / DEFAULT_NODES[d] · POLAR_SCALE[L], d = 2(L - 1)).
        L = 2 (with the estimate): tol defaults to ``escalate``, and samples still above the
        escalation's target (``escalation["refine"]`` × it after its rounds) are
        integrated again by the adaptive rule to it (``_pinned``; T = 3: the Laplace rule,
        ``_laplace``), kept where its estimate is lower (T = 3: the estimate taken no lower than
        the two rules' difference; at q = diag(0, 0.99) the Laplace rule's adaptive cubature was
        once kept 29 off while estimating 1.4e-4).  L = 3 with ``tol``: samples above
        max(tol, PINNED3["floor"]) are integrated again by the four-dimensional adaptive rule
        (``_pinned3``), kept where its estimate is lower."""
        log_z, mean, cov, error, target = self._polar_refined(y, omega, V, Vinv, logdetV)
        if self.model.layers == 3:
            target = self._polar_target()
            target = None if target is None else max(target, self.PINNED3["floor"])
        redo = np.flatnonzero(error > target) if target is not None else []
        if len(redo):       # e.g. the last layer pinned: the adaptive rule, kept where its estimate is lower
            if self.model.layers == 3:
                rule = partial(self._pinned3, ref=mean[redo], shift=log_z[redo])
            else:
                rule = partial(self._pinned, tol=target[redo]) if self.T == 2 else self._laplace
            better = rule(y[redo], omega[redo], V[redo], Vinv[redo], logdetV[redo])
            if self.T == 3:     # the Laplace rule's estimate can miss mass: no lower than the rules' difference
                differ = self._differ(omega[redo], V[redo], Vinv[redo], (log_z[redo], mean[redo], cov[redo]), better)
                better = (*better[:3], np.maximum(better[3], differ))
            _keep_lower((log_z, mean, cov, error), redo, better)
        return log_z, mean, cov, error

    def _laplace(self, y, omega, V, Vinv, logdetV):
        """The Laplace rule (``Channel._laplace``); L = 2 with ``tol``: every sample is integrated
        again by the adaptive rule (``_pinned``, whose estimate includes κ) at tol·PINNED["cross"]
        (up to PINNED["cross_regions"] regions), whose result is kept; the error is the larger of
        its estimate / PINNED["cross"] and the difference between the two rules (κ: on a
        near-singular draw with y uninformative along V's thin direction, κ ≈ 3e3, the rule at
        tol·PINNED["cross"] without κ was 4.5e-6 off, with it 1.1e-8).  The
        Laplace rule's estimate (the difference of two Gauss–Hermite rules) misses a posterior
        that is a thin curved ridge (near-singular V at an angle to the layers): on such draws
        it was off by 1.3e-6 to 9e-6 while estimating 1e-9 to 1e-7; the adaptive rule at 1e-9
        was within 7e-8 of an independent brute-force rule on 9 of 10 such draws and 1.2e-6 off
        on the tenth (estimating 1e-9), hence the difference."""
        out = super()._laplace(y, omega, V, Vinv, logdetV)
        if self.model.layers != 2 or self.tol is None or self.T != 2:
            return out
        cross = self.PINNED["cross"]
        better = self._pinned(y, omega, V, Vinv, logdetV, tol=self.tol * cross,
                              max_regions=self.PINNED["cross_regions"])
        differ = self._differ(omega, V, Vinv, out, better)
        return (*better[:3], np.maximum(better[3] / cross, differ))

    # -- L = 2, T = 2, samples the polar rule flags: adaptive cubature seeded at the posterior's peaks --
    PINNED = dict(escalate=1e-5, grid=(8, 8), reach=8.0, max_regions=20000, depth=40, floor=30.0,
                  cross=1e-2, cross_regions=200000)

    def _pinned_starts(self, u, omega, V):
        """Gauss–Newton starts at the h_1 that puts h_2 at its mean given h_1, per sign of u_2:
        Φ⁽¹⁾ = cI + A with A row-stochastic, so (cI + A) h_2 = ±u_2 is linear in A's two free
        entries; A is then the softmax output of one layer, whose pre-image is h_1 (up to sign;
        the reflection nearer ω_1 is kept).  Iterated three times (the mean of h_2 depends on
        h_1 when V₁₂ ≠ 0).  Returns (n, 2, 2) starts and (n, 2) signs; NaN where A is outside
        the softmax's range (no such h_1)."""
        n, c = len(u), self.model.skip
        starts = np.full((n, 2, 2), np.nan)
        for k, sign in enumerate((1.0, -1.0)):
            h1 = omega[:, 0].copy()
            for _ in range(3):
                v = _given_h1(h1, omega, V)[0]
                dv = v[:, 0] - v[:, 1]
                with np.errstate(divide="ignore", invalid="ignore"):      # dv = 0: no such A
                    own = (sign * u - c * v - v[:, ::-1]) / np.stack([dv, -dv], axis=1)
                    ok = np.isfinite(own).all(axis=1) & (own > 0).all(axis=1) & (own < 1).all(axis=1) & (own.sum(axis=1) > 1)
                A = np.stack([own[:, 0], 1 - own[:, 0], 1 - own[:, 1], own[:, 1]], axis=1).reshape(n, 2, 2)
                h = np.full((n, 2), np.nan)
                if ok.any():
                    h[ok] = self._u_model.reparametrise(A[ok]).u
                nearer = ((h - omega[:, 0]) ** 2).sum(axis=1) <= ((h + omega[:, 0]) ** 2).sum(axis=1)
                h1 = np.where(ok[:, None], np.where(nearer[:, None], h, -h), omega[:, 0])
            starts[ok, k] = h1[ok]
        return starts, np.broadcast_to([1.0, -1.0], (n, 2))

    def _pinned_peaks(self, u, omega, V, Vinv, logdetV):
        """Local maxima of each term of the integrand over h_1 (Gauss–Newton, ``_quadrature.modes``)
        from the pinned starts, from ±ω_1 and, for each sign of u_2, from two rings about ω_1
        (radii √V₁₁ and 2√V₁₁, 8 angles: a sign without an exact pre-image still has a peak where
        h_2 comes closest to its mean), with their Laplace covariances; peaks more than
        PINNED["floor"] below the highest are dropped.  Returns centres (n, K, 2), covariances
        (n, K, 2, 2), log heights (n, K) (-inf: dropped), signs of u_2 (n, K)."""
        n = len(u)
        pinned, pin_signs = self._pinned_starts(u, omega, V)
        _, x0, signs = self._prepare_starts(u, omega)
        phi = np.arange(8) * np.pi / 4
        ring = np.concatenate([r * np.stack([np.cos(phi), np.sin(phi)], axis=1) for r in (1.0, 2.0)])
        ring = omega[:, None, 0] + np.sqrt(V[:, 0, 0])[:, None, None] * ring[None]
        x = np.concatenate([np.where(np.isfinite(pinned), pinned, omega[:, None, 0]), x0, ring, ring], axis=1)
        ring_signs = np.repeat([1.0, -1.0], len(phi) * 2)
        signs = np.ascontiguousarray(np.concatenate([pin_signs, signs, np.broadcast_to(ring_signs, (n, ring_signs.size))], axis=1))
        x = np.ascontiguousarray(x)
        logf, hess = np.empty(x.shape[:2]), np.empty(x.shape[:2] + (2, 2))
        const0 = -(2 * np.log(2 * np.pi) + logdetV)
        _quadrature.modes(0, self._jac_kernel.capsule(), self.model.params, np.ascontiguousarray(u),
                          np.ascontiguousarray(omega.reshape(n, 4)), Vinv, const0, x, signs, logf,
                          hess, 2, 2, self._n_node, 0.0, threads=self.threads)
        logf = np.where(np.isfinite(logf), logf, -np.inf)
        logf[logf < logf.max(axis=1, keepdims=True) - self.PINNED["floor"]] = -np.inf
        with np.errstate(invalid="ignore"):
            cov = np.linalg.inv(hess + 1e-300 * np.eye(2))
        return x, cov, logf, signs

    def _pinned_boxes(self, peaks, cov, logf, tmax):
        """Initial boxes [t, θ, half-widths] in x = h_1 = √t (cos θ, sin θ), t ∈ [0, tmax],
        θ ∈ [0, π): PINNED["grid"] = (n_r, n_θ) intervals uniform in √t and θ, the θ cuts
        graded towards the softmax cliffs θ = 0, π/4, π/2 (where one constraint on h_2 holds
        while the other saturates: thin ridges of small mass a coarse box would not see) down
        to ≈ 1/(β t), the cliffs' width at the outer end of each √t interval; and about every
        peak the box that holds it bisected (along its relatively wider side) until it is no
        wider than the peak's Laplace sd in t and θ, so that the cubature sees every peak
        however narrow.  Returns the rows and each sample's start offset."""
        base = _cliff_grid(*self.PINNED["grid"], self.model.beta * tmax.max())
        rows, start = [], [0]
        for i in range(len(tmax)):
            boxes = base * [tmax[i], 1.0, tmax[i], 1.0]
            extra = []
            found = np.isfinite(logf[i])
            for x in np.unique(np.round(peaks[i, found], 6), axis=0):
                C = cov[i, found][np.argmin(np.abs(peaks[i, found] - x).sum(axis=1))]
                t, th = x @ x, np.arctan2(x[1], x[0]) % np.pi
                if not (t < tmax[i] and np.isfinite(C).all()):
                    continue
                g_t, g_th = 2 * x, np.array([-x[1], x[0]]) / max(t, 1e-300)
                sd = np.sqrt(np.maximum([g_t @ C @ g_t, g_th @ C @ g_th], 0.0))
                pool = np.concatenate([boxes] + extra) if extra else boxes
                inside = np.flatnonzero((np.abs(t - pool[:, 0]) <= pool[:, 2]) & (np.abs(th - pool[:, 1]) <= pool[:, 3]))
                if not inside.size:
                    continue
                b = pool[inside[0]].copy()
                chain = []
                for _ in range(self.PINNED["depth"]):      # bisect: keep the half with the peak
                    if b[2] <= sd[0] and b[3] <= sd[1]:
                        break
                    ax = 0 if b[2] / tmax[i] >= b[3] / np.pi else 1
                    b[2 + ax] *= 0.5
                    other = b.copy()
                    side = 1.0 if [t, th][ax] >= b[ax] else -1.0
                    b[ax] += side * b[2 + ax]
                    other[ax] -= side * other[2 + ax]
                    chain.append(other)
                if chain:
                    pool = np.delete(pool, inside[0], axis=0)
                    boxes, extra = pool, [np.array(chain + [b])]
            rows.append(np.concatenate([boxes] + extra) if extra else boxes)
            start.append(start[-1] + len(rows[-1]))
        return np.ascontiguousarray(np.concatenate(rows)), np.asarray(start, dtype=np.int64)

    def _pinned(self, y, omega, V, Vinv, logdetV, tol, max_regions=None):
        """Adaptive Genz–Malik cubature over h_1 in coordinates (t = |h_1|², θ), where the prior
        is smooth (dh_1 = ½ dt dθ) and the softmax cliffs are lines θ = const
        (``_quadrature.integrate_polar_adaptive``), from boxes refined about every peak
        (``_pinned_peaks``, ``_pinned_boxes``), to ``tol`` (a number or one per sample; from
        ``_polar``, its escalation's target: ``escalation["refine"]`` × ``tol``, else × ``escalate``)
        in κ Σ|I7 - I5| / mass of the moments whitened by V's Cholesky factor, κ (``_amp``) from
        the running sums: that bounds the metric of
        (g_out, dg_out), and is the error estimate (without κ, on 48 state-evolution draws at
        q = diag(0, 0.999) the whitened estimate 1e-5 came with errors up to 7.0e-5, κ up to 249)."""
        n = len(omega)
        u = np.ascontiguousarray(self._u_model.reparametrise(y).u)
        peaks, cov, logf, signs = self._pinned_peaks(u, omega, V, Vinv, logdetV)
        tmax = (np.linalg.norm(omega[:, 0], axis=1) + self.PINNED["reach"] * np.sqrt(V[:, 0, 0])) ** 2
        boxes, start = self._pinned_boxes(peaks, cov, logf, tmax)
        const0 = -(2 * np.log(2 * np.pi) + logdetV)
        found = np.isfinite(logf).any(axis=1)
        shift = np.where(found, logf.max(axis=1), const0)
        best = np.argmax(logf, axis=1)              # moments about Z at the highest peak
        ref = np.where(found[:, None], self._point(u, peaks[np.arange(n), best], signs[np.arange(n), best]),
                       omega.reshape(n, 4))
        return self._polar_adaptive(u, omega, V, Vinv, const0, ref, shift, boxes, start, tol,
                                    max_regions or self.PINNED["max_regions"], metric=True)

    def _polar_adaptive(self, u, omega, V, Vinv, const0, ref, shift, boxes, start, tol, max_regions,
                        capsule1=None, metric=False):
        """``_quadrature.integrate_polar_adaptive`` from the initial ``boxes`` (rows
        start[i]:start[i+1] per sample) to ``tol`` (a number or one per sample), moments about
        ``ref`` whitened by V's Cholesky factor (``metric``: times κ, see ``_pinned``).  Returns
        (log_z, E[Z], Cov[Z], the estimate)."""
        n, RT = len(omega), V.shape[1] * self.T
        log_z, mean, second = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        used, achieved = np.empty(n, dtype=np.int32), np.empty(n)
        _quadrature.integrate_polar_adaptive(self._node_kernel.capsule("columns"), self.model.params, u,
                                             np.ascontiguousarray(omega.reshape(n, RT)), np.ascontiguousarray(ref),
                                             Vinv, const0, np.ascontiguousarray(shift, dtype=float), boxes, start,
                                             _whitening(V, self.T), np.broadcast_to(np.asarray(tol, float), n).copy(),
                                             max_regions, log_z, mean, second, used, achieved, self.threads,
                                             capsule1=capsule1, V=np.ascontiguousarray(V) if metric else None,
                                             amp=_amp(V) if metric else None)
        return log_z, ref + mean, second - mean[:, :, None] * mean[:, None, :], achieved

    # -- L = 3, T = 2 with ``tol``: four-dimensional adaptive cubature ------------------------
    # floor: below it the polar rule's stalled estimate beats what the adaptive rule reaches with
    # max_regions boxes (broad draws, q = 0, tol = 1e-7: polar 8.3e-7 … 1.2e-6, the adaptive rule
    # 3.4e-6 … 3.7e-6 after 25 s), so only samples above max(tol, floor) take it.
    PINNED3 = dict(grid=(6, 8), grade=12, reach=8.0, max_regions=500000, floor=1e-5)

    def _pinned3(self, y, omega, V, Vinv, logdetV, ref, shift):
        """Adaptive Genz–Malik cubature in (t_1, θ_1, t_2, θ_2): h_1 = √t_1 (cos θ_1, sin θ_1),
        u_2 = Φ⁽¹⁾h_2 = √t_2 (cos θ_2, sin θ_2), so that both layers' softmax cliffs are planes
        θ_ℓ = const (``_quadrature.integrate_polar_adaptive``); from the product of each layer's
        ``_cliff_grid`` (PINNED3["grid"]) over t_1 ≤ (|ω_1| + reach √V₁₁)², t_2 ≤ ((c + √2)(|ω_2|
        + reach √V₂₂))² (‖Φ⁽¹⁾‖ ≤ c + √2), to ``tol`` in Σ|I7 - I5| / mass of the moments
        whitened by V's Cholesky factor (that ratio is the error estimate; without κ: with it, on
        16 draws at q = diag(0, 0, 0.99), tol = 1e-3 took 2.9 s per sample instead of 1.0 s, at
        the same errors on 8 of them against tol = 1e-5, max 1.9e-4 / 2.2e-4, which the whitened
        estimate already bounds).  With the last layer
        pinned the posterior is a thin sheet in (h_1, h_2) that rings do not resolve; this rule
        refines about it.  ``ref``, ``shift``: the polar rule's mean and log Z (moments about
        ref, sums relative to e^shift)."""
        n, c, reach = len(omega), self.model.skip, self.PINNED3["reach"]
        u = np.ascontiguousarray(self._u_model.reparametrise(y).u)
        tmax1 = (np.linalg.norm(omega[:, 0], axis=1) + reach * np.sqrt(V[:, 0, 0])) ** 2
        tmax2 = ((c + np.sqrt(2)) * (np.linalg.norm(omega[:, 1], axis=1) + reach * np.sqrt(V[:, 1, 1]))) ** 2
        rows, start = [], [0]
        for i in range(n):
            b1, b2 = (_cliff_grid(*self.PINNED3["grid"], self.model.beta * t, self.PINNED3["grade"]) * [t, 1.0, t, 1.0]
                      for t in (tmax1[i], tmax2[i]))
            i1, i2 = (a.ravel() for a in np.meshgrid(np.arange(len(b1)), np.arange(len(b2)), indexing="ij"))
            rows.append(np.concatenate([b1[i1, :2], b2[i2, :2], b1[i1, 2:], b2[i2, 2:]], axis=1))
            start.append(start[-1] + len(rows[-1]))
        return self._polar_adaptive(u, omega, V, Vinv, -(3 * np.log(2 * np.pi) + logdetV), ref, shift,
                                    np.ascontiguousarray(np.concatenate(rows)), np.asarray(start, dtype=np.int64),
                                    self.tol, self.PINNED3["max_regions"], capsule1=self._phi1_kernel.capsule("columns"))

    def representable(self, y) -> np.ndarray:
        """(n,) mask: softmax outputs whose pre-image ±u_L float64 determines (not an entry
        that underflowed to 0, nor u₁ ≈ u₂ lost to rounding: ``has_preimage``)."""
        y = np.asarray(y, dtype=np.float64)
        return super().representable(y) & self._u_model.has_preimage(y)

    def _check_y(self, y, n):
        y, _ = validate.batch("y", y, (self.T, self.T))
        if len(y) != n:
            raise ValueError(f"y and omega must have the same number of samples, got {len(y)} and {n}")
        return y

    def _prepare(self, y, omega, V):
        u = self._u_model.reparametrise(y).u               # validates y, rejects inconsistent y
        if self.model.layers == 1:
            return u, None, None
        return self._prepare_starts(u, omega)

    def _prepare_starts(self, u, omega):
        """Gauss–Newton starts: ω_{<L} with every earlier layer reflected or not, for each sign
        of u_L."""
        L, T = self.model.layers, self.T
        patterns = np.array(list(product((1.0, -1.0), repeat=L)))       # (sign of u_L, reflections)
        x0 = omega[:, None, :L - 1, :] * patterns[None, :, 1:, None]
        signs = np.broadcast_to(patterns[None, :, 0], (len(u), len(patterns)))
        return u, np.ascontiguousarray(x0.reshape(len(u), len(patterns), (L - 1) * T)), signs

    def _prior(self, omega, V):
        """The prior of x = h_{<L}: N(ω_{<L}, V_{<L,<L} ⊗ I_T)."""
        L, T = self.model.layers, self.T
        return omega[:, :L - 1].reshape(len(V), -1), _per_token(np.linalg.inv(V[:, :L - 1, :L - 1]), T)

    def _points(self, u, omega, Vinv, logdetV):
        """L = 1: the posterior is the two points ±u_L."""
        n, T = u.shape
        Z = np.stack([u, -u], axis=1)                                     # (n, 2, T)
        r = Z - omega[:, None, 0, :]
        logw = -0.5 * Vinv[:, 0, 0, None] * (r ** 2).sum(axis=2) - 0.5 * T * (np.log(2 * np.pi) + logdetV[:, None])
        top = logw.max(axis=1)
        w = np.exp(logw - top[:, None])
        log_z = top + np.log(w.sum(axis=1))
        w /= w.sum(axis=1, keepdims=True)
        mean = np.einsum("nk,nkt->nt", w, Z)
        dev = Z - mean[:, None, :]
        cov = np.einsum("nk,nks,nkt->nst", w, dev, dev)
        return log_z, mean, cov

    def _point(self, u, x, sign):
        n, T = u.shape
        out = self._node_kernel(np.concatenate([u, x], axis=1), self.model.params)
        return np.concatenate([x, sign[:, None] * out[:, :T]], axis=1)


class NoisyChannel(PolarRule, Channel):
    """Route 2: any differentiable link with Gaussian output noise, P(y|Z) = N(y; g(Z), Δ I).

    Tied softmax deep attention with T = 2, r = 1 and L ≤ 2 integrates broad posteriors by the
    polar rule (smi_core.polar) in x = (h_{<L}, u_L), u_L = Φ⁽ᴸ⁻¹⁾h_L (dh_L = du_L/|det Φ|): the
    likelihood N(y; σ_β(u_L u_Lᵀ), Δ I) depends on u_L alone and its softmax cliffs are lines
    through u_L = 0, so u_L gets a ring rule about the origin like the earlier layers, with
    counts × sharp = 1 + NOISY_SHARP/√Δ (the likelihood narrows the cliffs by ≈ √Δ; radial
    counts × √sharp).  Below POLAR_MIN_NOISE[L] samples whose likelihood window is well inside
    the softmax's range take the preimage rule (``PREIMAGE``: Gauss–Hermite in the off-diagonal
    entries of σ_β(u_L u_Lᵀ), where the likelihood is Gaussian), the others the chart rule
    (smi_core.chart: along the curves of constant σ_21 out to where the prior stops them)."""

    route, _route_id = "noisy", 1
    NOISY_SHARP = 0.8
    POLAR_SCALE = {1: 1.0, 2: 0.5}      # ring counts at the default ``nodes``
    POLAR_MIN_NOISE = {1: 1e-4, 2: 1e-3}    # below: too many ring nodes (∝ Δ^-3/4 per layer)
    # two layers below POLAR_MIN_NOISE, with the estimate: samples above ``escalate`` get h_1's rings ×1.5
    # (up to three times; ``_polar_run``).  At q = diag(0.3, 0.99), Δ = 1e-5 (64 draws) the
    # estimate is above 1e-4 on 69 % of the samples and at Δ = 1e-5, q = 0 / 0.3 / 0.9 on 0 / 0 /
    # 2 % (above 1e-5: 19 / 9 / 3 %)
    ESCALATE = 1e-4

    def __init__(self, model, noise: float, escalate: float | None = None, conditional: dict | None = None,
                 **options):
        """``escalate`` (T = 2 attention, L = 2, Δ < POLAR_MIN_NOISE[2]): the estimate above which
        a sample gets finer rings of h_1 (default ESCALATE; ``tol`` when given).  ``conditional``:
        entries of CONDITIONAL to change (two layers, Δ ≥ POLAR_MIN_NOISE[2]; e.g. state
        evolution's cheaper rule, ``state_evolution.CONDITIONAL``)."""
        super().__init__(model, **options)
        self._delta = validate.positive("noise", noise)
        self.escalate = self.ESCALATE if escalate is None else validate.positive("escalate", escalate)
        self.conditional = _settings("conditional", self.CONDITIONAL, conditional)
        self._n_node = self._n_data_noise = int(np.prod(model.output_shape)) if model.output_shape else 1
        spec = getattr(model, "spec", None)
        attention = (spec is not None and spec.architecture == "tied" and spec.link == "softmax"
                     and spec.rank == 1 and model.tokens == 2 and model.layers in self.POLAR_SCALE)
        self._preimage = attention and self._delta < self.POLAR_MIN_NOISE[model.layers]
        self._polar_applies = attention and (self._preimage or self._delta >= self.POLAR_MIN_NOISE[model.layers])
        self._token = None if attention else _token_channel(model, noise, escalate, options)
        if self._token is None:         # a token-wise link integrates by its one-token channel's kernels
            self._node_kernel = model.kernel("forward")
            self._jac_kernel = model.kernel("jacobian")
        if options.get("max_regions") is None and self._token is None and self.ridges and self.R * self.T > 2:
            self.max_regions = self.SURFACE_REGIONS
        if self._polar_applies:         # T = 2 attention, L ≤ 2: Δ ≥ POLAR_MIN_NOISE[L], or the preimage rule
            self._u_model = _shallow(model, self.threads, 1)
            self._u_jacobian = self._u_model.kernel("jacobian")
            self._u_reparam = self._u_model.kernel("reparam")
            if model.layers == 2:
                self._mixing_kernel = model.kernel("mixing")
            if self._preimage:
                self._chart_kernels = self._u_model.kernel("chart"), self._u_model.forward

    @property
    def per_token(self):
        """The one-token channel of a token-wise link (``moments``), else None."""
        return self._token

    def moments(self, y, omega, V) -> Moments:
        """A one-index link applied to each token alone (``derive.closed.token_wise``): the
        posterior factorises over the tokens, so the moments are those of T one-token channels
        (log Z summed, ∂g_out diagonal, the estimate the largest) — a 1-D rule per token instead
        of a T-dimensional one."""
        if self._token is None:
            return super().moments(y, omega, V)
        y, omega, V = self._inputs(y, omega, V)
        n, T = len(omega), self.T
        for option in ("error_estimate", "escalate", "tol", "max_regions"):     # as set on this channel
            setattr(self._token, option, getattr(self, option))
        m = self._token.moments(y.reshape(n * T), omega.reshape(n * T, 1, 1), np.repeat(V, T, axis=0))
        dg_out = np.zeros((n, T, T))
        dg_out[:, np.arange(T), np.arange(T)] = m.dg_out.reshape(n, T)
        return Moments(log_z=m.log_z.reshape(n, T).sum(axis=1), g_out=m.g_out.reshape(n, 1, T),
                       dg_out=dg_out, error=m.error.reshape(n, T).max(axis=1))

    # -- T = 2 attention, L ≤ 2: the polar rule in (h_{<L}, u_L) --------------------------------
    @property
    def POLAR_DELTA(self):
        return self._delta

    # two layers: one group per V (each sample runs over its own ball and its arc of h_1, so the
    # node set-up is shared by the whole batch) with 4 radii per √V of each ring layer's range
    # (at least 32, before POLAR_SCALE and √sharp).  64-draw batches at Δ = 0.1, without the
    # estimate, against the previous rule at 1.5× the counts (16 draws): 3.2 / 6.8 / 20.7 ms per
    # sample at q = 0 / 0.3 / 0.9, max error 2.7e-4 / 1.6e-4 / 1.0e-6, where groups of |ω_ℓ|
    # cells 0.25√V wide took 3.3 / 27.4 / 45.7 ms at 2.7e-4 / 2.4e-4 / 1.2e-3
    POLAR_BY_LAYERS = {2: dict(bin=np.inf, density=4.0)}

    def _polar_layers(self, group, mu, V, scale):
        """Rings of h_ℓ (ℓ < L) as the reparametrised route's, and of u_L = Φ h_L from the origin
        to (‖Φ‖ bound s = 1 for L = 1, c + √2 for L = 2) · (|ω_L| + reach·√V_LL)."""
        L, c = self.model.layers, self.model.skip
        s = 1.0 if L == 1 else c + np.sqrt(2.0)
        sharp = 1.0 + self.NOISY_SHARP / np.sqrt(self._delta)
        rings = [self._polar_rings(group, mu[:, l], V[:, l, l], scale, (1 + c) ** (2 * l)) for l in range(L - 1)]
        return rings + [self._polar_rings(group, s * mu[:, L - 1], s * s * V[:, L - 1, L - 1], scale, 1.0,
                                          sharp=sharp, origin=L > 1)]

    _polar_data_rows = 2 * 2 + 1 + 4      # [Φ⁻¹ (2 × 2), log|det Φ|] and g = σ_β(u_L u_Lᵀ) (2 × 2)

    def _polar_fill(self, nodes, m):
        """Rows [Φ⁻¹, log|det Φ|] of Φ⁽ᴸ⁻¹⁾(h_{<L}) (identity for L = 1) and g = σ_β(u_L u_Lᵀ) of
        the nodes x = (h_{<L}, u_L) (rows 0…m-1), in place."""
        x = np.ascontiguousarray(nodes[:m].T)
        k = m - 2
        nodes[m + 1:m + 6] = self._mixing_rows(x[:, :k])
        nodes[m + 6:] = self._u_model.forward(x[:, None, k:]).reshape(len(x), 4).T

    def _polar_input(self, y):
        return y

    def _polar_scale(self):
        return (self.nodes or DEFAULT_NODES[2]) / DEFAULT_NODES[2] * (
            1.0 if self._preimage else self.POLAR_SCALE[self.model.layers])

    @property
    def escalates(self) -> bool:
        """Below POLAR_MIN_NOISE: samples whose estimate is above ``escalate`` get finer rings
        (``_polar_target``); without the estimate the result stands (with the last layer pinned,
        q = diag(0.3, 0.99), Δ = 1e-12: up to 0.35 off where the escalation leaves 1e-6).  Any
        other link with R·T ≤ 4 (``ridges``): samples whose estimate is above ``escalate`` go to
        the adaptive rule.  Two layers at Δ ≥ POLAR_MIN_NOISE[2]: samples above it whose h_2 is
        narrow given h_1 go to the conditional rule (``_laplace``)."""
        return (self._preimage and self.model.layers == 2) or self._conditional_applies or self.ridges

    @property
    def ridges(self):
        """Any link but T = 2 attention with R·T ≤ 4: samples whose estimate is above
        ``escalate`` go to the adaptive rule at that tolerance by default (``_adaptive_target``),
        from starting boxes refined onto the likelihood's ridge (``_ridge_rule``; a curved
        posterior, which the Laplace rule does not resolve: without it state evolution and the
        thresholds of such links are far off at small q — y = h_1 h_2 + noise at Δ = 0.01 has
        α_c 0.256 against 0.602, y = h_1² + h_2² + h_3²/2 + noise at Δ = 0.1 0.792 against
        1.141 and the wrong direction; see README "Adding a model").  R·T = 1 too: at ω = 0 the
        mode search of an even link such as y = z² + noise stays on the saddle z = 0 and the
        Laplace rule misses the two peaks ±√y (up to 450× off at Δ = 0.001, flagged).  A
        token-wise link: its one-token channel's."""
        if self._token is not None:
            return self._token.ridges
        return not self._polar_applies and self.R * self.T <= 4

    @property
    def unresolved(self):
        """Any link but T = 2 attention with R·T > 4 (randomised QMC): curved posteriors keep
        the Laplace rule unless ``tol`` is given; its estimate flags them (state evolution and
        the thresholds keep it on and warn).  A token-wise link: its one-token channel's."""
        if self._token is not None:
            return self._token.unresolved
        return not self._polar_applies and self.R * self.T > 4

    def _adaptive_target(self):
        return self._target(self.ridges)

    def _polar_target(self):
        """Finer rings by default below POLAR_MIN_NOISE only (above it the conditional rule)."""
        return self._target(self._preimage and self.model.layers == 2)

    # -- L = 2, T = 2, Δ < POLAR_MIN_NOISE[2]: the preimage rule ------------------------------
    # In the off-diagonal entries p = σ_12, r = σ_21 of σ_β(u_2 u_2ᵀ) = [[1 − p, p], [r, 1 − r]]
    # the likelihood N(y; σ, Δ I) is exactly N(p; p̄, Δ/2) N(r; r̄, Δ/2) (times a constant), p̄ =
    # (y_12 + 1 − y_11)/2, r̄ = (y_21 + 1 − y_22)/2, and (p, r) ↦ u_2 is the one-layer
    # reparametrisation on the triangle p, r > 0, p + r < 1 (du = dp dr / |det ∂(p, r)/∂u|, which
    # vanishes on the triangle's edges).  Given h_1 the prior of h_2 = Φ⁻¹u_2 is Gaussian; linear
    # in (p, r) about (p̄, r̄) it makes the posterior ≈ Gaussian in (p, r).  So each node of the
    # rings of h_1 (the reparametrised route's) gets a Gauss–Hermite product in (p, r) (``nodes``
    # per dimension at the default ``nodes``) on that Gaussian, per sample; the reflection
    # u_2 → −u_2 is folded (the sign nearer h_2's prior mean is taken).  It applies where the
    # likelihood's window stays ``margin`` sd inside the triangle: min(p̄, r̄, (1 − p̄ − r̄)/√2) ≥
    # margin·√(Δ/2) (margin 4: up to 3.8e-4 off, the Jacobian's zeros too near; 5: 1.6e-6).
    # Other samples take the chart rule (``_chart_run``).  As Δ → 0 the rule tends to the
    # reparametrised route's (one u node).
    PREIMAGE = dict(nodes=8, margin=6.0, piece=1 << 18)   # piece: nodes held at a time (≈ 30 MB)

    @property
    def _ring_layers(self):
        """The preimage rule needs only h_1 broad (h_2's prior is in its Gauss–Hermite rule)."""
        return 1 if self._preimage else self.model.layers

    def _preimage_applies(self, y):
        """Samples whose likelihood window in (p, r) (``chart.window``) stays PREIMAGE["margin"]
        sd inside the triangle."""
        p, r, sd = chart.window(y, self._delta)
        return np.minimum(np.minimum(p, r), (1 - p - r) / np.sqrt(2)) >= self.PREIMAGE["margin"] * sd

    def _preimage_u(self, p, r):
        """u_2 (the + pre-image) of σ = [[1 − p, p], [r, 1 − r]] by the generated one-layer
        reparametrisation, ∂(p, r)/∂u by its Jacobian kernel, and σ itself (rows of 4)."""
        S = np.stack([1 - p, p, r, 1 - r], axis=1)
        u = self._u_reparam(S, self.model.params)[:, :2]
        D = self._u_jacobian(u, self.model.params)[:, 4:].reshape(-1, 4, 2)[:, [1, 2]]    # ∂(p, r)/∂u
        return u, D, S

    def _polar_run(self, u, omega, V, Vinv, logdetV, scale):
        """One pass of the polar rule, or of the preimage rule: the rings of h_1 of every sample
        (groups of one; with one layer, none) at ``scale``, their nodes with the (p, r) rules
        (``_preimage_nodes``) PREIMAGE["piece"] at a time (bounded memory), each piece's moments
        merged by mass.  With two layers the (p, r) rules take at most the default scale: the
        escalation (``PolarRule._polar``) grows only h_1's rings, which limit the rule with the
        last layer pinned (twice the rings: 1.0e-2 → 1.2e-5; twice the chart nodes: no change),
        and its estimate is then the rings' alone."""
        if not self._preimage:
            return super()._polar_run(u, omega, V, Vinv, logdetV, scale)
        n, RT = len(omega), self.R * self.T
        total = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
        applies = self._preimage_applies(u)
        near, far = np.flatnonzero(~applies), np.flatnonzero(applies)
        inner = min(scale, self._polar_scale()) if self.model.layers == 2 else scale
        if near.size:
            _merge(total, near, self._chart_run(u[near], omega[near], V[near], scale, inner))
        if far.size:
            _merge(total, far, self._preimage_run(u[far], omega[far], V[far], Vinv[far], logdetV[far], scale, inner))
        return total

    def _ring_rows(self, omega, V, scale, reflect=False):
        """The nodes x_1 of h_1's rings (the reparametrised route's) of every sample, with their
        sample and log weights (one layer: one empty x_1 per sample); ``reflect``: also -x_1
        (the rings cover a half plane)."""
        n = len(omega)
        if self.model.layers == 1:
            return np.arange(n), np.zeros((n, 0)), np.zeros(n)
        rings = self._polar_rings(np.arange(n), np.linalg.norm(omega[:, 0], axis=1), V[:, 0, 0], scale, 1.0)
        owner = np.repeat(np.arange(n), rings.count.sum(axis=1))
        if reflect:
            order = np.argsort(np.tile(owner, 2), kind="stable")          # by sample
            return np.tile(owner, 2)[order], np.concatenate([rings.x, -rings.x])[order], np.tile(rings.log_w, 2)[order]
        return owner, rings.x, rings.log_w

    def _mixing_rows(self, x1):
        """Rows [Φ⁻¹, log|det Φ|] (5 × k, inf where Φ is singular; ``_inverse_logdet``: the
        adjugate keeps Φ⁻¹ invertible where Φ is near-singular, which the chart rule inverts
        back, where the inverse kernel's columns can lose all but their largest term) of Φ =
        Φ⁽¹⁾(x_1) for nodes x_1; one layer (x_1 with no columns): Φ = I."""
        if not x1.shape[1]:
            return _no_mixing(len(x1))
        return _inverse_logdet(self._mixing_kernel(np.ascontiguousarray(x1), self.model.params))

    def _last_prior(self, x1, omega, V):
        """For nodes x_1 (with their samples' ω, V): ``_mixing_rows`` and h_2 | x_1 ~ N(m, s² I)
        (m, s²).  One layer: no x_1, Φ = I and h_1 ~ N(ω_1, V_11 I)."""
        prior = _given_h1(x1, omega, V) if x1.shape[1] else (omega[:, 0], V[:, 0, 0])
        return (self._mixing_rows(x1),) + prior

    def _chart_run(self, y, omega, V, scale, inner):
        """The chart rule (smi_core.chart) with the tokens swapped where only p's window is
        inside (0, 1) (``chart.swapped``).  Rows: one layer, the samples (u_1 = h_1, F = I);
        two layers, the nodes ±x_1 of h_1's rings with F = Φ⁽¹⁾(x_1)⁻¹ and h_2's prior given
        x_1 (rows where Φ⁽¹⁾ is singular are left out)."""
        swap = chart.swapped(y, self._delta)
        perm = np.arange(2 * self.R).reshape(self.R, 2)[:, ::-1].ravel()      # index a*T + t, t ↔ 1 - t
        y = np.where(swap[:, None], y[:, [3, 2, 1, 0]], y)
        omega = np.where(swap[:, None, None], omega[:, :, ::-1], omega)
        owner, x1, lw1 = self._ring_rows(omega, V, scale, reflect=True)
        inv, m, s2 = self._last_prior(x1, omega[owner], V[owner])
        keep = np.isfinite(inv).all(axis=0)
        rows = owner[keep], x1[keep], lw1[keep], inv[:4, keep].T.reshape(-1, 2, 2), m[keep], np.sqrt(s2[keep])
        log_z, mean, second = chart.integrate(y, omega, V, self._delta, rows, self._chart_kernels,
                                              self.model.params, self.model.beta, self.threads, chart.scaled(inner))
        mean = np.where(swap[:, None], mean[:, perm], mean)
        second = np.where(swap[:, None, None], second[:, perm][:, :, perm], second)
        return log_z, mean, second

    def _preimage_run(self, u, omega, V, Vinv, logdetV, scale, inner):
        """The preimage rule (see PREIMAGE) for samples where it applies: h_1's rings at
        ``scale``, the (p, r) rule at ``inner``."""
        n, RT = len(omega), self.R * self.T
        total = np.full(n, -np.inf), np.zeros((n, RT)), np.zeros((n, RT, RT))
        t, wt = np.polynomial.hermite.hermgauss(max(3, int(round(self.PREIMAGE["nodes"] * inner))))
        xi = np.stack(np.meshgrid(t, t, indexing="ij"), axis=-1).reshape(-1, 2)
        rule = xi, np.log(np.outer(wt, wt)).ravel() + (xi ** 2).sum(axis=1)
        centre = np.stack(chart.window(u, self._delta)[:2], axis=1)
        ustar, D, _ = self._preimage_u(*centre.T)
        Dinv = np.linalg.inv(D)                                                 # ∂u/∂(p, r) at u*
        owner, x1, lw1 = self._ring_rows(omega, V, scale)
        step = max(1, self.PREIMAGE["piece"] // len(xi))
        for a in range(0, len(owner), step):
            part = slice(a, a + step)
            i = owner[part]
            nodes = self._preimage_nodes(x1[part], lw1[part], omega[i], V[i], centre[i], ustar[i], Dinv[i], rule)
            ids, first, count = np.unique(i, return_index=True, return_counts=True)
            out = np.empty(len(ids)), np.empty((len(ids), RT)), np.empty((len(ids), RT, RT))
            _quadrature.integrate_polar(u[ids], omega[ids].reshape(-1, RT), Vinv[ids], logdetV[ids],
                                        np.arange(len(ids) + 1), first * len(xi), (first + count) * len(xi),
                                        nodes, *out, self.threads, self._delta)
            _merge(total, ids, out)
        return total

    def _preimage_nodes(self, x1, lw1, omega, V, centre, ustar, Dinv, rule):
        """The preimage rule's nodes for nodes x_1 (log weights lw1) of h_1's rings, each with
        its sample's ω, V, (p̄, r̄), u* and ∂u/∂(p, r) at u* (rows as the polar rule's, one node
        per column, x_1's Gauss–Hermite nodes ``rule`` = (ξ, log w_ξ + |ξ|²) consecutive).  With
        F = Φ⁽¹⁾(x_1)⁻¹: h_2 | x_1 ~ N(m, s² I), and h_2 = ±F u_2(p, r) ≈ h* + B δ with
        δ = (p, r) − (p̄, r̄), B = ±F ∂u/∂(p, r); with the likelihood N(δ; 0, Δ/2 I) the
        posterior ≈ N(δ; μ, Σ), Σ⁻¹ = 2I/Δ + BᵀB/s², μ = −ΣBᵀ(h* − m)/s²; nodes δ = μ + √2 Lξ
        (LLᵀ = Σ) with log weights log(2 det L) + log w_ξ + |ξ|² − log|det ∂(p, r)/∂u| on top of
        x_1's (nodes outside the triangle, or where Φ is singular, weigh 0).  One layer: no x_1,
        Φ = I and h_1 ~ N(ω_1, V_11 I)."""
        xi, lxi = rule
        G = len(xi)
        inv, m, s2 = self._last_prior(x1, omega, V)
        s2 = s2[:, None]
        finite = np.isfinite(inv).all(axis=0)                                  # Φ singular: weight 0
        F = np.where(finite[:, None, None], inv[:4].T.reshape(-1, 2, 2), np.eye(2))     # Φ⁻¹
        h = np.einsum("kab,kb->ka", F, ustar)
        sign = np.where(((h - m) ** 2).sum(1) <= ((h + m) ** 2).sum(1), 1.0, -1.0)[:, None]
        B = sign[:, :, None] * np.einsum("kab,kbc->kac", F, Dinv)
        P = 2 / self._delta * np.eye(2) + np.einsum("kba,kbc->kac", B, B) / s2[:, :, None]
        with np.errstate(all="ignore"):         # Σ = P⁻¹ and its Cholesky factor, 2 × 2
            Sigma = np.stack([P[:, 1, 1], -P[:, 0, 1], -P[:, 1, 0], P[:, 0, 0]], axis=1).reshape(-1, 2, 2) \
                / (P[:, 0, 0] * P[:, 1, 1] - P[:, 0, 1] * P[:, 1, 0])[:, None, None]
            l11 = np.sqrt(Sigma[:, 0, 0])
            L = np.stack([l11, 0 * l11, Sigma[:, 1, 0] / l11, np.sqrt(Sigma[:, 1, 1] - (Sigma[:, 1, 0] / l11) ** 2)],
                         axis=1).reshape(-1, 2, 2)
        finite &= np.isfinite(L).all(axis=(1, 2)) & (L[:, 0, 0] > 0) & (L[:, 1, 1] > 0)   # Φ near-singular:
        L = np.where(finite[:, None, None], L, 1.0)                                      # P lost to rounding
        mu = np.where(finite[:, None], -np.einsum("kab,kcb,kc->ka", Sigma, B, sign * h - m) / s2, 0.0)
        pr = ((centre + mu)[:, None] + np.sqrt(2.0) * np.einsum("kab,gb->kga", L, xi)).reshape(-1, 2)
        inside = (pr > 0).all(axis=1) & (pr.sum(axis=1) < 1) & np.repeat(finite, G)
        pr = np.where(inside[:, None], pr, 0.25)                               # placeholders, weight 0
        u2, Dn, S = self._preimage_u(*pr.T)
        u2 *= np.repeat(sign, G, axis=0)
        det = np.abs(Dn[:, 0, 0] * Dn[:, 1, 1] - Dn[:, 0, 1] * Dn[:, 1, 0])
        log_w = ((lw1 + np.log(2 * L[:, 0, 0] * L[:, 1, 1]))[:, None] + lxi[None]).ravel()
        log_w = np.where(inside, log_w - np.log(det), -np.inf)
        return np.ascontiguousarray(np.concatenate([np.repeat(x1.T, G, axis=1), u2.T, log_w[None],
                                                    np.repeat(inv, G, axis=1), S.T]))

    # -- L = 2, T = 2, Δ ≥ POLAR_MIN_NOISE[2], h_2 narrow: the conditional rule ------------------
    # With the last layer pinned (V_22 small) h_2's posterior given h_1 is a small ball about its
    # conditional prior mean, so u_2 = Φ⁽¹⁾(h_1) h_2 is a small ball that moves with h_1 over a
    # disc ≈ (c + √2)|ω_2| wide: a product of rings in h_1 and in u_2 puts few nodes on it, and
    # where h_2's sd falls below POLAR_MIN_SD the samples take the Laplace rule, whose
    # Gauss–Hermite in Z does not resolve h_1's softmax cliffs (Δ = 0.1, q = diag(0, 0.99): median
    # 4e-3 off, up to 1.3).  The conditional rule integrates over (h_1, h_2) instead: h_1 by the
    # reparametrised route's rings over the whole plane (``scale`` × the default counts), and per
    # node x_1 a Gauss–Hermite product in h_2 on N(m(x_1), s² I) (``nodes`` per dimension), with
    # the likelihood N(y; σ_β(u uᵀ), Δ I) at u = Φ⁽¹⁾(x_1) h_2 as the integrand — no 1/|det Φ|,
    # no reflections.  It applies where s ≤ ``sd`` (at s = 0.32, q₂₂ = 0.9, 8–12 nodes were
    # 3e-3 … 1e-2 off: the likelihood is not smooth on h_2's window) and is tried on the samples
    # whose estimate is above ``escalate`` (``tol`` when given); its result is kept where its own
    # estimate (``_conditional``) is lower.
    CONDITIONAL = dict(nodes=10, scale=2.0, rounds=3, sd=0.2, escalate=None)   # escalate: its rounds' target
                                                                                # (None: escalate, or tol)

    @property
    def _conditional_applies(self):
        """Two-layer T = 2 attention at Δ ≥ POLAR_MIN_NOISE[2] (below it, the preimage rule)."""
        return self._polar_applies and not self._preimage and self.model.layers == 2

    def _laplace(self, y, omega, V, Vinv, logdetV):
        """The Laplace rule (``Channel._laplace``); two layers with Δ ≥ POLAR_MIN_NOISE[2] and
        the estimate: its samples above ``escalate`` (``tol`` when given) whose h_2 is narrow
        given h_1 (s ≤ ``conditional["sd"]``; the rings take the samples with s ≥ POLAR_MIN_SD) get
        the conditional rule, kept where its estimate is lower (with ``tol``, instead of the
        adaptive rule: ``_escalated_elsewhere``)."""
        out = super()._laplace(y, omega, V, Vinv, logdetV)
        held = self._escalated_elsewhere(V)
        if held.any():
            target = self._target(True)
            redo = np.flatnonzero(held & ~(out[3] <= target))
            if redo.size:
                _keep_lower(out, redo, self._conditional(y[redo], omega[redo], V[redo], Vinv[redo], target))
        return out

    def _escalated_elsewhere(self, V):
        """Where the conditional rule runs (``_laplace``), the samples whose h_2 is narrow given
        h_1 (s ≤ ``conditional["sd"]``): the conditional rule, not the adaptive rule in Z, escalates
        them (at Δ = 0.1, q = diag(0, 0.99) that rule at its 4 000-box budget was ≈ 1e-4 off, the
        conditional rule ≈ 1e-6)."""
        if not self._conditional_applies or self._target(True) is None:
            return np.zeros(len(V), dtype=bool)
        return _h2_var(V) <= self.conditional["sd"] ** 2

    def _conditional(self, y, omega, V, Vinv, target):
        """The conditional rule at ``conditional``'s ``scale`` and ``nodes`` (both × ``nodes`` /
        DEFAULT_NODES[2]), its estimate the difference to the rule at scale / 1.5 and nodes − 2;
        samples above ``target`` (``conditional``'s ``escalate`` where given) get scale × 1.5 and
        nodes + 2 (the previous rule as the coarse one), up to ``rounds`` times.  Returns (log_z,
        E[Z], Cov[Z], error)."""
        c, ref = self.conditional, omega.reshape(len(omega), -1)
        target = c["escalate"] or target
        f = (self.nodes or DEFAULT_NODES[2]) / DEFAULT_NODES[2]
        scale, nodes = c["scale"] * f, max(3, round(c["nodes"] * f))
        coarse, fine = (self._conditional_run(y, omega, V, *lv) for lv in ((scale / 1.5, nodes - 2),
                                                                            (scale, nodes)))
        error = self._spread([fine, coarse], omega, V, Vinv, ref)
        scales = _growing(scale, 1.5, c["rounds"])
        refine(fine, error, target, c["rounds"], lambda i, k: self._conditional_run(
            y[i], omega[i], V[i], scales[k], nodes + 2 * (k + 1)),
            lambda i, runs: self._spread(runs, omega[i], V[i], Vinv[i], ref[i]))
        log_z, mean, second = fine
        return log_z, ref + mean, second - mean[:, :, None] * mean[:, None, :], error

    def _conditional_run(self, y, omega, V, scale, count):
        """One pass of the conditional rule: h_1's rings at ``scale`` (both half planes; nodes
        with |x_1 − ω_1|² > reach² V_11 left out, as the polar rule's), per node x_1 the
        ``count``² Gauss–Hermite nodes h_2 = m + √2 s ξ of N(h_2; m, s² I) (h_2 given x_1): the
        rule Σ e^{lb} N(Z; ω, V) N(y; g(Z), Δ I) at Z = (x_1, h_2) (``_quadrature.integrate_nodes``
        with the route's node kernel), lb = log w(x_1) + log(w_ξ/π) + |ξ|² + log(2π s²) (the
        Gauss–Hermite weight over N(h_2; m, s² I), which N(Z; ω, V) holds).  Returns (log_z,
        E[Z − ω], E[(Z − ω)(Z − ω)ᵀ])."""
        n, RT = len(omega), self.R * self.T
        total = np.empty(n), np.empty((n, RT)), np.empty((n, RT, RT))
        t, wt = np.polynomial.hermite.hermgauss(count)
        xi = np.stack(np.meshgrid(t, t, indexing="ij")).reshape(2, -1)          # the nodes by columns
        lxi = np.log(np.outer(wt, wt) / np.pi).ravel() + (xi ** 2).sum(axis=0)
        Vinv, logdetV = np.linalg.inv(V), np.linalg.slogdet(V)[1]
        owner, x1, lw1 = self._ring_rows(omega, V, scale, reflect=True)
        near = ((x1 - omega[owner, 0]) ** 2).sum(axis=1) <= self._polar_params()["reach"] ** 2 * V[owner, 0, 0]
        owner, x1, lw1 = owner[near], x1[near], lw1[near]
        m, s2 = _given_h1(x1, omega[owner], V[owner])
        rows = np.column_stack([x1, m, np.sqrt(2 * s2), lw1 + np.log(2 * np.pi * s2)])
        ptr = np.searchsorted(owner, np.arange(n + 1))
        _quadrature.integrate_nodes(self._route_id, self._node_kernel.capsule("columns"), self.model.params,
                                    np.ascontiguousarray(y), omega.reshape(n, RT), np.ascontiguousarray(Vinv),
                                    logdetV, rows, ptr, xi, lxi, self.R, self.T, self._n_node, self._delta,
                                    *total, self.threads)
        return total

    # -- any other link: the adaptive rule's starting boxes refined onto the likelihood (R·T ≤ 4 by default) --
    # reach: boxes whose linearised residual stays above reach·√Δ are left whole (the likelihood
    # below e^{-reach²/2} there); width: the others are halved until g moves by at most width·√Δ
    # across them; cap: starting boxes per sample at most; floor: boxes where the prior bounds the
    # integrand below e^-floor of the highest point seen are left whole
    # (surface: the width for R·T ≥ 3, whose ridge is a surface; there the adaptive rule's default
    # budget is SURFACE_REGIONS)
    RIDGE = dict(reach=9.0, width=0.5, surface=4.0, cap=20000, floor=30.0)
    SURFACE_REGIONS = 10000

    def _ridge_rule(self):
        """Any link but T = 2 attention, d = R·T ≤ 4: the adaptive rule integrates the prior's
        piece alone (weight 1; its box ±ADAPTIVE_BOUND prior sd holds the posterior) from its
        PRIOR_SPLIT^d equal boxes, every box that the likelihood's ridge {g(x) = y} may cross
        halved until g changes by at most RIDGE["width"]·√Δ across it (RIDGE["surface"]·√Δ for
        R·T ≥ 3: on the shell y = h_1² + h_2² + h_3²/2 + noise the same errors as with 0.5 or 2
        at 0.5–0.8 of the time, 8 up to 15× the error at Δ = 0.01; ``_quadrature._ridge_boxes``:
        g and ∂g at the box's centre and corners; a heuristic, not a bound).  So a ridge far
        narrower than the prior, where the modes' Laplace pieces do not reach (a curved
        posterior), is seen by the starting boxes' points: otherwise none of them need lie on it,
        and the rule never refines there.  Boxes where the prior bounds the integrand below
        e^-RIDGE["floor"] of the highest point seen are left whole (far out along y = h_1 h_2 the
        ridge narrows as 1/|h|); the sums are relative to that point (at ω = 0 the Gauss–Newton
        search for y = h_1 h_2 + noise stays at the origin, a saddle e^-1000 below the ridge).
        One piece, not every piece's own boxes: where pieces overlap the ridge was refined two
        or three times."""
        if self._polar_applies or self.R * self.T > 4:
            return None
        r, sd = self.RIDGE, np.sqrt(self._delta)
        width = r["width"] if self.R * self.T <= 2 else r["surface"]
        return np.array([r["reach"] * sd, width * sd, r["cap"], r["floor"]])

    def _check_y(self, y, n):
        y = np.asarray(y, dtype=np.float64)
        shape = tuple(self.model.output_shape)
        if shape == () and y.ndim == 1:          # scalar outputs: (n,) is the natural form
            y = y.reshape(-1)
        else:
            y, _ = validate.batch("y", y, shape)
        if len(y) != n:
            raise ValueError(f"y and omega must have the same number of samples, got {len(y)} and {n}")
        return y.reshape(n, -1)

    def _prepare(self, y, omega, V):
        flips = self.model.symmetries()                                  # (S, R) row signs
        x0 = omega[:, None] * flips[None, :, :, None]
        signs = np.zeros((len(y), len(flips)))
        return y, np.ascontiguousarray(x0.reshape(len(y), len(flips), -1)), signs

    def _point(self, y, x, sign):
        return x

    def _prior(self, omega, V):
        """The prior of x = Z: N(ω, V ⊗ I_T)."""
        return omega.reshape(len(V), -1), _per_token(np.linalg.inv(V), self.T)


class ClosedChannel:
    """Route 3: a closed form derived by SymPy (derive.closed) for a one-index link applied to
    each token alone (T = 1, or y_t = g(h_t) with one shared weight vector: the channel is the
    product over tokens): affine links with Gaussian noise; without noise sign(z) and even
    links with two pre-images ±r(y) (phase retrieval z², |z|).  No quadrature, ``error`` = 0."""

    route = "closed"
    escalates = error_estimate = ridges = unresolved = False     # exact: no estimate to compute

    def __init__(self, model, noise: float | None = None, threads: int | None = None):
        from derive.closed import closed_form_program, support, token_wise
        from derive.registry import KernelSpec
        from .kernels import Kernel
        link = model.link
        g = token_wise(link.expr, link.tokens) if link.indices == 1 else None
        if g is None:
            raise ValueError(f"route='closed' needs one index (R = 1) and a link applied to each token "
                             f"alone; {link.name!r} has R = {link.indices}, T = {link.tokens}")
        self.model, self.R, self.T = model, 1, link.tokens
        self.params = model.params if noise is None else np.append(model.params, validate.positive("noise", noise))
        name = f"{link.key}_{'noisy' if noise is not None else 'noiseless'}"
        program = closed_form_program(name, g, link.params, noisy=noise is not None)
        if program is None:
            raise ValueError(f"link {link.name!r} has no elementary closed-form channel "
                             f"({'noisy' if noise is not None else 'noiseless'}); use route='noisy'")
        self.support = support(g, noisy=noise is not None)
        spec = KernelSpec(program.name, program.name, lambda: program)
        self._kernel = Kernel(spec, model.backend, threads=threads or 0)

    def _inside(self, y: np.ndarray) -> np.ndarray:
        return {"sign": np.abs(y) == 1, "positive": y > 0, "real": np.isfinite(y)}[self.support]

    def representable(self, y) -> np.ndarray:
        """(n,) mask of the outputs in the link's range."""
        y = np.asarray(y, dtype=np.float64)
        return self._inside(y.reshape(len(y), -1)).all(axis=1)

    def moments(self, y, omega, V) -> Moments:
        omega, _ = validate.batch("omega", omega, (1, self.T))
        n, T = len(omega), self.T
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        if y.shape != (n * T,) or not np.isfinite(y).all():
            raise ValueError(f"y must hold {n}×{T} finite outputs, got shape {np.shape(y)}")
        outside = ~self._inside(y)
        if outside.any():
            raise ValueError(f"y must be {'±1' if self.support == 'sign' else '> 0'} for link "
                             f"{self.model.link.name!r} (sample {int(np.argmax(outside)) // T} has {y[outside][0]})")
        V = np.broadcast_to(np.asarray(V, dtype=np.float64).reshape(-1), (n,)) if np.size(V) in (1, n) else None
        if V is None or not (V > 0).all():
            raise ValueError("V must be positive (a (1, 1) matrix or one per sample)")
        out = self._kernel(np.stack([y, omega.reshape(n * T), np.repeat(V, T)], axis=1), self.params)
        bad = first_bad_row(out)
        if bad is not None:
            raise FloatingPointError(f"non-finite channel moment at sample {bad // T} (closed route)")
        out = out.reshape(n, T, 3)
        dg_out = np.zeros((n, T, T))
        dg_out[:, np.arange(T), np.arange(T)] = out[:, :, 2]
        return Moments(log_z=out[:, :, 0].sum(axis=1), g_out=out[:, :, 1].reshape(n, 1, T),
                       dg_out=dg_out, error=np.zeros(n))


def make_channel(model, route: str | None = None, noise: float | None = None, **options):
    """The channel of ``model``: ``noise`` > 0 selects the noisy route; otherwise the
    reparametrisation for tied softmax deep attention with r = 1, or the SymPy closed form for
    a one-index link (``route="closed"`` also with noise)."""
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
